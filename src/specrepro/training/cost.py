"""What a trained component cost on the machine that trained it, in minutes: generating the data it learned from
plus its training loops (or search).

Each data cache records the seconds it took to make (`cost.json` beside the data), and each loop checkpoint its
own loop seconds, so the figure is the same whether a training reused a cached dataset or made it, and whether
it ran straight through or resumed after a kill (work lost to a kill is not counted). An artifact states it as
`metrics.compute_minutes`; a run adds up those of the artifacts it uses (`training_minutes`).
"""

from __future__ import annotations

import json
from pathlib import Path

from specrepro.training.artifacts import METADATA

COST_FILE = "cost.json"


def record(folder: Path, seconds: float) -> None:
    """Note in `folder` (a cache being staged) the seconds it took to make."""
    (Path(folder) / COST_FILE).write_text(json.dumps({"seconds": seconds}) + "\n")


def recorded(folder: Path) -> float | None:
    """The seconds `folder` took to make; None for a cache made before costs were recorded."""
    path = Path(folder) / COST_FILE
    return json.loads(path.read_text())["seconds"] if path.is_file() else None


def loop_seconds(history: list[dict]) -> float | None:
    """One training loop's seconds: the cumulative `seconds` of its last logged step."""
    return history[-1].get("seconds") if history else 0.0


def artifact_minutes(artifact: Path) -> float | None:
    """What a published artifact cost (its `metrics.compute_minutes`); None when it does not say (or is elsewhere)."""
    path = Path(artifact) / METADATA
    return json.loads(path.read_text()).get("metrics", {}).get("compute_minutes") if path.is_file() else None


def artifact_metrics(artifacts) -> dict[str, dict]:
    """What each published artifact's training measured (its `metrics`: held-out agreement, sequences, tokens,
    minutes), by component (`eagle_head`): a run records them, so a table can set a run beside its draft's budget."""
    found = {}
    for artifact in artifacts:
        path = Path(artifact) / METADATA
        if path.is_file():
            recorded = json.loads(path.read_text())
            found[recorded.get("component", Path(artifact).name)] = recorded.get("metrics", {})
    return found


def minutes(*seconds: float | None) -> float | None:
    """The parts' sum in minutes; None when any part is unknown."""
    return None if any(s is None for s in seconds) else sum(seconds) / 60
