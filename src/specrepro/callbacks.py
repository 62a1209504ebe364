"""Hydra callbacks: after a multirun sweep, print one table of every run it made."""

from __future__ import annotations

import json
from pathlib import Path

from hydra.experimental.callback import Callback
from omegaconf import DictConfig


class SweepTable(Callback):
    def on_multirun_end(self, config: DictConfig, **kwargs) -> None:
        from specrepro.cli import POINTER_FILE
        from specrepro.runner import results_table

        metrics = []
        for pointer in sorted(Path(config.hydra.sweep.dir).glob(f"*/{POINTER_FILE}"), key=lambda p: int(p.parent.name)):
            metrics_path = Path(pointer.read_text().strip()) / "metrics.json"
            if metrics_path.is_file():
                metrics.append(json.loads(metrics_path.read_text()))
        if metrics:
            print(results_table(metrics))
