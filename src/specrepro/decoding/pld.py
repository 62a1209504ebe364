"""`pld`: prompt-lookup decoding (Saxena 2023): draft the tokens that followed the last n-gram's earlier occurrence.

Training-free. The n-gram (longest first, `max_ngram` down to `min_ngram`) is searched in the prompt and
the generated text; up to `num_pred_tokens` tokens after the match are the draft. Which earlier occurrence
(`match`): `saxena`, the default, as his code (apoorvumang/prompt-lookup-decoding's find_candidate_pred_tokens, the
one Spec-Bench runs): the earliest whose continuation starts before the last n-gram; `earliest`, transformers'
PromptLookupCandidateGenerator: the earliest with any continuation; `latest`, beyond the paper: the latest with any,
which drafts from the most recent repetition (on Spec-Bench here a higher MAT). With no match Spec-Bench's copy
drafts a dummy token (id 100); this drafts nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from specrepro.decoding.device import upload
from specrepro.decoding.controllers import CONTROLLERS, DraftLengthController, build_controller
from specrepro.decoding.draft_verify import DraftVerifyDecoder, Proposal
from specrepro.decoding.sampling import Sampling
from specrepro.registry import MethodConfig, register_method


MATCHES = ("saxena", "earliest", "latest")


@dataclass
class PLDConfig(MethodConfig):
    name: str = "pld"
    max_ngram: int = 3
    min_ngram: int = 1
    num_pred_tokens: int = 10  # draft length (the controller's start value)
    controller: str = "fixed"  # fixed | heuristic
    match: str = "saxena"  # which earlier occurrence drafts: saxena | earliest | latest (module docstring)

    def __post_init__(self):
        self.require(self.max_ngram >= 1, "max_ngram", ">= 1")
        self.require(1 <= self.min_ngram <= self.max_ngram, "min_ngram", f"between 1 and max_ngram ({self.max_ngram})")
        self.require(self.num_pred_tokens >= 1, "num_pred_tokens", ">= 1")
        self.require_one_of("controller", CONTROLLERS)
        self.require_one_of("match", MATCHES)


def lookup_ngram(tokens, max_ngram: int, min_ngram: int, k: int, match: str = "saxena") -> list[int]:
    """Continuation (up to k tokens) of the last n-gram's earlier occurrence in `tokens` (a list or an array) that
    `match` picks (`MATCHES`), or empty. The search runs on the host (on a GPU, searching the device's copy would wait
    for it once per n-gram length tried), from the earlier occurrences of the last token, extended back one token at
    a time."""
    sequence = np.asarray(tokens)
    n_tokens = len(sequence)
    if n_tokens < 2:
        return []
    ends = np.flatnonzero(sequence[: n_tokens - 1] == sequence[-1])  # where a match can end: each has a successor
    for n in range(min(max_ngram, n_tokens - 1), min_ngram - 1, -1):
        found = ends[ends >= n - 1]
        for back in range(1, n):
            found = found[sequence[found - back] == sequence[-1 - back]]
        if match == "saxena":  # his `start_idx < input_length - ngram_size`: not one overlapping the last n-gram
            found = found[found + 1 < n_tokens - n]
        if found.size:
            start = int(found[-1] if match == "latest" else found[0]) + 1
            return sequence[start : start + k].tolist()
    return []


@register_method(PLDConfig)
class PLDDecoder(DraftVerifyDecoder):
    name = "pld"
    compilable = True

    def __init__(self, model, tokenizer, cfg: PLDConfig, steps=None):
        super().__init__(model, tokenizer, steps)
        self.cfg = cfg

    @classmethod
    def from_config(cls, cfg: PLDConfig, target, ctx) -> "PLDDecoder":
        return cls(target.model, target.tokenizer, cfg)

    def new_controller(self) -> DraftLengthController:
        return build_controller(self.cfg.controller, self.cfg.num_pred_tokens)

    def propose(self, state, tokens, k, sampling: Sampling, rng, controller) -> Proposal:
        history = tokens[0].cpu().numpy()  # the round's one read of the device before verifying
        drafts = lookup_ngram(history, self.cfg.max_ngram, self.cfg.min_ngram, k, self.cfg.match)
        return Proposal(upload(drafts, tokens.device))  # a deterministic drafter: q is one-hot on each draft
