#!/usr/bin/env bash
# EESD (003) Table 4's draft-length rows on the embedded model: eesd with Beta-TS and Cali-TS (the same runs as
# eesd_main.sh at equal LIMIT), with a fixed draft length K (KS), and with token trees of the head's top 4 at the
# first draft position (method.tree_width=4, beyond the paper), on GSM8K and XSum.
# Train the head first (same results_dir): specrepro train method=eesd method.draft_vocab=4096
# Usage: experiments/tables/eesd_table4.sh [results dir] [extra overrides...]
# LIMIT (prompts per dataset, default 20), KS (fixed K values, default 1,2,4,5,6,10), DRAFT_VOCAB (the head's
# reduced vocabulary, default 4096; 0 = the paper's full head).
set -euo pipefail
cd "$(dirname "$0")/../.."
RESULTS=${1:-results}
shift || true
SPECREPRO=${SPECREPRO:-.venv/bin/specrepro}
KS=${KS:-1,2,4,5,6,10}
COMMON=(model=smollm2_135m method=eesd method.draft_vocab=${DRAFT_VOCAB:-4096} dataset=gsm8k,xsum dataset.limit=${LIMIT:-20} decoding=greedy
  timing.paired=true hardware.threads=${THREADS:-1} results_dir="$RESULTS" "$@")
"$SPECREPRO" run -m method.control=beta_ts,cali_ts "${COMMON[@]}"
"$SPECREPRO" run -m method.control=beta_ts method.beta_decision=break_even "${COMMON[@]}"
"$SPECREPRO" run -m method.control=fixed method.k="$KS" "${COMMON[@]}"
"$SPECREPRO" run -m method.control=fixed method.k=1,2 method.tree_width=4 "${COMMON[@]}"
"$SPECREPRO" run -m method.control=beta_ts method.beta_decision=break_even method.beta_break_even=0.15 method.k_max=2 \
  method.tree_width=4 "${COMMON[@]}"
"$SPECREPRO" table eesd_table4 --results-dir "$RESULTS"
