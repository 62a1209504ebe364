"""Trained components as artifacts: `<artifacts_dir>/<name>-<model>-<hash of the training config>/`.

A finished artifact holds the component (e.g. `save_pretrained` files) and `artifact.json` (its training
config, metrics and history); `artifact.json` is written last, atomically, so its presence marks the
artifact complete. Runs name an artifact by its full directory name, by its prefix (`sps_draft`: the
newest complete match) or by a path.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Callable

from specrepro.tracking import atomic_write

METADATA = "artifact.json"


def is_complete(path: Path) -> bool:
    return (path / METADATA).is_file()


def staging_dir(final: Path) -> Path:
    """Where a component is written before it is moved into place."""
    staging = final.with_name(f".{final.name}.staging")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    return staging


def publish(staging: Path, final: Path, metadata: dict) -> Path:
    """Mark the staged component complete and move it to its final place."""
    atomic_write(staging / METADATA, json.dumps(metadata, indent=2, default=str) + "\n")
    if final.exists():
        shutil.rmtree(final)
    staging.rename(final)
    return final


def find_artifact(ref: str, artifacts_dir: str | Path) -> Path | None:
    """Resolve an artifact reference: exact name, newest complete `<ref>-*`, or a path."""
    root = Path(artifacts_dir)
    exact = root / ref
    if is_complete(exact) or (exact / "config.json").is_file():
        return exact
    matches = [p for p in root.glob(f"{ref}-*") if is_complete(p)]
    if matches:
        return max(matches, key=lambda p: (p / METADATA).stat().st_mtime)
    path = Path(ref).expanduser()
    if is_complete(path) or (path / "config.json").is_file():
        return path
    return None


def find_matching_artifact(ref: str, artifacts_dir: str | Path, model_name: str | None,
                           matches: Callable[[Path], bool]) -> Path | None:
    """`ref` itself (name or path) if it matches, else the newest complete `<ref>-<model>-*` that does
    (`<ref>-*` when model_name is None: a ref that already names the model)."""
    root = Path(artifacts_dir)
    prefix = f"{ref}-{model_name}-" if model_name else f"{ref}-"
    exact = find_artifact(ref, root)
    candidates = [exact] if exact is not None and not exact.name.startswith(prefix) else []
    if "/" not in ref:
        candidates += sorted((p for p in root.glob(f"{prefix}*") if is_complete(p)),
                             key=lambda p: (p / METADATA).stat().st_mtime, reverse=True)
    return next((path for path in candidates if matches(path)), None)
