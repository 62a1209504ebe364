"""The target model a process has loaded: a sweep in one process (and a run with its `ar` reference) loads each
target once."""

from __future__ import annotations

import json

from omegaconf import DictConfig, OmegaConf

from specrepro.errors import SpecReproError
from specrepro.identity import model_weights
from specrepro.models import LoadedModel, ModelLoader

_loaded_models: dict[str, LoadedModel] = {}  # its model, device, dtype and hardware config -> the loaded target


def load_target(cfg: DictConfig, loader: ModelLoader) -> LoadedModel:
    """The run's target model with its hardware's kernels, loaded once while a process uses it (one at a time)."""
    weights = model_weights(cfg.model, loader.artifacts_dir)  # what it names now: a newer artifact, a new save
    key = json.dumps(
        [
            OmegaConf.to_container(cfg.model, resolve=True),
            weights,
            str(loader.device),
            str(loader.dtype),
            OmegaConf.to_container(cfg.hardware, resolve=True),
        ]
    )  # the kernels live on the model
    if key not in _loaded_models:
        _loaded_models.clear()  # keep one target in memory
        target = loader.load_model(cfg.model)
        if weights:  # the decoders look their artifacts up for these weights, as the run's name does (run_target)
            target.config = (target.config or {}) | {"weights": weights}
        _loaded_models[key] = target
    target = _loaded_models[key]
    if target.tokenizer is None:
        raise SpecReproError(f"model '{cfg.model.name}' has no tokenizer; set model.tokenizer (e.g. embedded)")
    return target
