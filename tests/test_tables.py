"""Paper tables from run records (`specrepro table`), and pass@10 through the runner.

`tiny_sweep` (session-scoped; test_notebook.py uses it too) makes the records once: a basic-launcher
sweep on the tiny random LLaMA over pld with two draft lengths and two datasets (ar references run first),
plus one hf_assisted run."""

from __future__ import annotations

import json
import logging
import math
import re
import shutil
import types
from pathlib import Path

import pytest
import yaml

from specrepro.errors import SpecReproError
from specrepro.metrics.speed import mean_ci95
from specrepro.reproduce import PIPELINES_DIR, load_pipeline
from specrepro.plots import read_here, write_plots
from specrepro.tables import (
    TABLES_DIR,
    Column,
    Plot,
    Row,
    RunInfo,
    TableSpec,
    _mark_ranges,
    _matches,
    _selector,
    build_table,
    cell_runs,
    local_runs,
    render_csv,
    write_table,
)
from tests.test_runner import FAST, run_dirs, specrepro

COMMITTED = Path(__file__).parents[1] / "results"
PAPERS_WITH_INPUTS = sorted(runs.parent for runs in COMMITTED.glob("*/runs") if runs.is_dir())

TINY = [*FAST, "decoding.max_new_tokens=48", "dataset.limit=2", "logger=none"]  # 48: long enough for pld to draft

TINY_TABLE = """
paper: tiny
title: "A tiny table"
source: "a made-up source for the test"
select: {model: tiny_random}
row_header: [Method, K]
rows:
  - {label: [ar, "-"], select: {method: ar}}
  - {label: [pld, 2], select: {method: pld, method.num_pred_tokens: 2},
     paper: {GSM8K speedup: 1.5, GSM8K MAT: "2.0 (printed)", CNN/DM ROUGE-L: 14.5}}
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


def test_table_cli(tiny_sweep, tmp_path):
    out = specrepro("table", "specbench_small", "--results-dir", str(tiny_sweep / "results"), cwd=tmp_path)
    assert (tiny_sweep / "results" / "specbench" / "specbench_small.md").is_file()
    assert "wrote" in out.stdout

    missing = specrepro("table", "no_such_table", cwd=tmp_path, check=False)
    assert missing.returncode == 2 and "no table spec 'no_such_table'" in missing.stderr
    offline = specrepro("table", "specbench_small", "--source", "wandb", cwd=tmp_path, check=False)
    errors = [line for line in offline.stderr.splitlines() if line.startswith("specrepro: error:")]
    assert offline.returncode == 2 and len(errors) == 1 and "W&B online" in errors[0]


def test_a_table_from_wandb_equals_the_one_from_the_same_local_records(tmp_path, monkeypatch):
    """`--source wandb` took `dict(run.summary)`, whose nested values stay W&B's own summary objects: every
    `trained.*` cell went empty, `provenance.*` selectors matched nothing (so a `[AMD EPYC, null]` row took the
    Xeon's runs: pld's mean 1.87x for 1.74x), and writing the table's inputs raised a KeyError. The runs here hold
    what `tracking.log_to_wandb` logs, in wandb's own public-API summary class."""
    import wandb
    from omegaconf import OmegaConf
    from wandb.apis.public.summary import HTTPSummary

    committed = Path(__file__).parent.parent / "results" / "scaling"

    class LoggedRun:
        def __init__(self, run_dir: Path):
            metrics = json.loads((run_dir / "metrics.json").read_text())
            self.name, self.dir = run_dir.name, str(tmp_path)
            logged = {key: value for key, value in metrics.items() if value is not None and key != "complete"}
            self._attrs = {"summaryMetrics": logged}
            self.summary = HTTPSummary(self, None, summary=logged)
            self.config = OmegaConf.to_container(OmegaConf.load(run_dir / "config.yaml"))

        @property
        def summary_metrics(self):  # wandb.apis.public.Run's: the summary as the API's JSON gives it
            return self._attrs["summaryMetrics"]

    class Api:
        default_entity = "me"

        def runs(self, path, filters=None):
            return [LoggedRun(p.parent) for p in sorted(committed.glob("runs/*/metrics.json"))]

    monkeypatch.setenv("WANDB_MODE", "online")
    monkeypatch.setattr(wandb, "Api", Api)
    local = write_table("eagle_scaling", committed, out_dir=tmp_path / "local")
    remote = write_table("eagle_scaling", source="wandb", out_dir=tmp_path / "wandb")

    def cells(path: Path) -> list[str]:
        return [line for line in path.with_suffix(".csv").read_text().splitlines() if not line.startswith("#")]

    assert cells(remote) == cells(local) and ",49," in cells(remote)[1]  # Training conversations, a trained.* cell


def test_pass_at_10_from_sampling_with_recorded_seeds(tmp_path):
    specrepro(
        "run",
        *FAST,
        "method=ar",
        "decoding=sample",
        "dataset=humaneval",
        "dataset.limit=1",
        "logger=none",
        cwd=tmp_path,
    )
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


def test_a_list_valued_setting_is_selected_by_a_list_inside_the_list():
    """A skip set is a list: `[[8, 9]]` wants that list, and `[8, 9]` would want either number."""
    early_exit = RunInfo("early", {"method": "self_sd"}, {"method": {"attn_skip": [8, 9]}}, 0.0)
    searched = RunInfo("searched", {"method": "self_sd"}, {"method": {"attn_skip": [3, 9]}}, 1.0)
    select = yaml.safe_load("{method.attn_skip: [[8, 9]]}")
    assert [r.name for r in (early_exit, searched) if _matches(r, _selector(select, "row"))] == ["early"]


def test_a_selector_can_name_the_machine_a_record_was_timed_on():
    """`provenance.machine.cpu` reads the record's provenance, so two machines' runs of one method are two rows."""

    def timed_on(name: str, cpu: str | None) -> RunInfo:
        provenance = {"machine": {"cpu": cpu}} if cpu else {}
        return RunInfo(name, {"method": "pld", "provenance": provenance}, {"method": {"name": "pld"}}, 0.0)

    runs = [timed_on("epyc", "AMD EPYC"), timed_on("xeon", "Intel(R) Xeon(R) Processor"), timed_on("old", None)]
    select = yaml.safe_load("{method: pld, provenance.machine.cpu: [AMD EPYC, null]}")
    assert [r.name for r in runs if _matches(r, select)] == ["epyc", "old"]
    select = yaml.safe_load("{provenance.machine.cpu: Intel(R) Xeon(R) Processor}")
    assert [r.name for r in runs if _matches(r, select)] == ["xeon"]


def test_a_cell_whose_runs_differ_in_a_method_option_is_refused_not_filled_by_the_newest():
    """An ablation run (Cali-TS with one half switched off) also matches a row that leaves the option open: the
    newest run would put the ablation's number in the full method's cell. Re-runs of one setting stay fine."""

    def cali(name: str, order: float, mode: str | None) -> RunInfo:
        method = {"control": "cali_ts", **({"cali_mode": mode} if mode else {})}
        return RunInfo(name, {"speedup_paired": order}, {"method": method}, order)

    spec = TableSpec(
        "t",
        "p",
        "title",
        "",
        ["Control"],
        [Row(label=["Cali-TS"], select={"method.control": "cali_ts"})],
        [Column("speedup", "speedup_paired")],
    )
    assert build_table(spec, [cali("old", 1.0, None), cali("rerun", 2.0, "both")])[1][0][1] == "2.00"
    with pytest.raises(SpecReproError, match="differ in method.cali_mode"):
        build_table(spec, [cali("both", 1.0, "both"), cali("ablation", 2.0, "sampling")])
    spec.rows[0].select["method.cali_mode"] = ["both", None]
    assert build_table(spec, [cali("both", 1.0, "both"), cali("ablation", 2.0, "sampling")])[1][0][1] == "1.00"


def test_a_cell_whose_runs_differ_in_budget_data_or_timing_is_refused_not_filled_by_the_newest():
    """A smoke run at another token budget (or on another limit, or timed otherwise) also matches a row that
    leaves the key open: it must not take the cell of the setting the table means."""

    def pld(name: str, order: float, **config) -> RunInfo:
        return RunInfo(name, {"speedup_paired": order}, {"method": {"name": "pld"}, **config}, order)

    def table() -> TableSpec:
        return TableSpec("t", "p", "title", "", ["Method"], [Row(label=["pld"])], [Column("speedup", "speedup_paired")])

    for key, values in (("decoding", "max_new_tokens"), ("dataset", "limit"), ("timing", "repeats")):
        spec = table()
        runs = [pld("meant", 1.0, **{key: {values: 16}}), pld("smoke", 2.0, **{key: {values: 4}})]
        with pytest.raises(SpecReproError, match=f"differ in {key}.{values}: select the value the row means"):
            build_table(spec, runs)
        spec.rows[0].select[f"{key}.{values}"] = 16
        assert build_table(spec, runs)[1][0][1] == "1.00"
    assert build_table(table(), [pld("a", 1.0), pld("rerun", 2.0)])[1][0][1] == "2.00"  # re-runs of one setting


def test_a_newer_compiled_run_fills_only_the_cells_that_ask_for_compiled_steps():
    """A compiled run's speedup is over compiled `ar`: it never takes an eager cell's place (runs made before the
    option existed count as eager), and fills a column that selects `hardware.compile: true`."""
    older = RunInfo("older", {"speedup_paired": 1.2}, {"hardware": {"device": "cuda"}}, 0.0)
    eager = RunInfo("eager", {"speedup_paired": 1.5}, {"hardware": {"device": "cuda", "compile": False}}, 1.0)
    compiled = RunInfo(
        "compiled",
        {"speedup_paired": 1.1, "speedup_paired_eager": 3.0},
        {"hardware": {"device": "cuda", "compile": True}},
        2.0,
    )
    spec = TableSpec(
        "t",
        "p",
        "title",
        "",
        ["Method"],
        [Row(label=["pld"])],
        [
            Column("eager", "speedup_paired"),
            Column("compiled", "speedup_paired", select={"hardware.compile": True}),
            Column("compiled over eager ar", "speedup_paired_eager", select={"hardware.compile": True}),
        ],
    )
    assert build_table(spec, [older, compiled])[1][0][1:4] == ["1.20", "1.10", "3.00"]
    assert build_table(spec, [older, eager, compiled])[1][0][1:4] == ["1.50", "1.10", "3.00"]
    assert build_table(spec, [compiled])[1][0][1:4] == ["–", "1.10", "3.00"]


def test_the_leaderboards_gpu_cells_take_only_the_settings_their_columns_name():
    """The GPU columns' runs are hardware=cuda_bf16 (eager) and hardware=cuda_bf16_compiled (compiled); a run of
    another compiled setting, one width (cuda_bf16_compiled_exact) among them, fills none of them, so a newer run of
    it never takes a cell's place without a word."""
    from omegaconf import OmegaConf

    from tests.test_config import compose_run

    spec = TableSpec.load("spec_bench")
    gpu = [column for column in spec.columns if column.label.startswith("GPU")]
    pld = next(row for row in spec.rows if row.label[0] == "pld (Saxena's match)")  # the paper's pld

    def filled(hardware: str, *overrides: str) -> list[str]:
        cfg = compose_run(
            "+experiment=spec_bench", "method=pld", "dataset.category=qa", f"hardware={hardware}", *overrides
        )
        names = {group: cfg[group].name for group in ("model", "method", "dataset", "decoding")}  # as metrics.json
        run = RunInfo(hardware, names, OmegaConf.to_container(cfg, resolve=True), 0.0)
        return [column.label for column in gpu if run in cell_runs(spec, pld, column, [run])]

    eager = ["GPU mean speedup", "GPU lossless", "GPU lossless near-ties"]
    assert filled("cuda_bf16") == eager
    assert filled("cuda_bf16_compiled") == [c.label for c in gpu if c.label not in eager]
    assert filled("cuda_bf16_compiled_exact") == []
    assert filled("cuda_bf16", "hardware.row_invariant=true") == []
    assert filled("cuda_bf16_compiled", "hardware.compile_freezing=true") == []


def test_selector_values_from_the_environment_pin_the_runs(monkeypatch):
    """ "${CLLM4}" selects the runs of the artifact it names; unset, the key is left unconstrained."""
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


def test_a_row_label_names_an_environment_variable(monkeypatch):
    """ "SPACE (k = ${K:-5})" labels the row by the k its selector picks, the default when K is unset."""
    runs = [RunInfo(f"space-k{k}", {"mat": float(k)}, {"method": {"k": k}}, 0.0) for k in (2, 5)]
    row = Row(label=["SPACE (k = ${K:-5})"], select={"method.k": "${K:-5}"})
    spec = TableSpec("t", "p", "title", "", ["Method"], [row], [Column("MAT", "mat")])
    monkeypatch.delenv("K", raising=False)
    assert build_table(spec, runs)[1][0][:2] == ["SPACE (k = 5)", "5.00"]
    monkeypatch.setenv("K", "2")
    assert build_table(spec, runs)[1][0][:2] == ["SPACE (k = 2)", "2.00"]


def test_a_cell_is_a_metric_never_a_config_flag_of_that_name():
    """A run without the metric shows "–", not its config's `reference_nll: false` as 0.00."""
    runs = [RunInfo("no-nll", {"mat": 1.5}, {"reference_nll": False}, 0.0)]
    spec = TableSpec(
        "t",
        "p",
        "title",
        "",
        ["Method"],
        [Row(label=["space"])],
        [Column("MAT", "mat"), Column("Ref NLL", "reference_nll")],
    )
    assert build_table(spec, runs)[1][0][1:3] == ["1.50", "–"]


def test_a_mean_column_averages_the_cells_it_names_and_needs_all_of_them():
    """`mean_over: {dataset.category: [...]}`: the leaderboard's mean speedup and lossless over the categories."""
    runs = [
        RunInfo(f"pld-{c}", {"speedup_paired": s}, {"method": {"name": "pld"}, "dataset": {"category": c}}, 0.0)
        for c, s in (("qa", 1.2), ("rag", 1.6))
    ]
    spec = pld_table(
        Column("Mean", "speedup_paired", mean_over={"dataset.category": ["qa", "rag"]}),
        Column("Mean of three", "speedup_paired", mean_over={"dataset.category": ["qa", "rag", "translation"]}),
    )
    header, body, footnotes = build_table(spec, runs)
    assert body[0][1:3] == ["1.40", "–"] and footnotes == ["pld-qa", "pld-rag"]


def pld_table(*columns: Column) -> TableSpec:
    """A table of one row, pld, with these columns."""
    return TableSpec("t", "p", "title", "", ["Method"], [Row(label=["pld"])], list(columns))


def test_a_mean_column_averages_the_runs_of_one_machine_never_two_cards():
    """The GPU leaderboard is filled over lent sessions, on an H100 or an H200 by chance: a row that one card timed
    whole and another card re-timed in part is the first card's mean until the second has timed every category."""

    def run(name: str, order: float, category: str, gpu: str, speedup: float) -> RunInfo:
        provenance = {"machine": {"gpu": gpu, "gpu_count": 1, "cpu": "x"}}
        metrics = {"speedup_paired": speedup, "provenance": provenance}
        return RunInfo(name, metrics, {"method": {"name": "pld"}, "dataset": {"category": category}}, order)

    spec = pld_table(Column("Mean", "speedup_paired", mean_over={"dataset.category": ["qa", "rag"]}))
    h100 = [run("h100-qa", 1, "qa", "H100", 1.2), run("h100-rag", 2, "rag", "H100", 1.6)]
    cut_off = run("h200-qa", 3, "qa", "H200", 3.0)
    header, body, footnotes = build_table(spec, [*h100, cut_off])
    assert body[0][1] == "1.40" and footnotes == ["h100-qa", "h100-rag"]
    header, body, footnotes = build_table(spec, [*h100, cut_off, run("h200-rag", 4, "rag", "H200", 2.0)])
    assert body[0][1] == "2.50" and footnotes == ["h200-qa", "h200-rag"]


def test_a_cell_of_one_run_shows_its_confidence_interval_and_a_plot_reads_its_value(tmp_path):
    """A run recording `speedup_paired_ci95` shows "1.35x ±0.06x" (a run made before the key shows the value alone,
    and so does a mean over it), a mean over runs that all record one shows the mean's, and a plot of the table
    reads 1.35."""
    runs = [
        RunInfo(
            "pld-qa",
            {"speedup_paired": 1.35, "speedup_paired_ci95": 0.0612},
            {"method": {"name": "pld"}, "dataset": {"category": "qa"}},
            0.0,
        ),
        RunInfo("pld-rag", {"speedup_paired": 1.5}, {"method": {"name": "pld"}, "dataset": {"category": "rag"}}, 0.0),
    ]
    spec = TableSpec(
        "t",
        "p",
        "title",
        "",
        ["Method"],
        [Row(["pld"])],
        [
            Column("QA speedup", "speedup_paired", select={"dataset.category": "qa"}, fmt="{:.2f}x"),
            Column("RAG speedup", "speedup_paired", select={"dataset.category": "rag"}, fmt="{:.2f}x"),
            Column("Mean", "speedup_paired", mean_over={"dataset.category": ["qa", "rag"]}, fmt="{:.2f}x"),
        ],
    )
    header, body, footnotes = build_table(spec, runs)
    assert body[0][1:4] == ["1.35x ±0.06x", "1.50x", "1.43x"]
    runs[1].metrics |= {"speedup_paired_ci95": 0.0612, "n_generations": 10}
    runs[0].metrics["n_generations"] = 10
    mean = build_table(spec, runs)[1][0][3]  # two equal intervals over 10 turns each: about 1/sqrt(2) of one
    assert mean == f"1.43x ±{mean_ci95([r.metrics for r in runs], 'speedup_paired'):.2f}x" == "1.43x ±0.04x"
    path = tmp_path / "t.csv"
    path.write_text(render_csv(header, body, footnotes, ["- Machine: test"]))
    assert read_here(path, ["Method"])[1]["QA speedup"] == [1.35]


def test_plots_show_the_tables_own_numbers(tmp_path):
    """A spec's plots read the "(here)" cells of the CSV the table wrote: the figure and the table agree."""
    runs = [
        RunInfo(
            f"{m}-{c}",
            {"speedup_paired": s, "training_minutes": t},
            {"method": {"name": m}, "dataset": {"category": c}},
            0.0,
        )
        for m, t, cells in (("pld", 0.0, (("qa", 1.2), ("rag", 1.6))), ("sps", 17.5, (("qa", 0.9),)))
        for c, s in cells
    ]
    columns = [
        Column("QA speedup", "speedup_paired", select={"dataset.category": "qa"}, fmt="{:.2f}x"),
        Column("RAG speedup", "speedup_paired", select={"dataset.category": "rag"}, fmt="{:.2f}x"),
        Column("Training minutes", "training_minutes", select={"dataset.category": "qa"}, fmt="{:.0f}"),
    ]
    spec = TableSpec(
        "t",
        "p",
        "title",
        "",
        ["Method"],
        [Row(["pld"], {"method.name": "pld"}), Row(["sps"], {"method.name": "sps"})],
        columns,
        plots=[
            Plot("bars", "bars", columns=["QA speedup", "RAG speedup"]),
            Plot("cost", "scatter", x="Training minutes", y="QA speedup"),
        ],
    )
    header, body, footnotes = build_table(spec, runs)
    path = tmp_path / "t.csv"
    path.write_text(render_csv(header, body, footnotes, ["- Machine: test"]))
    assert read_here(path, ["Method"]) == (
        [("pld",), ("sps",)],
        {"QA speedup": [1.2, 0.9], "RAG speedup": [1.6, None], "Training minutes": [0.0, 18.0]},
    )
    written = write_plots(spec.plots, path, ["Method"], spec.title)
    assert [p.name for p in written] == ["t_bars.png", "t_cost.png"]
    assert all(p.read_bytes().startswith(b"\x89PNG") for p in written)


def test_a_plot_names_rows_by_the_label_cells_it_asks_for():
    """`label_cells: 1` names a bar by the method alone, not by every label cell ("Trained on" is long)."""
    from specrepro.plots import draw

    cells = [("pld", "paper", "training-free"), ("sps_tree", "best here", "general mix")]
    here = {"QA speedup": [1.2, None]}
    for label_cells, legend in ((1, ["pld"]), (None, ["pld / paper / training-free"])):
        plot = Plot("b", "bars", columns=["QA speedup"], label_cells=label_cells)
        figure = draw(plot, cells, here, "title")
        assert [t.get_text() for t in figure.axes[0].get_legend().get_texts()] == legend
        assert (
            figure.axes[0]
            .get_title()
            .endswith("(no number yet: " + ("sps_tree)" if label_cells else "sps_tree / best here / general mix)"))
        )


def test_a_bar_charts_empty_cell_draws_no_bar_and_is_named():
    """A row with a number in one column and none in another drew a bar of height 0 there (a 0x speedup) and named
    only rows with no number at all."""
    from specrepro.plots import draw

    here = {"Math speedup": [1.5, 1.2], "RAG speedup": [1.3, None]}
    plot = Plot("b", "bars", columns=["Math speedup", "RAG speedup"], label_cells=1)
    axes = draw(plot, [("pld",), ("eagle",)], here, "title").axes[0]
    heights = {bars.get_label(): [bar.get_height() for bar in bars.patches] for bars in axes.containers}
    assert heights["pld"] == [1.5, 1.3] and heights["eagle"][0] == 1.2 and math.isnan(heights["eagle"][1])
    assert axes.get_title().endswith("(no number yet: eagle / RAG)")


SMALL_TABLE = """\
paper: small
title: A small table
row_header: [Method]
rows:
  - {label: ar, select: {method: ar}, paper: {MAT: 1.0}}
columns:
  - {label: MAT, key: mat, fmt: "{:.2f}"}
"""

# each: (the edit to SMALL_TABLE that breaks it, what the one-line error must say)
MALFORMED = {
    "yaml syntax": (("title: A small table", "title: [A small table"), "YAML syntax error"),
    "top level a list": ((SMALL_TABLE, "- paper: small\n"), "top level: expected a mapping, got a list"),
    "empty file": ((SMALL_TABLE, ""), "top level: expected a mapping, got null"),
    "no rows": (
        ("rows:\n  - {label: ar, select: {method: ar}, paper: {MAT: 1.0}}\n", ""),
        "top level: missing required key 'rows'",
    ),
    "unknown key": (("fmt:", "fomt:"), "columns[0]: unknown key 'fomt' (did you mean 'fmt'?)"),
    "columns a string": (
        ('columns:\n  - {label: MAT, key: mat, fmt: "{:.2f}"}', "columns: mat"),
        "columns: expected a non-empty list, got a string 'mat'",
    ),
    "select not a mapping": (
        ("select: {method: ar}", "select: method=ar"),
        "rows[0].select: expected a mapping, got a string 'method=ar'",
    ),
    "column without key": (("key: mat, ", ""), "columns[0]: missing required key 'key'"),
    "paper number for no column": (
        ("paper: {MAT: 1.0}", "paper: {MTA: 1.0}"),
        "rows[0].paper: no column labelled 'MTA'",
    ),
    "bad fmt": (('"{:.2f}"', '"{:.2f"'), "columns[0].fmt: '{:.2f' cannot format a number"),
    "scale not a number": (
        ('fmt: "{:.2f}"', "scale: x100"),
        "columns[0].scale: expected a number, got a string 'x100'",
    ),
    "mean over a scalar": (
        ('fmt: "{:.2f}"', "mean_over: {dataset: gsm8k}"),
        "columns[0].mean_over: expected one key and a non-empty list of its values",
    ),
    "plot of no column": (
        ('fmt: "{:.2f}"}\n', 'fmt: "{:.2f}"}\nplots: [{name: m, kind: bars, columns: [MTA]}]\n'),
        "plots[0].columns: no column labelled 'MTA'",
    ),
    "target of a column the trend does not plot": (
        (
            'fmt: "{:.2f}"}\n',
            'fmt: "{:.2f}"}\nplots: [{name: m, kind: trend, x: MAT, columns: [MAT], '
            "targets: {N: {csv: b.csv, row: pld}}}]\n",
        ),
        "plots[0].targets: 'N' is not a column this trend plots",
    ),
    "target without its row": (
        (
            'fmt: "{:.2f}"}\n',
            'fmt: "{:.2f}"}\nplots: [{name: m, kind: trend, x: MAT, columns: [MAT], targets: {MAT: {csv: b.csv}}}]\n',
        ),
        "expected {csv: <a table's CSV>, row: <its row's label>}",
    ),
    "plot of no kind": (
        ('fmt: "{:.2f}"}\n', 'fmt: "{:.2f}"}\nplots: [{name: m, kind: pie, columns: [MAT]}]\n'),
        "plots[0].kind: expected one of bars, scatter, trend, got 'pie'",
    ),
    "unknown experiment": (
        ("paper: small\n", "paper: small\nexperiment: sar_tabel2\n"),
        "experiment: no experiment 'sar_tabel2' (",
    ),
}


def write_spec(tmp_path, edit=None):
    spec = SMALL_TABLE.replace(*edit) if edit else SMALL_TABLE
    assert edit is None or spec != SMALL_TABLE
    path = tmp_path / "small.yaml"
    path.write_text(spec)
    return path


@pytest.mark.parametrize("spec_name", sorted(p.stem for p in TABLES_DIR.glob("*.yaml")))
def test_every_shipped_spec_is_valid(spec_name):
    spec = TableSpec.load(spec_name)
    assert spec.rows and spec.columns
    written = {
        stage["table"]
        for path in PIPELINES_DIR.glob("*.yaml")
        for stage in load_pipeline(path.stem)[1]
        if "table" in stage
    }
    assert spec_name in written, f"no pipeline in experiments/reproduce/ writes {spec_name}"


def test_the_small_spec_is_valid(tmp_path):
    spec = TableSpec.load("small", write_spec(tmp_path).parent)
    assert spec.rows[0].label == ["ar"] and spec.rows[0].paper == {"MAT": 1.0} and spec.columns[0].key == "mat"


@pytest.mark.parametrize("variant", MALFORMED)
def test_a_malformed_spec_is_one_line_naming_file_and_fault(variant, tmp_path):
    edit, expected = MALFORMED[variant]
    path = write_spec(tmp_path, edit)
    with pytest.raises(SpecReproError) as raised:
        TableSpec.load("small", tmp_path)
    message = str(raised.value)
    assert message.startswith(f"invalid table spec {path}: ") and expected in message
    assert "\n" not in message


SMALL_EXPERIMENT = """\
# @package _global_
defaults:
  - override /method: pld_wide
  - override /dataset: gsm8k
  - override /judge: local
method:
  num_pred_tokens: 4
dataset:
  limit: 5
  category: qa
  cut_at: ["Question:"]
timing:
  paired: true
reference_nll: true
hydra:
  sweeper:
    params:
      dataset: gsm8k,cnn_dm
      dataset.category: qa,rag
"""


def test_a_spec_naming_an_experiment_selects_the_runs_it_makes(tmp_path):
    """`experiment: NAME` selects what conf/experiment/NAME.yaml fixes: each scalar it sets in a group and the name
    each overridden option's runs record (pld_wide extends pld); not what its sweeper varies, a top-level flag (the
    metric of that name would be read) or a list; the spec's own `select` adds keys and overrides the experiment's."""
    conf = tmp_path / "conf"
    for path, text in {
        "experiment/small.yaml": SMALL_EXPERIMENT,
        "method/pld_wide.yaml": "defaults: [pld, _self_]\nnum_pred_tokens: 8\n",
        "method/pld.yaml": "defaults: [/method_schema_pld@_here_, _self_]\n",
        "dataset/gsm8k.yaml": "defaults: [/dataset_schema@_here_, _self_]\nname: gsm8k\n",
    }.items():
        (conf / path).parent.mkdir(parents=True, exist_ok=True)
        (conf / path).write_text(text)
    write_spec(tmp_path, ("paper: small\n", "paper: small\nexperiment: small\nselect: {method.num_pred_tokens: 2}\n"))

    spec = TableSpec.load("small", tmp_path, conf_dir=conf)
    assert spec.select == {"method": "pld", "method.num_pred_tokens": 2, "dataset.limit": 5, "timing.paired": True}

    def run(name: str, method: str, paired: bool, **method_settings) -> RunInfo:
        config = {"method": method_settings, "dataset": {"limit": 5}, "timing": {"paired": paired}}
        return RunInfo(name, {"method": method, "mat": 2.0}, config, order=len(name))

    runs = [run("pld", "pld", True, num_pred_tokens=2), run("pld-unpaired", "pld", False, num_pred_tokens=2)]
    runs.append(run("ar", "ar", True))
    ar_row = Row(["ar"], select={"method": "ar", "method.num_pred_tokens": None})  # rows override it as before
    assert [cell_runs(spec, row, spec.columns[0], runs)[0].name for row in (Row(["pld"]), ar_row)] == ["pld", "ar"]


def test_an_unknown_spec_name_lists_the_known_ones(tmp_path):
    write_spec(tmp_path)
    with pytest.raises(SpecReproError, match=r"no table spec 'smal' \(.*smal.yaml does not exist; known: small\)"):
        TableSpec.load("smal", tmp_path)


def test_table_cli_takes_a_spec_path_and_reports_a_bad_one_in_one_line(tmp_path):
    """A spec file path works; a malformed one exits 2 with one `specrepro: error:` line; a corrupt run record is
    skipped with a warning, never a traceback."""
    good = write_spec(tmp_path)
    bad = tmp_path / "bad.yaml"
    bad.write_text(SMALL_TABLE.replace(*MALFORMED["select not a mapping"][0]))
    corrupt = tmp_path / "results" / "runs" / "torn" / "metrics.json"
    corrupt.parent.mkdir(parents=True)
    corrupt.write_text('{"complete": tr')

    out = specrepro("table", str(good), "--results-dir", "results", cwd=tmp_path)
    assert (tmp_path / "results" / "small" / "small.md").is_file() and "wrote" in out.stdout
    (warning,) = out.stderr.splitlines()
    assert warning.startswith("skipping a run record: results/runs/torn/metrics.json: ")

    failed = specrepro("table", str(bad), cwd=tmp_path, check=False)
    assert failed.returncode == 2
    (line,) = failed.stderr.splitlines()
    assert line == (
        f"specrepro: error: invalid table spec {bad}: rows[0].select: expected a mapping, got a string 'method=ar'"
    )


def test_a_corrupt_run_record_is_skipped_with_a_warning_naming_it(tmp_path, caplog):
    """A truncated or corrupt metrics.json / config.yaml leaves that run out of the table, with one warning line."""
    runs = tmp_path / "runs"
    records = {
        "good": ('{"complete": true, "method": "ar", "mat": 1.5}', "method: {name: ar}\n"),
        "incomplete": ('{"complete": false}', None),  # still running: skipped quietly
        "truncated": ('{"complete": true, "mat": 1.', None),
        "not_an_object": ("[1, 2]", None),
        "not_utf8": (b"\xff\xfe{}", None),
        "bad_config": ('{"complete": true}', "method: {name: ar\n"),
    }
    for name, (metrics, config) in records.items():
        (runs / name).mkdir(parents=True)
        metrics_path = runs / name / "metrics.json"
        metrics_path.write_bytes(metrics) if isinstance(metrics, bytes) else metrics_path.write_text(metrics)
        if config is not None:
            (runs / name / "config.yaml").write_text(config)

    with caplog.at_level(logging.WARNING, logger="specrepro"):  # tracking reads metrics.json, tables config.yaml
        found = local_runs(tmp_path)
    assert [run.name for run in found] == ["good"]
    warnings = [record.getMessage() for record in caplog.records]
    assert len(warnings) == 4 and all("\n" not in warning for warning in warnings)
    for name in ("truncated", "not_an_object", "not_utf8"):
        assert any(str(runs / name / "metrics.json") in warning for warning in warnings), name
    assert any(str(runs / "bad_config" / "config.yaml") in warning for warning in warnings)


def test_a_table_without_paper_numbers_has_only_here_columns():
    """A benchmark's table (no row has a paper number, the leaderboard) gets one "(here)" column a label, not an
    empty "(paper)" beside each; one paper number anywhere brings the pairs back."""
    runs = [RunInfo("pld", {"mat": 1.5}, {}, 0.0)]
    columns = [Column("MAT", "mat"), Column("Speedup", "speedup_paired")]
    header, body, _ = build_table(TableSpec("t", "p", "title", "", ["Method"], [Row(label=["pld"])], columns), runs)
    assert header == ["Method", "MAT (here)", "Speedup (here)", "runs"] and body[0] == ["pld", "1.50", "–", "[1]"]
    with_paper = TableSpec("t", "p", "title", "", ["Method"], [Row(label=["pld"], paper={"MAT": 2.0})], columns)
    assert build_table(with_paper, runs)[0] == [
        "Method",
        "MAT (paper)",
        "MAT (here)",
        "Speedup (paper)",
        "Speedup (here)",
        "runs",
    ]


def test_a_cell_holding_no_number_shows_its_text():
    """A record whose metric is not a number (hand-edited, or from another version) shows it, not a traceback."""
    runs = [RunInfo("odd", {"mat": [1.5]}, {}, 0.0)]
    spec = TableSpec("t", "p", "title", "", ["Method"], [Row(label=["space"])], [Column("MAT", "mat")])
    assert build_table(spec, runs)[1][0][1] == "[1.5]"


KEEP_TABLE = """
paper: keep
title: "Two rows"
row_header: [Method]
rows:
  - {label: [ar], select: {method: ar}}
  - {label: [pld], select: {method: pld}}
columns:
  - {label: MAT, key: mat}
"""


def _record(results, name: str, method: str, mat: float) -> None:
    run = results / "runs" / name
    run.mkdir(parents=True)
    (run / "metrics.json").write_text(json.dumps({"complete": True, "method": method, "mat": mat}))
    (run / "config.yaml").write_text(f"method: {{name: {method}}}\n")


def _two_runs(tmp_path: Path) -> tuple[Path, Path]:
    """(tables dir holding KEEP_TABLE as two.yaml, records dir with its ar and pld runs)."""
    tables_dir, records = tmp_path / "tables", tmp_path / "records"
    tables_dir.mkdir()
    (tables_dir / "two.yaml").write_text(KEEP_TABLE)
    _record(records, "ar-run", "ar", 1.0)
    _record(records, "pld-run", "pld", 1.5)
    return tables_dir, records


def _amend(records: Path, run: str, **fields) -> None:
    """Add or replace fields of one run's metrics.json."""
    path = records / "runs" / run / "metrics.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **fields}))


def test_keep_rows_carries_rows_whose_runs_are_elsewhere(tmp_path):
    """--keep-rows: a row with no run here keeps its cells and runs from the table already written, the footer
    names it and carries that table's provenance; without it the row is empty; other columns are refused."""
    tables_dir, first, second, out = tmp_path / "tables", tmp_path / "a", tmp_path / "b", tmp_path / "out"
    tables_dir.mkdir()
    (tables_dir / "two.yaml").write_text(KEEP_TABLE)
    _record(first, "ar-run", "ar", 1.0)
    _record(first, "pld-run-old", "pld", 1.5)
    write_table("two", first, tables_dir=tables_dir, out_dir=out)
    _record(second, "pld-run-new", "pld", 2.25)  # another machine re-ran pld only

    md = write_table("two", second, tables_dir=tables_dir, out_dir=out, keep_rows=True).read_text()
    assert "| ar | 1.00 | [1] |" in md and "| pld | 2.25 | [2] |" in md
    assert "1. `ar-run`" in md and "2. `pld-run-new`" in md and "pld-run-old" not in md
    assert "- Kept rows: ar (no run of theirs" in md
    assert "- Kept rows' provenance (that of the table they were kept from): Code: unknown" in md
    csv_text = (out / "two.csv").read_text()
    assert "ar,1.00,ar-run\n" in csv_text and "# Kept rows: ar" in csv_text

    assert sorted(p.name for p in (out / "runs").iterdir()) == ["ar-run", "pld-run-new"]  # the old pld input dropped

    again = write_table("two", second, tables_dir=tables_dir, out_dir=out, keep_rows=True).read_text()
    assert again == md  # keeping is idempotent: the kept line is not nested into the provenance it carries
    assert "| ar | – | – |" in write_table("two", second, tables_dir=tables_dir, out_dir=out).read_text()

    (tables_dir / "two.yaml").write_text(KEEP_TABLE + "  - {label: Speedup, key: speedup_paired}\n")
    with pytest.raises(SpecReproError, match="columns differ from the spec's"):
        write_table("two", second, tables_dir=tables_dir, out_dir=out, keep_rows=True)


def test_a_table_regenerates_from_its_committed_inputs_alone(tmp_path):
    """`<out dir>/runs/` holds the metrics and config of every run behind the table: with the records gone, the
    table regenerates from it unchanged; a record read beside it that finished later takes its cell."""
    tables_dir, records, out = tmp_path / "tables", tmp_path / "records", tmp_path / "out"
    tables_dir.mkdir()
    (tables_dir / "two.yaml").write_text(KEEP_TABLE)
    _record(records, "ar-run", "ar", 1.0)
    _record(records, "pld-run", "pld", 1.5)
    first = write_table("two", records, tables_dir=tables_dir, out_dir=out, command="cmd").read_text()
    shutil.rmtree(records)
    assert write_table("two", out, tables_dir=tables_dir, out_dir=out, command="cmd").read_text() == first

    newer = tmp_path / "newer"
    _record(newer, "pld-run-2", "pld", 2.0)
    metrics = newer / "runs" / "pld-run-2" / "metrics.json"
    record = json.loads(metrics.read_text())
    metrics.write_text(json.dumps({**record, "provenance": {"finished_at": "2026-01-02T00:00:00+00:00"}}))
    inputs = out / "runs" / "pld-run" / "metrics.json"
    older = {**json.loads(inputs.read_text()), "provenance": {"finished_at": "2026-01-01T00:00:00+00:00"}}
    inputs.write_text(json.dumps(older))
    inputs.touch()  # a checkout's file time says nothing about which run is newer
    md = write_table("two", [newer, out], tables_dir=tables_dir, out_dir=out).read_text()
    assert "| pld | 2.00 | [2] |" in md and "| ar | 1.00 | [1] |" in md
    assert sorted(p.name for p in (out / "runs").iterdir()) == ["ar-run", "pld-run-2"]


def test_a_run_decoded_again_under_its_name_fills_its_cell_inputs_and_footer_with_its_new_record(tmp_path):
    """New records read beside a table's committed inputs can hold a second copy of a run's name (decoded again
    after records were lost): the newer copy is the run, in the cell and in the inputs written, so the table still
    regenerates from its inputs alone; the footer's command regenerates it as written."""
    (tables_dir, records), out = _two_runs(tmp_path), tmp_path / "out"
    write_table("two", records, tables_dir=tables_dir, out_dir=out)
    _amend(records, "pld-run", mat=1.25, provenance={"finished_at": "2026-01-02T00:00:00+00:00"})
    _amend(out, "pld-run", provenance={"finished_at": "2026-01-01T00:00:00+00:00"})
    md = write_table("two", [records, out], tables_dir=tables_dir, out_dir=out).read_text()
    assert "| pld | 1.25 | [2] |" in md
    assert json.loads((out / "runs" / "pld-run" / "metrics.json").read_text())["mat"] == 1.25
    assert f"specrepro table two --results-dir {records} --results-dir {out} --out-dir {out}`" in md
    shutil.rmtree(records)
    assert "| pld | 1.25 | [2] |" in write_table("two", out, tables_dir=tables_dir, out_dir=out).read_text()


def test_a_comparison_page_keeps_the_inputs_it_names_when_a_table_is_regenerated(tmp_path):
    """`specrepro compare --out <table dir>/compare/PAGE.md` reads committed inputs no table names any more."""
    (tables_dir, records), out = _two_runs(tmp_path), tmp_path / "out"
    write_table("two", records, tables_dir=tables_dir, out_dir=out)
    (out / "compare").mkdir()
    (out / "compare" / "page.md").write_text("`specrepro compare pld-run ar-run --results-dir out`\n")
    shutil.rmtree(records / "runs" / "pld-run")
    _record(records, "pld-run-2", "pld", 2.0)
    _amend(records, "pld-run-2", provenance={"finished_at": "2030-01-01T00:00:00+00:00"})
    write_table("two", [records, out], tables_dir=tables_dir, out_dir=out)
    assert sorted(p.name for p in (out / "runs").iterdir()) == ["ar-run", "pld-run", "pld-run-2"]


def test_a_table_whose_runs_loaded_other_weights_or_data_under_one_name_says_so(tmp_path, caplog):
    """Records merged from two machines, or made before and after a retrain or a data edit: the footer names which
    runs had which content of the artifact or dataset, and a warning says it; one content is not worth a line."""
    tables_dir, records = _two_runs(tmp_path)

    def loaded(run: str, digest: str) -> None:
        _amend(records, run, artifacts={"draft": {"name": "sps_draft-m-1234", "content_digest": digest}})

    loaded("ar-run", "aaaa")
    loaded("pld-run", "aaaa")
    one = write_table("two", records, tables_dir=tables_dir, out_dir=tmp_path / "one").read_text()
    assert "Mixed weights" not in one and "| pld | 1.50 | [2] |" in one
    loaded("pld-run", "bbbb")
    with caplog.at_level("WARNING"):
        md = write_table("two", records, tables_dir=tables_dir, out_dir=tmp_path / "two").read_text()
    line = (
        "- Mixed weights: runs loaded 2 different contents of sps_draft-m-1234 ([1]: aaaa; [2]: bbbb): it was "
        "retrained between them; their cells do not come from one model"
    )
    assert line in md.splitlines() and "Mixed weights" in caplog.text and "Mixed data" not in md

    path = records / "runs" / "ar-run" / "metrics.json"  # recorded before runs named their weights' contents
    old_record = {k: v for k, v in json.loads(path.read_text()).items() if k != "artifacts"}
    path.write_text(json.dumps({**old_record, "training_minutes": 0.0}))  # it loads no trained weights
    md = write_table("two", records, tables_dir=tables_dir, out_dir=tmp_path / "four").read_text()
    assert "Unrecorded weights" not in md and "Mixed weights" not in md
    path.write_text(json.dumps({**old_record, "training_minutes": 12.5}))
    md = write_table("two", records, tables_dir=tables_dir, out_dir=tmp_path / "five").read_text()
    assert "Unrecorded weights" not in md  # nothing in its config names the draft pld-run recorded
    for run, draft in (("ar-run", "sps_draft"), ("pld-run", "sps_draft")):
        (records / "runs" / run / "config.yaml").write_text(f"method: {{name: {run[:-4]}, draft: {{id: {draft}}}}}\n")
    md = write_table("two", records, tables_dir=tables_dir, out_dir=tmp_path / "six").read_text()
    assert (
        "- Unrecorded weights: runs [1] predate records of the weights a run loads (`artifacts` in "
        "metrics.json); nothing shows they loaded the contents runs naming the same artifacts recorded "
        "(sps_draft-m-1234: bbbb)"
    ) in md.splitlines()
    (records / "runs" / "ar-run" / "config.yaml").write_text("method: {name: ar, draft: {id: a/sps_draft-m-1234}}\n")
    md = write_table("two", records, tables_dir=tables_dir, out_dir=tmp_path / "path").read_text()
    assert "- Unrecorded weights: runs [1] predate" in md  # named by a path to it
    (records / "runs" / "ar-run" / "config.yaml").write_text("method: {name: ar, draft: {id: sps_draft_general}}\n")
    md = write_table("two", records, tables_dir=tables_dir, out_dir=tmp_path / "seven").read_text()
    assert "Unrecorded weights" not in md  # another draft: the recorded one's digest says nothing of it
    (records / "runs" / "ar-run" / "config.yaml").write_text("method: {name: ar, draft: {id: sps_draft}}\n")
    path.write_text(json.dumps({**old_record, "training_minutes": 12.5, "model": "another"}))  # its own weights
    md = write_table("two", records, tables_dir=tables_dir, out_dir=tmp_path / "eight").read_text()
    assert "Unrecorded weights" not in md

    for run, fingerprint in (("ar-run", "d1"), ("pld-run", "d2")):  # one dataset setting, its file edited between
        (records / "runs" / run / "config.yaml").write_text(
            f"method: {{name: {run[:-4]}}}\ndataset: {{name: gsm8k, limit: 10}}\n"
        )
        path = records / "runs" / run / "metrics.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), "data_fingerprint": fingerprint}))
    md = write_table("two", records, tables_dir=tables_dir, out_dir=tmp_path / "three").read_text()
    assert (
        "- Mixed data: runs decoded 2 different contents of gsm8k (limit 10) ([1]: d1; [2]: d2): its records "
        "changed between them; their cells do not come from the same prompts"
    ) in md.splitlines()


def test_a_table_whose_runs_of_one_method_decoded_with_other_code_says_so(tmp_path):
    """Runs of one method made before and after a change to its code (now a new run, never a resumed one) can still
    meet in one table: the footer names which runs had which code; one method's code or several methods' is no line."""
    tables_dir, records = _two_runs(tmp_path)
    (tables_dir / "pld.yaml").write_text(
        KEEP_TABLE.replace("{method: ar}", "{method: pld, mat: 2.0}").replace(
            "{method: pld}", "{method: pld, mat: 1.5}"
        )
    )
    _record(records, "pld-run-fixed", "pld", 2.0)
    for run, fingerprint in (("ar-run", "a1"), ("pld-run", "p1"), ("pld-run-fixed", "p1")):
        _amend(records, run, code_fingerprint=fingerprint)
    assert "Mixed code" not in write_table("pld", records, tables_dir=tables_dir, out_dir=tmp_path / "one").read_text()
    assert "Mixed code" not in write_table("two", records, tables_dir=tables_dir, out_dir=tmp_path / "two").read_text()
    _amend(records, "pld-run-fixed", code_fingerprint="p2")
    md = write_table("pld", records, tables_dir=tables_dir, out_dir=tmp_path / "three").read_text()
    assert (
        "- Mixed code: runs decoded with 2 different contents of pld's code ([1]: p2; [2]: p1): it changed "
        "between them (a fix, a refactor, another torch or transformers); their cells may not come from one "
        "decoder"
    ) in md.splitlines()


def test_a_table_whose_runs_two_machines_timed_says_which_runs_each_timed(tmp_path):
    """Runs merged from two machines: the footer lists each machine's runs, so a reader compares tok/s only
    within one; runs from one machine (or without a recorded machine) add no line."""
    tables_dir, records = _two_runs(tmp_path)

    def timed_on(run: str, cpu: str) -> None:
        _amend(records, run, provenance={"machine": {"cpu": cpu, "cpu_capability": "AVX2", "cpu_cores": 2}})

    timed_on("ar-run", "AMD EPYC")
    one = write_table("two", records, tables_dir=tables_dir, out_dir=tmp_path / "one").read_text()
    timed_on("pld-run", "AMD EPYC")
    same = write_table("two", records, tables_dir=tables_dir, out_dir=tmp_path / "same").read_text()
    assert "Runs by machine" not in one + same and "- Machine: AMD EPYC (AVX2), 2 cores\n" in same
    timed_on("pld-run", "Intel Xeon")
    md = write_table("two", records, tables_dir=tables_dir, out_dir=tmp_path / "two").read_text().splitlines()
    line = (
        "- Runs by machine: AMD EPYC (AVX2), 2 cores: [1]; Intel Xeon (AVX2), 2 cores: [2] (tok/s compare only "
        "between runs of one machine)"
    )
    assert md[md.index("- Machine: AMD EPYC (AVX2), 2 cores; Intel Xeon (AVX2), 2 cores") + 1] == line
    assert _mark_ranges([1, 2, 3, 7, 9, 10]) == "[1]-[3] [7] [9]-[10]"  # a long table's marks stay short


@pytest.mark.parametrize("paper", PAPERS_WITH_INPUTS, ids=lambda path: path.name)
def test_the_committed_tables_are_what_their_committed_inputs_regenerate(paper, tmp_path):
    """Each committed table beside committed inputs (`results/<paper>/runs/`) is, byte for byte, what `specrepro
    table` writes from them with the command its footer names, and the inputs are exactly the runs the tables name:
    no cell typed in or left stale by a change to the table code."""
    copy = tmp_path / paper.name
    shutil.copytree(paper, copy)  # its tables too: the inputs a table in the folder names are kept
    for table in sorted(paper.glob("*.csv")):
        command = re.search(r"^# Regenerate: `(.+)`$", table.read_text(), re.M).group(1)
        md = write_table(table.stem, copy, out_dir=copy, command=command)
        assert md.read_text() == table.with_suffix(".md").read_text(), f"{table.with_suffix('.md')} differs"
        assert md.with_suffix(".csv").read_text() == table.read_text(), f"{table} differs"
    inputs = sorted(path.relative_to(paper) for path in (paper / "runs").rglob("*") if path.is_file())
    assert inputs == sorted(path.relative_to(copy) for path in (copy / "runs").rglob("*") if path.is_file())
    assert all((copy / path).read_bytes() == (paper / path).read_bytes() for path in inputs)


def test_a_results_dir_that_fills_nothing_does_not_wipe_a_committed_table(tmp_path, caplog):
    """A mistyped or empty --results-dir is refused in one line, leaving the table and its committed inputs as
    they were; a run that fills some rows writes the table and names the rows it empties."""
    tables_dir, records, out = tmp_path / "tables", tmp_path / "records", tmp_path / "out"
    tables_dir.mkdir()
    (tables_dir / "two.yaml").write_text(KEEP_TABLE)
    _record(records, "ar-run", "ar", 1.0)
    _record(records, "pld-run", "pld", 1.5)
    table = write_table("two", records, tables_dir=tables_dir, out_dir=out).read_text()

    with pytest.raises(SpecReproError, match=r"no run records in .*typo \(no .*typo/runs directory\)"):
        write_table("two", tmp_path / "typo", tables_dir=tables_dir, out_dir=out)
    (tmp_path / "empty" / "runs").mkdir(parents=True)
    with pytest.raises(SpecReproError, match="no run in .*empty fills a cell of two: not replacing"):
        write_table("two", tmp_path / "empty", tables_dir=tables_dir, out_dir=out)
    assert (out / "two.md").read_text() == table
    assert sorted(p.name for p in (out / "runs").iterdir()) == ["ar-run", "pld-run"]

    _record(tmp_path / "pld_only", "pld-run-2", "pld", 2.0)
    with caplog.at_level("WARNING"):
        md = write_table("two", tmp_path / "pld_only", tables_dir=tables_dir, out_dir=out).read_text()
    assert "| ar | – | – |" in md and "| pld | 2.00 | [1] |" in md
    assert "now empty: ar (--keep-rows keeps them)" in caplog.text


def test_the_commands_that_read_records_start_without_torch():
    """`table`, `compare`, `summary` and `reproduce` (between its stages) import neither torch nor transformers,
    which take seconds to import: a table or a comparison is answered in about two seconds."""
    import subprocess
    import sys

    code = (
        "import sys, specrepro.cli, specrepro.tables, specrepro.compare, specrepro.reproduce; "
        "print(sorted({'torch', 'transformers', 'accelerate'} & set(sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_a_trend_plot_fits_log_x_and_extrapolates_with_the_lines_interval(tmp_path):
    """`kind: trend` reads a run's trained-component metrics (`trained.<component>.<key>`, a list item by
    position), fits y = a + b log10(x) and writes the figure and a page with the slope and the extrapolated values."""
    from specrepro.plots import draw_trend, log_linear_fit

    exact = log_linear_fit([10, 100, 1000], [1.0, 1.5, 2.0])
    assert exact["slope"] == pytest.approx(0.5) and exact["predict"](10_000) == pytest.approx((2.5, 0.0), abs=1e-9)
    noisy = log_linear_fit([10, 100, 1000, 10_000], [1.0, 1.6, 1.9, 2.6])
    value, margin = noisy["predict"](100_000)
    assert margin > noisy["predict"](300)[1] > 0  # the line is pinned best inside the measured range
    assert log_linear_fit([10, 100], [1.0, 2.0]) is None
    assert log_linear_fit([100, 100, 100], [1.0, 1.2, 1.1]) is None  # one x: no slope (was a division by zero)
    trend = types.SimpleNamespace(
        columns=["MAT"], x="Conversations", xlabel=None, extrapolate={}, targets=None, reference=None
    )
    here = {"Conversations": [0, 10, 100, 1000], "MAT": [1.0, 1.0, 1.5, 2.0]}  # an untrained head at x = 0
    _, lines = draw_trend(trend, here, "a learning curve")  # its log10(0) made the fit nan
    assert lines[2].startswith("| MAT | 3 (and 1 at x <= 0, off the log axis) | +0.5 (")

    runs = [
        RunInfo(
            f"eagle-{n}",
            {"mat": m, "trained": {"eagle_head": {"train_sequences": n, "heldout_top1_by_depth_after": [t, t / 2]}}},
            {"method": {"name": "eagle", "head": f"h{n}"}},
            0.0,
        )
        for n, m, t in ((100, 1.3, 0.2), (1000, 1.5, 0.3), (10_000, 1.7, 0.4))
    ]
    columns = [
        Column("Conversations", "trained.eagle_head.train_sequences", fmt="{:.0f}"),
        Column("Top-1 depth 1", "trained.eagle_head.heldout_top1_by_depth_after.1"),
        Column("MAT", "mat"),
    ]
    spec = TableSpec(
        "t",
        "p",
        "title",
        "",
        ["Budget"],
        [Row([str(r.config["method"]["head"])], {"method.head": r.config["method"]["head"]}) for r in runs],
        columns,
        plots=[
            Plot("curve", "trend", x="Conversations", columns=["Top-1 depth 1", "MAT"], extrapolate={"paper": 100_000})
        ],
    )
    header, body, footnotes = build_table(spec, runs)
    assert [row[1:4] for row in body] == [["100", "0.10", "1.30"], ["1000", "0.15", "1.50"], ["10000", "0.20", "1.70"]]
    path = tmp_path / "t.csv"
    path.write_text(render_csv(header, body, footnotes, ["- Machine: test"]))
    written = write_plots(spec.plots, path, ["Budget"], spec.title)
    assert [p.name for p in written] == ["t_curve.md", "t_curve.png"]
    page = written[0].read_text()
    assert "| MAT | 3 | +0.2 (+0.2 to +0.2) | 1.9 (1.9 to 1.9) |" in page and "- Machine: test" in page


def test_a_trend_gives_the_budget_at_which_its_line_reaches_another_tables_cell(tmp_path, monkeypatch):
    """`targets` reads a row's cell from another committed CSV and solves the fitted line (and each edge of its band)
    for it: the earliest and the latest budget the fit allows around the line's own."""
    from specrepro.plots import log_linear_fit, reaching

    exact = log_linear_fit([10, 100, 1000], [1.0, 1.5, 2.0])  # y = 0.5 + 0.5 log10(x): 2.5 at 10,000
    line, early, late = reaching(exact, 2.5, 10)
    assert line == pytest.approx(10_000, rel=1e-6) and early == pytest.approx(line) and late == pytest.approx(line)
    noisy = log_linear_fit([10, 100, 1000, 10_000], [1.0, 1.6, 1.9, 2.6])
    line, early, late = reaching(noisy, 3.5, 10)
    assert early < line < late and noisy["predict"](line)[0] == pytest.approx(3.5)
    assert reaching(noisy, 0.5, 10) == [10, 10, 10]  # reached before the first budget
    assert reaching(log_linear_fit([10, 100, 1000], [2.0, 1.5, 1.0]), 3.0, 10)[0] is None  # a falling line never does

    monkeypatch.chdir(tmp_path)
    Path("board.csv").write_text("Method,Mean speedup (here)\nar,1.00x\npld,2.00x ±0.10x\n")
    runs = [
        RunInfo(f"h{n}", {"speedup_paired": s, "trained": {"head": {"n": n}}}, {"method": {"head": f"h{n}"}}, 0.0)
        for n, s in ((10, 1.0), (100, 1.25), (1000, 1.5))
    ]
    columns = [Column("Conversations", "trained.head.n", fmt="{:.0f}"), Column("Mean speedup", "speedup_paired")]
    rows = [Row([f"h{n}"], {"method.head": f"h{n}"}) for n in (10, 100, 1000)]
    targets = {"Mean speedup": {"csv": "board.csv", "row": "pld"}}
    plot = Plot("curve", "trend", x="Conversations", columns=["Mean speedup"], targets=targets)
    spec = TableSpec("t", "p", "title", "", ["Budget"], rows, columns, plots=[plot])
    path = tmp_path / "t.csv"
    path.write_text(render_csv(*build_table(spec, runs), ["- Machine: test"]))
    page = write_plots(spec.plots, path, ["Budget"], spec.title)[0].read_text()
    assert "| Mean speedup | 2 (pld, board.csv) | 100,000 (100,000 to 100,000) |" in page
    plot.targets = {"Mean speedup": {"csv": "board.csv", "row": "eagle"}}
    with pytest.raises(SpecReproError, match="has no row 'eagle'"):
        write_plots(spec.plots, path, ["Budget"], spec.title)


def test_a_tables_regenerating_command_is_quoted_for_a_shell():
    """Words were joined with spaces: a results directory or W&B group holding a space regenerated another table."""
    from specrepro.tables import table_command

    local = table_command("t", ["results/my runs"], "local", None, None, None, None, False)
    assert local == "specrepro table t --results-dir 'results/my runs'"
    wandb = table_command("t", [], "wandb", "proj", None, "sweep 1", "out", True)
    assert wandb == "specrepro table t --source wandb --project proj --group 'sweep 1' --out-dir out --keep-rows"


def test_a_mean_column_refuses_runs_of_other_settings_in_its_cells():
    """A mean over categories whose qa run is pld k=2 and whose rag run is an ablation at k=4 (the row leaves k
    open) is not one setting's mean: refused, as two runs of one cell are."""
    runs = [
        RunInfo(
            f"pld-{c}",
            {"speedup_paired": s},
            {"method": {"name": "pld", "num_pred_tokens": k}, "dataset": {"category": c}},
            0.0,
        )
        for c, s, k in (("qa", 1.2, 2), ("rag", 3.0, 4))
    ]
    spec = pld_table(Column("Mean", "speedup_paired", mean_over={"dataset.category": ["qa", "rag"]}))
    with pytest.raises(SpecReproError, match="differ in method.num_pred_tokens"):
        build_table(spec, runs)
    spec.rows[0].select["method.num_pred_tokens"] = 2
    assert build_table(spec, runs)[1][0][1] == "–"
