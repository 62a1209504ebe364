"""Verification and cache rollback shared by every draft-then-verify method.

- `greedy_verify`: longest prefix of the drafts that equals the target's argmax, plus the target's token.
- `speculative_verify`: speculative sampling for chains (Leviathan et al. 2023; Chen et al. 2023):
  accept draft x_i with probability min(1, p(x_i)/q(x_i)); on the first rejection draw from
  norm(max(p - q, 0)); if every draft is accepted draw a bonus token from p. Deterministic drafters
  (prompt lookup, ...) pass q = None, i.e. q is one-hot on the draft.
- `crop_cache`: roll a transformers cache back to a length after a rejection.
- `keep_cache_positions`: keep chosen positions of a cache (drafts interleaved with real tokens, SPACE).
"""

from __future__ import annotations

import torch

from specrepro.decoding.sampling import Sampling, probs, sample


def greedy_verify(drafts: torch.Tensor, target_logits: torch.Tensor) -> tuple[list[int], int]:
    """drafts: (k,), target_logits: (k + 1, vocab) at [last token, drafts...]. Returns (tokens, n_accepted)."""
    choice = target_logits.argmax(-1)
    k = drafts.shape[0]
    mismatch = (drafts != choice[:k]).nonzero()
    n_accepted = int(mismatch[0]) if mismatch.numel() else k
    return choice[: n_accepted + 1].tolist(), n_accepted


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
    rejected = (u * q_draft > p_draft).nonzero()  # u < p/q  <=>  accept
    n_accepted = int(rejected[0]) if rejected.numel() else k
    if n_accepted == k or not resample_residual:
        last = sample(p[n_accepted], rng)  # bonus token from p
    else:
        if draft_probs is not None:
            residual = (p[n_accepted] - draft_probs[n_accepted]).clamp_min(0)
        else:
            residual = p[n_accepted].clone()
            residual[drafts[n_accepted]] = 0
        total = residual.sum()
        # total == 0 only when p == q, where rejection has probability 0; fall back to p.
        last = sample(residual / total if total > 0 else p[n_accepted], rng)
    return drafts[:n_accepted].tolist() + [int(last)], n_accepted


def cache_length(cache, layer: int = 0) -> int:
    return cache.get_seq_length(layer)


def crop_cache(cache, length: int) -> None:
    """Cut every layer of a transformers DynamicCache back to `length` positions.

    Layers are cropped one by one to an absolute length, so caches whose layers hold different lengths
    (layer-skipping drafts write only some layers) are rolled back correctly too.
    """
    for layer in cache.layers:
        if getattr(layer, "is_initialized", False):
            extra = layer.keys.shape[-2] - length
            if extra > 0:
                layer.crop(-extra)


def keep_cache_positions(cache, positions: torch.Tensor) -> None:
    """Keep only `positions` (ascending indices along the sequence axis) in every layer of a DynamicCache."""
    for layer in cache.layers:
        if getattr(layer, "is_initialized", False):
            layer.keys = layer.keys.index_select(-2, positions)
            layer.values = layer.values.index_select(-2, positions)
