"""`hf_assisted`: transformers' own `generate` (assisted generation, prompt lookup, or plain) as an external peer.

Its output is turned into a Generation so that it is measured by the same code as our methods. Steps and
accepted lengths are read off the target's forward calls: a pre-hook records the cache length before
each call, and the growth between calls is what that step committed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specrepro.config import MethodConfig, ModelConfig, register_method_schema
from specrepro.decoding.base import Decoder, GenerationBuilder, parameters_beside
from specrepro.decoding.sampling import Sampling
from specrepro.errors import SpecReproError


@register_method_schema("hf_assisted")
@dataclass
class HFAssistedConfig(MethodConfig):
    name: str = "hf_assisted"
    mode: str = "prompt_lookup"  # prompt_lookup | assistant | plain (no drafting: HF's own AR generate)
    prompt_lookup_num_tokens: int = 10
    max_matching_ngram_size: int = 2
    draft: ModelConfig = field(default_factory=lambda: ModelConfig(name="draft", source="artifact", id="sps_draft"))
    num_assistant_tokens: int = 5
    num_assistant_tokens_schedule: str = "constant"  # constant | heuristic


class HFAssistedDecoder(Decoder):
    name = "hf_assisted"

    def __init__(self, model, tokenizer, cfg: HFAssistedConfig, assistant=None):
        super().__init__(model, tokenizer)
        if cfg.mode not in ("prompt_lookup", "assistant", "plain"):
            raise SpecReproError(f"hf_assisted mode '{cfg.mode}' is not one of prompt_lookup, assistant, plain")
        self.cfg = cfg
        self.assistant = assistant

    @property
    def extra_parameters(self) -> int:
        return 0 if self.assistant is None else parameters_beside(self.assistant, self.model)

    @classmethod
    def from_config(cls, cfg: HFAssistedConfig, target, ctx) -> "HFAssistedDecoder":
        assistant = ctx.load_model(cfg.draft).model if cfg.mode == "assistant" else None
        return cls(target.model, target.tokenizer, cfg, assistant)

    def generate_kwargs(self, sampling: Sampling, max_new_tokens: int) -> dict:
        kwargs = dict(max_new_tokens=max_new_tokens, do_sample=not sampling.greedy, eos_token_id=sorted(self.eos_ids))
        if not sampling.greedy:
            kwargs.update(temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p)
        else:
            kwargs.update(temperature=None, top_k=None, top_p=None)
        if self.cfg.mode == "prompt_lookup":
            kwargs.update(
                prompt_lookup_num_tokens=self.cfg.prompt_lookup_num_tokens,
                max_matching_ngram_size=self.cfg.max_matching_ngram_size,
            )
        elif self.cfg.mode == "assistant":
            self.assistant.generation_config.num_assistant_tokens = self.cfg.num_assistant_tokens
            self.assistant.generation_config.num_assistant_tokens_schedule = self.cfg.num_assistant_tokens_schedule
            kwargs.update(assistant_model=self.assistant)
        return kwargs

    def _decode(self, prompt_ids: torch.Tensor, sampling: Sampling, out: GenerationBuilder, rng) -> None:
        cache_lengths: list[int] = []
        drafted: list[int] = []

        def record_call(module, args, kwargs):
            cache = kwargs.get("past_key_values")
            inputs = kwargs.get("input_ids", args[0] if args else None)
            cache_lengths.append(cache.get_seq_length() if cache is not None else 0)
            drafted.append(inputs.shape[1] - 1 if inputs is not None else 0)

        # HF samples from the global RNG; the seed is drawn on the generator's device (CUDA generators too)
        torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=rng, device=rng.device)))
        hook = self.model.register_forward_pre_hook(record_call, with_kwargs=True)
        try:
            output = self.model.generate(
                prompt_ids,
                attention_mask=torch.ones_like(prompt_ids),
                **self.generate_kwargs(sampling, out.max_new_tokens),
            )
        finally:
            hook.remove()
        new_tokens = output[0, prompt_ids.shape[1] :].tolist()
        out.commit(new_tokens[:1], prefill=True)
        # call i (after prefill) committed the growth of the cache up to call i + 1
        ends = cache_lengths[2:] + [prompt_ids.shape[1] + len(new_tokens) - 1]
        position = 1
        for start, end, n_drafted in zip(cache_lengths[1:], ends, drafted[1:]):
            step = new_tokens[position : position + (end - start)]
            position += len(step)
            if step:
                out.commit(step, drafted=n_drafted)
        out.gen.extra["phase_times"] = "not separable: HF interleaves drafting and verification"
