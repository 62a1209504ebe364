"""Decoding methods: one file per method, all meeting the Decoder contract of `base.py`."""

from __future__ import annotations

from omegaconf import OmegaConf

from specrepro.config import _METHOD_SCHEMAS, MethodConfig
from specrepro.decoding.ar import ARDecoder
from specrepro.decoding.base import Decoder, Generation
from specrepro.decoding.eesd import EESDDecoder
from specrepro.decoding.hf_assisted import HFAssistedDecoder
from specrepro.decoding.jacobi import CLLMDecoder, JacobiDecoder
from specrepro.decoding.pld import PLDDecoder
from specrepro.decoding.sampling import Sampling
from specrepro.decoding.sar_draft import SARDraftDecoder
from specrepro.decoding.self_sd import SelfSDDecoder
from specrepro.decoding.space import SpaceDecoder
from specrepro.decoding.sps import SPSDecoder
from specrepro.errors import SpecReproError

DECODERS: dict[str, type[Decoder]] = {
    cls.name: cls for cls in (ARDecoder, SPSDecoder, PLDDecoder, HFAssistedDecoder, EESDDecoder, SelfSDDecoder,
                 JacobiDecoder, CLLMDecoder, SARDraftDecoder, SpaceDecoder)
}


def validate_method_config(method_cfg) -> MethodConfig:
    """The method's schema dataclass built from its `method/` config (a Hydra node, a mapping or a dataclass):
    SpecReproError for an unknown method or an option its schema refuses. Needs no model."""
    node = OmegaConf.structured(method_cfg)
    if node.name not in DECODERS:
        raise SpecReproError(f"unknown method '{node.name}'; known: {', '.join(sorted(DECODERS))}")
    return OmegaConf.to_object(OmegaConf.merge(_METHOD_SCHEMAS[node.name], node))  # the schema's __post_init__ validates


def build_decoder(method_cfg, target, ctx) -> Decoder:
    """Build the Decoder a `method/` config names, on the loaded target model."""
    validate_method_config(method_cfg)
    return DECODERS[method_cfg.name].from_config(method_cfg, target, ctx)


__all__ = ["DECODERS", "Decoder", "Generation", "Sampling", "build_decoder", "validate_method_config"]
