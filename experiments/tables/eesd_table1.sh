#!/usr/bin/env bash
# EESD Table 1 (GSM8K and XSum, HM and speedup) on the embedded model. Runs the methods implemented so
# far (sps needs its draft: `specrepro train method=sps` once); add eesd/self_sd to METHODS as they land.
# Usage: experiments/tables/eesd_table1.sh [results dir] [extra overrides...]
set -euo pipefail
cd "$(dirname "$0")/../.."
RESULTS=${1:-results}
shift || true
SPECREPRO=${SPECREPRO:-.venv/bin/specrepro}
METHODS=${METHODS:-sps}
"$SPECREPRO" run -m model=smollm2_135m method="$METHODS" dataset=gsm8k,xsum dataset.limit=${LIMIT:-20} \
  decoding=greedy results_dir="$RESULTS" "$@"
"$SPECREPRO" table eesd_table1 --results-dir "$RESULTS"
