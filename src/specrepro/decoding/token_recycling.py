"""`token_recycling`: Token Recycling (Luo et al., 2024, "Turning Trash into Treasure: Accelerating Inference of
Large Language Models with Token Recycling"): draft a token tree from the target's own earlier candidates.

Training-free. An adjacency matrix M (vocab x k) holds, for every token, the k most likely next tokens the target
gave after it the last time it was an input row (the "trash" candidates of earlier forwards). Every
target forward updates it from all of its rows, accepted or not: M[x_i] <- top-k(logits_i). Drafting
fills a static tree template breadth-first: the root is the last committed token, and a node that is
its parent's r-th child takes M[parent's token][r]. The tree is verified in one forward with the shared
tree attention and `tree_verify` (greedy: the longest path the target's argmax follows; sampling: one speculative
stage per child, every node a deterministic draft), so the output is the target's whatever M holds.

The template is given level by level: level d lists, for each node of level d - 1 in breadth-first order (level
0: the root alone), how many children it has; its children are ranks 0, 1, ... of its token's row of M. A row not
yet filled (-1) drafts nothing below it. The paper's template (80 nodes, depth 6, k = 8) is conf/method/
token_recycling.yaml's. M persists across generations in the paper ("hot start"); `persist=false`
starts each generation from an empty M. Either way M only chooses drafts, never what is committed.

Beyond the paper's code (Spec-Bench's evaluation/inference_recycling.py, whose "2.2.2" template is PAPER_TREE):
the prefill's last row updates M before the first draft. That code prefills all but the last prompt token without
touching M and makes the last one the first tree's root, so M learns its row only after that tree; it starts M at
zeros (token 0 drafted everywhere) where -1 here drafts nothing.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import List

import torch

from specrepro.decoding.device import upload
from specrepro.decoding.controllers import DraftLengthController, FixedLength
from specrepro.decoding.draft_verify import DraftVerifyDecoder, Proposal, TargetOutput
from specrepro.decoding.sampling import Sampling
from specrepro.errors import SpecReproError
from specrepro.registry import MethodConfig, register_method

# The paper's static tree (80 nodes, depth 6): children per node, level by level, breadth-first.
PAPER_TREE = [
    [8],
    [8, 4, 3, 2, 1, 1, 1, 1],
    [8, 3, 2, 1, 1, 1, 1, 1, 2, 1, 0, 0, 1, 0, 0, 1, 0, 1, 1, 0, 0],
    [5, 2, 1, 1, 1, 0, 0, 0, 1, 0, 0, 1, 0, 0, 0, 0, 0, 0, 1, 0, 0, 1, 1, 0, 0],
    [3, 1, 1, 0, 0, 1, 0, 0, 0, 0, 1, 0, 1, 0, 0],
    [2, 0, 0, 1, 0, 0, 0, 0],
]


@dataclass
class TokenRecyclingConfig(MethodConfig):
    name: str = "token_recycling"
    candidates: int = 8  # k: next-token candidates M keeps per token (the paper's 8)
    tree: List[List[int]] = field(default_factory=lambda: [list(level) for level in PAPER_TREE])
    persist: bool = True  # M carries over from one generation to the next (the paper's hot start)

    def __post_init__(self):
        self.require(self.candidates >= 1, "candidates", ">= 1")
        try:
            tree_template(self.tree, self.candidates)
        except ValueError as error:
            raise SpecReproError(f"method.tree: {error}") from None


@dataclass(frozen=True)
class TreeTemplate:
    """A static draft tree, nodes breadth-first: each node's parent (-1: the root), rank in its parent's row of M
    and depth (1 for the root's children)."""

    parents: list[int]
    ranks: list[int]
    depths: list[int]


def tree_template(levels: list[list[int]], candidates: int) -> TreeTemplate:
    """The template of a tree given level by level as children counts (module docstring); ValueError if the
    counts do not match the previous level's nodes or a node asks for more than `candidates` children."""
    parents, ranks, depths = [], [], []
    previous = [-1]
    for depth, counts in enumerate(levels, start=1):
        if len(counts) != len(previous):
            raise ValueError(
                f"level {depth} gives {len(counts)} children counts for the {len(previous)} nodes of level {depth - 1}"
            )
        if any(not 0 <= count <= candidates for count in counts):
            raise ValueError(f"level {depth}: every children count must be between 0 and candidates ({candidates})")
        current = []
        for parent, count in zip(previous, counts):
            for rank in range(count):
                current.append(len(parents))
                parents.append(parent)
                ranks.append(rank)
                depths.append(depth)
        previous = current
    if not parents:
        raise ValueError("the tree has no node")
    return TreeTemplate(parents, ranks, depths)


def draft_tree(matrix: torch.Tensor, last_token, template: TreeTemplate, max_depth: int) -> tuple[list[int], list[int]]:
    """Fill `template` from the adjacency `matrix` (vocab, k) below `last_token` (an int, or a 0-d tensor on the
    matrix's device) (draft tokens, parents as `tree_attention` reads them). Nodes deeper than `max_depth`, on a
    row not yet filled (-1), or below such a node are left out. Filled on the matrix's device a level at a time
    (a gather of each node's row and rank), then read once: on a GPU, reading each parent token's row (tens a
    round for the paper's 80-node tree) would wait for the device each time."""
    layout = upload([template.parents, template.ranks], matrix.device)
    tokens = torch.full((len(template.parents),), -1, dtype=matrix.dtype, device=matrix.device)
    filled = torch.zeros(len(template.parents), dtype=torch.bool, device=matrix.device)
    start = 0
    for depth, level in itertools.groupby(template.depths):  # breadth-first: each level's nodes are contiguous
        end = start + len(list(level))
        if depth > max_depth:
            break
        parents, ranks = layout[0, start:end], layout[1, start:end]
        if depth == 1:
            above = torch.as_tensor(last_token, device=matrix.device).expand(end - start)
            ok = torch.ones_like(filled[start:end])
        else:
            above, ok = tokens[parents], filled[parents]
        tokens[start:end] = matrix[above.clamp_min(0), ranks]
        filled[start:end] = ok & (tokens[start:end] >= 0)
        start = end
    read, filled = torch.stack([tokens, filled.to(tokens.dtype)]).tolist()  # the draft's one read
    drafts: list[int] = []
    parents: list[int] = []
    placed: list[int] = []  # template node -> its index among the drafts, -1 if left out
    for parent, token, ok in zip(template.parents, read, filled):
        if not ok:
            placed.append(-1)
            continue
        placed.append(len(drafts))
        drafts.append(token)
        parents.append(placed[parent] if parent >= 0 else -1)
    return drafts, parents


def recycle(matrix: torch.Tensor, input_ids: torch.Tensor, logits: torch.Tensor) -> None:
    """M[x_i] <- top-k(logits_i) for every row i of a forward ; `logits` (rows, vocab) are the forward's
    last rows, `input_ids` (n,) its inputs. A token that is the input of several rows keeps the last one's."""
    rows = logits.shape[0]
    matrix[input_ids[-rows:]] = logits.topk(matrix.shape[1], dim=-1).indices.to(matrix.dtype)


@dataclass
class RecyclingState:
    matrix: torch.Tensor  # M (vocab, k): -1 where no forward has filled a row yet


@register_method(TokenRecyclingConfig)
class TokenRecyclingDecoder(DraftVerifyDecoder):
    name = "token_recycling"
    compilable = True

    def __init__(self, model, tokenizer, cfg: TokenRecyclingConfig, steps=None):
        super().__init__(model, tokenizer, steps)
        self.cfg = cfg
        self.template = tree_template(cfg.tree, cfg.candidates)
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        # the hot-start matrix every generation shares when `persist` (filled in place, never reassigned)
        self.shared_matrix = self.empty_matrix() if cfg.persist else None

    @classmethod
    def from_config(cls, cfg: TokenRecyclingConfig, target, ctx) -> "TokenRecyclingDecoder":
        return cls(target.model, target.tokenizer, cfg)

    def empty_matrix(self) -> torch.Tensor:
        return torch.full((self.vocab_size, self.cfg.candidates), -1, dtype=torch.long, device=self.device)

    def new_controller(self) -> DraftLengthController:
        return FixedLength(max(self.template.depths))  # the tree's depth; the loop caps it at the budget

    def carried(self) -> torch.Tensor | None:
        return self.shared_matrix.clone() if self.cfg.persist else None

    def restore(self, carried: torch.Tensor | None) -> None:
        if carried is not None:
            self.shared_matrix.copy_(carried)

    @property
    def verifies_trees(self) -> bool:
        return True

    @property
    def max_step_width(self) -> int:
        return 1 + len(self.template.parents)

    def start(self, prompt_ids, cache, length) -> RecyclingState:
        return RecyclingState(self.shared_matrix if self.cfg.persist else self.empty_matrix())

    def target_forward(
        self, state: RecyclingState, input_ids, cache, logits_to_keep=0, tree=None, past=None
    ) -> TargetOutput:
        output = super().target_forward(state, input_ids, cache, logits_to_keep, tree, past)
        recycle(state.matrix, input_ids[0], output.logits[0])
        return output

    def propose(self, state: RecyclingState, tokens, k, sampling: Sampling, rng, controller) -> Proposal:
        drafts, parents = draft_tree(state.matrix, tokens[0, -1], self.template, k)
        if not drafts:
            return Proposal(tokens.new_empty(0))
        return Proposal(upload(drafts, tokens.device), None, parents)  # deterministic drafts: q is one-hot on each
