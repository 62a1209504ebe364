"""The draft-then-verify loop that every drafting method shares.

A drafter says how to draft and nothing about the loop's order. Per generation:

    state = start(prompt_ids, cache, length)          # the drafter's own per-generation state (or None)
    output = target_forward(state, ids, cache, ...)   # every target forward: prefill, then each verification
    after_verify(state, tokens, output, rows)         # after each: the committed tokens and the output rows kept
    proposal = propose(state, tokens, k, ...)         # a Proposal: drafts, their q, and a tree's parents

Everything a drafter carries from one call to the next lives in its state object; the decoder itself holds
only its configuration. `target_forward` returns a `TargetOutput`: the logits and the hidden states a drafter
declared it reads. Verification, cache rollback, sampling and draft-length control live here once.

Token trees beyond the paper (`tree_width` w > 1): a drafter that can name its next-best tokens at the first
draft position adds them as siblings of its chain's first node (`with_first_siblings`), verified in the same
forward. On a CPU whose linears pad inputs to `hardware.linear_min_rows` rows, a verification of up to that
many rows costs about what one of two rows does, so the alternatives are nearly free.
"""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass, field
from typing import Any

import torch

from specrepro.decoding import draft_vocab
from specrepro.decoding.base import Decoder, GenerationBuilder
from specrepro.decoding.device import upload
from specrepro.decoding.controllers import DraftLengthController
from specrepro.decoding.sampling import Sampling, next_token
from specrepro.decoding.verify import crop_cache, keep_tree_path, speculative_verify, tree_attention, tree_verify


@dataclass
class Proposal:
    """One round's drafts: nodes (n,), the q each was drawn from ((n, vocab); None: deterministic, one-hot) and
    each node's parent (-1: the last committed token; None: a chain). Nodes 0, 1, ... that descend one from the
    other form the main chain, which the controller counts; the others are alternatives."""

    drafts: torch.Tensor
    q: torch.Tensor | None = None
    parents: list[int] | None = None


@dataclass
class TargetOutput:
    """One target forward: its logits (1, rows, vocab) and what a drafter that overrides `target_forward` reads
    from it: hidden states by name (each (1, rows, hidden)), the cache position of its first row."""

    logits: torch.Tensor
    position: int | None = None
    hidden: dict[str, torch.Tensor] = field(default_factory=dict)


class DraftVerifyDecoder(Decoder):
    """Target-model KV cache + draft proposals + shared verification (greedy or speculative sampling)."""

    tree_width = 1  # w > 1: the first draft position's w - 1 next-best tokens join the chain as siblings

    @abstractmethod
    def new_controller(self) -> DraftLengthController:
        """A fresh draft-length controller for one generation."""

    def start(self, prompt_ids: torch.Tensor, cache, length: int) -> Any:
        """The drafter's state for one generation on the target's `cache` (called before the prefill); `length`: the
        positions the generation may fill (prompt and budget), for a cache of the drafter's own."""
        return None

    @abstractmethod
    def propose(
        self, state, tokens: torch.Tensor, k: int, sampling: Sampling, rng, controller: DraftLengthController
    ) -> Proposal:
        """Draft up to k tokens (a chain, or a tree of depth <= k) after the committed `tokens` (1, n)."""

    def target_forward(
        self, state, input_ids: torch.Tensor, cache, logits_to_keep: int = 0, tree=None, past: int | None = None
    ) -> TargetOutput:
        """One target forward on the shared cache (the prefill, then each verification). `tree`: (allowed keys,
        position ids) of a tree verification (`verify.tree_attention`), None for a causal chain; `past`: the
        positions the cache holds, which a verification knows (compiled steps then need not read them back from
        the device). Drafters that read hidden states override it to return them too."""
        return TargetOutput(self.steps(input_ids, cache, logits_to_keep, tree, past=past).logits)

    def after_verify(self, state, tokens: torch.Tensor, output: TargetOutput, rows: list[int]) -> None:
        """After the prefill and each verification: `tokens` (1, n) are committed, `rows` the indices of
        `output`'s rows that were kept (the last one produced the newest token); roll the state back to them."""

    def generation_extras(self, state) -> dict:
        """Numbers a generation reports in `extra` beside the step counts (e.g. the draft vocabulary it used)."""
        return {}

    @property
    def max_step_width(self) -> int:
        """The last token, the longest chain the controller allows and the tree's extra siblings."""
        return 1 + self.new_controller().max_length + self.tree_width - 1

    @property
    def verifies_trees(self) -> bool:
        return self.tree_width > 1

    def with_first_siblings(
        self, drafts: torch.Tensor, q: torch.Tensor | None, first_logits: torch.Tensor, vocab_ids: torch.Tensor | None
    ) -> Proposal:
        """The chain `drafts`; with `tree_width` w > 1, plus the w - 1 next-best tokens of the first position's
        draft logits (over `vocab_ids` when the draft vocabulary is reduced) as siblings of its first node."""
        if self.tree_width == 1:
            return Proposal(drafts, q)
        siblings = draft_vocab.alternatives(vocab_ids, first_logits, drafts[0], self.tree_width - 1)
        parents = list(range(-1, len(drafts) - 1)) + [-1] * len(siblings)
        if q is not None:  # a sibling is a deterministic draft: its q is one-hot
            q = torch.cat([q, torch.nn.functional.one_hot(siblings, q.shape[-1]).to(q.dtype)])
        return Proposal(torch.cat([drafts, siblings]), q, parents)

    def _decode(self, prompt_ids: torch.Tensor, sampling: Sampling, out: GenerationBuilder, rng) -> None:
        controller = self.new_controller()
        length = prompt_ids.shape[1] + out.max_new_tokens
        cache = self.steps.new_cache(length)
        state = self.start(prompt_ids, cache, length)
        with out.timed("prefill"):
            output = self.target_forward(state, prompt_ids, cache, logits_to_keep=1)
            first = next_token(output.logits[0, -1], sampling, rng)
        out.commit([first], prefill=True)
        tokens = torch.cat([prompt_ids, prompt_ids.new_tensor([[first]])], dim=1)
        self.after_verify(state, tokens, output, list(range(prompt_ids.shape[1])))
        while not out.done:
            # k drafts + 1 bonus token must fit the budget
            k = max(0, min(controller.next_length(), out.remaining - 1))
            with out.timed("draft"):
                proposal = (
                    self.propose(state, tokens, k, sampling, rng, controller) if k else Proposal(tokens.new_empty(0))
                )
            drafts, parents = proposal.drafts, proposal.parents
            with out.timed("verify"):
                verify_input = torch.cat([tokens[:, -1], drafts]).view(1, -1)
                committed = tokens.shape[1]
                if parents is None:
                    output = self.target_forward(state, verify_input, cache, past=committed - 1)
                    new_tokens, n_accepted = speculative_verify(drafts, proposal.q, output.logits[0], sampling, rng)
                    crop_cache(cache, committed + n_accepted)
                    rows = list(range(n_accepted + 1))
                else:
                    allow, positions = tree_attention(parents, committed - 1)
                    tree = (upload(allow, self.device), upload(positions, self.device))
                    output = self.target_forward(state, verify_input, cache, tree=tree, past=committed - 1)
                    new_tokens, path = tree_verify(drafts, parents, proposal.q, output.logits[0], sampling, rng)
                    keep_tree_path(cache, committed, path)
                    n_accepted, rows = len(path), [0] + [node + 1 for node in path]
            kept = out.commit(new_tokens, drafted=len(drafts))
            tokens = torch.cat([tokens, upload([kept], self.device)], dim=1)
            controller.update(*main_chain(parents, len(drafts), n_accepted, rows))
            self.after_verify(state, tokens, output, rows)
        out.gen.extra.update(self.generation_extras(state))


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
