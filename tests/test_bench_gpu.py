"""experiments/bench_gpu.py, end to end on the CPU (eager backend, a tiny random LLaMA), and gpu_check.sh's refusal
without a GPU: a lent GPU's minutes are too few to find a broken script there."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).parents[1] / "experiments" / "bench_gpu.py"


def test_bench_runs_every_arm_and_writes_its_figures(tmp_path, monkeypatch):
    out = tmp_path / "bench.json"
    subprocess.run([sys.executable, str(BENCH), "--device", "cpu", "--backend", "eager", "--dtype", "float32",
                    "--model", "tiny_random model.random.num_layers=2", "--methods",
                    "jacobi;eesd1=eesd method.head=none method.num_layers=1", "--limit", "2",
                    "--max-new-tokens", "8", "--json", str(out), "--markdown", str(tmp_path / "bench.md")],
                   check=True, capture_output=True, text=True)
    figures = json.loads(out.read_text())
    arms = {"ar_eager", "ar_compiled", "pld_eager", "pld_compiled", "jacobi_eager", "jacobi_compiled", "eesd1_eager",
            "eesd1_compiled", "generate_eager", "generate_compiled"}  # jacobi and eesd run on compiled steps too
    assert arms <= set(figures["tok_per_s"]) and figures["model"] == "tiny_random"
    assert figures["prompts"] == figures["prompts_asked"] == 2
    assert all(n == 2 for n in figures["identical_to_ar_eager"].values())  # greedy: every arm decodes what ar does
    assert figures["speculative"]["jacobi_eager"]["mat"] >= 1.0
    # compiled drafts commit what eager ones do, round for round (EESD's exit layer once did not)
    assert all(figures["speculative"][f"{arm}_compiled"]["rounds_as_eager"] == 2 for arm in ("pld", "jacobi", "eesd1"))
    assert figures["ar_compiled_over_eager"] > 0 and figures["bound_tok_per_s"] > 0
    assert "bench_gpu.py" in figures["provenance"]["command"]  # quoted as a shell takes it back
    assert "--methods 'jacobi;eesd1=eesd method.head=none method.num_layers=1'" in figures["provenance"]["command"]
    assert figures["methods"] == {"jacobi": {"spec": "jacobi", "artifacts": {}},  # what each arm ran, which weights
                                  "eesd1": {"spec": "eesd1=eesd method.head=none method.num_layers=1", "artifacts": {}}}
    monkeypatch.syspath_prepend(str(BENCH.parent))
    from bench_gpu import markdown

    page = (tmp_path / "bench.md").read_text()
    assert page == markdown(figures) and "| `eesd1_compiled` |" in page and figures["date"] in page
    assert "- `eesd1`: `eesd1=eesd method.head=none method.num_layers=1`, nothing trained" in page
    # Beta-TS drafts up to k_max = 16 tokens: a 17-row verify is past the widest bucket (16), so it runs eagerly
    assert figures["eager_wide_steps"] == {"eesd1_compiled": 17}
    assert "run eagerly: `eesd1_compiled` (up to 17 rows)" in page
    assert "| `eesd1_compiled` |" in page and page.count(" | 2/2 | 2/2 |") == 3  # pld, jacobi, eesd1 compiled


def test_two_method_arms_of_one_name_are_refused_in_one_line(tmp_path):
    """`--methods "sar_draft;sar_draft method.k=3"` would time one arm under the other's name: refused, label one."""
    proc = subprocess.run([sys.executable, str(BENCH), "--device", "cpu", "--backend", "eager", "--dtype", "float32",
                           "--model", "tiny_random model.random.num_layers=2", "--json", str(tmp_path / "bench.json"),
                           "--methods", "jacobi;jacobi method.block_size=4"], capture_output=True, text=True)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == ("bench_gpu.py: error: --methods names the arm 'jacobi' twice: "
                                                     "label one (e.g. 'jacobi_2=jacobi method.block_size=4')")
    assert not (tmp_path / "bench.json").exists()


def test_the_committed_cpu_page_is_the_one_its_committed_figures_give(monkeypatch):
    """results/cpu/compiled.md is the bench's rendering of the JSON it wrote beside it, never typed."""
    monkeypatch.syspath_prepend(str(BENCH.parent))
    from bench_gpu import markdown

    results = BENCH.parents[1] / "results" / "cpu"
    figures = json.loads((results / "compiled.json").read_text())
    assert (results / "compiled.md").read_text() == markdown(figures)
    assert figures["prompts"] == figures["prompts_asked"] and not figures["provenance"]["code"].get("dirty")


def test_gpu_check_refuses_a_machine_without_cuda_in_one_line(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    script = Path(__file__).parents[1] / "experiments" / "gpu_check.sh"
    proc = subprocess.run(["bash", str(script), str(tmp_path / "out")], capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable})
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [f"gpu_check: no CUDA device visible to {sys.executable}"]
    assert not list((tmp_path / "out").glob("*.json"))  # nothing measured, nothing written


def test_an_unknown_model_preset_is_one_line():
    proc = subprocess.run([sys.executable, str(BENCH), "--device", "cpu", "--model", "no_such_model"],
                          capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith("bench_gpu.py: error: ")
    assert "no_such_model" in proc.stderr and "Traceback" not in proc.stderr
