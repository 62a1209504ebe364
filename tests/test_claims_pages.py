"""A claims page (`results/<paper>/README.md`) only points at its tables' cells: every decimal its prose shows is a
value of a committed table or of `stages.json` in the same folder, so no figure on it is typed from a diary.

Quoted from the paper and exempt: the cells of a claims table's "claim (paper)" column and section numbers
("Sec. 3.1"). Commands, commits and versions in backticks are not figures. Of the integers only minutes are checked
("89 compute minutes"): the rest are mostly settings (k, prompts, threads)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

RESULTS = Path(__file__).resolve().parents[1] / "results"
CLAIMS_PAGES = sorted(p for p in RESULTS.glob("*/README.md") if any(p.parent.glob("*.csv")))

# a decimal not inside a version ("5.24.0") or a section number, a sign only where it cannot be a range's dash; or
# a count of minutes
FIGURE = re.compile(r"(?<![\w.])(?<!Sec\. )(?:(?<=[\s(])[+-])?\d+\.\d+(?!\.?\d)|(?<![\w.])\d+(?= (?:compute )?min)")
NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def page_figures(text: str) -> list[str]:
    """The decimals a claims page shows in its own words."""
    text = re.sub(r"`[^`]*`", "", text)
    lines, claims_table = [], False
    for line in text.splitlines():
        cells = line.split("|")[1:-1]
        if not cells:
            claims_table = False
        elif cells[0].strip().startswith("claim"):
            claims_table = True
        line = "|".join(cells[1:]) if claims_table else line
        lines.append(line)
    return FIGURE.findall("\n".join(lines))


def folder_values(folder: Path) -> list[float]:
    """Every number the folder's generated tables and its stages.json hold."""
    texts = [p.read_text() for p in [*folder.glob("*.csv"), *folder.glob("*.md")] if p.name != "README.md"]
    stages = folder / "stages.json"
    if stages.exists():
        texts.append(json.dumps(json.loads(stages.read_text())))
    return [float(n) for text in texts for n in NUMBER.findall(text)]


def in_values(figure: str, values: list[float]) -> bool:
    """`figure` is one of `values` as shown at its precision."""
    decimals = len(figure.partition(".")[2])
    return any(f"{value:.{decimals}f}" == figure.lstrip("+") for value in values)


def test_page_figures_skip_quotes_versions_and_code_and_keep_signs_and_ranges():
    page = """| claim (paper) | status here | where |
|---|---|---|
| 1.94x on XSum (Sec. 3.1) | 0.62x | row *AR* |

Measured at `1.23` with transformers 5.24.0 on 10 prompts: 1.35-1.84 tokens, a change of -0.002 and +0.024
(0.99x-1.07x), trained in 89 compute minutes (2 threads, 3 min of data)."""
    assert page_figures(page) == ["0.62", "1.35", "1.84", "-0.002", "+0.024", "0.99", "1.07", "89", "3"]


def test_in_values_compares_at_the_figure_s_own_precision():
    assert in_values("1.06", [1.0612]) and in_values("+0.02", [0.024]) and in_values("89.7", [89.68])
    assert in_values("89", [89.4]) and not in_values("89", [89.6])
    assert not in_values("1.06", [1.07, 10.6]) and not in_values("-0.002", [0.002])


@pytest.mark.parametrize("page", CLAIMS_PAGES, ids=lambda p: p.parent.name)
def test_every_figure_on_a_claims_page_is_in_its_folder_s_tables(page):
    values = folder_values(page.parent)
    typed = [figure for figure in page_figures(page.read_text()) if not in_values(figure, values)]
    assert not typed, f"{page.relative_to(RESULTS.parent)} shows figures no table beside it holds: {typed}"


def test_the_claims_pages_are_checked():
    assert {p.parent.name for p in CLAIMS_PAGES} >= {"cllm", "eesd", "sar", "self_sd", "space", "specbench"}
