"""`ar`: plain autoregressive decoding with a KV cache; the reference for every speedup and for losslessness.

Each step's token stays on the device and feeds the next step; the host reads the tokens once every `sync_every`
steps (gpt-fast's decode loop, with an EOS check per read). On an asynchronous device (a GPU) the host then queues
steps while earlier ones run instead of waiting for every token, at the cost of up to `sync_every - 1` steps
decoded past an EOS and thrown away (`discarded_steps`: step costs divide by the forwards run). The CPU has
nothing to overlap, so there it reads every token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specrepro.decoding.base import Decoder, GenerationBuilder
from specrepro.decoding.sampling import Sampling, next_token, pick_token
from specrepro.registry import MethodConfig, register_method

ASYNC_SYNC_EVERY = 8  # steps between host reads on an asynchronous device


@dataclass
class ARConfig(MethodConfig):
    name: str = "ar"


@register_method(ARConfig)
class ARDecoder(Decoder):
    name = "ar"
    rolls_back = False  # it never rolls a token back
    compilable = True

    def __init__(self, model, tokenizer=None, steps=None, sync_every: int | None = None):
        """`sync_every`: steps between host reads of the tokens; default 1 on the CPU, `ASYNC_SYNC_EVERY` elsewhere."""
        super().__init__(model, tokenizer, steps)
        self.sync_every = sync_every or (1 if self.device.type == "cpu" else ASYNC_SYNC_EVERY)

    @classmethod
    def from_config(cls, cfg: ARConfig, target, ctx) -> "ARDecoder":
        return cls(target.model, target.tokenizer)

    def _decode(self, prompt_ids: torch.Tensor, sampling: Sampling, out: GenerationBuilder, rng) -> None:
        past = prompt_ids.shape[1]
        cache = self.steps.new_cache(past + out.max_new_tokens, rolls_back=False)  # the model's own layers
        with out.timed("prefill"):
            logits = self.steps(prompt_ids, cache, logits_to_keep=1).logits[0, -1]
            token = next_token(logits, sampling, rng)
        out.commit([token], prefill=True)
        step_input = torch.tensor([[token]], device=prompt_ids.device)
        while not out.done:
            chunk = []
            with out.timed("verify"):
                for _ in range(min(self.sync_every, out.remaining)):
                    logits = self.steps(step_input, cache, logits_to_keep=1, past=past).logits[0, -1]
                    step_input = pick_token(logits, sampling, rng).view(1, 1)
                    chunk.append(step_input)
                    past += 1
                tokens = torch.cat(chunk).view(-1).tolist()  # the chunk's one host read
            for index, token in enumerate(tokens):
                out.commit([token])
                if out.done:  # at EOS: the chunk's steps after it are thrown away
                    out.gen.discarded_steps = len(tokens) - index - 1
                    break
