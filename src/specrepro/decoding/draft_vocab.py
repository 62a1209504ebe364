"""Reduced draft vocabularies (FR-Spec, Zhao et al. 2025; EAGLE-3): a draft head scores only V frequent tokens.

On small targets with large vocabularies (SmolLM2-135M: 49k tokens, the LM head is a fifth of a forward) the
draft's output layer dominates its cost. A head over V << |vocab| tokens keeps the method lossless: the target
verifies over the whole vocabulary, so greedy output is unchanged, and a draft distribution q that is zero
outside the V tokens keeps speculative sampling exact (the residual max(p - q, 0) restores their mass).
A head holds its draft vocabulary as a `vocab_ids` buffer (V token ids, most frequent first) or None.
"""

from __future__ import annotations

import functools
from collections import Counter

import torch
from torch import nn

from specrepro.decoding.sampling import Sampling, probs, sample

MISSING = -100  # the draft index of a token outside the draft vocabulary (cross-entropy's ignore_index)


def token_ids(vocab_ids: torch.Tensor | None, draft_index: torch.Tensor) -> torch.Tensor:
    """Token ids of draft-vocabulary indices (e.g. an argmax of the head's logits). `take`, as indexing by a 0-d
    tensor reads it to the host (a wait on a GPU)."""
    return draft_index if vocab_ids is None else vocab_ids.take(draft_index)


def draft_index(vocab_ids: torch.Tensor | None, tokens: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Draft-vocabulary indices of token ids; MISSING where a token is outside the draft vocabulary."""
    if vocab_ids is None:
        return tokens
    index = torch.full((vocab_size,), MISSING, dtype=torch.long, device=tokens.device)
    index[vocab_ids] = torch.arange(len(vocab_ids), device=tokens.device)
    return index[tokens]


def head_rows(lm_head: nn.Linear, vocab_ids: torch.Tensor) -> nn.Linear:
    """A copy of `lm_head`'s rows of the draft vocabulary, as a head of its own (frozen or trained by its owner)."""
    weight = lm_head.weight
    rows = nn.Linear(lm_head.in_features, len(vocab_ids), bias=False, device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        rows.weight.copy_(weight[vocab_ids.to(weight.device)])
    return rows


def full_vocab_logits(vocab_ids: torch.Tensor | None, logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Draft logits over the target's whole vocabulary: -inf outside the draft vocabulary."""
    if vocab_ids is None:
        return logits
    full = logits.new_full((*logits.shape[:-1], vocab_size), float("-inf"))
    full[..., vocab_ids] = logits
    return full


def choose_draft_token(
    vocab_ids: torch.Tensor | None, logits: torch.Tensor, vocab_size: int, sampling: Sampling, rng
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """One draft token from a head's logits over its draft vocabulary: (token id, q over the target's vocabulary
    or None when greedy, the draft's top-1 probability), each on the logits' device, read by no one here.
    Greedy drafting never leaves the V draft logits."""
    top1 = logits.float().softmax(-1).max()  # -inf outside the draft vocabulary adds nothing
    if sampling.greedy:
        return token_ids(vocab_ids, logits.argmax(-1)), None, top1
    q = probs(full_vocab_logits(vocab_ids, logits, vocab_size), sampling)
    return sample(q, rng), q, top1


def alternatives(
    vocab_ids: torch.Tensor | None, logits: torch.Tensor, chosen: torch.Tensor, count: int
) -> torch.Tensor:
    """Token ids of the `count` best draft tokens for `logits` other than `chosen`, best first (on the device: a
    stable sort moves `chosen` behind the others, where a boolean mask would wait for it to count them)."""
    count = min(count, logits.shape[-1] - 1)
    best = token_ids(vocab_ids, logits.topk(count + 1).indices)
    return best[torch.argsort((best == chosen).to(torch.uint8), stable=True)[:count]]


def _strings(value):
    """Every string inside a JSON value (a row, a conversation, ...), depth first."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _strings(item)
    elif isinstance(value, list):
        for item in value:
            yield from _strings(item)


def corpus_file(cfg) -> dict[str, str]:
    """The corpus a method config's draft vocabulary is ranked from (`draft_vocab_corpus`), as `Decoder.read_files`
    names it; none without a draft vocabulary."""
    return {"draft_vocab_corpus": cfg.draft_vocab_corpus} if cfg.draft_vocab else {}


def corpus_ranking(tokenizer, path: str) -> torch.Tensor:
    """Token ids by their count in a text corpus (every string of every row of a bundled or local file), most
    frequent first, then by id; tokens the corpus lacks are left out. FR-Spec ranks by a general corpus too."""
    from specrepro.data.files import HF_PREFIX, resolve_path

    if path.startswith(HF_PREFIX):
        return _ranking(tokenizer, path, 0, 0)
    file = resolve_path(path)
    return _ranking(tokenizer, path, file.stat().st_size, file.stat().st_mtime_ns)  # ranked again once edited


@functools.lru_cache(maxsize=4)
def _ranking(tokenizer, path: str, size: int, mtime_ns: int) -> torch.Tensor:
    from specrepro.data.files import read_rows

    texts = [text for row in read_rows(path) for text in _strings(row)]
    counts = Counter(token for ids in tokenizer(texts, add_special_tokens=False)["input_ids"] for token in ids)
    return torch.tensor(sorted(counts, key=lambda token: (-counts[token], token)), dtype=torch.long)


def with_prompt_tokens(frequent: torch.Tensor, prompt_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """A prompt's draft vocabulary: the `frequent` token ids, then the prompt's own tokens that are not among
    them (a summary copies names from its article), ids below `vocab_size` only."""
    frequent = frequent[frequent < vocab_size]
    prompt = prompt_ids.flatten().unique().to(frequent.device)
    return torch.cat([frequent, prompt[~torch.isin(prompt, frequent) & (prompt < vocab_size)]])


def prompt_head(lm_head: torch.nn.Linear, frequent: torch.Tensor, prompt_ids: torch.Tensor):
    """A prompt's draft vocabulary (`with_prompt_tokens`) and an LM head over it: `lm_head`'s rows of those
    tokens, so the draft scores V tokens instead of the whole vocabulary. Returns (vocab_ids, head)."""
    weight = lm_head.weight
    vocab_ids = with_prompt_tokens(frequent, prompt_ids, weight.shape[0]).to(weight.device)
    head = torch.nn.Linear(weight.shape[1], len(vocab_ids), bias=False, device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        head.weight.copy_(weight[vocab_ids])
    return vocab_ids, head
