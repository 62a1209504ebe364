"""Sweeps on Hydra's launcher plugins: a joblib sweep killed midway resumes to exactly one copy of every
sample; submitit_local runs the same jobs; the runs of one sweep share a W&B group."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.test_runner import FAST, offline_wandb_records, specrepro

# 6 runs: ar and pld for three decoding seeds (greedy: the seed only changes the run name), so each pld
# run's `ar` reference is also a job of the same sweep and two jobs may need the same run at once.
SWEEP = [
    "run",
    "-m",
    "hydra/launcher=joblib",
    "hydra.launcher.n_jobs=2",
    *FAST,
    "decoding.max_new_tokens=16",
    "method=ar,pld",
    "decoding.seed=0,1,2",
    "dataset=gsm8k",
    "dataset.limit=12",
    "logger=none",
]


def _run_states(runs: Path) -> tuple[int, int]:
    """(complete runs, runs with finished samples but no metrics yet)."""
    complete = partial = 0
    for run_dir in runs.glob("*"):
        if (run_dir / "metrics.json").is_file():
            complete += 1
        elif (run_dir / "generations.jsonl").is_file() and (run_dir / "generations.jsonl").stat().st_size > 0:
            partial += 1
    return complete, partial


def test_joblib_sweep_killed_midway_resumes_without_duplicates(tmp_path):
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "specrepro.cli", *SWEEP],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    runs = tmp_path / "results" / "runs"
    deadline = time.monotonic() + 300
    while proc.poll() is None and time.monotonic() < deadline:
        complete, partial = _run_states(runs)
        if complete >= 1 and partial >= 1:
            break
        time.sleep(0.05)
    assert proc.poll() is None, "the sweep ended before it could be killed midway"
    os.killpg(proc.pid, signal.SIGKILL)  # the launcher and its joblib workers
    proc.wait()
    assert _run_states(runs)[0] < 6

    specrepro(*SWEEP, cwd=tmp_path)
    run_dirs = sorted(p for p in runs.iterdir() if p.is_dir())
    assert len(run_dirs) == 6
    for run_dir in run_dirs:
        metrics = json.loads((run_dir / "metrics.json").read_text())
        assert metrics["complete"] and metrics["n_samples"] == 12
        ids = [json.loads(line)["id"] for line in (run_dir / "generations.jsonl").read_text().splitlines()]
        assert sorted(ids, key=int) == [str(i) for i in range(12)], run_dir.name  # each once, none lost
        if metrics["method"] == "pld":
            assert metrics["reference_run"] in {p.name for p in run_dirs}


def _wandb_group(run_dir: Path) -> str:
    for record in offline_wandb_records(run_dir):
        if record.WhichOneof("record_type") == "run":
            return record.run.run_group
    raise AssertionError(f"no run record in {run_dir}/wandb")


def test_submitit_local_sweep_completes_and_shares_a_wandb_group(tmp_path):
    specrepro(
        "run",
        "-m",
        "hydra/launcher=submitit_local",
        *FAST,
        "method=ar,pld",
        "dataset.limit=2",
        "logger=wandb",
        cwd=tmp_path,
    )
    run_dirs = [p for p in (tmp_path / "results" / "runs").iterdir()]
    assert len(run_dirs) == 2
    assert all(json.loads((p / "metrics.json").read_text())["complete"] for p in run_dirs)
    sweep_dir = next((tmp_path / "results" / "hydra" / "multirun").iterdir())
    assert {_wandb_group(p) for p in run_dirs} == {sweep_dir.name}
