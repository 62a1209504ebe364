"""`ar`: plain autoregressive decoding with a KV cache; the reference for every speedup and for losslessness."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache

from specrepro.config import MethodConfig, register_method_schema
from specrepro.decoding.base import Decoder, GenerationBuilder
from specrepro.decoding.sampling import Sampling, next_token


@register_method_schema("ar")
@dataclass
class ARConfig(MethodConfig):
    name: str = "ar"


class ARDecoder(Decoder):
    name = "ar"

    @classmethod
    def from_config(cls, cfg: ARConfig, target, ctx) -> "ARDecoder":
        return cls(target.model, target.tokenizer)

    def _decode(self, prompt_ids: torch.Tensor, sampling: Sampling, out: GenerationBuilder, rng) -> None:
        cache = DynamicCache(config=self.model.config)
        with out.timed("prefill"):
            logits = self.model(prompt_ids, past_key_values=cache, logits_to_keep=1).logits[0, -1]
            token = next_token(logits, sampling, rng)
        out.commit([token], prefill=True)
        while not out.done:
            with out.timed("verify"):
                step_input = torch.tensor([[token]], device=prompt_ids.device)
                logits = self.model(step_input, past_key_values=cache, logits_to_keep=1).logits[0, -1]
                token = next_token(logits, sampling, rng)
            out.commit([token])
