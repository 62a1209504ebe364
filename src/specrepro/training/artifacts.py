"""Trained components as artifacts: `<artifacts_dir>/<name>-<model>-<hash of the training config>/`.

A finished artifact holds the component (e.g. `save_pretrained` files) and `artifact.json` (its training
config, metrics and history); `artifact.json` is written last, atomically, so its presence marks the
artifact complete. Runs name an artifact by its full directory name, by its prefix (`sps_draft`: the
newest complete match) or by a path. A named directory without that marker (a staging directory, training
that never finished) is refused, as is an artifact whose weights do not read back whole. A run's identity holds
each artifact's content digest (`identity.content_digest`), not only its name: retraining under the same name
(`resume=false`, or after deleting a damaged artifact) with other weights makes new runs, never a reuse of records
the old weights made.

Every artifact but a run's own model is trained for one target: `artifact.json` records it (`target`: the target's
model config, weights, vocabulary and hidden size) and every lookup takes only artifacts trained for the run's
target (`target_mismatch`), by name or by prefix: a draft trained for another model is never used.
"""

from __future__ import annotations

import json
import logging
import shutil
from dataclasses import is_dataclass
from pathlib import Path
from typing import Callable, Union

from omegaconf import OmegaConf

from specrepro.config import weights_identity
from specrepro.errors import SpecReproError
from specrepro.models.loading import unreadable_weights
from specrepro.tracking import atomic_write

METADATA = "artifact.json"
log = logging.getLogger(__name__)


Target = Union[str, dict, None]  # a target model's name, its identity (`target_identity`), or None: any target
TARGET_KEYS = ("name", "source", "id", "revision")  # of a model config: which model it is (not where it is cached)


def target_identity(model_cfg) -> dict:
    """What names a target model in a model config (a Hydra node, a mapping or a ModelConfig): its name, source, id
    and revision (and its shape when random)."""
    model = weights_identity(OmegaConf.structured(model_cfg) if is_dataclass(model_cfg) else model_cfg)
    identity = {key: model.get(key) for key in TARGET_KEYS}
    return identity | ({"random": model.get("random")} if model.get("source") == "random" else {})


def trained_for(path: Path) -> dict:
    """The target an artifact was trained for, as recorded (older artifacts: their training config's model);
    {} when it records neither (made by hand)."""
    meta = read_metadata(path)
    if "target" in meta:
        return meta["target"]
    model = (meta.get("config") or {}).get("model")
    return target_identity(model) if model else {}


def target_mismatch(path: Path, target: Target) -> str | None:
    """How the artifact at `path` was trained for another target than `target`, or None. Compared: every field both
    record (model config, weights digests, vocabulary and hidden size). An artifact that is the run's model itself (a
    joint-mode head beside its fine-tuned target) belongs to it."""
    if not target:
        return None
    expected = {"name": target} if isinstance(target, str) else target
    if expected.get("source") == "artifact" and Path(str(expected.get("id"))).name == path.name:
        return None
    recorded = trained_for(path)
    differ = [key for key in expected if key in recorded and recorded[key] != expected[key]]
    if not differ:
        return None
    return (
        f"artifact {path.name} was trained for target '{recorded.get('name')}' (its {', '.join(differ)} differ "
        f"from this run's model '{expected.get('name')}')"
    )


def check_target(path: Path, target: Target) -> Path:
    """`path`, if trained for `target`; else one line saying for which target it was trained."""
    mismatch = target_mismatch(path, target)
    if mismatch:
        raise SpecReproError(
            f"{mismatch}: train one for this model with `specrepro train` and this run's model "
            "options, or name one trained for it"
        )
    return path


def read_metadata(path: Path) -> dict:
    """An artifact's `artifact.json`; one line naming the artifact when it does not read (cut short, edited)."""
    try:
        meta = json.loads((path / METADATA).read_text())
    except (OSError, ValueError):
        meta = None
    if not isinstance(meta, dict):
        raise SpecReproError(
            f"artifact {path.name} is damaged (its {METADATA} does not read): delete {path} and train it again "
            "with the `specrepro train` command that made it"
        )
    return meta


def artifact_damage(path: Path) -> str | None:
    """How a complete artifact does not hold what it was published with, or None: its metadata unreadable, a file
    its metadata lists (`publish` records each one's size) missing or of another size, or a safetensors file
    whose header or length is wrong."""
    try:
        listed = read_metadata(path).get("files", {})
    except SpecReproError:
        return f"its {METADATA} does not read"
    for name, size in listed.items():
        file = path / name
        if not file.is_file():
            return f"{name} is missing"
        if file.stat().st_size != size:
            return f"{name} is {file.stat().st_size} bytes, not the {size} it was published with"
    bad = unreadable_weights(path)
    return f"{bad.name} is truncated or unreadable" if bad is not None else None


def is_complete(path: Path) -> bool:
    """A published artifact; a staging directory never is, even once its metadata is written."""
    return not path.name.endswith(".staging") and (path / METADATA).is_file()


def check_intact(path: Path) -> Path:
    """`path`, if it reads back whole (`artifact_damage`); else one clear error naming the artifact."""
    damage = artifact_damage(path)
    if damage is not None:
        raise SpecReproError(
            f"artifact {path.name} is damaged ({damage}): delete {path} "
            "and train it again with the `specrepro train` command that made it"
        )
    return path


def staging_dir(final: Path) -> Path:
    """Where a component is written before it is moved into place."""
    staging = final.with_name(f".{final.name}.staging")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    return staging


def publish(staging: Path, final: Path, metadata: dict) -> Path:
    """Mark the staged component complete, with the size of every file it holds (`artifact_damage` checks them),
    and move it to its final place."""
    files = {str(p.relative_to(staging)): p.stat().st_size for p in sorted(staging.rglob("*")) if p.is_file()}
    metadata = metadata | {"files": {name: size for name, size in files.items() if name != METADATA}}
    atomic_write(staging / METADATA, json.dumps(metadata, indent=2, default=str) + "\n")
    replaced = final.with_name(f".{final.name}.replaced")  # a retrain's old copy, kept until the new one is in place
    shutil.rmtree(replaced, ignore_errors=True)
    if final.exists():
        final.rename(replaced)
    staging.rename(final)
    shutil.rmtree(replaced, ignore_errors=True)
    return final


def newest(pattern: str, matches: list[Path]) -> Path:
    """The newest of the complete artifacts `pattern` matches, saying which when there are several (a results
    folder where one component was trained twice, e.g. under other overrides): the run record names it too."""
    chosen = max(matches, key=lambda p: (p / METADATA).stat().st_mtime)
    if len(matches) > 1:
        log.warning(
            "%d trained artifacts match %s in %s; using the newest, %s (name one in full to pin it)",
            len(matches),
            pattern,
            chosen.parent,
            chosen.name,
        )
    return chosen


def named_artifact(ref: str, artifacts_dir: str | Path) -> Path | None:
    """The complete artifact `ref` names exactly (a directory of `artifacts_dir`, or a path), or None."""
    return next((p for p in (Path(artifacts_dir) / ref, Path(ref).expanduser()) if is_complete(p)), None)


def refuse_incomplete(ref: str, artifacts_dir: str | Path) -> None:
    """A directory `ref` names that is not a complete artifact is an error."""
    for named in (Path(artifacts_dir) / ref, Path(ref).expanduser()):
        if named.is_dir() and not is_complete(named):
            raise SpecReproError(
                f"{named} is an incomplete artifact (a staging directory, or no {METADATA}: its "
                "training did not finish): train it again, or load a plain model directory with "
                "source=hf"
            )


def find_artifact(ref: str, artifacts_dir: str | Path, target: Target = None) -> Path | None:
    """Resolve an artifact reference: exact name, newest complete `<ref>-*` trained for `target`, or a path; None if
    none exists. One named exactly but trained for another target is an error."""
    if (named := named_artifact(ref, artifacts_dir)) is not None:
        return check_target(named, target)
    if not Path(ref).expanduser().is_absolute():  # Path.glob takes relative patterns only
        matches = [p for p in Path(artifacts_dir).glob(f"{ref}-*") if is_complete(p) and not target_mismatch(p, target)]
        if matches:
            return newest(f"{ref}-*", matches)
    refuse_incomplete(ref, artifacts_dir)
    return None


def find_matching_artifact(
    ref: str, artifacts_dir: str | Path, target: Target, matches: Callable[[Path], bool]
) -> Path | None:
    """`ref` itself (name or path) if it matches, else the newest complete `<ref>-<model>-*` that does, of those
    trained for `target` (a model name or identity; `<ref>-*` and any target when None). One named exactly but
    trained for another target is an error."""
    model_name = target if isinstance(target, str) or target is None else target.get("name")
    pattern = f"{ref}-{model_name}-*" if model_name else f"{ref}-*"
    named = named_artifact(ref, artifacts_dir)
    if named is not None and matches(named):
        return check_intact(check_target(named, target))
    found = (
        [
            p
            for p in Path(artifacts_dir).glob(pattern)
            if is_complete(p) and matches(p) and not target_mismatch(p, target)
        ]
        if "/" not in ref
        else []
    )
    if found:
        return check_intact(newest(pattern, found))
    refuse_incomplete(ref, artifacts_dir)
    return None
