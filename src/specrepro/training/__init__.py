"""`specrepro train`: train the component a method needs and publish it as an artifact."""

from __future__ import annotations

import dataclasses
import json
import logging
import typing
from pathlib import Path

from accelerate import PartialState
from omegaconf import DictConfig, OmegaConf

from specrepro import registry
from specrepro.config import (
    ModelConfig,
    TrainRunConfig,
    check_device,
    check_known_keys,
    check_logger,
    check_model,
    check_names,
    check_threads,
    weights_identity,
)
from specrepro.models import ModelLoader
from specrepro.models.loading import resolve_device
from specrepro.provenance import now, provenance
from specrepro.reuse import note_reused
from specrepro.tracking import atomic_write, config_hash, wandb_init
from specrepro.training.artifacts import artifact_damage, is_complete, publish, read_metadata, staging_dir
from specrepro.training.loop import clear_checkpoints, validate_loop
from specrepro.locks import lock_file
from specrepro.training.shards import exclusive

log = logging.getLogger(__name__)


def artifact_path(cfg, inputs: bool = True) -> Path:
    """`<artifacts_dir>/<component>-<model>-<hash of model + training config>` (and, for a target loaded from an
    artifact, a local directory or the hub cache, of its weights: `identity.weights_key`; of the artifacts a
    component trains from, `Component.inputs`: new CLLM trajectories train a new CLLM). `inputs=False`: the name
    its settings alone give, for stages compared before anything is made."""
    from specrepro.identity import weights_key

    registry.load()
    content = OmegaConf.to_container(cfg, resolve=True)
    training, dtype = content["training"], content["hardware"]["dtype"]
    declared = registry.component(cfg.training.component).inputs
    trained_from = declared(cfg) if declared and inputs else {}
    key = config_hash(
        {"model": weights_identity(content["model"]), "training": training, "dtype": dtype, **weights_key(cfg)}
        | ({"inputs": trained_from} if trained_from else {})
    )
    return Path(cfg.artifacts_dir) / f"{cfg.training.component}-{cfg.model.name}-{key}"


def training_data(cfg) -> dict[str, str]:
    """The content of every record set the training config reads (the recipe's dataset settings, by its schema):
    {setting: `identity.records_fingerprint`}. Recorded with the artifact: one its config would now train on other
    records (a file replaced at its path, a loader that reads it otherwise) is trained again."""
    from specrepro.data import load_records
    from specrepro.data.config import DatasetConfig
    from specrepro.identity import records_fingerprint

    def datasets(node, schema, where: str):
        for key, hint in typing.get_type_hints(schema).items():
            value = node.get(key)
            if value is None:
                continue
            args = typing.get_args(hint)  # Optional[DatasetConfig]: (DatasetConfig, None); Dict[str, X]: (str, X)
            if hint is DatasetConfig or (typing.get_origin(hint) is typing.Union and DatasetConfig in args):
                yield f"{where}{key}", value
            elif typing.get_origin(hint) is dict and args[-1] is DatasetConfig:
                for name, each in value.items():
                    yield f"{where}{key}.{name}", each
            elif dataclasses.is_dataclass(hint):
                yield from datasets(value, hint, f"{where}{key}.")

    schema = registry.component(cfg.training.component).schema
    return {name: records_fingerprint(load_records(node)) for name, node in datasets(cfg.training, schema, "training.")}


def trained_target(cfg, target) -> dict:
    """The target a component is trained for, as runs check it (training/artifacts.target_mismatch): its model
    config, weights, vocabulary and hidden size."""
    from specrepro.identity import run_target

    return run_target(cfg) | target.identity


def validate_loops(node: DictConfig, key: str = "training") -> None:
    """Check every training loop in the config (a component may have several, e.g. EESD's calibration)."""
    for name, value in node.items():
        if isinstance(value, DictConfig):
            if name == "loop":
                validate_loop(value, f"{key}.loop")
            else:
                validate_loops(value, f"{key}.{name}")


def train(cfg) -> Path:
    """Train (or resume training) the configured component; return its artifact directory.

    In one process, or in each process of an `accelerate launch` / torchrun: every process prepares the data
    (each its share, see training/shards.py) and trains; the main process alone logs to W&B and publishes."""
    check_device(cfg.hardware.device)
    # first: under a launch it selects this process's GPU, or on the CPU joins the processes over gloo
    state = PartialState(cpu=resolve_device(cfg.hardware.device).type == "cpu")
    check_names(cfg)
    check_threads(cfg.hardware.threads)
    check_logger(cfg.logger)
    registry.load()
    check_known_keys(cfg, TrainRunConfig, "")
    check_known_keys(cfg.model, ModelConfig, "model")
    check_model(cfg.model)
    check_known_keys(cfg.training, registry.component(cfg.training.component).schema, "training")
    final, data = artifact_path(cfg), training_data(cfg)
    if trained_already(cfg, final, data, say_damage=False):  # before the lock: one on read-only storage is reused too
        return final
    with exclusive(lock_file(final), f"training {final.name}"):  # a second job training it waits, then re-uses it
        return final if trained_already(cfg, final, data) else _train(cfg, state, final, data)


def trained_already(cfg, final: Path, data: dict[str, str], say_damage: bool = True) -> bool:
    """Whether the artifact is made and whole (`resume=true`) from the records its config reads now (`data`, as
    `training_data` gives it; an artifact made before they were recorded is taken as is): reused, said so; a
    damaged one, or one made from other records, is trained again."""
    if not (cfg.resume and is_complete(final)):
        return False
    damage = artifact_damage(final)
    made_from = read_metadata(final).get("training_data", data) if damage is None else data
    if damage is None and made_from == data:
        log.info("artifact %s is already trained; skipping (resume=false to retrain)", final)
        note_reused(f"artifact {final.name}")
        return True
    if say_damage and damage:
        log.warning("artifact %s is damaged (%s): training it again", final, damage)
    elif say_damage:
        changed = sorted(name for name in data.keys() | made_from.keys() if data.get(name) != made_from.get(name))
        log.warning("artifact %s was trained on other records of %s: training it again", final, ", ".join(changed))
    return False


def _train(cfg, state: PartialState, final: Path, data: dict[str, str]) -> Path:
    registry.load()
    trainer = registry.component(cfg.training.component).trainer
    validate_loops(cfg.training)
    loader = ModelLoader.for_hardware(cfg.hardware, cfg.artifacts_dir)
    device = loader.device
    target = loader.load_model(cfg.model)
    work_dir = Path(cfg.artifacts_dir) / ".work" / final.name
    work_dir.mkdir(parents=True, exist_ok=True)
    trained_on = work_dir / "training_data.json"  # what its checkpoints were trained on
    if state.is_main_process:
        if not cfg.resume or (trained_on.is_file() and json.loads(trained_on.read_text()) != data):
            clear_checkpoints(work_dir)
        atomic_write(trained_on, json.dumps(data, sort_keys=True))
    state.wait_for_everyone()
    started_at = now()
    run = wandb_init(cfg, final.name, work_dir, job_type="train") if state.is_main_process else None

    def log_metrics(metrics: dict, step: int) -> None:
        if run is not None:
            run.log(metrics, step=step)

    component_model, metrics, history = trainer(cfg, target, work_dir, log_metrics, device)
    if not state.is_main_process:
        state.wait_for_everyone()  # until the main process has published
        return final
    staging = staging_dir(final)
    component_model.save_pretrained(staging)
    if hasattr(component_model, "peft_config"):  # a LoRA adapter alone: loading merges it into its base model
        component_model.get_base_model().config.save_pretrained(staging)
    if target.tokenizer is not None:
        target.tokenizer.save_pretrained(staging)
    origin = provenance(cfg.hardware, device) | {"started_at": started_at, "finished_at": now()}
    publish(
        staging,
        final,
        {
            "component": cfg.training.component,
            "target": trained_target(cfg, target),
            "metrics": metrics,
            "history": history,
            "config": OmegaConf.to_container(cfg, resolve=True),
            "training_data": data,
            "provenance": origin,
        },
    )
    if run is not None:
        run.summary.update(metrics)
        try:
            import wandb

            artifact = wandb.Artifact(final.name, type="model", metadata=metrics)
            artifact.add_dir(str(final))
            run.log_artifact(artifact)
        except Exception as exc:
            log.warning("W&B artifact upload failed (%s); the artifact is at %s", exc, final)
        run.finish()
    log.info("trained %s: %s", final, metrics)
    state.wait_for_everyone()
    return final
