"""What makes two runs the same run: the full resolved config, the artifacts it resolves to, and the data.

A run's name ends in a hash of everything that changes what it computes: the resolved config (without
where results go and how they are logged), the trained artifacts its references resolve to now, the
content of the records it decodes, and the record version. A record is resumed, skipped or used as a
reference only under the same hash, so an edited dataset file or a newer artifact is a new run.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json

from omegaconf import DictConfig, OmegaConf

from specrepro import registry
from specrepro.models.loading import resolve_artifact
from specrepro.provenance import RECORD_VERSION
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


def model_artifact(cfg: DictConfig) -> dict[str, str]:
    """The checkpoint a `model.source=artifact` config resolves to now (its id may be a prefix: the newest)."""
    return {"model": resolve_artifact(cfg.model.id, cfg.artifacts_dir).name} if cfg.model.source == "artifact" else {}


def resolved_artifacts(cfg: DictConfig) -> dict[str, str]:
    """Every trained artifact a run uses, as resolved now: a newer one under the same prefix is a new run."""
    registry.load()
    method = registry.METHODS.get(cfg.method.name)
    found = method.decoder.resolve_artifacts(cfg.method, cfg.model.name, cfg.artifacts_dir) if method else {}
    return model_artifact(cfg) | found


def run_name(cfg: DictConfig, data_fingerprint: str) -> str:
    """`<model>-<method>-<dataset>-<decoding>-<hash of config, artifacts, data and record version>`."""
    if cfg.run_name:
        return cfg.run_name
    content = {k: v for k, v in OmegaConf.to_container(cfg, resolve=True).items() if k not in NOT_IN_IDENTITY}
    content.update(artifacts=resolved_artifacts(cfg), data=data_fingerprint, record_version=RECORD_VERSION)
    return f"{cfg.model.name}-{cfg.method.name}-{cfg.dataset.name}-{cfg.decoding.name}-{config_hash(content)}"


def reference_key(cfg: DictConfig, data_fingerprint: str) -> str:
    """Runs with equal keys decode the same prompts on the same weights, hardware and decoding."""
    content = OmegaConf.to_container(cfg, resolve=True)
    key = {k: content[k] for k in ("model", "dataset", "decoding", "hardware")}
    key.update(artifacts=model_artifact(cfg), data=data_fingerprint, record_version=RECORD_VERSION)
    return config_hash(key)
