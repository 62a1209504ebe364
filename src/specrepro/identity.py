"""What makes two runs the same run: the full resolved config, the artifacts it resolves to, and the data.

A run's name ends in a hash of everything that changes what it computes: the resolved config (without
where results go and how they are logged), the trained artifacts its references resolve to now (each by name
and content digest), the content of the records it decodes, and the record version. A record is resumed,
skipped or used as a reference only under the same hash, so an edited dataset file, a newer artifact or one
retrained under the same name with other weights is a new run.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from specrepro import registry
from specrepro.models.loading import resolve_artifact
from specrepro.provenance import RECORD_VERSION
from specrepro.training.artifacts import content_digest
from specrepro.tracking import config_hash

# where results go and how they are logged: not part of what a run computes
NOT_IN_IDENTITY = ("logger", "results_dir", "artifacts_dir", "resume", "run_name", "reference")


def records_fingerprint(records) -> str:
    """A hash of the records' content (ids, turns, references, task fields): what a run decodes."""
    digest = hashlib.sha256()
    for record in records:
        digest.update(json.dumps(dataclasses.asdict(record), sort_keys=True, default=str).encode())
        digest.update(b"\n")
    return digest.hexdigest()[:16]


def model_artifact(cfg: DictConfig) -> dict[str, Path]:
    """The checkpoint a `model.source=artifact` config resolves to now (its id may be a prefix: the newest)."""
    return {"model": resolve_artifact(cfg.model.id, cfg.artifacts_dir)} if cfg.model.source == "artifact" else {}


def resolved_artifacts(cfg: DictConfig) -> dict[str, Path]:
    """Every trained artifact a run uses (role -> directory), as resolved now: a newer one under the same prefix
    is a new run."""
    registry.load()
    method = registry.METHODS.get(cfg.method.name)
    found = method.decoder.resolve_artifacts(cfg.method, cfg.model.name, cfg.artifacts_dir) if method else {}
    return model_artifact(cfg) | found


def artifact_identities(artifacts: dict[str, Path]) -> dict[str, dict[str, str]]:
    """Each artifact's name and content digest (role -> {name, content_digest}): part of a run's identity, and
    in its record so a table can tell runs made with other weights under one name apart."""
    return {role: {"name": path.name, "content_digest": content_digest(path)} for role, path in artifacts.items()}


def run_name(cfg: DictConfig, data_fingerprint: str, artifacts: dict[str, dict] | None = None) -> str:
    """`<model>-<method>-<dataset>-<decoding>-<hash of config, artifacts, data and record version>`; `artifacts`:
    the `artifact_identities` of what the config resolves to, when the caller has them already."""
    if cfg.run_name:
        return cfg.run_name
    content = {k: v for k, v in OmegaConf.to_container(cfg, resolve=True).items() if k not in NOT_IN_IDENTITY}
    artifacts = artifact_identities(resolved_artifacts(cfg)) if artifacts is None else artifacts
    content.update(artifacts=artifacts, data=data_fingerprint, record_version=RECORD_VERSION)
    return f"{cfg.model.name}-{cfg.method.name}-{cfg.dataset.name}-{cfg.decoding.name}-{config_hash(content)}"


def reference_key(cfg: DictConfig, data_fingerprint: str) -> str:
    """Runs with equal keys decode the same prompts on the same weights, hardware and decoding."""
    content = OmegaConf.to_container(cfg, resolve=True)
    key = {k: content[k] for k in ("model", "dataset", "decoding", "hardware")}
    key.update(artifacts=artifact_identities(model_artifact(cfg)), data=data_fingerprint,
               record_version=RECORD_VERSION)
    return config_hash(key)
