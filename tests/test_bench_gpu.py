"""experiments/bench_gpu.py, end to end on the CPU (eager backend, a tiny random LLaMA): a lent GPU's minutes are
too few to find a broken script there."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).parents[1] / "experiments" / "bench_gpu.py"


def test_bench_runs_every_arm_and_writes_its_figures(tmp_path):
    out = tmp_path / "bench.json"
    subprocess.run([sys.executable, str(BENCH), "--device", "cpu", "--backend", "eager", "--dtype", "float32",
                    "--model", "tiny_random model.random.num_layers=1", "--methods", "jacobi", "--limit", "2",
                    "--max-new-tokens", "8", "--json", str(out)], check=True, capture_output=True, text=True)
    figures = json.loads(out.read_text())
    arms = {"ar_eager", "ar_compiled", "pld_eager", "pld_compiled", "jacobi_eager", "generate_eager",
            "generate_compiled"}
    assert arms <= set(figures["tok_per_s"]) and figures["model"] == "tiny_random"
    assert all(n == 2 for n in figures["identical_to_ar_eager"].values())  # greedy: every arm decodes what ar does
    assert figures["speculative"]["jacobi_eager"]["mat"] >= 1.0
    assert figures["ar_compiled_over_eager"] > 0 and figures["bound_tok_per_s"] > 0
    assert "bench_gpu.py" in figures["provenance"]["command"]
