"""The draft-then-verify loop that every chain-drafting method shares.

A subclass only says how to draft (`propose`) and how to roll its own drafter state back
(`after_verify`); verification, cache rollback, sampling and draft-length control live here once.
"""

from __future__ import annotations

from abc import abstractmethod

import torch
from transformers import DynamicCache

from specrepro.decoding.base import Decoder, GenerationBuilder
from specrepro.decoding.controllers import DraftLengthController
from specrepro.decoding.sampling import Sampling, next_token
from specrepro.decoding.verify import crop_cache, speculative_verify


class DraftVerifyDecoder(Decoder):
    """Target-model KV cache + draft proposals + shared verification (greedy or speculative sampling)."""

    @abstractmethod
    def new_controller(self) -> DraftLengthController:
        """A fresh draft-length controller for one generation."""

    @abstractmethod
    def propose(
        self, tokens: torch.Tensor, k: int, sampling: Sampling, rng, controller: DraftLengthController
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Draft up to k tokens after `tokens` (1, n). Returns (drafts (m,), q (m, vocab) or None if one-hot)."""

    def start(self, prompt_ids: torch.Tensor) -> None:
        """Reset per-generation drafter state (caches) before the first proposal."""

    def after_verify(self, tokens: torch.Tensor, n_accepted: int) -> None:
        """Roll drafter state back to the committed `tokens` (1, n) after a verification."""

    def target_forward(self, input_ids: torch.Tensor, cache, logits_to_keep: int = 0):
        """One target forward on the shared cache; subclasses may ask for hidden states too."""
        return self.model(input_ids, past_key_values=cache, logits_to_keep=logits_to_keep)

    def _decode(self, prompt_ids: torch.Tensor, sampling: Sampling, out: GenerationBuilder, rng) -> None:
        controller = self.new_controller()
        cache = DynamicCache(config=self.model.config)
        with out.timed("prefill"):
            logits = self.target_forward(prompt_ids, cache, logits_to_keep=1).logits[0, -1]
            first = next_token(logits, sampling, rng)
        out.commit([first], prefill=True)
        tokens = torch.cat([prompt_ids, prompt_ids.new_tensor([[first]])], dim=1)
        self.start(prompt_ids)
        while not out.done:
            # k drafts + 1 bonus token must fit the budget
            k = max(0, min(controller.next_length(), out.remaining - 1))
            with out.timed("draft"):
                drafts, q = self.propose(tokens, k, sampling, rng, controller) if k else (tokens.new_empty(0), None)
            with out.timed("verify"):
                verify_input = torch.cat([tokens[:, -1], drafts]).view(1, -1)
                logits = self.target_forward(verify_input, cache).logits[0]
                new_tokens, n_accepted = speculative_verify(drafts, q, logits, sampling, rng)
                crop_cache(cache, tokens.shape[1] + n_accepted)
            kept = out.commit(new_tokens, drafted=len(drafts))
            tokens = torch.cat([tokens, tokens.new_tensor([kept])], dim=1)
            controller.update(len(drafts), n_accepted)
            self.after_verify(tokens, n_accepted)
