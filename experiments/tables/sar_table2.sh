#!/usr/bin/env bash
# SAR (001) Table 2 on the embedded model: trains one sar_draft head per variant (simplified = the paper's SAR,
# block = Medusa, redrafter = ReDrafter, lstm), sharing the target's LM head (training skips finished
# artifacts), then decodes GSM8K and sql_context with paired timing (ar timed right before each sample).
# Usage: experiments/tables/sar_table2.sh [results dir] [extra run overrides...]
# LIMIT (prompts per dataset, default 10), VARIANTS (default simplified,block,redrafter,lstm).
set -euo pipefail
cd "$(dirname "$0")/../.."
RESULTS=${1:-results}
shift || true
SPECREPRO=${SPECREPRO:-.venv/bin/specrepro}
VARIANTS=${VARIANTS:-simplified,block,redrafter,lstm}
"$SPECREPRO" train -m model=smollm2_135m method=sar_draft method.variant="$VARIANTS" method.shared_lm_head=true \
  hardware.threads=${THREADS:-1} results_dir="$RESULTS"
"$SPECREPRO" run -m model=smollm2_135m method=sar_draft method.variant="$VARIANTS" method.shared_lm_head=true \
  dataset=gsm8k,sql_context dataset.limit=${LIMIT:-10} decoding=greedy timing.paired=true \
  hardware.threads=${THREADS:-1} results_dir="$RESULTS" "$@"
"$SPECREPRO" table sar_table2 --results-dir "$RESULTS"
