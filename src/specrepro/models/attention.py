"""Row-invariant attention for multi-token forwards over a cache (`hardware.row_invariant`).

A verification pass scores [last token, drafts] in one forward; greedy decoding is lossless only if each of
those rows computes what a one-token `ar` step would. Linear layers, norms and the MLP are row-wise, but
SDPA with one query and with K + 1 queries takes different kernels (GQA packing, masks, blocking), so a row's
attention output differs in the last bits. In fp32 that never changed a greedy token in our tests; in bf16 it
flips near-ties: on GSM8K, 7-8 of 10 outputs of pld, eesd and sar_draft diverged from bf16 `ar`.

`set_attention(model, "row_invariant")` sets, on that model only, an attention registered with transformers
under its own name ("specrepro_row_invariant_sdpa"; transformers' "sdpa" is left as it is) that, for a forward
of T > 1 queries after a cache, runs SDPA once per query row exactly as a one-token step would: one query, no
mask, and only the keys the row may see, gathered into one contiguous tensor. Under a plain causal mask those
are the keys up to its own position; under SPACE's group mask a real token's keys are the cached prefix and the
real tokens before it, interleaved with masks in the block, so the gather gives it exactly the keys of the
`ar` step at its position. Prefill (no cache) takes SDPA unchanged, and so does a mask that is not one 0/1
pattern for the whole batch (an additive bias, several sequences). The cost is T small attention calls per
layer instead of one.

In bf16 (and fp16) these calls, and the one-token step's, run in fp32 on the upcast query, keys and values, and
round the output back. The cast is exact, so rows stay bit-identical to the steps, and one-query calls are
cheaper in fp32 on a CPU without native bf16 (experiments/bench_attention.py prints a T-token forward's cost in
one-token steps for bf16 rows, fp32 rows and one SDPA call). With the flag `ar` itself takes this path, so
speedups are measured against the same kernels.

A caller may name the rows that must be exact (`exact_rows=` in the model call, passed down to attention):
only those take the one-row path, and the rest come from one SDPA call (in fp32 too). SPACE names its k + 1
real slots, so its (k + 1)^2-row block costs k + 1 row calls and one shared call instead of (k + 1)^2.

Grouped-query attention on CPU: for a multi-token forward with a mask, transformers copies each layer's keys
and values n_rep times (`repeat_kv`) before SDPA, because CUDA's fast kernels take no mask with GQA. torch's
CPU kernels do, bit for bit (`enable_gqa`), so our attentions let every CPU call use it (`attend`): on
SmolLM2-135M (3 KV heads for 9 query heads) the copies were ~10% of a 2-3-token verification at a 200-token
context.

Half precision on CPU: torch's bf16 SDPA kernels are several times slower there than its fp32 ones (a one-token
step of 16 sequences over a 300-token cache: ~7.8 ms against ~1.3 ms a layer, 1 thread), so every attention
call on a CPU upcasts bf16/fp16 query, keys and values to fp32 (an exact cast) and rounds the output back
(`cpu_sdpa`, set on a model as "specrepro_sdpa"). Only attention changes: the weights, the linears and the
cache stay in half precision.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.utils.import_utils import is_torch_greater_or_equal

from specrepro.errors import SpecReproError

ATTENTIONS = ("sdpa", "row_invariant")
IMPLEMENTATIONS = {"sdpa": "specrepro_sdpa", "row_invariant": "specrepro_row_invariant_sdpa"}  # transformers' names
_HALF = (torch.bfloat16, torch.float16)
_CPU_GQA = is_torch_greater_or_equal("2.5")  # SDPA's enable_gqa


def attend(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    """One SDPA call as transformers' sdpa attention makes it, with SDPA's own GQA on a CPU whatever the mask
    (module docstring) unless the model was set with `cpu_gqa=False`."""
    if not (_CPU_GQA and query.device.type == "cpu" and getattr(module, "cpu_gqa", True)):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    is_causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    out = F.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=attention_mask,
        dropout_p=dropout,
        scale=scaling,
        is_causal=query.shape[2] > 1 and attention_mask is None and is_causal,
        enable_gqa=key.shape[1] != query.shape[1],
    )
    return out.transpose(1, 2).contiguous(), None


def allowed_keys(mask: torch.Tensor | None, q_len: int, kv_len: int) -> torch.Tensor | None:
    """(q_len, kv_len) bool: the keys each query may see; None for a mask that is not a single 0/1 pattern."""
    if mask is None:  # transformers drops the mask when causal attention after a cache needs none
        rows = torch.arange(q_len).unsqueeze(1) + (kv_len - q_len)
        return torch.arange(kv_len).unsqueeze(0) <= rows
    if mask.dim() != 4 or mask.shape[:2] != (1, 1) or mask.shape[-2:] != (q_len, kv_len):
        return None
    if mask.dtype == torch.bool:
        visible = mask[0, 0].cpu()
    else:
        visible, blocked = mask[0, 0] == 0, mask[0, 0] <= torch.finfo(mask.dtype).min
        if not bool((visible | blocked).all()):  # a real bias changes scores: leave it to SDPA
            return None
        visible = visible.cpu()
    return visible if bool(visible.any(-1).all()) else None  # a row that sees nothing (padding) too


def row_key_plan(mask: torch.Tensor | None, q_len: int, kv_len: int) -> list | None:
    """Per query row, the keys it may see: a prefix length (a view, as a one-token step's cache is) or an index
    tensor; None where `allowed_keys` leaves the call to SDPA. A forward hands every layer the same mask object,
    built for that forward, so the plan is worked out once per forward and kept on that mask."""
    memo = getattr(mask, "specrepro_row_plan", None)
    if memo is not None and memo[0] == (q_len, kv_len):
        return memo[1]
    allowed = allowed_keys(mask, q_len, kv_len)
    plan = None
    if allowed is not None:
        plan = []
        for row in allowed:
            seen = row.nonzero().squeeze(1)
            plan.append(len(seen) if int(seen[-1]) + 1 == len(seen) else seen)  # keys 0 .. n-1: a prefix
    if mask is not None:
        mask.specrepro_row_plan = ((q_len, kv_len), plan)
    return plan


def _upcast(query, key, value, attention_mask):
    """q, k, v and an additive mask in fp32 (bf16/fp16 -> fp32 is exact)."""
    if attention_mask is not None and attention_mask.is_floating_point():
        attention_mask = attention_mask.float()
    return query.float(), key.float(), value.float(), attention_mask


def cpu_sdpa(module, query, key, value, attention_mask, **kwargs):
    """transformers' sdpa attention, computed in fp32 for half-precision inputs on a CPU (module docstring)."""
    dtype = query.dtype
    if query.device.type != "cpu" or dtype not in _HALF:
        return attend(module, query, key, value, attention_mask, **kwargs)
    out, weights = attend(module, *_upcast(query, key, value, attention_mask), **kwargs)
    return out.to(dtype), weights


def row_invariant_sdpa(module, query, key, value, attention_mask, exact_rows=None, **kwargs):
    """transformers' sdpa attention, one query row at a time after a cache (see the module docstring)."""
    q_len, kv_len = query.shape[2], key.shape[2]
    if kv_len == q_len:  # prefill: no cache
        return cpu_sdpa(module, query, key, value, attention_mask, **kwargs)
    one_token_step = q_len == 1 and attention_mask is None  # it sees every cached key
    plan = None if one_token_step else row_key_plan(attention_mask, q_len, kv_len)
    if plan is None and not one_token_step:
        return cpu_sdpa(module, query, key, value, attention_mask, **kwargs)
    dtype = query.dtype
    if dtype in _HALF:
        query, key, value, attention_mask = _upcast(query, key, value, attention_mask)
    if one_token_step:
        return attend(module, query, key, value, None, **kwargs)[0].to(dtype), None
    batched = None
    if exact_rows is not None:  # the other rows in one call
        batched = attend(module, query, key, value, attention_mask, **kwargs)[0]
    rows = []
    for i in range(q_len) if batched is None else exact_rows.tolist():
        seen = plan[i]
        if isinstance(seen, int):
            row_keys, row_values = key[:, :, :seen], value[:, :, :seen]
        else:
            index = seen.to(key.device)
            row_keys, row_values = key.index_select(2, index), value.index_select(2, index)
        out, _ = attend(module, query[:, :, i : i + 1], row_keys, row_values, None, **kwargs)
        rows.append(out)
    exact = torch.cat(rows, dim=1)
    if batched is None:
        return exact.to(dtype), None
    batched[:, exact_rows] = exact
    return batched.to(dtype), None


for _kind, _function in (("sdpa", cpu_sdpa), ("row_invariant", row_invariant_sdpa)):  # new names: "sdpa" stays
    AttentionInterface.register(IMPLEMENTATIONS[_kind], _function)
    AttentionMaskInterface.register(IMPLEMENTATIONS[_kind], sdpa_mask)  # the masks "sdpa" gets


def set_attention(model, kind: str, cpu_gqa: bool = True) -> str:
    """Make `model` (a transformers model) attend with our `kind`, and no other model; returns the name it is set
    under. `cpu_gqa=False` keeps transformers' own GQA choice (K/V copies on CPU), for
    experiments/bench_attention.py."""
    if kind not in ATTENTIONS:
        raise SpecReproError(f"attention '{kind}' is not one of {', '.join(ATTENTIONS)}")
    model.set_attn_implementation(IMPLEMENTATIONS[kind])
    for module in model.modules():
        if hasattr(module, "num_key_value_groups"):  # an attention layer (what transformers' sdpa checks)
            module.cpu_gqa = cpu_gqa
    return IMPLEMENTATIONS[kind]
