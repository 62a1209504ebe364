"""Benchmark: sps and pld against ar, and our pld against transformers' prompt lookup, on the embedded model.

Every method runs through the harness with `timing.paired=true`: `ar` is timed on each sample right
before the method, in this same process, so `speedup_paired` is robust to a shared, noisy machine.
Prints, per dataset, the paired speedups (and the unpaired ones with --reference) with the MAT, acceptance,
draft cost, verify cost and lossless_paired (method tokens == the paired ar tokens)
behind them (cost = ms per step / ms per `ar` step), and our pld / HF prompt lookup.

Run: .venv/bin/python experiments/bench_speculative.py [--limit 20] [--datasets gsm8k cnn_dm]
The sps arm needs the trained draft: .venv/bin/specrepro train method=sps
"""

from __future__ import annotations

import argparse

from common import compose_config, run_script

from specrepro.metrics.summary import results_table
from specrepro.runner import run

ARMS = {
    "sps": ["method=sps"],
    "pld": ["method=pld"],
    "hf_pld": ["method=hf_assisted", "method.mode=prompt_lookup"],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", type=int, default=20)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--datasets", nargs="+", default=["gsm8k", "cnn_dm"])
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    parser.add_argument("--results-dir", default="results/bench")
    parser.add_argument("--artifacts-dir", default="results/artifacts")
    parser.add_argument(
        "--reference",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="also run the unpaired ar reference (speedup_mean/total); paired figures need none",
    )
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides, e.g. hardware.threads=2")
    args = parser.parse_args()

    for dataset in args.datasets:
        rows = []
        for arm in args.arms:
            overrides = [
                *ARMS[arm],
                f"dataset={dataset}",
                f"dataset.limit={args.limit}",
                f"decoding.max_new_tokens={args.max_new_tokens}",
                "timing.paired=true",
                "logger=none",
                f"reference={str(args.reference).lower()}",
                f"results_dir={args.results_dir}",
                f"artifacts_dir={args.artifacts_dir}",
                *args.overrides,
            ]
            metrics = run(compose_config("run", overrides))
            metrics["run_name"] = arm
            rows.append(metrics)
        print(f"\n== {dataset} ({args.limit} prompts, {args.max_new_tokens} new tokens) ==")
        print(results_table(rows))
        by_arm = {m["run_name"]: m for m in rows}
        if "pld" in by_arm and "hf_pld" in by_arm:
            ratio = by_arm["pld"]["speedup_paired"] / by_arm["hf_pld"]["speedup_paired"]
            print(f"our pld / HF prompt lookup (paired speedups): {ratio:.3f}")


if __name__ == "__main__":
    run_script(main)
