"""Hydra callbacks: after a multirun sweep, print one table of every job it ran, failed ones included."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from specrepro.cli import FAILURE_FILE, POINTER_FILE


class SweepTable(Callback):
    failed_jobs: list[str] = []  # of the last sweep in this process: the CLI exits non-zero when any failed

    def on_multirun_end(self, config: DictConfig, **kwargs) -> None:
        from specrepro.metrics.summary import results_table  # here: torch, which the CLI imports only for a run

        rows, failed = [], []
        job_dirs = sorted(
            (p for p in Path(config.hydra.sweep.dir).iterdir() if p.is_dir() and p.name.isdigit()),
            key=lambda p: int(p.name),
        )
        overrides = {p: _overrides(p) for p in job_dirs}
        common = set.intersection(*map(set, overrides.values())) if overrides else set()
        for job_dir in job_dirs:
            pointer, failure = job_dir / POINTER_FILE, job_dir / FAILURE_FILE
            metrics_path = Path(pointer.read_text().strip()) / "metrics.json" if pointer.is_file() else None
            if metrics_path is not None and metrics_path.is_file():
                rows.append(json.loads(metrics_path.read_text()))
                continue
            label = " ".join(o for o in overrides[job_dir] if o not in common)  # what this job swept
            reason = failure.read_text().strip() if failure.is_file() else "no result (see the job's log)"
            rows.append({"run_name": f"job {job_dir.name} FAILED: {label}", "error": reason})
            failed.append(job_dir.name)
        SweepTable.failed_jobs = failed
        if rows:
            print(results_table(rows))
        if failed:
            print(f"specrepro: {len(failed)} of {len(rows)} jobs failed: {', '.join(failed)}", file=sys.stderr)


def _overrides(job_dir: Path) -> list[str]:
    path = job_dir / ".hydra" / "overrides.yaml"
    return list(OmegaConf.load(path)) if path.is_file() else []
