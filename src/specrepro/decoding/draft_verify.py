"""The draft-then-verify loop that every drafting method shares.

A subclass only says how to draft (`propose` a chain, or `propose_tree` a token tree) and how to roll its own
drafter state back (`after_verify`); verification, cache rollback, sampling and draft-length control live
here once.

Token trees beyond the paper (`tree_width` w > 1): a drafter that can name its next-best tokens at the first
draft position (`first_alternatives`) gets them verified as siblings of its chain's first node, in the same
forward. On a CPU whose linears pad inputs to `hardware.linear_min_rows` rows, a verification of up to that
many rows costs about what one of two rows does, so the alternatives are nearly free.
"""

from __future__ import annotations

from abc import abstractmethod

import torch

from specrepro.decoding.base import Decoder, GenerationBuilder
from specrepro.decoding.controllers import DraftLengthController
from specrepro.decoding.sampling import Sampling, next_token
from specrepro.errors import SpecReproError
from specrepro.decoding.verify import (crop_cache, keep_tree_path, speculative_verify, tree_attention,
                                      tree_verify)


class DraftVerifyDecoder(Decoder):
    """Target-model KV cache + draft proposals + shared verification (greedy or speculative sampling)."""

    tree_width = 1  # w > 1: the first draft position's w - 1 next-best tokens join the chain as siblings

    @abstractmethod
    def new_controller(self) -> DraftLengthController:
        """A fresh draft-length controller for one generation."""

    @abstractmethod
    def propose(
        self, tokens: torch.Tensor, k: int, sampling: Sampling, rng, controller: DraftLengthController
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Draft up to k tokens after `tokens` (1, n). Returns (drafts (m,), q (m, vocab) or None if one-hot)."""

    def propose_tree(
        self, tokens: torch.Tensor, k: int, sampling: Sampling, rng, controller: DraftLengthController
    ) -> tuple[torch.Tensor, torch.Tensor | None, list[int] | None]:
        """Draft a token tree of depth <= k: (nodes (n,), q (n, vocab) or None, each node's parent (-1: the last
        token) or None for a chain). Nodes 0, 1, ... that descend one from the other form the main chain, which
        the controller counts; the others are alternatives. By default, the chain of `propose`, with
        `tree_width` - 1 siblings of its first node when the tree is on."""
        drafts, q = self.propose(tokens, k, sampling, rng, controller)
        if self.tree_width == 1:
            return drafts, q, None
        siblings = self.first_alternatives(drafts[0], self.tree_width - 1)
        parents = list(range(-1, len(drafts) - 1)) + [-1] * len(siblings)
        if q is not None:  # a sibling is a deterministic draft: its q is one-hot
            q = torch.cat([q, torch.nn.functional.one_hot(siblings, q.shape[-1]).to(q.dtype)])
        return torch.cat([drafts, siblings]), q, parents

    @property
    def max_step_width(self) -> int:
        """The last token, the longest chain the controller allows and the tree's extra siblings."""
        return 1 + self.new_controller().max_length + self.tree_width - 1

    def first_alternatives(self, chosen: torch.Tensor, count: int) -> torch.Tensor:
        """Up to `count` best draft tokens for the last proposal's first position other than `chosen`, best
        first: what a drafter that supports `tree_width` > 1 provides."""
        raise SpecReproError(f"{self.name} does not draft token trees (tree_width {self.tree_width})")

    def start(self, prompt_ids: torch.Tensor) -> None:
        """Reset per-generation drafter state (caches) before the first proposal."""

    def after_verify(self, tokens: torch.Tensor, n_accepted: int, rows: list[int] | None = None) -> None:
        """Roll drafter state back to the committed `tokens` (1, n) after a verification; `rows` are the verify
        inputs that were kept ([last token, accepted nodes]; None: the first n_accepted + 1, as in a chain)."""

    def target_forward(self, input_ids: torch.Tensor, cache, logits_to_keep: int = 0, tree=None):
        """One target forward on the shared cache; subclasses may ask for hidden states too. `tree`: (allowed
        keys, position ids) of a tree verification (`verify.tree_attention`), None for a causal chain."""
        return self.steps(input_ids, cache, logits_to_keep, tree)

    def _decode(self, prompt_ids: torch.Tensor, sampling: Sampling, out: GenerationBuilder, rng) -> None:
        controller = self.new_controller()
        cache = self.steps.new_cache(prompt_ids.shape[1] + out.max_new_tokens)
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
                drafts, q, parents = (self.propose_tree(tokens, k, sampling, rng, controller) if k
                                      else (tokens.new_empty(0), None, None))
            with out.timed("verify"):
                verify_input = torch.cat([tokens[:, -1], drafts]).view(1, -1)
                committed = tokens.shape[1]
                if parents is None:
                    logits = self.target_forward(verify_input, cache).logits[0]
                    new_tokens, n_accepted = speculative_verify(drafts, q, logits, sampling, rng)
                    crop_cache(cache, committed + n_accepted)
                    rows = None
                else:
                    allow, positions = tree_attention(parents, committed - 1)
                    logits = self.target_forward(verify_input, cache, tree=(allow.to(self.device),
                                                                            positions.to(self.device))).logits[0]
                    new_tokens, path = tree_verify(drafts, parents, q, logits, sampling, rng)
                    keep_tree_path(cache, committed, path)
                    n_accepted, rows = len(path), [0] + [node + 1 for node in path]
            kept = out.commit(new_tokens, drafted=len(drafts))
            tokens = torch.cat([tokens, tokens.new_tensor([kept])], dim=1)
            controller.update(*main_chain(parents, len(drafts), n_accepted, rows))
            self.after_verify(tokens, n_accepted, rows)


def main_chain(parents: list[int] | None, n: int, n_accepted: int, rows: list[int] | None) -> tuple[int, int]:
    """(drafted, accepted) of a round's main chain (node 0, its child 1, ...): what a draft-length controller
    learns from; a tree's other nodes are alternatives for positions the chain drafts too."""
    if parents is None:
        return n, n_accepted
    drafted = 0
    while drafted < n and parents[drafted] == drafted - 1:
        drafted += 1
    accepted = 0
    while accepted < n_accepted and rows[accepted + 1] == accepted + 1:
        accepted += 1
    return drafted, accepted
