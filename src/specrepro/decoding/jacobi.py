"""`jacobi` and `cllm`: Jacobi decoding (CLLMs, Kou et al. 2024, Alg. 3), greedy only as in the paper.

Greedy AR decoding of an n-token block is the fixed point of y_i = argmax p(y | y_<i, x) (Eq. 1-2).
Jacobi iteration (Eq. 3) starts the block from n - 1 guesses drawn uniformly from the context tokens
(prompt + generated so far, seeded) behind the known-correct first token, and refines all positions in
parallel: one causal forward of the state [first token, guesses...] on the KV cache of the committed
prefix gives the argmax at every position. The longest prefix of guesses equal to the argmax plus the
next argmax are fixed ("fast-forwarded", Alg. 3 lines 8-10); the KV cache keeps only that converged
prefix (line 12) and the remaining positions take their new argmaxes as the next state (line 13), so the
state shrinks every iteration. A block ends when every guess is confirmed (y^(k) = y^(k-1)); its last
argmax is the next block's first token. The output equals greedy AR token for token.

`sliding=true` (beyond the paper) keeps the state at n - 1 guesses instead: after every iteration the last
position's argmax (a prediction of the token after the state, which the block discards) becomes a guess,
and fresh context tokens fill the rest, so a position far ahead is refined for several iterations before it
is reached, at the price of an n-token forward every iteration. Still exact: every committed token is an
argmax of a forward on a verified prefix.

Per iteration (= one target forward = one step) `Generation.extra` records
- `fast_forwarded`: tokens fixed by the iteration and committed (none past an EOS; Table 3 counts the one
  that is correct anyway too);
- `stationary`: tokens fixed by the iteration and committed that already held that value, unchanged, in the state of
  the previous iteration although an earlier position of that state was still wrong (a correct token
  that "remains unaltered through subsequent iterations despite being preceded by inaccurate tokens");
  each generation's mean per iteration (`stationary_per_iteration`), averaged over the run's generations as
  tok/s is, reaches the run's metrics (a short answer weighs as much as a long one; the trainer's held-out
  measure, `training/cllm.py`, divides total stationary tokens by total iterations instead). The fast-forwarded
  mean per iteration is the run's MAT (total tokens over total iterations).

`cllm` is the same decoder on consistency-trained weights (`specrepro train method=cllm`). A CLLM is a
different model from its base, so it is loaded as the run's model: `model.source=artifact model.id=cllm`,
and the runner's `ar` reference then decodes the same weights (losslessness = Jacobi on the CLLM equals AR
on the CLLM; the base model's AR is a separate run).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from specrepro.decoding.base import Decoder, GenerationBuilder
from specrepro.decoding.device import upload
from specrepro.decoding.sampling import Sampling
from specrepro.decoding.verify import crop_cache
from specrepro.errors import SpecReproError
from specrepro.registry import MethodConfig, register_method


@dataclass
class JacobiConfig(MethodConfig):
    name: str = "jacobi"
    block_size: int = 16  # n: tokens per Jacobi block (the known first token + n - 1 guesses)
    sliding: bool = False  # beyond the paper: a sliding window of n - 1 guesses instead of a shrinking block

    def __post_init__(self):
        self.require(self.block_size >= 1, "block_size", ">= 1")


@dataclass
class CLLMConfig(JacobiConfig):
    name: str = "cllm"
    artifact_prefix: str = "cllm"  # the run's model must be a consistency-trained artifact named cllm-*

    def __post_init__(self):
        super().__post_init__()
        self.require(bool(self.artifact_prefix), "artifact_prefix", "an artifact name prefix")


@register_method(JacobiConfig)
class JacobiDecoder(Decoder):
    name = "jacobi"
    compilable = True

    def __init__(self, model, tokenizer=None, block_size: int = 16, sliding: bool = False, steps=None):
        super().__init__(model, tokenizer, steps)
        if block_size < 1:
            raise SpecReproError(f"method.block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.sliding = sliding

    @classmethod
    def from_config(cls, cfg: JacobiConfig, target, ctx) -> "JacobiDecoder":
        return cls(target.model, target.tokenizer, cfg.block_size, cfg.sliding)

    @property
    def max_step_width(self) -> int:
        return self.block_size  # the state: the first token and n - 1 guesses

    def _decode(self, prompt_ids: torch.Tensor, sampling: Sampling, out: GenerationBuilder, rng) -> None:
        if not sampling.greedy:
            raise SpecReproError("Jacobi decoding is greedy only (as in the CLLM paper): use decoding=greedy")
        device = prompt_ids.device
        cache = self.steps.new_cache(prompt_ids.shape[1] + out.max_new_tokens)
        with out.timed("prefill"):
            first = int(self.steps(prompt_ids, cache, logits_to_keep=1).logits[0, -1].argmax())
        out.commit([first], prefill=True)
        context = prompt_ids[0].tolist()
        past = prompt_ids.shape[1]  # positions the cache holds
        fast_forwarded, stationary = [], []
        guesses: list[int] = []
        held_since: list[int] = []  # per guess: the first step whose state held this value unchanged
        while not out.done:
            step = len(fast_forwarded)
            n_guesses = min(self.block_size - 1, out.remaining - 1)  # never guess past max_new_tokens
            guesses, held_since = guesses[:n_guesses], held_since[:n_guesses]
            n_new = n_guesses - len(guesses)
            if n_new > 0 and (self.sliding or not guesses):  # new guesses drawn from the context (Alg. 3 line 1)
                pool = context + out.gen.token_ids
                picks = torch.randint(len(pool), (n_new,), generator=rng, device=device).tolist()
                guesses, held_since = guesses + [pool[i] for i in picks], held_since + [step] * n_new
            state = upload([[out.gen.token_ids[-1], *guesses]], device)
            with out.timed("verify"):  # one parallel Jacobi update of every position (Eq. 3)
                update = self.steps(state, cache, past=past).logits[0].argmax(-1).tolist()  # the round's one read
            n_fixed = next((i for i, guess in enumerate(guesses) if guess != update[i]), len(guesses))
            past += 1 + n_fixed
            crop_cache(cache, past)  # keep the KV of the converged prefix only (Alg. 3 line 12)
            kept = out.commit(update[: n_fixed + 1], drafted=len(state[0]) - 1)  # cut at an EOS
            fast_forwarded.append(len(kept))
            stationary.append(sum(since < step for since in held_since[: min(n_fixed, len(kept))]))
            # line 13: z_next beyond i*; a sliding window also keeps the last position's prediction (of the next token)
            new_guesses = update[n_fixed + 1 : len(guesses) + self.sliding]
            held_since = [
                since if new == old else step + 1
                for new, old, since in zip(new_guesses, guesses[n_fixed + 1 :], held_since[n_fixed + 1 :])
            ]
            held_since += [step + 1] * (len(new_guesses) - len(held_since))
            guesses = new_guesses
        out.gen.extra.update(
            block_size=self.block_size,
            fast_forwarded=fast_forwarded,
            stationary=stationary,
            stationary_per_iteration=sum(stationary) / max(len(stationary), 1),
        )


@register_method(CLLMConfig)
class CLLMDecoder(JacobiDecoder):
    """Jacobi decoding on a consistency-trained model, which must be the run's model (see module doc)."""

    name = "cllm"

    @classmethod
    def from_config(cls, cfg: CLLMConfig, target, ctx) -> "CLLMDecoder":
        source = Path(str(getattr(target.model.config, "_name_or_path", "")))
        if not source.name.startswith(f"{cfg.artifact_prefix}-"):
            raise SpecReproError(
                f"method=cllm decodes consistency-trained weights, but the run's model is '{source}': run with "
                f"model.source=artifact model.id={cfg.artifact_prefix} (so the ar reference shares the weights)"
            )
        return cls(target.model, target.tokenizer, cfg.block_size, cfg.sliding)
