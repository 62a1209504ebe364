"""Draft-length controllers: how many tokens to draft next, updated after each verification.

A controller answers `next_length()` before drafting, may stop a draft early via `keep_drafting(p_top1)`,
and learns from `update(drafted, accepted)`. Draft & Verify's confidence threshold and EESD's Thompson
sampling plug in here too.
"""

from __future__ import annotations

from abc import ABC, abstractmethod


class DraftLengthController(ABC):
    @abstractmethod
    def next_length(self) -> int:
        """The number of tokens to draft next (an upper bound when `keep_drafting` can stop early)."""

    def keep_drafting(self, top1_prob: float) -> bool:
        """Called after each draft token with its top-1 probability; False ends this draft early."""
        return True

    def update(self, drafted: int, accepted: int) -> None:
        """Feedback after verification: `accepted` of `drafted` draft tokens matched."""


class FixedLength(DraftLengthController):
    def __init__(self, k: int):
        self.k = k

    def next_length(self) -> int:
        return self.k


class HeuristicLength(DraftLengthController):
    """transformers' `num_assistant_tokens_schedule="heuristic"`: +2 after full acceptance, else -1."""

    def __init__(self, k: int, k_min: int = 1, k_max: int = 64):
        self.k, self.k_min, self.k_max = k, k_min, k_max

    def next_length(self) -> int:
        return self.k

    def update(self, drafted: int, accepted: int) -> None:
        if drafted == 0:
            return
        step = 2 if accepted == drafted else -1
        self.k = max(self.k_min, min(self.k_max, self.k + step))


def build_controller(kind: str, k: int, k_max: int = 64) -> DraftLengthController:
    if kind == "fixed":
        return FixedLength(k)
    if kind == "heuristic":
        return HeuristicLength(k, k_max=k_max)
    raise ValueError(f"unknown draft-length controller '{kind}' (fixed, heuristic)")
