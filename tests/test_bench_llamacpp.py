"""experiments/bench_llamacpp.py: our decoding beside llama.cpp's on the embedded GGUF. The bench needs
llama-cpp-python (an optional, source-built package), so its end-to-end test runs where that is installed."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
BENCH = ROOT / "experiments" / "bench_llamacpp.py"


def test_a_pld_arm_that_drafts_otherwise_than_llama_cpp_is_refused_in_one_line():
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--pld", "pld method.match=latest"], capture_output=True, text=True
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "bench_llamacpp.py: error: --pld must be a pld preset that drafts as llama.cpp's lookup does "
        "(method.match=earliest, method.min_ngram=1, method.controller=fixed), got: pld method.match=latest"
    ]


@pytest.mark.embedded
def test_bench_times_every_arm_and_each_lookup_decodes_what_its_own_ar_does(tmp_path):
    pytest.importorskip("llama_cpp")
    out, page = tmp_path / "bench.json", tmp_path / "bench.md"
    subprocess.run(
        [
            sys.executable,
            str(BENCH),
            "--limit",
            "2",
            "--max-new-tokens",
            "24",
            "--threads",
            "1",
            "--json",
            str(out),
            "--markdown",
            str(page),
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    figures = json.loads(out.read_text())
    assert figures["prompts"] == figures["prompts_asked"] == 2
    assert set(figures["tok_per_s"]) == {"ar", "pld", "llamacpp_ar", "llamacpp_lookup"}
    assert all(rate > 0 for rate in figures["tok_per_s"].values())
    assert figures["identical"]["pld"] == 2  # ours: lossless by construction and by test
    assert figures["mat"]["ar"] == figures["mat"]["llamacpp_ar"] == 1.0
    assert figures["mat"]["pld"] >= 1.0 and figures["mat"]["llamacpp_lookup"] >= 1.0
    assert 0.0 <= figures["shared_prefix_share"] <= 1.0
    assert figures["verify_width"] == 11 and set(figures["verify_cost"]) == {"ours", "llamacpp"}
    assert all(cost > 0 for cost in figures["verify_cost"].values())
    assert len(figures["llamacpp_batched_mismatches"]) == 2
    assert all(gap > 0 for gaps in figures["llamacpp_batched_mismatches"] for gap in gaps)
    text = page.read_text()
    assert "| `llamacpp_lookup` | llama.cpp prompt lookup | Q4_1 GGUF |" in text
    assert "bench_llamacpp.py" in text.splitlines()[-1] and "Regenerate" in text.splitlines()[-1]


def test_the_committed_page_is_the_one_its_committed_figures_give(monkeypatch):
    """results/cpu/llamacpp.md is the bench's rendering of the JSON it wrote beside it, never typed."""
    monkeypatch.syspath_prepend(str(BENCH.parent))
    from bench_llamacpp import markdown

    figures = json.loads((ROOT / "results" / "cpu" / "llamacpp.json").read_text())
    assert (ROOT / "results" / "cpu" / "llamacpp.md").read_text() == markdown(figures)
    assert figures["prompts"] == figures["prompts_asked"] and not figures["provenance"]["code"].get("dirty")


def test_the_page_says_where_our_pld_left_our_ar(monkeypatch):
    """The page said "Our `pld` equals our `ar` token for token here" whatever its figures counted."""
    monkeypatch.syspath_prepend(str(BENCH.parent))
    from bench_llamacpp import markdown

    figures = json.loads((ROOT / "results" / "cpu" / "llamacpp.json").read_text())
    figures["identical"]["pld"] = figures["prompts"] - 1
    text = markdown(figures)
    assert "equals our `ar`" not in text
    assert f"left our `ar`'s tokens on 1 of {figures['prompts']} prompts here" in text


def test_an_arm_that_ran_no_step_has_no_mean_accepted_tokens(monkeypatch):
    """A one-token budget commits every token in the prefill: MAT is undefined (NaN), not an impossible 0.00."""
    monkeypatch.syspath_prepend(str(BENCH.parent))
    from bench_llamacpp import mean_accepted

    assert math.isnan(mean_accepted([{"tokens": [5], "steps": 0}, {"tokens": [7], "steps": 0}]))
    assert mean_accepted([{"tokens": [5, 6, 7], "steps": 1}, {"tokens": [1, 2], "steps": 1}]) == 1.5
