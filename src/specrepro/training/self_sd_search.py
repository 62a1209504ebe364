"""The skip set of `self_sd`: Bayesian optimisation of the draft's skipped sub-layers (Draft & Verify, 002 §3.3).

z in {0,1}^{2L} (L attention + L MLP sub-layers, L = the model's own depth) is relaxed to [0,1]^{2L} and
thresholded (0.5, as in the official `searching.py`); variables 0..L-1 are attention, L..2L-1 MLP. The
objective, maximised, is the decode throughput of greedy self_sd on a few development prompts: generated
tokens / (draft + verify time), the inverse of the paper's "average inference time per verified token"
(`objective=tokens_per_s`); by default it is divided by ar's throughput on the same prompts, each prompt
decoded by ar right before self_sd (`paired_speedup`): on a shared machine the load drifts during a search, and
raw timings then reward whichever sets ran while the machine was quiet (timing ar on all prompts before
self_sd on all let a load spike during ar's half make a set that accepts nothing the best of a search).
`recheck_top` n > 0 evaluates the n best sets `recheck_repeats` more times at the end and keeps the best mean:
one lucky timing no longer picks the set. Prefill is the full model whatever the skip set,
so it is computed once per prompt and left out of the objective. `search=random` draws the same number of
uniform points (each sub-layer skipped with probability 1 - threshold) for the ablation. `gp_inputs=binary`
fits the GP on the thresholded points instead of the official code's raw ones (`relaxed`): the objective is a
function of the skip set only, and raw points make one set look like many inputs (on the embedded model, 40
evaluations: best 0.60 against relaxed's 0.59, so the official choice stays the default). No constraint on
the sets: skipping nothing or nearly everything scores low on its own (no cheaper draft, or no accepted
drafts), which is the paper's argument for this objective.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Dict, Optional

import numpy as np
from tqdm import tqdm

from specrepro import suspension
from specrepro.data import load_records, prompt_ids
from specrepro.data.config import DatasetConfig
from specrepro.decoding.ar import ARDecoder
from specrepro.decoding.draft_verify import TargetOutput
from specrepro.decoding.sampling import Sampling
from specrepro.decoding.self_sd import SelfSDConfig, SelfSDDecoder, SkipSet, decoder_layers
from specrepro.errors import SpecReproError
from specrepro.registry import register_component

log = logging.getLogger(__name__)


@dataclass
class SelfSDSearchConfig:
    component: str = "self_sd_skip_set"
    search: str = "bayes"  # bayes (GP + UCB, bayesian-optimization) | random (the same number of uniform points)
    iterations: int = 200  # objective evaluations in all (paper: 1000; App. E: 200 already gives most of it)
    init_points: int = 10  # random points before the GP proposes (bayes); official code: 0, after probing known sets
    seed: int = 1  # official code: random_state=1
    kappa: float = 2.576  # UCB exploration (the library's default)
    # L-BFGS-B starts when maximising UCB (the library's default 10); its gradients over 2L variables are finite
    # differences, so each start costs about 1 s on a CPU and a suggestion 2-20 s: fewer starts leave more of a
    # time budget to objective evaluations
    acq_restarts: int = 10
    gp_alpha: float = 1e-2  # GP noise term for noisy timings (official code)
    # what the GP sees of an evaluated point: relaxed = the raw [0,1] point (official code); binary = the
    # thresholded skip set, which is all the objective depends on
    gp_inputs: str = "relaxed"
    threshold: float = 0.5
    # tokens_per_s: the paper's objective (decode tokens/s); paired_speedup: that throughput over ar's, timed on
    # the same prompts right before each evaluation, so a shared machine's load drift cancels out
    objective: str = "paired_speedup"
    prompts: Dict[str, DatasetConfig] = field(default_factory=dict)  # development prompt sets
    dev_records: int = 4  # per set, taken from the END of the file (evaluation runs take records from the start)
    max_prompt_tokens: Optional[int] = None  # keep only the last tokens of each prompt; null = whole prompt
    max_new_tokens: int = 32
    recheck_top: int = 0  # n > 0: the n best sets are evaluated recheck_repeats more times; the best mean wins
    recheck_repeats: int = 2
    decoder: SelfSDConfig = field(default_factory=lambda: SelfSDConfig(skip_set=None))  # draft control while searching


def dev_prompts(spec: SelfSDSearchConfig, tokenizer) -> list[list[int]]:
    """Token ids of the last `dev_records` records of every prompt set."""
    prompts = []
    for dataset_cfg in spec.prompts.values():
        for record in load_records(dataset_cfg)[-spec.dev_records :]:
            ids = prompt_ids(record, tokenizer, dataset_cfg, [])
            prompts.append(ids[-spec.max_prompt_tokens :] if spec.max_prompt_tokens else ids)
    return prompts


class PrefilledSelfSD(SelfSDDecoder):
    """The self_sd loop with each prompt's prefill computed once and copied into the cache afterwards."""

    def __init__(self, *args, prefills: dict, **kwargs):
        super().__init__(*args, **kwargs)
        self.prefills = prefills

    def target_forward(self, state, input_ids, cache, logits_to_keep=0, tree=None, past=None) -> TargetOutput:
        if cache.get_seq_length() > 0:
            return super().target_forward(state, input_ids, cache, logits_to_keep, tree, past)
        key = tuple(input_ids[0].tolist())
        if key not in self.prefills:
            logits = super().target_forward(state, input_ids, cache, logits_to_keep).logits
            self.prefills[key] = (logits, [(layer.keys, layer.values) for layer in cache.layers])
        else:
            logits, kv = self.prefills[key]
            for index, (keys, values) in enumerate(kv):
                cache.update(keys, values, index)
        return TargetOutput(logits)


def decode_throughput(decoder, prompts, max_new_tokens: int, ar=None) -> tuple[float, float | None, dict]:
    """Generated tokens after the first / (draft + verify seconds) over greedy generations of all prompts, and
    the same for `ar` decoding each prompt right before `decoder` (None without `ar`)."""
    tokens = seconds = ar_tokens = ar_seconds = drafted = accepted = steps = 0
    for ids in prompts:
        if ar is not None:
            gen = ar.generate(ids, Sampling(), max_new_tokens)
            ar_tokens += len(gen.token_ids) - 1
            ar_seconds += gen.draft_time + gen.verify_time
        gen = decoder.generate(ids, Sampling(), max_new_tokens)
        tokens += len(gen.token_ids) - 1
        seconds += gen.draft_time + gen.verify_time
        drafted += sum(gen.drafted)
        accepted += sum(gen.accepted) - len(gen.accepted)  # draft tokens kept (bonus/correction excluded)
        steps += gen.steps
    ar_tps = ar_tokens / ar_seconds if ar is not None else None
    return tokens / seconds, ar_tps, {"accept_rate": accepted / max(drafted, 1), "mat": tokens / max(steps, 1)}


def to_skip_set(params: dict, num_layers: int, threshold: float) -> tuple[list[int], list[int]]:
    """Variables x0..x{L-1} (attention) and x{L}..x{2L-1} (MLP) above the threshold are skipped."""
    values = [params[f"x{i:03d}"] for i in range(2 * num_layers)]
    attn = [i for i in range(num_layers) if values[i] > threshold]
    mlp = [i for i in range(num_layers) if values[num_layers + i] > threshold]
    return attn, mlp


def recheck(history: list[dict], spec: SelfSDSearchConfig, evaluate) -> dict:
    """The best of the `recheck_top` best distinct sets of `history` by their mean objective over their first
    evaluation and `recheck_repeats` more; its row, with those values as `rechecks` and `objective` their mean."""
    candidates, seen = [], set()
    for row in sorted(history, key=lambda row: -row["objective"]):
        key = (tuple(row["attn_skip"]), tuple(row["mlp_skip"]))
        if key not in seen:
            seen.add(key)
            candidates.append(row)
    rows = []
    for row in tqdm(candidates[: spec.recheck_top], desc="self_sd skip-set recheck", unit="set"):
        again = [evaluate(row["attn_skip"], row["mlp_skip"])[0] for _ in range(spec.recheck_repeats)]
        values = [row["objective"], *again]
        rows.append(row | {"rechecks": values, "objective": sum(values) / len(values)})
    return max(rows, key=lambda row: row["objective"])


def restart_limited_ucb(kappa: float, restarts: int):
    """bayes_opt's UCB acquisition, maximised from `restarts` L-BFGS-B starts instead of the library's 10."""
    from bayes_opt.acquisition import UpperConfidenceBound

    class RestartLimitedUCB(UpperConfidenceBound):
        def suggest(self, gp, target_space, n_random=10_000, n_smart=10, fit_gp=True, random_state=None):
            return super().suggest(gp, target_space, n_random, restarts, fit_gp, random_state)

    return RestartLimitedUCB(kappa=kappa)


@register_component("self_sd_skip_set", schema=SelfSDSearchConfig)
def train_self_sd_skip_set(cfg, target, work_dir, log_metrics, device):
    """Search the skip set; returns (SkipSet, metrics, per-iteration history)."""
    from bayes_opt import BayesianOptimization

    spec = cfg.training
    if spec.acq_restarts < 1:
        raise SpecReproError(f"self_sd search acq_restarts must be at least 1, got {spec.acq_restarts}")
    if spec.search not in ("bayes", "random"):
        raise SpecReproError(f"self_sd search '{spec.search}' is not one of bayes, random")
    if spec.gp_inputs not in ("binary", "relaxed"):
        raise SpecReproError(f"self_sd search gp_inputs '{spec.gp_inputs}' is not one of binary, relaxed")
    if spec.objective not in ("tokens_per_s", "paired_speedup"):
        raise SpecReproError(f"self_sd search objective '{spec.objective}' is not one of tokens_per_s, paired_speedup")
    if spec.recheck_top < 0 or spec.recheck_repeats < 1:
        raise SpecReproError(
            f"self_sd search needs recheck_top >= 0 and recheck_repeats >= 1, "
            f"got {spec.recheck_top} and {spec.recheck_repeats}"
        )
    num_layers = len(decoder_layers(target.model))
    prompts = dev_prompts(spec, target.tokenizer)
    prefills: dict = {}
    ar = ARDecoder(target.model, target.tokenizer)

    def evaluate(attn: list[int], mlp: list[int]) -> tuple[float, dict]:
        decoder = PrefilledSelfSD(target.model, target.tokenizer, attn, mlp, spec.decoder, prefills=prefills)
        paired = ar if spec.objective == "paired_speedup" else None
        tps, ar_now, stats = decode_throughput(decoder, prompts, spec.max_new_tokens, paired)
        stats["tokens_per_s"] = tps
        if ar_now is not None:
            stats["ar_tokens_per_s"] = ar_now
        return (tps / ar_now if ar_now else tps), stats

    bounds = {f"x{i:03d}": (0.0, 1.0) for i in range(2 * num_layers)}
    optimizer = BayesianOptimization(
        f=None,
        pbounds=bounds,
        acquisition_function=restart_limited_ucb(spec.kappa, spec.acq_restarts),
        random_state=spec.seed,
        verbose=0,
        allow_duplicate_points=True,
    )
    optimizer.set_gp_params(alpha=spec.gp_alpha)
    uniform = np.random.RandomState(spec.seed)
    # untimed: fills the prefill cache, warms kernels up
    evaluate(*to_skip_set(optimizer.random_sample(1)[0], num_layers, spec.threshold))
    ar_tps = decode_throughput(ar, prompts, spec.max_new_tokens)[0]
    log.info("ar on %d development prompts: %.2f tokens/s", len(prompts), ar_tps)

    history, best = [], None
    start = suspension.clock()
    bar = tqdm(range(spec.iterations), desc=f"self_sd skip-set search ({spec.search})", unit="eval")
    for iteration in bar:
        if spec.search == "random":
            params = {name: float(uniform.uniform()) for name in bounds}
        elif iteration < spec.init_points:
            params = optimizer.random_sample(1)[0]
        else:
            params = optimizer.suggest()
        attn, mlp = to_skip_set(params, num_layers, spec.threshold)
        value, stats = evaluate(attn, mlp)
        if spec.search == "bayes":
            seen = params if spec.gp_inputs == "relaxed" else {k: float(v > spec.threshold) for k, v in params.items()}
            optimizer.register(params=seen, target=value)
        row = {
            "iteration": iteration,
            "objective": value,
            **stats,
            "speedup_vs_ar": stats.get("ar_tokens_per_s") and stats["tokens_per_s"] / stats["ar_tokens_per_s"],
            "n_attn_skipped": len(attn),
            "n_mlp_skipped": len(mlp),
            "attn_skip": attn,
            "mlp_skip": mlp,
            "elapsed_s": suspension.clock() - start,
        }
        if row["speedup_vs_ar"] is None:  # tokens_per_s objective: against ar's throughput at the start
            row["speedup_vs_ar"] = stats["tokens_per_s"] / ar_tps
        history.append(row)
        if best is None or value > best["objective"]:
            best = row
        log_metrics(
            {k: v for k, v in row.items() if not isinstance(v, list)} | {"best_objective": best["objective"]}, iteration
        )
        bar.set_postfix(objective=f"{value:.2f}", best=f"{best['objective']:.2f}")
    if spec.recheck_top:
        best = recheck(history, spec, evaluate)

    metrics = {
        "search": spec.search,
        "objective": spec.objective,
        "iterations": spec.iterations,
        "dev_prompts": len(prompts),
        "ar_tokens_per_s": ar_tps,
        "best_objective": best["objective"],
        "best_tokens_per_s": best["tokens_per_s"],
        "best_speedup_vs_ar": best["speedup_vs_ar"],
        "best_iteration": best["iteration"],
        "best_accept_rate": best["accept_rate"],
        "best_mat": best["mat"],
        "best_rechecks": best.get("rechecks", []),
        "n_attn_skipped": best["n_attn_skipped"],
        "n_mlp_skipped": best["n_mlp_skipped"],
        "search_seconds": suspension.clock() - start,
        "compute_minutes": (suspension.clock() - start) / 60,
    }
    info = {
        "search": spec.search,
        "metrics": metrics,
        "history": [
            {k: row[k] for k in ("iteration", "objective", "tokens_per_s", "speedup_vs_ar", "accept_rate")}
            for row in history
        ],
    }
    return SkipSet(best["attn_skip"], best["mlp_skip"], num_layers, info), metrics, history
