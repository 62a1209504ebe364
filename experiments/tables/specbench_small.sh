#!/usr/bin/env bash
# Spec-Bench-style table on the embedded model: ar, pld and hf_assisted on 5 GSM8K and 5 CNN/DM prompts,
# paired timing (ar timed right before each sample). A few minutes on a 2-core CPU. One torch thread by
# default (THREADS=n to change): on a shared machine more threads than free cores slow everything down.
# Usage: experiments/tables/specbench_small.sh [results dir] [extra overrides...]
set -euo pipefail
cd "$(dirname "$0")/../.."
RESULTS=${1:-results}
shift || true
SPECREPRO=${SPECREPRO:-.venv/bin/specrepro}
"$SPECREPRO" run -m model=smollm2_135m method=ar,pld,hf_assisted dataset=gsm8k,cnn_dm dataset.limit=5 \
  decoding=greedy timing.paired=true hardware.threads=${THREADS:-1} results_dir="$RESULTS" "$@"
"$SPECREPRO" table specbench_small --results-dir "$RESULTS"
