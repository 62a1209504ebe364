"""Trained components as artifacts: `<artifacts_dir>/<name>-<model>-<hash of the training config>/`.

A finished artifact holds the component (e.g. `save_pretrained` files) and `artifact.json` (its training
config, metrics and history); `artifact.json` is written last, atomically, so its presence marks the
artifact complete. Runs name an artifact by its full directory name, by its prefix (`sps_draft`: the
newest complete match) or by a path. A named directory without that marker (a staging directory, training
that never finished) is refused, as is an artifact whose weights do not read back whole. A run's identity holds
each artifact's content digest (`identity.content_digest`), not only its name: retraining under the same name
(`resume=false`, or after deleting a damaged artifact) with other weights makes new runs, never a reuse of records
the old weights made.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Callable

from specrepro.errors import SpecReproError
from specrepro.models.loading import unreadable_weights
from specrepro.tracking import atomic_write

METADATA = "artifact.json"
log = logging.getLogger(__name__)


def is_complete(path: Path) -> bool:
    """A published artifact; a staging directory never is, even once its metadata is written."""
    return not path.name.endswith(".staging") and (path / METADATA).is_file()


def check_intact(path: Path) -> Path:
    """`path`, if its weights read back whole; else one clear error naming the artifact."""
    bad = unreadable_weights(path)
    if bad is not None:
        raise SpecReproError(f"artifact {path.name} is damaged ({bad.name} is truncated or unreadable): delete {path} "
                             "and train it again with the `specrepro train` command that made it")
    return path


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


def newest(pattern: str, matches: list[Path]) -> Path:
    """The newest of the complete artifacts `pattern` matches, saying which when there are several (a results
    folder where one component was trained twice, e.g. under other overrides): the run record names it too."""
    chosen = max(matches, key=lambda p: (p / METADATA).stat().st_mtime)
    if len(matches) > 1:
        log.warning("%d trained artifacts match %s in %s; using the newest, %s (name one in full to pin it)",
                    len(matches), pattern, chosen.parent, chosen.name)
    return chosen


def named_artifact(ref: str, artifacts_dir: str | Path) -> Path | None:
    """The complete artifact `ref` names exactly (a directory of `artifacts_dir`, or a path), or None."""
    return next((p for p in (Path(artifacts_dir) / ref, Path(ref).expanduser()) if is_complete(p)), None)


def refuse_incomplete(ref: str, artifacts_dir: str | Path) -> None:
    """A directory `ref` names that is not a complete artifact is an error."""
    for named in (Path(artifacts_dir) / ref, Path(ref).expanduser()):
        if named.is_dir() and not is_complete(named):
            raise SpecReproError(f"{named} is an incomplete artifact (a staging directory, or no {METADATA}: its "
                                 "training did not finish): train it again, or load a plain model directory with "
                                 "source=hf")


def find_artifact(ref: str, artifacts_dir: str | Path) -> Path | None:
    """Resolve an artifact reference: exact name, newest complete `<ref>-*`, or a path; None if none exists."""
    if (named := named_artifact(ref, artifacts_dir)) is not None:
        return named
    if not Path(ref).expanduser().is_absolute():  # Path.glob takes relative patterns only
        matches = [p for p in Path(artifacts_dir).glob(f"{ref}-*") if is_complete(p)]
        if matches:
            return newest(f"{ref}-*", matches)
    refuse_incomplete(ref, artifacts_dir)
    return None


def find_matching_artifact(ref: str, artifacts_dir: str | Path, model_name: str | None,
                           matches: Callable[[Path], bool]) -> Path | None:
    """`ref` itself (name or path) if it matches, else the newest complete `<ref>-<model>-*` that does
    (`<ref>-*` when model_name is None: a ref that already names the model)."""
    pattern = f"{ref}-{model_name}-*" if model_name else f"{ref}-*"
    named = named_artifact(ref, artifacts_dir)
    if named is not None and matches(named):
        return check_intact(named)
    found = [p for p in Path(artifacts_dir).glob(pattern) if is_complete(p) and matches(p)] if "/" not in ref else []
    if found:
        return check_intact(newest(pattern, found))
    refuse_incomplete(ref, artifacts_dir)
    return None
