"""Sampling config and logits warpers (temperature, top-k, top-p), written once for every method.

The warped distribution is the one a method must preserve: speculative sampling accepts against the
warped target distribution p and the warped draft distribution q. Order as in transformers:
temperature, then top-k, then top-p.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Sampling:
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    @classmethod
    def from_config(cls, cfg) -> "Sampling":
        return cls(cfg.do_sample, float(cfg.temperature), int(cfg.top_k), float(cfg.top_p))

    @property
    def greedy(self) -> bool:
        return not self.do_sample or self.temperature == 0.0


def warp_logits(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """Apply temperature, top-k and top-p to logits of shape (..., vocab); filtered entries become -inf."""
    logits = logits.float() / sampling.temperature
    if sampling.top_k > 0:
        kth = torch.topk(logits, min(sampling.top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sampling.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=False)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        remove_sorted = cumulative <= (1 - sampling.top_p)
        remove_sorted[..., -1] = False  # always keep the most likely token
        remove = remove_sorted.scatter(-1, order, remove_sorted)
        logits = logits.masked_fill(remove, float("-inf"))
    return logits


def probs(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """The distribution a sampling step draws from (one-hot on the argmax when greedy)."""
    if sampling.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    return warp_logits(logits, sampling).softmax(dim=-1)


def sample(distribution: torch.Tensor, rng: torch.Generator | None, noise: torch.Tensor | None = None) -> torch.Tensor:
    """Draw one token per row of a (..., vocab) probability tensor, as `torch.multinomial` draws one (the argmax of
    p / Exp(1) noise: the same token for the same generator state) but without reading its validity checks to the
    host, a wait on a GPU each draw: an invalid distribution fails an asynchronous device assert instead. `noise`:
    Exp(1) noise drawn beforehand (`exponential_noise`), shared by candidate draws of which at most one is used and
    none decides which (the draw stays exact; one noise draw costs as much as a CPU sampling step)."""
    flat = distribution.reshape(-1, distribution.shape[-1])
    valid = (flat.max() < float("inf")) & (flat.min() >= 0) & (flat.sum(-1) > 0).all()
    if valid.device.type not in ("cpu", "cuda"):  # the devices that assert asynchronously
        valid = valid.cpu()
    torch._assert_async(valid, "a sampling distribution holds inf, nan or a negative value, or sums to 0")
    noise = exponential_noise(flat, rng) if noise is None else noise.reshape(flat.shape)
    return (flat / noise).argmax(-1).view(distribution.shape[:-1])


def exponential_noise(like: torch.Tensor, rng: torch.Generator) -> torch.Tensor:
    """Exp(1) noise shaped as `like`, from `rng`: what `sample` divides a distribution by."""
    return torch.empty_like(like).exponential_(1, generator=rng)


def pick_token(logits: torch.Tensor, sampling: Sampling, rng: torch.Generator) -> torch.Tensor:
    """The next token from the logits of one position, as a 0-d tensor on their device (read it without a host
    sync later): argmax when greedy, else a warped sample."""
    if sampling.greedy:
        return logits.argmax(-1)
    return sample(warp_logits(logits, sampling).softmax(-1), rng)


def next_token(logits: torch.Tensor, sampling: Sampling, rng: torch.Generator) -> int:
    """`pick_token`, read to the host."""
    return int(pick_token(logits, sampling, rng))
