"""`sps`: speculative decoding with a separate draft model that shares the target's tokenizer.

Leviathan et al. 2023 / Chen et al. 2023: the draft proposes k tokens autoregressively (sampling from
its warped distribution q when the run samples), the target verifies them in one forward.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from specrepro.config import ModelConfig
from specrepro.decoding.base import parameters_beside
from specrepro.decoding.controllers import CONTROLLERS, DraftLengthController, build_controller
from specrepro.decoding.draft_verify import DraftVerifyDecoder, Proposal
from specrepro.decoding.sampling import Sampling, probs, sample
from specrepro.decoding.verify import crop_cache
from specrepro.errors import SpecReproError
from specrepro.registry import MethodConfig, register_method


@dataclass
class DraftCache:
    """The draft model's KV cache during one generation, and how many committed tokens it holds."""

    cache: DynamicCache
    cached: int = 0


@dataclass
class SPSConfig(MethodConfig):
    name: str = "sps"
    draft: ModelConfig = field(default_factory=lambda: ModelConfig(name="sps_draft", source="artifact", id="sps_draft"))
    k: int = 4  # draft length (the controller's start value)
    controller: str = "fixed"  # fixed | heuristic (transformers' +2 / -1 schedule)
    k_max: int = 16  # the heuristic controller's cap

    def __post_init__(self):
        self.require(self.k >= 1, "k", ">= 1")
        self.require_one_of("controller", CONTROLLERS)
        self.require(self.controller != "heuristic" or self.k_max >= self.k, "k_max", f">= k ({self.k})")


@register_method(SPSConfig)
class SPSDecoder(DraftVerifyDecoder):
    name = "sps"
    compilable = True

    def __init__(self, model, tokenizer, draft: torch.nn.Module, k: int, controller: str, k_max: int):
        super().__init__(model, tokenizer)
        if draft.config.vocab_size != model.config.vocab_size:
            raise SpecReproError(
                f"draft vocabulary ({draft.config.vocab_size}) differs from the target's ({model.config.vocab_size}): "
                "sps needs a draft that shares the tokenizer"
            )
        self.draft = draft
        self.k, self.controller_kind, self.k_max = k, controller, k_max

    @property
    def extra_parameters(self) -> int:
        return parameters_beside(self.draft, self.model)

    @classmethod
    def resolve_artifacts(cls, cfg: SPSConfig, model_name: str, artifacts_dir) -> dict[str, str]:
        from specrepro.models.loading import resolve_artifact

        return {"draft": resolve_artifact(cfg.draft.id, artifacts_dir).name} if cfg.draft.source == "artifact" else {}

    @classmethod
    def from_config(cls, cfg: SPSConfig, target, ctx) -> "SPSDecoder":
        draft = ctx.load_model(cfg.draft).model
        return cls(target.model, target.tokenizer, draft, cfg.k, cfg.controller, cfg.k_max)

    def new_controller(self) -> DraftLengthController:
        return build_controller(self.controller_kind, self.k, self.k_max)

    def start(self, prompt_ids: torch.Tensor, cache) -> DraftCache:
        return DraftCache(DynamicCache(config=self.draft.config))

    def propose(self, state: DraftCache, tokens, k, sampling: Sampling, rng, controller) -> Proposal:
        step_input = tokens[:, state.cached :]
        drafts, qs = [], []
        for _ in range(k):
            logits = self.draft(step_input, past_key_values=state.cache, logits_to_keep=1).logits[0, -1]
            q = probs(logits, sampling)
            token = logits.argmax(-1) if sampling.greedy else sample(q, rng)
            drafts.append(token)
            qs.append(q)
            step_input = token.view(1, 1)
            if not controller.keep_drafting(float(logits.softmax(-1).max())):
                break
        # the draft cache now holds the committed tokens and all drafts but the last
        state.cached = tokens.shape[1] + len(drafts) - 1
        return Proposal(torch.stack(drafts), None if sampling.greedy else torch.stack(qs))

    def after_verify(self, state: DraftCache, tokens, output, rows) -> None:
        # keep the draft's KV only for positions that are still committed tokens
        state.cached = min(state.cached, tokens.shape[1] - 1)
        crop_cache(state.cache, state.cached)
