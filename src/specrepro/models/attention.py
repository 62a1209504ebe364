"""Row-invariant attention for multi-token forwards over a cache (`hardware.row_invariant`).

A verification pass scores [last token, drafts] in one forward; greedy decoding is lossless only if each of
those rows computes what a one-token `ar` step would. Linear layers, norms and the MLP are row-wise, but
SDPA with one query and with K + 1 queries takes different kernels (GQA packing, masks, blocking), so a row's
attention output differs in the last bits. In fp32 that never changed a greedy token in our tests; in bf16 it
flips near-ties: on GSM8K, 7-8 of 10 outputs of pld, eesd and sar_draft diverged from bf16 `ar`.

`set_attention("row_invariant")` replaces transformers' "sdpa" attention with a wrapper that, for a forward
of T > 1 queries after a cache with a plain causal mask, runs SDPA once per query row exactly as a one-token
step would (one query, no mask, the keys up to its own position). Prefill (no cache) and any other mask
(SPACE's groups) take SDPA unchanged. The cost is T small attention calls per layer instead of one.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from specrepro.errors import SpecReproError

ATTENTIONS = ("sdpa", "row_invariant")


def _is_plain_causal(mask: torch.Tensor | None, q_len: int, kv_len: int) -> bool:
    """True for no mask, or a boolean mask letting query i see exactly keys 0 .. kv_len - q_len + i."""
    if mask is None:
        return True
    if mask.dtype != torch.bool or mask.shape[-2:] != (q_len, kv_len):
        return False
    rows = torch.arange(q_len, device=mask.device).unsqueeze(1) + (kv_len - q_len)
    causal = torch.arange(kv_len, device=mask.device).unsqueeze(0) <= rows
    return bool((mask == causal).all())


def row_invariant_sdpa(module, query, key, value, attention_mask, **kwargs):
    """transformers' sdpa attention, one query row at a time after a cache (see the module docstring)."""
    q_len, kv_len = query.shape[2], key.shape[2]
    if q_len == 1 or kv_len == q_len or not _is_plain_causal(attention_mask, q_len, kv_len):
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    rows = []
    for i in range(q_len):
        end = kv_len - q_len + i + 1
        out, _ = sdpa_attention_forward(module, query[:, :, i:i + 1], key[:, :, :end], value[:, :, :end], None,
                                        **kwargs)
        rows.append(out)
    return torch.cat(rows, dim=1), None


def set_attention(kind: str) -> str:
    """Make every model in this process that uses "sdpa" attention run `kind`; returns it."""
    if kind not in ATTENTIONS:
        raise SpecReproError(f"attention '{kind}' is not one of {', '.join(ATTENTIONS)}")
    AttentionInterface.register("sdpa", row_invariant_sdpa if kind == "row_invariant" else sdpa_attention_forward)
    return kind
