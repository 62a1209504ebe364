"""notebooks/analysis.ipynb runs top to bottom (nbclient, this interpreter's kernel) on records made by a
tiny sweep, and writes its plots."""

from __future__ import annotations

import json
from pathlib import Path

import nbformat
from nbclient import NotebookClient

from tests.test_tables import tiny_sweep  # noqa: F401  (the session fixture: records of a tiny sweep)

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "analysis.ipynb"
PLOTS = {"speedup.png", "mat.png", "accepted_length_hist.png", "cost_model.png", "hm_vs_k.png"}


def test_analysis_notebook_executes_and_writes_plots(tiny_sweep, tmp_path, monkeypatch):  # noqa: F811
    monkeypatch.setenv("SPECREPRO_RESULTS", str(tiny_sweep / "results"))
    monkeypatch.setenv("SPECREPRO_PLOTS", str(tmp_path / "plots"))
    monkeypatch.setenv("MPLBACKEND", "Agg")
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    # kernel "python3" is the native kernel of the running interpreter (the venv's), installed or not
    NotebookClient(notebook, kernel_name="python3", timeout=300, resources={"metadata": {"path": str(tmp_path)}}).execute()

    assert {p.name for p in (tmp_path / "plots").glob("*.png")} == PLOTS
    assert all((tmp_path / "plots" / name).stat().st_size > 1000 for name in PLOTS)
    outputs = [o for cell in notebook.cells if cell.cell_type == "code" for o in cell.get("outputs", [])]
    assert not [o for o in outputs if o.get("output_type") == "error"]
    hm_table = json.dumps(notebook.cells[-2].outputs)
    assert "pld" in hm_table  # pld at K=2 and K=4 on two datasets made the HM-vs-K plot
