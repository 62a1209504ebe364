#!/usr/bin/env bash
# MT-Bench with the local judge (the embedded model, greedy): ar and pld answer both turns of 8 questions
# (one per category, ids in mt_bench_8_ids.json); every answer is judged (FastChat single-answer prompts,
# reference-guided for math/reasoning/coding); judgments are cached under <results>/judgments/.
# Usage: experiments/tables/mt_bench_judged.sh [results dir] [extra overrides, e.g. judge=openai judge.model=gpt-4]
set -euo pipefail
cd "$(dirname "$0")/../.."
RESULTS=${1:-results}
shift || true
SPECREPRO=${SPECREPRO:-.venv/bin/specrepro}
"$SPECREPRO" run -m model=smollm2_135m method=ar,pld dataset=mt_bench \
  dataset.ids_path=mt_bench/one_per_category_ids.json judge=local \
  hardware.threads=${THREADS:-1} results_dir="$RESULTS" "$@"
"$SPECREPRO" table mt_bench_judged --results-dir "$RESULTS"
