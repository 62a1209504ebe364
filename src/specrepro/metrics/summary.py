"""A run's summary: its metrics from its recorded rows (speed, paired speedups, scores, losslessness against its
`ar` reference), and the plain-text table of runs that `specrepro run` prints."""

from __future__ import annotations

import math

from specrepro.errors import SpecReproError
from specrepro.metrics.divergence import near_tie_metrics
from specrepro.metrics.speed import fastest_ar_speedup, lossless, paired_speedup, speed_metrics, speedups


def run_level_extras(gens: list[dict]) -> dict[str, float]:
    """Means of the numbers a decoder reports once per generation in `extra` (sar_draft's extra_memory_pct,
    jacobi's block_size, ...); per-step lists stay in generations.jsonl."""
    numbers = [
        {k: v for k, v in g.get("extra", {}).items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        for g in gens
    ]
    in_every = set.intersection(*map(set, numbers)) if numbers else set()
    return {k: sum(n[k] for n in numbers) / len(numbers) for k in sorted(in_every)}


def summarize(rows: list[dict], reference_rows: list[dict] | None, greedy: bool) -> dict:
    """A run's metrics from its rows; with its `ar` reference's rows, its speedups over `ar` and, greedy, whether
    it decoded the same tokens."""
    gens = [g for row in rows for sample in row["samples"] for g in sample]
    metrics = speed_metrics(gens) | run_level_extras(gens)
    for key in sorted({k for row in rows for k in row["scores"]}):
        values = [row["scores"][key] for row in rows if key in row["scores"]]
        metrics[key] = sum(values) / len(values)
    if any("ar_wall_time" in g for g in gens):
        metrics.update(paired_speedup(gens))
        if greedy:  # the paired ar outputs are a reference on the same weights too
            metrics["lossless_paired"] = lossless(gens, [{"token_ids": g["ar_token_ids"]} for g in gens])
    if any("eager_ar_wall_time" in g for g in gens):  # a compiled run: eager `ar` was timed beside it too
        metrics.update(paired_speedup(gens, "eager_ar"))
        if greedy:
            metrics["lossless_eager"] = lossless(gens, [{"token_ids": g["eager_ar_token_ids"]} for g in gens])
    if any("torch_ar_wall_time" in g for g in gens):  # timing.torch_ar: `ar` on torch's linears too
        metrics.update(paired_speedup(gens, "torch_ar") | fastest_ar_speedup(gens))
        if greedy:
            metrics["lossless_torch"] = lossless(gens, [{"token_ids": g["torch_ar_token_ids"]} for g in gens])
    if reference_rows is not None:
        by_id = {row["id"]: row for row in reference_rows}
        for row in rows:  # later turns follow each run's own (sampled) answers; the first prompt must match
            if by_id[row["id"]]["prompts"][:1] != row["prompts"][:1]:
                raise SpecReproError(
                    f"the `ar` reference decoded a different prompt for record {row['id']}; "
                    "it is not comparable (delete it to re-run it)"
                )
        ref_gens = [g for row in rows for sample in by_id[row["id"]]["samples"] for g in sample]
        metrics.update(speedups(gens, ref_gens))
        if greedy:
            metrics["lossless"] = lossless(gens, ref_gens)
            metrics.update(near_tie_metrics(gens, ref_gens))  # each divergence a near-tie or a bug
    return metrics


TABLE_COLUMNS = [
    ("run", "run_name", "{}"),
    ("n", "n_samples", "{}"),
    ("tok/s", "tokens_per_s", "{:.1f}"),
    ("speedup_mean", "speedup_mean", "{:.2f}x"),
    ("speedup_total", "speedup_total", "{:.2f}x"),
    ("speedup_paired", "speedup_paired", "{:.2f}x"),
    ("mat", "mat", "{:.2f}"),
    ("accept_rate", "accept_rate", "{:.2f}"),
    ("hm", "hm", "{:.1f}"),
    ("draft_cost", "draft_cost", "{:.2f}"),
    ("verify_cost", "verify_cost", "{:.2f}"),
    ("draft_cost_p", "draft_cost_paired", "{:.2f}"),
    ("verify_cost_p", "verify_cost_paired", "{:.2f}"),
    ("lossless", "lossless", "{:.2f}"),
    ("lossless_near_ties", "lossless_near_tie", "{:.2f}"),  # shown where some run's `lossless` < 1
    ("lossless_paired", "lossless_paired", "{:.2f}"),
    ("speedup_eager", "speedup_paired_eager", "{:.2f}x"),
    ("resumed", "resumed", "{}"),
    ("error", "error", "{}"),
]
QUALITY_KEYS = ["gsm8k_acc", "rouge_l", "rouge_2", "pass@1", "pass@10", "mt_bench_score"]


def results_table(all_metrics: list[dict]) -> str:
    """A plain-text table of runs (only the columns some run has)."""
    columns = [
        c
        for c in TABLE_COLUMNS
        if any(m.get(c[1]) is not None for m in all_metrics)
        and (
            c[1] != "lossless_near_tie"
            or any(isinstance(m.get("lossless"), float) and m["lossless"] < 1 for m in all_metrics)
        )
    ]
    columns += [(k, k, "{:.3f}") for k in QUALITY_KEYS if any(k in m for m in all_metrics)]

    def cell(metrics, key, fmt):
        value, ci95 = metrics.get(key), metrics.get(f"{key}_ci95")
        if value is None or (isinstance(value, float) and math.isnan(value)):
            return "-"
        return fmt.format(value) + (f" ±{fmt.format(ci95)}" if ci95 is not None and not math.isnan(ci95) else "")

    grid = [[c[0] for c in columns]] + [[cell(m, key, fmt) for _, key, fmt in columns] for m in all_metrics]
    widths = [max(len(row[i]) for row in grid) for i in range(len(columns))]
    lines = [
        "  ".join(v.ljust(w) if i == 0 else v.rjust(w) for i, (v, w) in enumerate(zip(row, widths))) for row in grid
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
