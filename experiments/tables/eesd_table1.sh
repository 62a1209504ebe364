#!/usr/bin/env bash
# EESD Table 1 (GSM8K and XSum, HM and speedup) on the embedded model: sps and self_sd (METHODS), eesd with
# each draft-length control in CONTROLS (method.control values) and Medusa-style heads (sar_draft block).
# Train first (same results_dir): specrepro train method=sps; specrepro train method=self_sd;
# specrepro train method=eesd method.draft_vocab=4096; specrepro train method=sar_draft method.variant=block method.shared_lm_head=true
# Usage: experiments/tables/eesd_table1.sh [results dir] [extra overrides...]
# LIMIT (prompts per dataset, default 20), DRAFT_VOCAB (eesd head's reduced vocabulary, default 4096; 0 = full).
set -euo pipefail
cd "$(dirname "$0")/../.."
RESULTS=${1:-results}
shift || true
SPECREPRO=${SPECREPRO:-.venv/bin/specrepro}
METHODS=${METHODS:-sps,self_sd}
CONTROLS=${CONTROLS:-beta_ts,cali_ts}
COMMON=(model=smollm2_135m dataset=gsm8k,xsum dataset.limit=${LIMIT:-20} decoding=greedy hardware.threads=${THREADS:-1}
  results_dir="$RESULTS" "$@")
"$SPECREPRO" run -m method="$METHODS" "${COMMON[@]}"
"$SPECREPRO" run -m method=eesd method.draft_vocab=${DRAFT_VOCAB:-4096} method.control="$CONTROLS" "${COMMON[@]}"
"$SPECREPRO" run -m method=sar_draft method.variant=block method.shared_lm_head=true "${COMMON[@]}"
"$SPECREPRO" table eesd_table1 --results-dir "$RESULTS"
