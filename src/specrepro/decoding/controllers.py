"""Draft-length controllers: how many tokens to draft next, updated after each verification.

A controller answers `next_length()` before drafting, may stop a draft early via `keep_drafting(p_top1)`,
and learns from `update(drafted, accepted)`. Draft & Verify's confidence threshold and EESD's Thompson
sampling plug in here too. `p_top1` is a 0-d tensor on the draft's device: only a controller that decides by it
reads it to the host (a wait on a GPU), so the others draft without waiting.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod

import torch

from specrepro.errors import SpecReproError

CONTROLLERS = ("fixed", "heuristic")  # the kinds `build_controller` builds


class DraftLengthController(ABC):
    @abstractmethod
    def next_length(self) -> int:
        """The number of tokens to draft next (an upper bound when `keep_drafting` can stop early)."""

    @property
    def max_length(self) -> int:
        """The most tokens `next_length` can ever return (what a compiled verification must fit)."""
        return self.next_length()

    def keep_drafting(self, top1_prob: torch.Tensor) -> bool:
        """Called after each draft token with its top-1 probability (0-d); False ends this draft early."""
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

    @property
    def max_length(self) -> int:
        return self.k_max

    def update(self, drafted: int, accepted: int) -> None:
        if drafted == 0:
            return
        step = 2 if accepted == drafted else -1
        self.k = max(self.k_min, min(self.k_max, self.k + step))


class AdaptiveDraftExit(DraftLengthController):
    """Draft & Verify (002) §3.4 adaptive draft-exiting: draft up to `k_max` tokens, stop after a token whose
    top-1 draft probability is below gamma (that token is kept), and move gamma toward the target
    acceptance rate alpha after every verification:
        (2) AR <- beta1 * AR + (1 - beta1) * AR_e       (beta1 = 0 at the first round: AR = AR_1)
        (3) gamma~ = gamma + epsilon if AR <= alpha else gamma - epsilon
        (4) gamma <- beta2 * gamma + (1 - beta2) * gamma~
    AR_e = accepted / drafted of round e (the official code's definition). No clipping of gamma (none in the paper).
    """

    def __init__(
        self,
        k_max: int = 12,
        gamma0: float = 0.6,
        alpha: float = 0.9,
        epsilon: float = 0.01,
        beta1: float = 0.5,
        beta2: float = 0.9,
    ):
        self.k_max, self.alpha, self.epsilon, self.beta1, self.beta2 = k_max, alpha, epsilon, beta1, beta2
        self.gamma = gamma0
        self.accept_rate: float | None = None  # AR, reset per generation as in the official code

    def next_length(self) -> int:
        return self.k_max

    def keep_drafting(self, top1_prob: torch.Tensor) -> bool:
        return float(top1_prob) >= self.gamma

    def update(self, drafted: int, accepted: int) -> None:
        if drafted == 0:  # nothing was drafted (the budget's last token): no acceptance to learn from
            return
        round_rate = accepted / drafted
        if self.accept_rate is None:
            self.accept_rate = round_rate  # Eq. 2 with beta1 = 0 at e = 1
        else:
            self.accept_rate = self.beta1 * self.accept_rate + (1 - self.beta1) * round_rate  # Eq. 2
        gamma_tilde = (
            self.gamma + self.epsilon if self.accept_rate <= self.alpha else self.gamma - self.epsilon
        )  # Eq. 3
        self.gamma = self.beta2 * self.gamma + (1 - self.beta2) * gamma_tilde  # Eq. 4


def build_controller(kind: str, k: int, k_max: int = 64) -> DraftLengthController:
    if kind == "fixed":
        return FixedLength(k)
    if kind == "heuristic":
        return HeuristicLength(k, k_max=k_max)
    raise SpecReproError(f"unknown draft-length controller '{kind}' ({', '.join(CONTROLLERS)})")


class BetaTS(DraftLengthController):
    """EESD's Beta-TS (Algorithm 2): after each draft token, draw theta ~ Beta(alpha, beta) and keep drafting
    with probability theta; the posterior counts verification outcomes of the current generation (Eqs. 2-4).

    `counting` reads the paper's Q_v (see the EESD note, section 4.2) for a round with k drafted, a accepted:
    literal_R1 (Q_v = accepted drafts + the target's token): r = a, n = min(a + 2, k);
    literal_R2 (Q_v = accepted drafts only): r = a - 1, n = min(a + 1, k);
    clean (geometric stopping model): r = a, n = a + [a < k].

    `decision` is what a draw of theta decides. "bernoulli" (the paper): keep drafting with probability theta,
    so within a round the length is geometric. "break_even" (beyond the paper; Thompson sampling proper, which
    acts optimally for the drawn parameter): draw theta once per round and draft the longest chain whose last
    token is still reached and accepted with probability theta^k >= `break_even`, the acceptance at which one
    more draft token pays for itself (its draft cost in AR steps times the tokens an AR step is worth).
    """

    def __init__(
        self,
        alpha0: float,
        beta0: float,
        k_max: int,
        rng,
        counting: str = "literal_R1",
        decision: str = "bernoulli",
        break_even: float = 0.2,
    ):
        if counting not in ("literal_R1", "literal_R2", "clean"):
            raise SpecReproError(f"Beta-TS counting '{counting}' is not one of literal_R1, literal_R2, clean")
        if decision not in ("bernoulli", "break_even"):
            raise SpecReproError(f"Beta-TS decision '{decision}' is not one of bernoulli, break_even")
        if not 0 < break_even < 1:
            raise SpecReproError(f"Beta-TS break_even must be in (0, 1), got {break_even}")
        self.alpha, self.beta, self.k_max, self.rng, self.counting = alpha0, beta0, k_max, rng, counting
        self.decision, self.break_even = decision, break_even

    @property
    def max_length(self) -> int:
        return self.k_max  # a break-even round's length is drawn: `next_length` would draw one (and use the rng)

    def next_length(self) -> int:
        if self.decision == "bernoulli":
            return self.k_max
        theta = self.rng.beta(self.alpha, self.beta)  # one draw per round
        if theta >= 1.0:
            return self.k_max
        chain = math.floor(math.log(self.break_even) / math.log(theta)) if theta > 0 else 0  # theta^k >= break_even
        return max(1, min(self.k_max, chain))

    def keep_drafting(self, top1_prob: torch.Tensor) -> bool:
        if self.decision == "break_even":  # the round's length was chosen with its draw
            return True
        theta = self.rng.beta(self.alpha, self.beta)  # re-drawn at every draft step (Alg. 2, line 8)
        return bool(self.rng.random() < theta)  # chi ~ Bernoulli(theta)

    def update(self, drafted: int, accepted: int) -> None:
        if drafted == 0:
            return
        if self.counting == "literal_R1":
            successes, trials = accepted, min(accepted + 2, drafted)
        elif self.counting == "literal_R2":
            successes, trials = accepted - 1, min(accepted + 1, drafted)
        else:
            successes, trials = accepted, accepted + int(accepted < drafted)
        # Eqs. 3-4; R1 can count fewer trials than successes + 1 at a == k, and R2 a negative success
        self.alpha = max(self.alpha + successes, 1e-3)
        self.beta = max(self.beta + max(trials - successes, 0), 1e-3)


class CaliTS(DraftLengthController):
    """EESD's Cali-TS (Algorithm 3): a Gaussian posterior over the keep-drafting probability whose prior mean
    is a trained predictor's theta_M (Eq. 5) and whose evidence is the running rate theta_hat (Eqs. 6-8).

    mode: both (the paper), model (w/o Sampling-Prediction: mu = theta_M, sigma = sigma_M) or sampling
    (w/o Model-Prediction: theta_M replaced by theta_hat). theta_update: successes_only (theta_hat counts the
    accepted drafts among the committed tokens) or literal (Eq. 8 as printed, which drives theta_hat to 1).
    theta ~ N(mu, sigma^2) is clipped to [0, 1] before the Bernoulli draw.
    """

    def __init__(
        self,
        sigma_m: float,
        sigma_s: float,
        theta0: float,
        k_max: int,
        rng,
        mode: str = "both",
        theta_update: str = "successes_only",
    ):
        if mode not in ("both", "model", "sampling"):
            raise SpecReproError(f"Cali-TS mode '{mode}' is not one of both, model, sampling")
        if theta_update not in ("successes_only", "literal"):
            raise SpecReproError(f"Cali-TS theta_update '{theta_update}' is not one of successes_only, literal")
        self.sigma_m, self.sigma_s, self.k_max, self.rng = sigma_m, sigma_s, k_max, rng
        self.mode, self.theta_update = mode, theta_update
        self.theta_hat, self.t, self.n = theta0, 0, 0  # running rate, committed tokens, verifications

    @property
    def needs_model_prediction(self) -> bool:
        return self.mode != "sampling"

    def next_length(self) -> int:
        return self.k_max

    def posterior(self, theta_model: float | None) -> tuple[float, float]:
        """(mu, sigma^2) of Eqs. 6-7 for the current draft step."""
        if self.mode == "model":
            return theta_model, self.sigma_m**2
        prior = self.theta_hat if self.mode == "sampling" else theta_model
        vm, vs = self.sigma_m**2, self.sigma_s**2
        mu = vs / (self.n * vm + vs) * prior + self.n * vm / (self.n * vm + vs) * self.theta_hat  # Eq. 6
        return mu, vm * vs / (vs + self.n * vm)  # Eq. 7

    def keep_drafting(self, top1_prob: torch.Tensor, theta_model: float | None = None) -> bool:
        mu, var = self.posterior(theta_model)
        theta = min(max(self.rng.normal(mu, var**0.5), 0.0), 1.0)
        return bool(self.rng.random() < theta)

    def update(self, drafted: int, accepted: int) -> None:
        if drafted == 0:
            return
        committed = accepted + 1  # |Q_v| under reading R1: accepted drafts + the target's token
        successes = committed if self.theta_update == "literal" else accepted
        self.theta_hat = (self.theta_hat * (self.t + 1) + successes) / (self.t + committed + 1)  # Eq. 8
        self.t += committed
        self.n += 1
