"""Verification and cache rollback shared by every draft-then-verify method.

- `greedy_verify`: longest prefix of the drafts that equals the target's argmax, plus the target's token.
- `speculative_verify`: speculative sampling for chains (Leviathan et al. 2023; Chen et al. 2023):
  accept draft x_i with probability min(1, p(x_i)/q(x_i)); on the first rejection draw from
  norm(max(p - q, 0)); if every draft is accepted draw a bonus token from p. Deterministic drafters
  (prompt lookup, ...) pass q = None, i.e. q is one-hot on the draft.
- `tree_verify`: the same for a token tree (siblings are alternatives for one position): greedy walks the
  target's argmax down the tree; sampling runs one speculative-sampling stage per child, in order, against
  what the earlier stages left of p (SpecInfer's multi-step speculative sampling, Miao et al. 2024).
- `tree_attention`: the attention pattern and positions of a tree verification (a node sees its ancestors).
- `crop_cache`: roll a transformers cache back to a length after a rejection.
- `keep_tree_path`: keep a tree verification's accepted path in the cache.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicSlidingWindowLayer, StaticLayer

from specrepro.decoding.device import upload
from specrepro.decoding.sampling import Sampling, exponential_noise, probs, sample


def greedy_verify(drafts: torch.Tensor, target_logits: torch.Tensor) -> tuple[list[int], int]:
    """drafts: (k,), target_logits: (k + 1, vocab) at [last token, drafts...]. Returns (tokens, n_accepted).
    The target's choices and the drafts are read to the host at once (one wait on a GPU)."""
    k = drafts.shape[0]
    choice, drafted = read_choices(drafts, target_logits)
    n_accepted = next((i for i in range(k) if drafted[i] != choice[i]), k)
    return choice[: n_accepted + 1], n_accepted


def read_choices(drafts: torch.Tensor, target_logits: torch.Tensor) -> tuple[list[int], list[int]]:
    """(the target's argmax at every row, the drafts), read to the host at once: one wait on a GPU."""
    read = torch.cat([target_logits.argmax(-1), drafts.to(target_logits.device)]).tolist()
    return read[: len(target_logits)], read[len(target_logits) :]


def speculative_verify(
    drafts: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_logits: torch.Tensor,
    sampling: Sampling,
    rng: torch.Generator,
    resample_residual: bool = True,
) -> tuple[list[int], int]:
    """Lossless acceptance for sampling. draft_probs: (k, vocab) warped q, or None for one-hot drafts.

    `resample_residual=False` draws the token after a rejection from p instead of norm(max(p - q, 0)), as
    SPACE's Algorithm 1 (line 18) does: that does not preserve the target distribution when q != p.
    """
    if sampling.greedy:
        return greedy_verify(drafts, target_logits)
    p = probs(target_logits, sampling)  # (k + 1, vocab)
    k = drafts.shape[0]
    rows = torch.arange(k, device=drafts.device)
    p_draft = p[rows, drafts]
    q_draft = draft_probs[rows, drafts] if draft_probs is not None else torch.ones_like(p_draft)
    u = torch.rand(k, generator=rng, device=drafts.device)
    if k == 0:  # nothing drafted: a token from p
        return [int(sample(p[0], rng))], 0
    # on the device, read once at the end: n_accepted = the drafts before the first rejection (u < p/q <=> accept;
    # torch.rand can draw u = 0, which must not accept a token p rules out)
    n_accepted = ((u * q_draft <= p_draft) & (p_draft > 0)).cumprod(0).sum().view(1)
    at = p.index_select(0, n_accepted)[0]  # p where the first rejection is (or the bonus row)
    draw_from = at
    if resample_residual:  # norm(max(p - q, 0)) after a rejection, p for the bonus token
        rejected = n_accepted.clamp_max(k - 1)
        if draft_probs is not None:
            residual = (at - draft_probs.index_select(0, rejected)[0]).clamp_min(0)
        else:
            residual = at.scatter(0, drafts.index_select(0, rejected), 0.0)
        total = residual.sum()
        # total == 0 only when p == q, where rejection has probability 0: p then too
        draw_from = torch.where((n_accepted[0] == k) | (total <= 0), at, residual / total)
    last = sample(draw_from, rng)
    read = torch.cat([drafts, last.view(1), n_accepted]).tolist()  # the round's one read
    n = read[-1]
    return read[:n] + [read[k]], n


def additive_mask(allow: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A (1, 1, q, kv) float mask for transformers' 4-D attention_mask: 0 where allowed, the dtype's min elsewhere."""
    mask = torch.zeros(allow.shape, dtype=dtype, device=allow.device)
    return mask.masked_fill(~allow, torch.finfo(dtype).min)[None, None]


def tree_attention(parents: list[int], past: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows [last token, node 0, ..., node n-1] of a tree verification after `past` cached positions: (allowed
    keys (n + 1, past + n + 1) bool, position ids (n + 1,)). A node sees the cache, the last token, its
    ancestors and itself; parents[i] is node i's parent, -1 for the last token."""
    n = len(parents)
    allow = torch.zeros(n + 1, past + n + 1, dtype=torch.bool)
    allow[:, : past + 1] = True
    depth = [0] * (n + 1)
    for i, parent in enumerate(parents):
        if not -1 <= parent < i:
            raise ValueError(f"node {i}'s parent {parent} must be -1 or an earlier node")
        allow[i + 1] = allow[parent + 1]
        allow[i + 1, past + i + 1] = True
        depth[i + 1] = depth[parent + 1] + 1
    return allow, past + torch.tensor(depth)


def tree_verify(
    drafts: torch.Tensor,
    parents: list[int],
    draft_probs: torch.Tensor | None,
    target_logits: torch.Tensor,
    sampling: Sampling,
    rng: torch.Generator,
) -> tuple[list[int], list[int]]:
    """Accept the longest path of a draft tree. drafts: (n,), parents as in `tree_attention`, draft_probs: (n,
    vocab) the q each node was drawn from (None: every node is a deterministic draft), target_logits: (n + 1,
    vocab) at [last token, nodes...]. Returns (accepted drafts + the target's token, accepted node indices).

    Sampling: at a node, each child x in turn is accepted with probability min(1, p(x)/q(x)); on a rejection p
    becomes norm(max(p - q, 0)), the distribution of what that stage would have emitted, and the next child is
    tried against it; after the last child the token is drawn from what is left. Every stage is exact speculative
    sampling against the current p, so the emitted token is distributed as p. Siblings must be drafted without
    seeing each other's acceptance (deterministic alternatives, or draws from their q). A node's stages run on the
    device (`node_choice`), read once: one wait on a GPU for each node the accepted path visits.
    """
    children: dict[int, list[int]] = {}
    for i, parent in enumerate(parents):
        children.setdefault(parent, []).append(i)
    if sampling.greedy:
        choices, tokens = read_choices(drafts, target_logits)
        path, node = [], -1
        while match := [c for c in children.get(node, []) if tokens[c] == choices[node + 1]]:
            node = match[0]
            path.append(node)
        return [tokens[i] for i in path] + [choices[node + 1]], path
    path, node = [], -1
    noise = exponential_noise(target_logits[0].float(), rng)  # the final token's, whichever node draws it
    while True:
        p = probs(target_logits[node + 1], sampling)
        kids = children.get(node, [])
        choice, last = node_choice(p, drafts, draft_probs, kids, rng, noise)
        read = torch.cat([choice, last, drafts if node == -1 else drafts[:0]]).tolist()  # the drafts with the root's
        if node == -1:
            tokens = read[2:]
        if read[0] == len(kids):
            return [tokens[i] for i in path] + [read[1]], path
        node = kids[read[0]]
        path.append(node)


def node_choice(
    p: torch.Tensor,
    drafts: torch.Tensor,
    draft_probs: torch.Tensor | None,
    kids: list[int],
    rng: torch.Generator,
    noise: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`tree_verify`'s stages at one node, on the device: child j of `kids` is tried against what stages 1..j-1 left
    of p; returns (the first accepted child's position in `kids`, or len(kids) when none was, (1,); a token drawn
    from what the last stage left with `noise`, (1,), used only when none was accepted). Every child gets a uniform
    draw, so a stage after the accepted one draws but decides nothing."""
    x = drafts.index_select(0, upload(kids, drafts.device))
    u = torch.rand(len(kids), generator=rng, device=p.device)
    if draft_probs is None:  # one-hot q: each stage takes its token out of p, so all of them are scalars
        return deterministic_choice(p, x, u, noise)
    # r is what the stages left of p, unnormalized (its mass z): stage j accepts x when u_j q_j(x) z <= r(x)
    r, z = p, p.sum().view(1)
    first = torch.full((1,), len(kids), device=p.device)
    accepted = torch.zeros((1,), dtype=torch.bool, device=p.device)
    for j, kid in enumerate(kids):
        q = draft_probs[kid]
        r_x = r.gather(0, x[j : j + 1])
        take = (u[j] * q.gather(0, x[j : j + 1]) * z <= r_x) & (r_x > 0) & ~accepted
        first = torch.where(take, j, first)
        accepted |= take
        residual = torch.addcmul(r, q, z, value=-1).clamp_min_(0)  # max(p_j - q_j, 0), times z
        residual_z = residual.sum().view(1)
        # r moves on to the residual unless the stage could not reject (p_j == q_j) or a child was accepted
        stay = accepted | (residual_z <= 0)
        r, z = torch.where(stay, r, residual), torch.where(stay, z, residual_z)
    return first, sample(r, rng, noise).view(1)


def deterministic_choice(
    p: torch.Tensor, x: torch.Tensor, u: torch.Tensor, noise: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`node_choice` for deterministic children x: norm(max(p - onehot(x_i), 0)) is p without x_i, renormalized, so
    stage j accepts x_j when u_j <= p(x_j) / (the mass stages 1..j-1 left), and a token an earlier stage took out
    has no mass left. What the last stage left is p without every x_i."""
    earlier = torch.ones(len(x), len(x), dtype=torch.bool, device=p.device).tril(-1)
    repeated = ((x[:, None] == x[None, :]) & earlier).any(1)
    mass = p.gather(0, x).masked_fill(repeated, 0.0)
    left = p.sum() - (mass.cumsum(0) - mass)
    take = (u * left <= mass) & (mass > 0)
    first = torch.cat([take, take.new_ones(1)]).int().argmax().view(1)  # len(x) when none was accepted
    return first, sample(p.scatter(0, x, 0.0), None, noise).view(1)


def crop_cache(cache, length: int) -> None:
    """Cut every layer of a transformers cache back to `length` positions: a DynamicCache drops the rows, a
    StaticCache moves its write position back (the rows past it are masked out and overwritten later).

    Layers are cropped one by one to an absolute length, so caches whose layers hold different lengths
    (layer-skipping drafts write only some layers) are rolled back correctly too. A static layer's write position
    is clamped where it lives, in one launch for all of them: reading each to the host stalls a GPU once a layer
    (compiled `ar` on the 30-layer embedded model made 32 device-to-host copies a token on an H200). A sliding layer
    that records its past (`steps.rollback_cache`) is trimmed to its window too, rejected rows or not.
    """
    positions = [
        layer.cumulative_length for layer in cache.layers if type(layer) is StaticLayer and layer.is_initialized
    ]
    if positions:
        torch._foreach_clamp_max_(positions, length)
    for layer in cache.layers:
        if type(layer) is not StaticLayer and getattr(layer, "is_initialized", False):
            extra = int(layer.get_seq_length()) - length
            trims = getattr(layer, "record_past", False)
            if extra > 0 or (extra == 0 and trims):
                layer.crop(-extra)
            if trims and layer.keys.shape[-2] < min(layer.cumulative_length, layer.sliding_window - 1):
                raise RuntimeError(f"cropped a sliding layer to {length} positions, behind the keys it had dropped")


def held_offset(layer) -> int:
    """The position of a cache layer's first row: past a sliding layer's window, the keys it dropped; else 0."""
    if isinstance(layer, DynamicSlidingWindowLayer):
        return layer.cumulative_length - layer.keys.shape[-2]
    return 0


def keep_tree_path(cache, committed: int, path: list[int]) -> None:
    """After a tree verification appended its n + 1 rows at position `committed` - 1 (the last committed token,
    then the nodes), keep the prefix, that token and the accepted `path` (node indices): the path's rows after the
    nodes it shares with the chain 0, 1, ... move down in place and the rest is cropped, so a round costs a copy of
    a few rows, not of the whole cache, and no read of the device. Rows are found by position less the layer's
    `held_offset`."""
    start = next((i for i, node in enumerate(path) if node != i), len(path))  # a chain's path is all prefix
    if start < len(path):
        sources = {}  # the path's rows, by the row that holds position `committed`
        for layer in cache.layers:
            if getattr(layer, "is_initialized", False):
                row = committed - held_offset(layer)
                if row not in sources:
                    sources[row] = upload([row + node for node in path[start:]], layer.keys.device)
                target = slice(row + start, row + len(path))
                layer.keys[..., target, :] = layer.keys.index_select(-2, sources[row])
                layer.values[..., target, :] = layer.values.index_select(-2, sources[row])
                if getattr(layer, "is_indexer_initialized", False):  # a sparse-attention indexer's keys (DSA's)
                    layer.indexer_keys[:, target] = layer.indexer_keys.index_select(1, sources[row])
                if getattr(layer, "indexer_position_ids", None) is not None:
                    positions = layer.indexer_position_ids
                    positions[..., target] = positions.index_select(-1, sources[row])
    crop_cache(cache, committed + len(path))
