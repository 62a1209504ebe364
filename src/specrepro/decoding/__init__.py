"""Decoding methods: one file per method, all meeting the Decoder contract of `base.py`; each registers itself
(`registry.register_method`)."""

from __future__ import annotations

from omegaconf import OmegaConf

from specrepro import registry
from specrepro.decoding.base import Decoder, Generation
from specrepro.decoding.sampling import Sampling
from specrepro.registry import MethodConfig


def validate_method_config(method_cfg) -> MethodConfig:
    """The method's schema dataclass built from its `method/` config (a Hydra node, a mapping or a dataclass):
    SpecReproError for an unknown method or an option its schema refuses. Needs no model."""
    registry.load()
    node = OmegaConf.structured(method_cfg)
    schema = registry.method(node.name).schema
    return OmegaConf.to_object(OmegaConf.merge(schema, node))  # the schema's __post_init__ validates


def build_decoder(method_cfg, target, ctx) -> Decoder:
    """Build the Decoder a `method/` config names, on the loaded target model."""
    validate_method_config(method_cfg)
    return registry.method(method_cfg.name).decoder.from_config(method_cfg, target, ctx)


__all__ = ["Decoder", "Generation", "Sampling", "build_decoder", "validate_method_config"]
