"""Speed metrics, computed from Generations in one place (names as in docs/DESIGN.md).

Inputs are generation dicts (`Generation.to_dict()`), one per decoded turn; a reference list holds
the `ar` run's generations for the same prompts.
"""

from __future__ import annotations

import math
from statistics import fmean, stdev

from scipy import special


def _rate(gen: dict) -> float:
    return len(gen["token_ids"]) / gen["wall_time"] if gen["wall_time"] > 0 else math.nan


def _ratio(num: float, den: float) -> float:
    return num / den if den else math.nan


def _part_ms_per_step(gens: list[dict], part: str, steps: int) -> float:
    """Milliseconds per step spent in a step's `part` ("draft" or "verify"); NaN when the method timed neither part
    (transformers' own generate loop in hf_assisted), rather than a cost of 0."""
    if not any(g["draft_time"] or g["verify_time"] for g in gens):
        return math.nan
    return 1000 * _ratio(sum(g[f"{part}_time"] for g in gens), steps)


def ci95(values: list[float]) -> float:
    """Half-width of the 95% confidence interval of the mean of `values` (Student's t); NaN for fewer than two."""
    if len(values) < 2:
        return math.nan
    return float(special.stdtrit(len(values) - 1, 0.975)) * stdev(values) / math.sqrt(len(values))


# keys whose `<key>_ci95` is `ci95` over each of a run's `n_generations` turns
STUDENT_T_KEYS = ("speedup_paired", "speedup_paired_eager", "speedup_paired_torch", "speedup_paired_fastest")


def mean_ci95(runs: list[dict], key: str) -> float:
    """Half-width of the 95% interval of the plain mean of `key` over independent runs (a table's mean over cells):
    the runs' standard errors, each from its `<key>_ci95`, combined with Welch-Satterthwaite degrees of freedom;
    NaN for a key not in STUDENT_T_KEYS or a run without an interval."""
    half_widths = [m.get(f"{key}_ci95") for m in runs]
    half_widths = [math.nan if h is None else h for h in half_widths]  # a record writes NaN as null
    counts = [m.get("n_generations", 0) for m in runs]
    if key not in STUDENT_T_KEYS or not runs or any(not math.isfinite(h) or n < 2 for h, n in zip(half_widths, counts)):
        return math.nan
    variances = [(h / special.stdtrit(n - 1, 0.975)) ** 2 for h, n in zip(half_widths, counts)]
    if not sum(variances):
        return 0.0
    dof = sum(variances) ** 2 / sum(v**2 / (n - 1) for v, n in zip(variances, counts))
    return float(special.stdtrit(dof, 0.975)) * math.sqrt(sum(variances)) / len(runs)


def speed_metrics(gens: list[dict]) -> dict[str, float]:
    """Throughput, MAT, acceptance, HM and the per-step draft/verify cost of one run."""
    tokens = sum(len(g["token_ids"]) for g in gens)
    wall = sum(g["wall_time"] for g in gens)
    steps = sum(g["steps"] for g in gens)
    forwards = steps + sum(g.get("discarded_steps", 0) for g in gens)  # what the timed parts ran
    committed_after_prefill = sum(sum(g["accepted"]) for g in gens)
    drafted = sum(sum(g["drafted"]) for g in gens)
    # tokens a step took from the draft: all it committed but the target's own bonus/correction token, which a
    # last step cut at EOS or the budget did not reach
    from_drafts = sum(max(a - 1, 0) for g in gens for a in g["accepted"])
    from_drafts += sum(bool(g["accepted"]) and g.get("last_step_cut", False) for g in gens)
    v_d = _ratio(from_drafts, drafted)  # acceptance rate of draft tokens
    r_d = _ratio(from_drafts, tokens)  # share of output tokens that came from drafts
    return {
        "n_generations": len(gens),
        "new_tokens": tokens,
        "tokens_per_s": fmean(_rate(g) for g in gens) if gens else math.nan,
        "total_tokens_per_s": _ratio(tokens, wall),
        "wall_time": wall,
        "steps": steps,
        "mat": _ratio(committed_after_prefill, steps),
        "accept_rate": v_d,
        "draft_token_share": r_d,
        # EESD's harmonic mean of v_d and r_d, x100 (003, Sec. 4)
        "hm": (100 * 2 * v_d * r_d / (v_d + r_d) if v_d + r_d > 0 else 0.0) if drafted else math.nan,
        "mean_drafted_per_step": _ratio(drafted, steps),
        "draft_ms_per_step": _part_ms_per_step(gens, "draft", forwards),
        "verify_ms_per_step": _part_ms_per_step(gens, "verify", forwards),
    }


def speedups(gens: list[dict], reference: list[dict]) -> dict[str, float]:
    """Speedups against the reference (`ar`) run's generations on the same prompts and weights."""
    method, ref = speed_metrics(gens), speed_metrics(reference)
    ref_step_ms = ref["verify_ms_per_step"]
    return {
        # Spec-Bench: ratio of the mean per-sample throughputs
        "speedup_mean": _ratio(method["tokens_per_s"], ref["tokens_per_s"]),
        # SPACE speedup_sum: ratio of total throughputs
        "speedup_total": _ratio(method["total_tokens_per_s"], ref["total_tokens_per_s"]),
        # cost of a step's drafting and verification in units of one AR decoding step
        "draft_cost": _ratio(method["draft_ms_per_step"], ref_step_ms),
        "verify_cost": _ratio(method["verify_ms_per_step"], ref_step_ms),
        "reference_tokens_per_s": ref["tokens_per_s"],
    }


def paired_ratio(gen: dict, baseline: str = "ar") -> float:
    """One turn's throughput over that of the `baseline` timed beside it."""
    return _rate(gen) / (gen[f"{baseline}_tokens"] / gen[f"{baseline}_wall_time"])


def relative_speedup(turns: list[dict], others: list[dict]) -> dict[str, float]:
    """How much faster one run decoded the same turns than another, from each turn's `speedup` over the `ar` timed
    beside it in its own run (`paired_ratio`: the machine's load at either run's time cancels) and its `tokens`
    (any value that is equal for the same tokens): the geometric mean of the turns' ratios of the two paired speedups
    (`ratio`), the bounds of its 95% interval (Student's t on the logs), the number of `turns` and the share of them
    decoded to the same tokens (`same_tokens`)."""
    logs = [math.log(t["speedup"] / o["speedup"]) for t, o in zip(turns, others, strict=True)]
    mean, half = fmean(logs), ci95(logs)
    return {
        "ratio": math.exp(mean),
        "low": math.exp(mean - half),
        "high": math.exp(mean + half),
        "turns": len(logs),
        "same_tokens": fmean(float(t["tokens"] == o["tokens"]) for t, o in zip(turns, others)),
    }


def paired_speedup(gens: list[dict], baseline: str = "ar") -> dict[str, float]:
    """Speedup over `ar` timed beside each sample (right before it, or in turn before and after it): the mean
    per-sample throughput ratio with the half-width of its 95% confidence interval over the decoded turns (`ci95`),
    the draft and verify cost per step in units of the paired `ar` decoding step, and with alternating order the
    `order_effect`. `baseline="eager_ar"`: the same against eager `ar` timed beside a
    compiled run (keys `speedup_paired_eager`, ...); `"torch_ar"`: against `ar` on torch's linears (`_torch`)."""
    suffix = PAIRED_SUFFIXES[baseline]
    paired = [g for g in gens if g.get(f"{baseline}_wall_time") and g["wall_time"] > 0]
    if not paired:
        return {f"speedup_paired{suffix}": math.nan, f"speedup_paired{suffix}_ci95": math.nan}
    ratios = [paired_ratio(g, baseline) for g in paired]
    ar_step_ms = 1000 * _ratio(  # over the steps it ran: its tokens after the prefill's and those past EOS
        sum(g[f"{baseline}_wall_time"] - g.get(f"{baseline}_prefill_time", 0.0) for g in paired),
        sum(g[f"{baseline}_tokens"] - 1 + g.get(f"{baseline}_discarded_steps", 0) for g in paired),
    )
    forwards = sum(g["steps"] + g.get("discarded_steps", 0) for g in paired)  # what its timed parts ran, as ar's
    return {
        f"speedup_paired{suffix}": fmean(ratios),
        f"speedup_paired{suffix}_ci95": ci95(ratios),
        f"draft_cost_paired{suffix}": _ratio(_part_ms_per_step(paired, "draft", forwards), ar_step_ms),
        f"verify_cost_paired{suffix}": _ratio(_part_ms_per_step(paired, "verify", forwards), ar_step_ms),
    } | order_effect(paired, ratios, suffix)


PAIRED_SUFFIXES = {"ar": "", "eager_ar": "_eager", "torch_ar": "_torch"}  # a paired baseline's metric-name suffix


def fastest_ar_speedup(gens: list[dict], baselines=("ar", "torch_ar")) -> dict[str, float]:
    """Speedup over the faster of the `ar` arms timed beside each turn (`timing.torch_ar`: oneDNN's linears and
    torch's), turn by turn: the mean ratio with its 95% interval, and the share of turns the second arm was faster
    (`fastest_ar_share_torch`)."""
    paired = [g for g in gens if all(g.get(f"{b}_wall_time") for b in baselines) and g["wall_time"] > 0]
    if not paired:
        return {"speedup_paired_fastest": math.nan, "speedup_paired_fastest_ci95": math.nan}
    rates = [[g[f"{b}_tokens"] / g[f"{b}_wall_time"] for b in baselines] for g in paired]
    ratios = [_rate(g) / max(r) for g, r in zip(paired, rates)]
    return {
        "speedup_paired_fastest": fmean(ratios),
        "speedup_paired_fastest_ci95": ci95(ratios),
        "fastest_ar_share_torch": fmean(float(r[1] > r[0]) for r in rates),
    }


def order_effect(paired: list[dict], ratios: list[float], suffix: str = "") -> dict[str, float]:
    """How much faster an arm runs when timed second on a turn than first (1.00: not at all), from a run that timed
    the method first on some turns and second on others (timing.order=alternate): half the difference of the two
    groups' mean log speedups, with the half-width of its 95% interval (Welch's t); {} without two turns of each."""
    first = [math.log(r) for g, r in zip(paired, ratios) if g.get("method_timed_first")]
    second = [math.log(r) for g, r in zip(paired, ratios) if g.get("method_timed_first") is False]
    if len(first) < 2 or len(second) < 2:
        return {}
    from scipy import stats  # slow to import: only runs timed in alternating order need it

    low, high = stats.ttest_ind(second, first, equal_var=False).confidence_interval(0.95)
    return {
        f"order_effect_paired{suffix}": math.exp((fmean(second) - fmean(first)) / 2),
        f"order_effect_paired{suffix}_ci95": (math.exp(high / 2) - math.exp(low / 2)) / 2,
    }


def lossless(gens: list[dict], reference: list[dict]) -> float:
    """Fraction of generations whose token ids equal the reference's (greedy runs on the same weights)."""
    if len(gens) != len(reference) or not gens:
        return math.nan
    return fmean(float(g["token_ids"] == r["token_ids"]) for g, r in zip(gens, reference))


def impossible_generation(gen: dict) -> str | None:
    """Why a Generation's step counts cannot be true (None when they can): every step commits at least one
    token and at most its drafts plus the target's own, and the steps account for every token but the
    prefill's."""
    accepted, drafted = gen["accepted"], gen["drafted"]
    if not gen["steps"] == len(accepted) == len(drafted):
        return f"{gen['steps']} steps but {len(accepted)} accepted and {len(drafted)} drafted counts"
    if any(a < 1 for a in accepted):
        return "a step committed no token"
    over = [(a, d) for a, d in zip(accepted, drafted) if a > d + 1]
    if over:
        return f"a step committed {over[0][0]} tokens from {over[0][1]} drafts (at most drafts + 1)"
    if not 0 <= len(gen["token_ids"]) - sum(accepted) <= 1:
        return f"{len(gen['token_ids'])} tokens but the steps committed {sum(accepted)} after prefill"
    return None


def impossible_metrics(metrics: dict) -> str | None:
    """Why a run's aggregate metrics cannot be true (None when they can)."""
    bounds = {
        "accept_rate": (0, 1),
        "draft_token_share": (0, 1),
        "hm": (0, 100),
        "lossless": (0, 1),
        "lossless_paired": (0, 1),
        "lossless_eager": (0, 1),
        "lossless_near_tie": (0, 1),
    }
    for key, (low, high) in bounds.items():
        value = metrics.get(key)
        if value is not None and not math.isnan(value) and not low <= value <= high:
            return f"{key} {value:.2f} is outside [{low}, {high}]"
    mat, drafted = metrics.get("mat"), metrics.get("mean_drafted_per_step")
    if mat is not None and drafted is not None and mat > drafted + 1 + 1e-9:
        return f"mat {mat:.2f} is more than the {drafted:.2f} tokens drafted per step + 1"
    return None
