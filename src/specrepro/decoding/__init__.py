"""Decoding methods: one file per method, all meeting the Decoder contract of `base.py`."""

from __future__ import annotations

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


def build_decoder(method_cfg, target, ctx) -> Decoder:
    """Build the Decoder a `method/` config names, on the loaded target model."""
    if method_cfg.name not in DECODERS:
        raise SpecReproError(f"unknown method '{method_cfg.name}'; known: {', '.join(sorted(DECODERS))}")
    return DECODERS[method_cfg.name].from_config(method_cfg, target, ctx)


__all__ = ["DECODERS", "Decoder", "Generation", "Sampling", "build_decoder"]
