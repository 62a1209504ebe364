"""Every method and every trainable component, by name: where `specrepro run` and `specrepro train` find them.

A method's module registers its decoder with its config schema (`@register_method(Schema)` on the decoder
class); a training module registers its trainer with the schema of its recipe (`@register_component(...)`).
This module imports no method: `load()` imports the built-in method and training modules, and the modules
named in $SPECREPRO_PLUGINS (comma-separated), which register themselves the same way. A new method is its own
module plus its `conf/method/<name>.yaml` (in a `--config-dir` of the user's, or in `conf/`).
"""

from __future__ import annotations

import functools
import importlib
import os
import pkgutil
from dataclasses import dataclass
from typing import Callable

from omegaconf import MISSING

from specrepro.errors import SpecReproError

BUILTIN_PACKAGES = ("specrepro.decoding", "specrepro.training")
PLUGINS_VARIABLE = "SPECREPRO_PLUGINS"


@dataclass
class MethodConfig:
    """Base of every method's schema; each method adds its own fields in a subclass, and refuses values outside
    their range in its `__post_init__`, which runs whenever the dataclass is built (`OmegaConf.to_object` too)."""

    name: str = MISSING

    def require(self, valid: bool, option: str, expected: str) -> None:
        """Unless `valid`, raise SpecReproError `method.<option> must be <expected>, got <value>`."""
        if not valid:
            raise SpecReproError(f"method.{option} must be {expected}, got {getattr(self, option)!r}")

    def require_one_of(self, option: str, choices: tuple[str, ...]) -> None:
        self.require(getattr(self, option) in choices, option, f"one of {', '.join(choices)}")


@dataclass(frozen=True)
class Method:
    decoder: type  # a specrepro.decoding.base.Decoder subclass, built by its `from_config`
    schema: type  # its MethodConfig dataclass


@dataclass(frozen=True)
class Component:
    trainer: Callable  # (cfg, target, work_dir, log_metrics, device) -> (model, metrics, history)
    schema: type  # the dataclass its `conf/training/` recipes extend
    # (cfg) -> {role: {name, content_digest}} of the artifacts it trains from: part of its artifact's name
    inputs: Callable | None = None


METHODS: dict[str, Method] = {}
COMPONENTS: dict[str, Component] = {}


def register_method(schema: type):
    """Class decorator for a decoder: register it, under its `name`, with its config `schema`."""

    def decorate(decoder: type) -> type:
        METHODS[decoder.name] = Method(decoder, schema)
        return decoder

    return decorate


def register_component(*names: str, schema: type, inputs: Callable | None = None):
    """Function decorator for a trainer: register it for each component `name` its recipes set, with `schema`
    and the artifacts it trains from (`inputs`)."""

    def decorate(trainer: Callable) -> Callable:
        for name in names:
            COMPONENTS[name] = Component(trainer, schema, inputs)
        return trainer

    return decorate


@functools.cache
def load() -> None:
    """Import the built-in methods and trainers, and the plugin modules in $SPECREPRO_PLUGINS, so that each has
    registered itself (once per process)."""
    for package_name in BUILTIN_PACKAGES:
        package = importlib.import_module(package_name)
        for module in pkgutil.iter_modules(package.__path__, f"{package_name}."):
            importlib.import_module(module.name)
    for name in filter(None, (part.strip() for part in os.environ.get(PLUGINS_VARIABLE, "").split(","))):
        try:
            importlib.import_module(name)
        except ImportError as error:
            raise SpecReproError(f"{PLUGINS_VARIABLE} names module '{name}', which does not import: {error}") from None


def method(name: str) -> Method:
    if name not in METHODS:
        raise SpecReproError(f"unknown method '{name}'; known: {', '.join(sorted(METHODS))}")
    return METHODS[name]


def component(name: str) -> Component:
    if name not in COMPONENTS:
        raise SpecReproError(f"no trainer for component '{name}'; known: {', '.join(sorted(COMPONENTS))}")
    return COMPONENTS[name]
