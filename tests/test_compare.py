"""`specrepro compare`: one run's speed over another's on the same prompts, paired turn by turn, with its interval."""

from __future__ import annotations

import json
import math
import re
import shutil

import pytest
from omegaconf import OmegaConf

from specrepro.compare import main as compare_main
from specrepro.errors import SpecReproError
from specrepro.metrics.speed import ci95, paired_ratio, relative_speedup
from tests.test_runner import FAST, run_dirs, specrepro


def _turn(wall_time: float, ar_wall_time: float, tokens=(1, 2, 3, 4)) -> dict:
    gen = {"token_ids": list(tokens), "wall_time": wall_time, "ar_wall_time": ar_wall_time, "ar_tokens": 4}
    return {"speedup": paired_ratio(gen), "tokens": tokens}


def test_the_relative_speedup_is_the_geometric_mean_of_the_turns_ratios_of_paired_speedups():
    """Turn by turn, each run's speedup over its own `ar` (a slower machine at one run's time cancels: the second
    run's `ar` took twice as long there too); the interval is Student's t on the logs; same_tokens counts turns."""
    run = [_turn(1.0, 2.0), _turn(1.0, 3.0), _turn(1.0, 2.5)]  # paired speedups 2.0, 3.0, 2.5
    other = [_turn(2.0, 2.0), _turn(2.0, 4.0), _turn(2.0, 2.0, tokens=(1, 2, 3, 5))]  # 1.0, 2.0, 1.0
    logs = [math.log(2.0), math.log(1.5), math.log(2.5)]
    mean = sum(logs) / 3
    result = relative_speedup(run, other)
    assert result["ratio"] == pytest.approx(math.exp(mean)) == pytest.approx((2.0 * 1.5 * 2.5) ** (1 / 3))
    assert result["low"] == pytest.approx(math.exp(mean - ci95(logs)))
    assert result["high"] == pytest.approx(math.exp(mean + ci95(logs)))
    assert result["turns"] == 3 and result["same_tokens"] == pytest.approx(2 / 3)
    with pytest.raises(ValueError):
        relative_speedup(run, other[:2])


PAIRED_TABLE = """
paper: committed
title: "Paired speedups"
source: "the test's runs"
select: {model: tiny_random, dataset.limit: 3}
row_header: [Method]
rows:
  - {label: [ar], select: {method: ar}}
  - {label: [pld], select: {method: pld}}
columns:
  - {label: speedup, key: speedup_paired, fmt: "{:.2f}x"}
"""


def test_compare_names_the_faster_run_also_from_committed_copies_and_refuses_other_prompts_or_unpaired_runs(
    tmp_path, capsys
):
    specrepro(
        "run",
        "-m",
        *FAST,
        "method=ar,pld",
        "dataset=gsm8k",
        "dataset.limit=3,2",
        "timing.paired=true",
        "logger=none",
        cwd=tmp_path,
    )
    runs = {
        (key.split(":")[0], OmegaConf.load(p / "config.yaml").dataset.limit): p for key, p in run_dirs(tmp_path).items()
    }
    pld, ar = runs["pld", 3], runs["ar", 3]
    (tmp_path / "paired.yaml").write_text(PAIRED_TABLE)  # its committed inputs: metrics.json, config.yaml, turns.jsonl
    specrepro("table", "paired.yaml", "--out-dir", "committed", cwd=tmp_path)
    committed = tmp_path / "committed" / "runs"
    assert sorted(p.parent.name for p in committed.glob("*/turns.jsonl")) == sorted([pld.name, ar.name])
    assert not list(committed.glob("*/generations.jsonl"))
    before_turns = committed.parent / "runs-before-turns" / pld.name  # a committed copy made before turns were kept
    shutil.copytree(committed / pld.name, before_turns)
    (before_turns / "turns.jsonl").unlink()
    unpaired = tmp_path / "results" / "runs" / "pld-unpaired"  # the same run as if timed without ar beside it
    shutil.copytree(pld, unpaired)
    rows = [json.loads(line) for line in (unpaired / "generations.jsonl").read_text().splitlines()]
    for turn in (turn for row in rows for sample in row["samples"] for turn in sample):
        del turn["ar_wall_time"]
    (unpaired / "generations.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))

    out = specrepro("compare", pld.name, str(ar), cwd=tmp_path).stdout
    turns = {}
    for path in (pld, ar):
        rows = [json.loads(line) for line in (path / "generations.jsonl").read_text().splitlines()]
        turns[path] = {row["id"]: row["samples"][0][0] for row in rows}
    expected = relative_speedup(
        *(
            [{"speedup": paired_ratio(turns[p][i]), "tokens": turns[p][i]["token_ids"]} for i in sorted(turns[p])]
            for p in (pld, ar)
        )
    )
    assert f"{pld.name} over {ar.name}, 3 turns on the same prompts" in out
    assert f"{expected['ratio']:.2f}x (95% interval {expected['low']:.2f}x-{expected['high']:.2f}x)" in out
    assert "the same tokens on 100% of the turns" in out  # pld is lossless

    # the committed copies compare as the runs themselves do, and --out keeps the comparison as a page
    page = tmp_path / "committed" / "pld_over_ar.md"
    compare_main([pld.name, ar.name, "--results-dir", str(committed.parent), "--out", str(page)])
    assert capsys.readouterr().out == out
    text = page.read_text()
    assert out.strip() in text and "- Machine: " in text and "- Code: " in text
    assert (
        f"- Regenerate: `specrepro compare {pld.name} {ar.name} --results-dir {committed.parent} --out {page}`" in text
    )

    # two sides that differ in more than their method: said under the ratio
    budget = committed.parent / "runs-other-budget"
    shutil.copytree(committed / pld.name, budget / pld.name)
    config = OmegaConf.load(budget / pld.name / "config.yaml")
    config.decoding.max_new_tokens += 1
    OmegaConf.save(config, budget / pld.name / "config.yaml")
    assert "note:" not in out
    compare_main([str(budget / pld.name), str(committed / ar.name)])
    assert "note: the two sides differ in decoding.max_new_tokens, not only in their method" in capsys.readouterr().out

    # runs named together pool their turns (a method over several datasets): copies of both runs on other records
    pooled = tmp_path / "pooled" / "runs"
    for path in (pld, ar):
        shutil.copytree(committed / path.name, pooled / path.name)
        lines = (committed / path.name / "turns.jsonl").read_text().splitlines()
        moved = [json.dumps({**json.loads(line), "id": f"other-{json.loads(line)['id']}"}) for line in lines]
        shutil.copytree(committed / path.name, pooled / f"{path.name}-other")
        (pooled / f"{path.name}-other" / "turns.jsonl").write_text("\n".join(moved) + "\n")
    both = f"{pld.name},{pld.name}-other"
    compare_main([both, f"{ar.name},{ar.name}-other", "--results-dir", str(pooled.parent)])
    twice = relative_speedup(
        *(
            [{"speedup": paired_ratio(turns[p][i]), "tokens": turns[p][i]["token_ids"]} for i in sorted(turns[p]) * 2]
            for p in (pld, ar)
        )
    )
    out = capsys.readouterr().out
    assert f"[{pld.name}, {pld.name}-other] over [{ar.name}, {ar.name}-other], 6 turns on the same prompts" in out
    assert f"{twice['ratio']:.2f}x (95% interval {twice['low']:.2f}x-{twice['high']:.2f}x)" in out
    for args, message in (
        ((f"{pld.name},{pld.name}", ar.name), "both decoded record"),
        ((both, ar.name), "did not decode the same prompts (record other-"),
    ):
        with pytest.raises(SpecReproError, match=re.escape(message)):
            compare_main([*args, "--results-dir", str(pooled.parent)])

    refusals = (
        ((pld.name, runs["pld", 2].name), "did not decode the same prompts"),
        ((pld.name, unpaired.name), "was not timed against ar (run it with timing.paired=true)"),
        ((pld.name, "no-such-run"), "no-such-run: no such run directory"),
        ((str(committed / ar.name), str(before_turns)), f"{pld.name}: holds no per-turn timings"),
    )
    for args, message in refusals:  # the command prints a SpecReproError as one line and exits with 2
        with pytest.raises(SpecReproError, match=re.escape(message)):
            compare_main([*args, "--results-dir", str(tmp_path / "results")])
    proc = specrepro("compare", pld.name, "no-such-run", cwd=tmp_path, check=False)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        "specrepro: error: no-such-run: no such run directory, nor a run of that name in results/runs"
    ]


def test_a_comparison_page_that_cannot_be_written_is_one_line(tmp_path):
    from specrepro.compare import write_page

    (tmp_path / "a_file").write_text("")
    page = tmp_path / "a_file" / "page.md"  # unwritable for any user, root too
    with pytest.raises(SpecReproError, match=re.escape(f"cannot write the comparison to {page}: ")):
        write_page(page, [], [], "text", "specrepro compare a b")


def test_compare_notes_two_sides_timed_with_other_hardware_settings(tmp_path):
    """A compiled run's paired speedup is over compiled `ar`, an eager one's over eager `ar`: their ratio is not how
    much faster one decoded, so the page says the sides differ in hardware.compile."""
    import yaml

    from specrepro.compare import compare, report
    from specrepro.tracking import RunRecord

    machine = {"cpu": "x", "gpu": "H100", "gpu_count": 1}

    def made(name: str, compiled: bool, speedup: float) -> RunRecord:
        run = tmp_path / "runs" / name
        run.mkdir(parents=True)
        metrics = {"complete": True, "speedup_paired": speedup, "provenance": {"machine": machine}}
        (run / "metrics.json").write_text(json.dumps(metrics))
        config = {"method": {"name": "pld"}, "decoding": {"max_new_tokens": 64}, "hardware": {"compile": compiled}}
        (run / "config.yaml").write_text(yaml.safe_dump(config))
        turns = [{"id": i, "prompt": "p", "sample": 0, "turn": 0, "speedup": speedup, "tokens": "t"} for i in range(3)]
        (run / "turns.jsonl").write_text("".join(json.dumps(turn) + "\n" for turn in turns))
        return RunRecord(run)

    compiled, eager = made("compiled", True, 1.1), made("eager", False, 1.5)
    assert "note: the two sides differ in hardware.compile" in report([compiled], [eager], compare([compiled], [eager]))
    again = made("eager_again", False, 1.4)
    assert "note:" not in report([again], [eager], compare([again], [eager]))
