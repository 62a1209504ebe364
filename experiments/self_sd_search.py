"""Draft & Verify (002) skip-set search: Bayesian optimisation against random search with the same budget.

For each seed, `specrepro train method=self_sd` runs BO and its ablation, `training.search=random`, with the
same number of evaluations of the same objective (greedy self_sd tok/s over ar's on the development prompts,
paired). The best set of each search then decodes a task (CNN/DM by default, paired timing). Prints, per
search: the best development objective, the skipped sub-layers, the search time, and the task speedup and
MAT of its set. Searches and runs resume: a finished artifact or run record is reused, not recomputed.

`--acq-restarts` bounds BO's own time per suggestion (`training.acq_restarts`), so that 80 evaluations fit about
15 minutes of one CPU thread, as random search's do. `--threshold` is the skip threshold of both searches (a
sub-layer is skipped when its variable exceeds it; random sets then skip 1 - threshold of the sub-layers). The
official 0.5 suits a 13B model; the embedded 135M model accepts almost no draft when half its sub-layers are
skipped, so the default here is 0.7. `--decoding` is how the searches decode their development prompts and the task
runs decode: `paper` (the adaptive draft exit, official search settings) or `tree` (fixed K=1, the draft's top 4 as a
token tree, a draft vocabulary of 4096 frequent tokens + the prompt's; beyond the paper).

Run: .venv/bin/python experiments/self_sd_search.py [--seeds 1 2] [--iterations 80] [--acq-restarts 2] [--limit 10]
     [--decoding paper|tree] [overrides...]
"""

from __future__ import annotations

import argparse
import json

from common import compose_config, run_script

from specrepro.runner import run
from specrepro.training import train

# the decoder settings of each --decoding choice (method.* for runs; training.decoder.* for the search)
DECODINGS = {"paper": {}, "tree": {"control": "fixed", "k": 1, "tree_width": 4, "draft_vocab": 4096}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--iterations", type=int, default=80)
    parser.add_argument("--threshold", type=float, default=0.7)
    parser.add_argument("--dev-records", type=int, default=1, help="development prompts per prompt set")
    parser.add_argument(
        "--acq-restarts",
        type=int,
        default=2,
        help="L-BFGS-B starts per BO suggestion (library default 10: 2-20 s per suggestion here)",
    )
    parser.add_argument("--decoding", choices=sorted(DECODINGS), default="paper")
    parser.add_argument("--dataset", default="cnn_dm")
    parser.add_argument("--limit", type=int, default=10)
    parser.add_argument("--results-dir", default="results")
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides for every job, e.g. hardware.threads=1")
    args = parser.parse_args()

    every_job = [f"results_dir={args.results_dir}", *args.overrides]
    decoding = DECODINGS[args.decoding]
    rows = []
    for seed in args.seeds:
        for search in ("bayes", "random"):
            artifact = train(
                compose_config(
                    "train",
                    [
                        "method=self_sd",
                        f"training.search={search}",
                        f"training.seed={seed}",
                        *([f"training.acq_restarts={args.acq_restarts}"] if search == "bayes" else []),
                        f"training.iterations={args.iterations}",
                        f"training.threshold={args.threshold}",
                        f"training.dev_records={args.dev_records}",
                        *[f"training.decoder.{k}={v}" for k, v in decoding.items()],
                        *every_job,
                    ],
                )
            )
            found = json.loads((artifact / "artifact.json").read_text())["metrics"]
            task = run(
                compose_config(
                    "run",
                    [
                        "method=self_sd",
                        f"method.skip_set={artifact.name}",
                        *[f"method.{k}={v}" for k, v in decoding.items()],
                        f"dataset={args.dataset}",
                        f"dataset.limit={args.limit}",
                        "decoding=greedy",
                        "timing.paired=true",
                        *every_job,
                    ],
                )
            )
            rows.append((seed, search, found, task))

    print(
        f"\n== skip-set search: {args.iterations} evaluations, threshold {args.threshold}, {args.decoding} decoding; "
        f"{args.dataset}, {args.limit} prompts =="
    )
    print(
        f"{'seed':>4}  {'search':<6}  {'dev objective':>13}  {'attn+mlp skipped':>16}  {'search min':>10}  "
        f"{'speedup':>7}  {'MAT':>5}"
    )
    for seed, search, found, task in rows:
        skipped = f"{found['n_attn_skipped']}+{found['n_mlp_skipped']}"
        print(
            f"{seed:>4}  {search:<6}  {found['best_objective']:>13.3f}  {skipped:>16}  "
            f"{found['search_seconds'] / 60:>10.1f}  {task['speedup_paired']:>6.2f}x  {task['mat']:>5.2f}"
        )


if __name__ == "__main__":
    run_script(main)
