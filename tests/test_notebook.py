"""notebooks/analysis.ipynb runs top to bottom (nbclient, this interpreter's kernel) on records made by a
tiny sweep, and writes its plots."""

from __future__ import annotations

import json
from pathlib import Path

import nbformat
from nbclient import NotebookClient

from specrepro.tables import RunInfo, TableSpec, build_table, render_csv
from tests.test_tables import tiny_sweep  # noqa: F401  (the session fixture: records of a tiny sweep)

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "analysis.ipynb"
PLOTS = {
    "speedup.png",
    "mat.png",
    "accepted_length_hist.png",
    "cost_model.png",
    "hm_vs_k.png",
    "spec_bench_speedup_by_category.png",
    "spec_bench_speedup_vs_training.png",
}
CATEGORIES = ("multi_turn", "translation", "summarization", "qa", "math_reasoning", "rag")


def leaderboard_csv(path: Path) -> Path:
    """A spec_bench table of pld over the six categories, as `specrepro table spec_bench` writes it."""
    config = {
        "dataset": {"name": "spec_bench"},
        "decoding": {"name": "greedy"},
        "timing": {"paired": True},
        "hardware": {"dtype": "float32"},
        "model": {"name": "smollm2_135m"},
    }
    runs = [
        RunInfo(
            f"pld-{c}",
            {
                "method": "pld",
                "model": "smollm2_135m",
                "dataset": "spec_bench",
                "decoding": "greedy",
                "speedup_paired": 1.1 + i / 10,
                "training_minutes": 0.0,
            },
            {**config, "dataset": {"name": "spec_bench", "category": c}},
            0.0,
        )
        for i, c in enumerate(CATEGORIES)
    ]
    path.write_text(render_csv(*build_table(TableSpec.load("spec_bench"), runs), ["- Machine: test"]))
    return path


def test_analysis_notebook_executes_and_writes_plots(tiny_sweep, tmp_path, monkeypatch):  # noqa: F811
    monkeypatch.setenv("SPECREPRO_RESULTS", str(tiny_sweep / "results"))
    monkeypatch.setenv("SPECREPRO_PLOTS", str(tmp_path / "plots"))
    monkeypatch.setenv("MPLBACKEND", "Agg")
    monkeypatch.setenv("SPECREPRO_LEADERBOARD", str(leaderboard_csv(tmp_path / "spec_bench.csv")))
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    # kernel "python3" is the native kernel of the running interpreter (the venv's), installed or not
    NotebookClient(
        notebook, kernel_name="python3", timeout=300, resources={"metadata": {"path": str(tmp_path)}}
    ).execute()

    assert {p.name for p in (tmp_path / "plots").glob("*.png")} == PLOTS
    assert all((tmp_path / "plots" / name).stat().st_size > 1000 for name in PLOTS)
    speedups = (tmp_path / "plots" / "speedup.csv").read_text()  # the numbers, then the runs' provenance
    assert (
        "\n# Machine: " in speedups
        and "# Regenerate: `run notebooks/analysis.ipynb with SPECREPRO_RESULTS=" in speedups
    )
    outputs = [o for cell in notebook.cells if cell.cell_type == "code" for o in cell.get("outputs", [])]
    assert not [o for o in outputs if o.get("output_type") == "error"]
    hm_table = json.dumps(next(cell.outputs for cell in notebook.cells if "with_k = " in cell.source))
    assert "pld" in hm_table  # pld at K=2 and K=4 on two datasets made the HM-vs-K plot
