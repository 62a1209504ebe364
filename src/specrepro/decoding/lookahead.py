"""`lookahead`: Lookahead decoding (Fu et al., 2024, "Break the Sequential Dependency of LLM Inference Using
Lookahead Decoding"): Jacobi iterations over a 2-D window fill an n-gram pool, whose n-grams that start with the
last committed token are verified in the same forward.

Training-free. Each step is one target forward of two branches:
- the lookahead branch: a window of N - 1 levels of W tokens each, the last N - 1 Jacobi iterations' outputs
  (level 0 the oldest). The token at level l, column i sits at position t + 1 + i + l (t: the last committed
  token's) and sees the committed tokens, the level-0 tokens of columns 0..i and its own column's earlier levels
  (the paper's attention-mask figure). Each last-level row's argmax is the next Jacobi iteration's token of its
  column: the column read down the levels plus it is an n-gram, added to the pool keyed by its first token; then
  the oldest level is dropped and the new tokens become the newest. Level 0 starts as W tokens drawn from the
  context, and for the first N - 2 steps the levels only fill up (no n-gram is complete yet). The authors' code
  (lade/decoding.py update_token_map, models/modeling_llama.py jforward_multilevel) lays the window one position
  earlier: level 0's first column is the last committed token itself and W - 1 guesses follow it, so its first
  n-gram starts with that token and a forward takes (G + W)(N - 1) rows, one fewer than here;
- the verification branch: up to G n-grams of the pool whose first token is the last committed token (the G
  most recently added), each a chain of N - 1 drafts after it, merged into a trie.

That mask is a token tree: level 0 is a chain below the last committed token, and each column's later levels a
chain below its level-0 token, so a node's ancestors are exactly what the paper's mask lets it see and its depth
its position. Both branches therefore go through the shared `tree_attention` and `tree_verify` in one forward
(the verification branch's nodes first). Beyond the paper: `tree_verify` walks every node it is given, so a
window path the target's argmax follows is accepted too (the paper verifies the n-grams only), and the window's
nodes count as drafted in the step records (MAT is unaffected). Verification is exact either way, so the output
is the target's: greedy equals `ar`, and sampling keeps the target distribution by the shared tree rule (one
speculative stage per child, every node a deterministic draft; the paper's sampling verification likewise checks
the candidates one after another against what the earlier ones left of p). The pool lives for one generation.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from specrepro.decoding.device import upload
from specrepro.decoding.controllers import DraftLengthController, FixedLength
from specrepro.decoding.draft_verify import DraftVerifyDecoder, Proposal
from specrepro.decoding.sampling import Sampling
from specrepro.registry import MethodConfig, register_method


@dataclass
class LookaheadConfig(MethodConfig):
    name: str = "lookahead"
    window: int = 15  # W: columns of the lookahead window
    ngram: int = 5  # N: n-gram size (N - 1 levels in the window, N - 1 drafts a candidate)
    guesses: int = 15  # G: candidate n-grams verified a step (and kept per first token in the pool)

    def __post_init__(self):
        self.require(self.window >= 1, "window", ">= 1")
        self.require(self.ngram >= 2, "ngram", ">= 2")
        self.require(self.guesses >= 1, "guesses", ">= 1")


class NgramPool:
    """n-grams by first token: each key keeps its `size` most recently added continuations (N - 1 tokens)."""

    def __init__(self, size: int):
        self.size = size
        self.by_first: dict[int, OrderedDict[tuple[int, ...], None]] = {}

    def add(self, ngram: tuple[int, ...]) -> None:
        entries = self.by_first.setdefault(ngram[0], OrderedDict())
        entries.pop(ngram[1:], None)
        entries[ngram[1:]] = None  # the most recent last
        if len(entries) > self.size:
            entries.popitem(last=False)

    def candidates(self, first: int) -> list[tuple[int, ...]]:
        """The continuations of `first`, the most recently added first."""
        return list(reversed(self.by_first.get(first, {})))


def candidate_trie(candidates: list[tuple[int, ...]], depth: int) -> tuple[list[int], list[int]]:
    """The candidates' first `depth` tokens merged into a trie below the last committed token: (tokens, parents)."""
    tokens: list[int] = []
    parents: list[int] = []
    index: dict[tuple[int, int], int] = {}
    for candidate in candidates:
        parent = -1
        for token in candidate[:depth]:
            if (parent, token) not in index:
                index[(parent, token)] = len(tokens)
                tokens.append(token)
                parents.append(parent)
            parent = index[(parent, token)]
    return tokens, parents


def window_tree(levels: list[list[int]], first_node: int) -> tuple[list[int], list[int], list[int]]:
    """The lookahead branch as tree nodes numbered from `first_node`: (tokens, parents, the node of each column's
    newest level). Level 0 is a chain below the last committed token (-1); level l's column i hangs below level l -
    1's column i, so it sees level 0's columns 0..i and its column's earlier levels (the paper's mask figure)."""
    tokens: list[int] = []
    parents: list[int] = []
    above: list[int] = []
    for level, row in enumerate(levels):
        nodes = []
        for column, token in enumerate(row):
            if level == 0:
                parent = first_node + column - 1 if column else -1
            else:
                parent = above[column]
            nodes.append(first_node + len(tokens))
            tokens.append(token)
            parents.append(parent)
        above = nodes
    return tokens, parents, above


@dataclass
class LookaheadState:
    pool: NgramPool
    levels: list[list[int]] = field(default_factory=list)  # the window, oldest level first
    newest_rows: list[int] | None = None  # output rows of the window's newest level in the pending forward
    last_token: int = -1  # the newest committed token, whose n-grams the verification branch drafts


@register_method(LookaheadConfig)
class LookaheadDecoder(DraftVerifyDecoder):
    name = "lookahead"
    compilable = True

    def __init__(self, model, tokenizer, cfg: LookaheadConfig, steps=None):
        super().__init__(model, tokenizer, steps)
        self.cfg = cfg

    @classmethod
    def from_config(cls, cfg: LookaheadConfig, target, ctx) -> "LookaheadDecoder":
        return cls(target.model, target.tokenizer, cfg)

    def new_controller(self) -> DraftLengthController:
        return FixedLength(self.cfg.ngram - 1)  # a candidate's drafts; the loop caps them at the budget

    @property
    def verifies_trees(self) -> bool:
        return True

    @property
    def max_step_width(self) -> int:
        return 1 + (self.cfg.guesses + self.cfg.window) * (self.cfg.ngram - 1)

    def start(self, prompt_ids, cache, length) -> LookaheadState:
        return LookaheadState(NgramPool(self.cfg.guesses))

    def propose(self, state: LookaheadState, tokens, k, sampling: Sampling, rng, controller) -> Proposal:
        if not state.levels:  # level 0 starts as tokens drawn from the context, as Jacobi decoding's guesses
            picks = torch.randint(tokens.shape[1], (self.cfg.window,), generator=rng, device=tokens.device)
            state.levels = [tokens[0, picks].tolist()]
        drafts, parents = candidate_trie(state.pool.candidates(state.last_token), k)  # verification branch
        window, window_parents, newest = window_tree(state.levels, len(drafts))  # lookahead branch
        state.newest_rows = [node + 1 for node in newest]  # row 0 is the last committed token
        return Proposal(upload(drafts + window, tokens.device), None, parents + window_parents)

    def after_verify(self, state: LookaheadState, tokens, output, rows) -> None:
        if state.newest_rows is None:  # the prefill, or a step without a window (the budget's last token)
            state.last_token = int(tokens[0, -1])
            return
        # one Jacobi iteration of every column, read with the newest token
        *new, state.last_token = torch.cat([output.logits[0, state.newest_rows].argmax(-1), tokens[0, -1:]]).tolist()
        state.newest_rows = None
        if len(state.levels) == self.cfg.ngram - 1:
            for column, token in enumerate(new):
                state.pool.add(tuple(level[column] for level in state.levels) + (token,))
            state.levels = state.levels[1:]
        state.levels.append(new)
