"""`hf_assisted`: transformers' own `generate` (assisted generation, prompt lookup, or plain) as an external peer.

Its output is turned into a Generation so that it is measured by the same code as our methods. Steps are
read off `generate` through public hooks, not its internals (`StepRecorder`): its streamer receives the
tokens each step commits, and a forward pre-hook on the target sees how many drafts each step verified.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import GenerationConfig
from transformers.generation import BaseStreamer

from specrepro.config import ModelConfig
from specrepro.decoding.base import Decoder, GenerationBuilder, parameters_beside
from specrepro.decoding.sampling import Sampling
from specrepro.errors import SpecReproError
from specrepro.registry import MethodConfig, register_method


@dataclass
class HFAssistedConfig(MethodConfig):
    name: str = "hf_assisted"
    mode: str = "prompt_lookup"  # prompt_lookup | assistant | plain (no drafting: HF's own AR generate)
    prompt_lookup_num_tokens: int = 10
    max_matching_ngram_size: int = 2
    draft: ModelConfig = field(default_factory=lambda: ModelConfig(name="sps_draft", source="artifact", id="sps_draft"))
    num_assistant_tokens: int = 5
    num_assistant_tokens_schedule: str = "constant"  # constant | heuristic

    def __post_init__(self):
        self.require_one_of("mode", ("prompt_lookup", "assistant", "plain"))
        self.require(self.prompt_lookup_num_tokens >= 1, "prompt_lookup_num_tokens", ">= 1")
        self.require(self.max_matching_ngram_size >= 1, "max_matching_ngram_size", ">= 1")
        self.require(self.num_assistant_tokens >= 1, "num_assistant_tokens", ">= 1")
        self.require_one_of("num_assistant_tokens_schedule", ("constant", "heuristic"))


@register_method(HFAssistedConfig)
class HFAssistedDecoder(Decoder):
    name = "hf_assisted"
    rolls_back = False  # transformers' generate keeps its own cache

    def __init__(self, model, tokenizer, cfg: HFAssistedConfig, assistant=None):
        super().__init__(model, tokenizer)
        self.cfg = cfg
        self.assistant = assistant

    @property
    def extra_parameters(self) -> int:
        return 0 if self.assistant is None else parameters_beside(self.assistant, self.model)

    @classmethod
    def resolve_artifacts(cls, cfg: HFAssistedConfig, target, artifacts_dir) -> dict[str, Path]:
        from specrepro.models.loading import resolve_artifact

        trained = cfg.mode == "assistant" and cfg.draft.source == "artifact"
        return {"draft": resolve_artifact(cfg.draft.id, artifacts_dir, target)} if trained else {}

    @classmethod
    def from_config(cls, cfg: HFAssistedConfig, target, ctx) -> "HFAssistedDecoder":
        from specrepro.models.loading import trained_for_target

        assistant = (
            ctx.load_model(trained_for_target(cfg.draft, ctx.artifacts_dir, target.identity)).model
            if cfg.mode == "assistant"
            else None
        )
        return cls(target.model, target.tokenizer, cfg, assistant)

    def generate_kwargs(self, sampling: Sampling, max_new_tokens: int) -> dict:
        # a model with no EOS: generate takes None (an empty list raised an IndexError deep in transformers)
        eos = sorted(self.eos_ids) or None
        kwargs = dict(max_new_tokens=max_new_tokens, do_sample=not sampling.greedy, eos_token_id=eos)
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
        recorder = StepRecorder()
        # HF samples from the global RNG; the seed is drawn on the generator's device (CUDA generators too)
        torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=rng, device=rng.device)))
        hook = self.model.register_forward_pre_hook(recorder.record_forward, with_kwargs=True)
        try:
            with run_settings_only(self.model), run_settings_only(self.assistant):
                output = self.model.generate(
                    prompt_ids,
                    attention_mask=torch.ones_like(prompt_ids),
                    streamer=recorder,
                    **self.generate_kwargs(sampling, out.max_new_tokens),
                )
        finally:
            hook.remove()
        if [token for chunk in recorder.chunks for token in chunk] != output[0].tolist():
            raise SpecReproError(
                "hf_assisted: generate streamed other tokens than it returned; its steps cannot be counted"
            )
        prompt, first, *steps = recorder.chunks
        out.commit(first[:1], prefill=True)
        # HF's first forward is the prefill and, when the prompt already yields drafts, their verification: its first
        # token is the prefill token (as for every method), and the tokens it committed after that one count as a
        # step that drafted the candidates after the first (no step when the first is rejected)
        committed = len(prompt) + 1
        for tokens, (cached, fed) in zip([first[1:], *steps], recorder.fed[1:]):
            drafts = fed[0, committed - cached :].tolist()  # what the step fed past the committed tokens
            if tokens and not out.done:
                out.commit(tokens, drafted=len(drafts))
                # cut at a drafted EOS: transformers drops the step's own token after it, so it committed drafts only
                out.gen.last_step_cut |= len(tokens) <= len(drafts) and tokens == drafts[: len(tokens)]
            committed += len(tokens)
        out.gen.extra["phase_times"] = "not separable: HF interleaves drafting and verification"


@contextlib.contextmanager
def run_settings_only(model):
    """While in it, `model.generate` decodes by the run's settings and transformers' defaults alone: `generate` fills
    every setting it is not given from the model's generation_config (a checkpoint's generation_config.json: a
    repetition penalty, as Qwen2.5-Instruct's 1.05, or a no-repeat n-gram size), so that one keeps only the model's
    special tokens here. The assistant model's too (its drafts are generated the same way); None: nothing."""
    if model is None:
        yield
        return
    own = model.generation_config
    tokens = ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id")
    model.generation_config = GenerationConfig(**{name: getattr(own, name, None) for name in tokens})
    try:
        yield
    finally:
        model.generation_config = own


class StepRecorder(BaseStreamer):
    """`generate`'s steps: it streams the prompt, then the tokens each step commits, and `record_forward` (a
    forward pre-hook on the target) sees what each step's last forward was fed after which cached positions. The
    tokens the target was fed beyond the committed sequence were that step's drafts."""

    def __init__(self):
        self.chunks: list[list[int]] = []  # the prompt, then each step's committed tokens
        self.fed: list[tuple[int, torch.Tensor | None]] = []  # per chunk: (cached positions, input ids) of the
        self.last_fed: tuple[int, torch.Tensor | None] = (0, None)  # target's last forward before it

    def record_forward(self, module, args, kwargs) -> None:
        inputs = kwargs["input_ids"] if "input_ids" in kwargs else args[0]
        cache = kwargs.get("cache")
        self.last_fed = (cache.get_seq_length() if cache is not None else 0, inputs)  # read once generate is done

    def put(self, value: torch.Tensor) -> None:
        self.chunks.append(value.reshape(-1).tolist())  # batch size 1: (1, n) or (1,)
        self.fed.append(self.last_fed)

    def end(self) -> None:
        pass
