"""`ar`: plain autoregressive decoding with a KV cache; the reference for every speedup and for losslessness."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specrepro.decoding.base import Decoder, GenerationBuilder
from specrepro.decoding.sampling import Sampling, next_token
from specrepro.registry import MethodConfig, register_method


@dataclass
class ARConfig(MethodConfig):
    name: str = "ar"


@register_method(ARConfig)
class ARDecoder(Decoder):
    name = "ar"
    compilable = True

    @classmethod
    def from_config(cls, cfg: ARConfig, target, ctx) -> "ARDecoder":
        return cls(target.model, target.tokenizer)

    def _decode(self, prompt_ids: torch.Tensor, sampling: Sampling, out: GenerationBuilder, rng) -> None:
        cache = self.steps.new_cache(prompt_ids.shape[1] + out.max_new_tokens)
        with out.timed("prefill"):
            logits = self.steps(prompt_ids, cache, logits_to_keep=1).logits[0, -1]
            token = next_token(logits, sampling, rng)
        out.commit([token], prefill=True)
        while not out.done:
            with out.timed("verify"):
                step_input = torch.tensor([[token]], device=prompt_ids.device)
                logits = self.steps(step_input, cache, logits_to_keep=1).logits[0, -1]
                token = next_token(logits, sampling, rng)
            out.commit([token])
