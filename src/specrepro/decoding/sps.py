"""`sps`: speculative decoding with a separate draft model that shares the target's tokenizer.

Leviathan et al. 2023 / Chen et al. 2023: the draft proposes k tokens autoregressively (sampling from
its warped distribution q when the run samples), the target verifies them in one forward. With
`hardware.compile` the draft's forwards run on compiled steps of its own (a static cache, one graph per width),
as the target's do: on a GPU an eager draft's per-token launch overhead would cost what the compiled target saves.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from specrepro.config import ModelConfig
from specrepro.decoding import draft_vocab
from specrepro.decoding.base import parameters_beside
from specrepro.decoding.controllers import CONTROLLERS, DraftLengthController, build_controller
from specrepro.decoding.draft_verify import DraftVerifyDecoder, Proposal
from specrepro.decoding.sampling import Sampling
from specrepro.decoding.steps import EagerSteps, target_steps
from specrepro.decoding.verify import crop_cache
from specrepro.errors import SpecReproError
from specrepro.registry import MethodConfig, register_method


@dataclass
class DraftCache:
    """The draft model during one generation: its KV cache, how many committed tokens it holds, and with a
    reduced draft vocabulary this prompt's vocabulary and the draft's LM-head rows of it."""

    cache: object  # a DynamicCache, or the draft's static cache on compiled steps
    cached: int = 0
    vocab_ids: torch.Tensor | None = None
    head: torch.nn.Linear | None = None


@dataclass
class SPSConfig(MethodConfig):
    name: str = "sps"
    draft: ModelConfig = field(default_factory=lambda: ModelConfig(name="sps_draft", source="artifact", id="sps_draft"))
    k: int = 4  # draft length (the controller's start value)
    controller: str = "fixed"  # fixed | heuristic (transformers' +2 / -1 schedule)
    k_max: int = 16  # the heuristic controller's cap
    # w > 1: the draft's top-w tokens at the first draft position, verified as a tree (beyond the paper)
    tree_width: int = 1
    # V > 0: the draft's LM head scores the V corpus-frequent tokens + the prompt's (beyond the paper)
    draft_vocab: int = 0
    draft_vocab_corpus: str = "sharegpt/sharegpt_v3_first1000.json.gz"  # ranks tokens for draft_vocab

    def __post_init__(self):
        self.require(self.k >= 1, "k", ">= 1")
        self.require_one_of("controller", CONTROLLERS)
        self.require(self.controller != "heuristic" or self.k_max >= self.k, "k_max", f">= k ({self.k})")
        self.require(self.tree_width >= 1, "tree_width", ">= 1")
        self.require(self.draft_vocab >= 0, "draft_vocab", ">= 0 (0: the whole vocabulary)")


@register_method(SPSConfig)
class SPSDecoder(DraftVerifyDecoder):
    name = "sps"
    compilable = True

    def __init__(
        self,
        model,
        tokenizer,
        draft: torch.nn.Module,
        k: int,
        controller: str,
        k_max: int,
        tree_width: int = 1,
        frequent: torch.Tensor | None = None,
    ):
        """`frequent`: token ids, most frequent first, that with each prompt's own tokens form the draft
        vocabulary (None: the whole vocabulary)."""
        super().__init__(model, tokenizer)
        if draft.config.vocab_size != model.config.vocab_size:
            raise SpecReproError(
                f"draft vocabulary ({draft.config.vocab_size}) differs from the target's ({model.config.vocab_size}): "
                "sps needs a draft that shares the tokenizer"
            )
        self.draft = draft
        # the draft runs as the target does: compiled on the loader's steps of its own, or eagerly; a draft that is
        # the target itself drafts eagerly (the target's compiled graphs are bound to the target's cache)
        compiled = self.steps.compiled and draft is not model
        self.draft_steps = target_steps(draft) if compiled else EagerSteps(draft)
        self.k, self.controller_kind, self.k_max = k, controller, k_max
        self.tree_width, self.frequent = tree_width, frequent

    @property
    def extra_parameters(self) -> int:
        return parameters_beside(self.draft, self.model)

    @property
    def draft_model_steps(self) -> list:
        """The draft's widest step after its prefill is 2 tokens: the bonus token and the draft it fed last (or a
        tree's winning sibling), which it never cached."""
        return [(self.draft_steps, 2, self.frequent is not None)]

    @classmethod
    def resolve_artifacts(cls, cfg: SPSConfig, target, artifacts_dir) -> dict[str, Path]:
        from specrepro.models.loading import resolve_artifact

        trained = cfg.draft.source == "artifact"
        return {"draft": resolve_artifact(cfg.draft.id, artifacts_dir, target)} if trained else {}

    @classmethod
    def read_files(cls, cfg: SPSConfig) -> dict[str, str]:
        return draft_vocab.corpus_file(cfg)

    @classmethod
    def from_config(cls, cfg: SPSConfig, target, ctx) -> "SPSDecoder":
        from specrepro.models.loading import trained_for_target

        draft = ctx.load_model(trained_for_target(cfg.draft, ctx.artifacts_dir, target.identity)).model
        frequent = (
            draft_vocab.corpus_ranking(target.tokenizer, cfg.draft_vocab_corpus)[: cfg.draft_vocab]
            if cfg.draft_vocab
            else None
        )
        return cls(target.model, target.tokenizer, draft, cfg.k, cfg.controller, cfg.k_max, cfg.tree_width, frequent)

    def new_controller(self) -> DraftLengthController:
        return build_controller(self.controller_kind, self.k, self.k_max)

    def start(self, prompt_ids: torch.Tensor, cache, length) -> DraftCache:
        state = DraftCache(self.draft_steps.new_cache(length))
        if self.frequent is not None:
            state.vocab_ids, state.head = draft_vocab.prompt_head(self.draft.lm_head, self.frequent, prompt_ids)
        return state

    def draft_logits(self, state: DraftCache, step_input, past: int) -> torch.Tensor:
        """The draft's last logits after `past` cached positions (passed, not read back from a static cache): over
        the whole vocabulary, or over the prompt's draft vocabulary."""
        if state.head is None:
            return self.draft_steps(step_input, state.cache, logits_to_keep=1, past=past).logits[0, -1]
        return state.head(self.draft_steps.hidden(step_input, state.cache, past=past)[0, -1])

    def propose(self, state: DraftCache, tokens, k, sampling: Sampling, rng, controller) -> Proposal:
        step_input, past = tokens[:, state.cached :], state.cached
        drafts, qs = [], []
        for i in range(k):
            logits = self.draft_logits(state, step_input, past)
            past += step_input.shape[1]
            if i == 0:
                first_logits = logits
            token, q, top1 = draft_vocab.choose_draft_token(
                state.vocab_ids, logits, self.model.config.vocab_size, sampling, rng
            )
            drafts.append(token)
            qs.append(q)
            step_input = token.view(1, 1)
            if not controller.keep_drafting(top1):
                break
        # the draft cache now holds the committed tokens and all drafts but the last
        state.cached = tokens.shape[1] + len(drafts) - 1
        q = None if sampling.greedy else torch.stack(qs)
        return self.with_first_siblings(torch.stack(drafts), q, first_logits, state.vocab_ids)

    def after_verify(self, state: DraftCache, tokens, output, rows) -> None:
        # keep the draft's KV only for positions that are still committed tokens: of this round's, the main chain's
        # drafts up to the first kept row that is not (a tree's accepted sibling was never in the draft's cache)
        on_chain = next((j for j, row in enumerate(rows) if row != j), len(rows))
        state.cached = min(state.cached, tokens.shape[1] - len(rows) + on_chain - 1)
        crop_cache(state.cache, state.cached)

    def generation_extras(self, state: DraftCache) -> dict:
        return {"draft_vocab": 0 if state.vocab_ids is None else len(state.vocab_ids)}
