"""Paper tables from run records (`specrepro table`), and pass@10 through the runner.

`tiny_sweep` (session-scoped; test_notebook.py uses it too) makes the records once: a basic-launcher
sweep on the tiny random LLaMA over pld with two draft lengths and two datasets (ar references run first),
plus one hf_assisted run."""

from __future__ import annotations

import json
import shutil

import pytest
import yaml

from specrepro.tables import TABLES_DIR, Column, Row, RunInfo, TableSpec, _matches, build_table, local_runs, write_table
from tests.test_runner import FAST, run_dirs, specrepro

TINY = [*FAST, "decoding.max_new_tokens=48", "dataset.limit=2", "logger=none"]  # 48: long enough for pld to draft

TINY_TABLE = """
paper: tiny
title: "A tiny table"
source: "a made-up source for the test"
select: {model: tiny_random}
row_header: [Method, K]
rows:
  - {label: [ar, "-"], select: {method: ar}}
  - {label: [pld, 2], select: {method: pld, method.num_pred_tokens: 2}, paper: {GSM8K speedup: 1.5, GSM8K MAT: "2.0 (printed)", CNN/DM ROUGE-L: 14.5}}
  - {label: [pld, 4], select: {method: pld, method.num_pred_tokens: 4}}
  - {label: [eesd, "-"], select: {method: eesd}, paper: {GSM8K speedup: 2.04}}
columns:
  - {label: GSM8K speedup, key: speedup_mean, select: {dataset: gsm8k}, fmt: "{:.2f}x"}
  - {label: GSM8K MAT, key: mat, select: {dataset: gsm8k}}
  - {label: CNN/DM ROUGE-L, key: rouge_l, select: {dataset: cnn_dm}, fmt: "{:.1f}", scale: 100}
"""


@pytest.fixture(scope="session")
def tiny_sweep(tmp_path_factory):
    """The directory holding `results/runs` of the tiny sweep, made once per session (a module that
    imports this fixture gets its own instance, which finds the records already made)."""
    root = tmp_path_factory.getbasetemp() / "tiny_sweep"
    if not (root / "done").is_file():
        root.mkdir(exist_ok=True)
        specrepro("run", "-m", *TINY, "method=pld", "method.num_pred_tokens=2,4", "dataset=gsm8k,cnn_dm", cwd=root)
        specrepro("run", *TINY, "method=hf_assisted", "dataset=gsm8k", cwd=root)
        (root / "done").touch()
    return root


def test_table_from_fixed_records_is_reproducible(tiny_sweep, tmp_path):
    tables_dir = tmp_path / "tables"
    tables_dir.mkdir()
    (tables_dir / "tiny_table.yaml").write_text(TINY_TABLE)
    results = tmp_path / "results"
    shutil.copytree(tiny_sweep / "results" / "runs", results / "runs")

    md = write_table("tiny_table", results, tables_dir=tables_dir)
    first_md, first_csv = md.read_text(), md.with_suffix(".csv").read_text()
    md2 = write_table("tiny_table", results, tables_dir=tables_dir)
    assert md2 == results / "tiny" / "tiny_table.md"
    assert md2.read_text() == first_md and md2.with_suffix(".csv").read_text() == first_csv

    lines = first_md.splitlines()
    header = next(line for line in lines if line.startswith("| Method"))
    assert "GSM8K speedup (paper) | GSM8K speedup (here)" in header and header.endswith("| runs |")
    pld2 = next(line for line in lines if line.startswith("| pld | 2 |"))
    cells = [c.strip() for c in pld2.strip("|").split("|")]
    assert cells[2] == "1.50x" and cells[3].endswith("x") and cells[4] == "2.0 (printed)"
    assert cells[6] == "14.5"  # `scale` multiplies our fraction, never the paper's printed number
    assert cells[-1] == "[3] [4]"  # the gsm8k and cnn_dm runs behind the row (the ar row has [1] [2])
    eesd = next(line for line in lines if line.startswith("| eesd |"))
    assert "2.04x | –" in eesd  # a paper number, no run yet

    runs = {r.name: r for r in local_runs(results)}
    footnotes = [line.split("`")[1] for line in lines if line[:1].isdigit() and "`" in line]
    assert all(name in runs for name in footnotes)
    assert runs[footnotes[2]].config["method"]["num_pred_tokens"] == 2
    assert runs[footnotes[2]].metrics["dataset"] == "gsm8k" and runs[footnotes[3]].metrics["dataset"] == "cnn_dm"

    csv_rows = first_csv.splitlines()
    assert csv_rows[0].split(",")[-1] == "runs"
    assert csv_rows[2].endswith(f"{footnotes[2]};{footnotes[3]}")


def test_table_cli_and_shipped_specs(tiny_sweep, tmp_path):
    for spec_path in sorted(TABLES_DIR.glob("*.yaml")):  # every shipped spec parses
        spec = TableSpec.load(spec_path.stem)
        assert spec.rows and spec.columns
        assert (TABLES_DIR / spec.recipe).is_file(), f"{spec_path.stem} has no recipe"
    out = specrepro("table", "specbench_small", "--results-dir", str(tiny_sweep / "results"), cwd=tmp_path)
    assert (tiny_sweep / "results" / "specbench" / "specbench_small.md").is_file()
    assert "wrote" in out.stdout

    missing = specrepro("table", "no_such_table", cwd=tmp_path, check=False)
    assert missing.returncode == 2 and "no table spec 'no_such_table'" in missing.stderr
    offline = specrepro("table", "specbench_small", "--source", "wandb", cwd=tmp_path, check=False)
    errors = [line for line in offline.stderr.splitlines() if line.startswith("specrepro: error:")]
    assert offline.returncode == 2 and len(errors) == 1 and "W&B online" in errors[0]


def test_pass_at_10_from_sampling_with_recorded_seeds(tmp_path):
    specrepro("run", *FAST, "method=ar", "decoding=sample", "dataset=humaneval", "dataset.limit=1",
              "logger=none", cwd=tmp_path)
    (run_dir,) = run_dirs(tmp_path).values()
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert 0.0 <= metrics["pass@10"] <= 1.0 and 0.0 <= metrics["pass@1"] <= 1.0
    (row,) = [json.loads(line) for line in (run_dir / "generations.jsonl").read_text().splitlines()]
    assert row["scores"]["n"] == 10
    seeds = [turns[0]["seed"] for turns in row["samples"]]
    assert len(set(seeds)) == 10  # one recorded seed per sample


def test_a_null_in_a_selector_list_matches_records_without_the_key():
    """`method.sliding: [false, null]` selects block-mode Jacobi runs made before the option existed as well."""
    older = RunInfo("older", {"method": "jacobi"}, {"method": {"block_size": 4}}, 0.0)
    block = RunInfo("block", {"method": "jacobi"}, {"method": {"block_size": 4, "sliding": False}}, 1.0)
    sliding = RunInfo("sliding", {"method": "jacobi"}, {"method": {"block_size": 4, "sliding": True}}, 2.0)
    select = yaml.safe_load("{method.block_size: 4, method.sliding: [false, null]}")
    assert [r.name for r in (older, block, sliding) if _matches(r, select)] == ["older", "block"]


def test_selector_values_from_the_environment_pin_a_recipes_runs(monkeypatch):
    """"${CLLM4}" selects the runs of the artifact the recipe decoded; unset, the key is left unconstrained."""
    older = RunInfo("older", {}, {"model": {"id": "cllm-a"}, "dataset": {"limit": 10}}, 0.0)
    newer = RunInfo("newer", {}, {"model": {"id": "cllm-b"}, "dataset": {"limit": 20}}, 1.0)
    select = yaml.safe_load('{model.id: "${CLLM4}", dataset.limit: "${LIMIT:-10}"}')
    monkeypatch.delenv("LIMIT", raising=False)
    monkeypatch.setenv("CLLM4", "cllm-a")
    assert [r.name for r in (older, newer) if _matches(r, select)] == ["older"]
    monkeypatch.setenv("CLLM4", "cllm-b")
    monkeypatch.setenv("LIMIT", "20")
    assert [r.name for r in (older, newer) if _matches(r, select)] == ["newer"]
    monkeypatch.delenv("CLLM4")
    monkeypatch.delenv("LIMIT")
    assert [r.name for r in (older, newer) if _matches(r, select)] == ["older"]  # only the default limit 10 applies


def test_a_row_label_names_the_recipes_variable(monkeypatch):
    """"SPACE (k = ${K:-5})" labels the row by the k its selector picks, the default when K is unset."""
    runs = [RunInfo(f"space-k{k}", {"mat": float(k)}, {"method": {"k": k}}, 0.0) for k in (2, 5)]
    row = Row(label=["SPACE (k = ${K:-5})"], select={"method.k": "${K:-5}"})
    spec = TableSpec("t", "p", "title", "", ["Method"], [row], [Column("MAT", "mat")])
    monkeypatch.delenv("K", raising=False)
    assert build_table(spec, runs)[1][0][:3] == ["SPACE (k = 5)", "–", "5.00"]
    monkeypatch.setenv("K", "2")
    assert build_table(spec, runs)[1][0][:3] == ["SPACE (k = 2)", "–", "2.00"]


def test_a_cell_is_a_metric_never_a_config_flag_of_that_name():
    """A run without the metric shows "–", not its config's `reference_nll: false` as 0.00."""
    runs = [RunInfo("no-nll", {"mat": 1.5}, {"reference_nll": False}, 0.0)]
    spec = TableSpec("t", "p", "title", "", ["Method"], [Row(label=["space"])],
                     [Column("MAT", "mat"), Column("Ref NLL", "reference_nll")])
    assert build_table(spec, runs)[1][0][1:5] == ["–", "1.50", "–", "–"]
