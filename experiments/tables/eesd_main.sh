#!/usr/bin/env bash
# EESD Tables 1-3 (GSM8K, XSum, HumanEval, MT-Bench: speedup, HM, v_d, r_d) on the embedded model: sps and
# self_sd (METHODS), eesd with each draft-length control in CONTROLS plus fixed K = 1 and break-even Beta-TS
# (beyond the paper), and with a token tree of the head's top 4 at the first draft position (method.tree_width=4,
# beyond the paper) fixed K = 2 and break-even 0.15 with K <= 2, and Medusa-style heads (sar_draft block), all with paired timing.
# Train first (same results_dir): specrepro train method=sps; specrepro train method=self_sd;
# specrepro train method=eesd method.draft_vocab=4096;
# specrepro train method=sar_draft method.variant=block method.draft_vocab=4096 training=sar_draft_distilled
# Usage: experiments/tables/eesd_main.sh [results dir] [extra overrides...]
# LIMIT (prompts per dataset, default 10), DRAFT_VOCAB (eesd head's reduced vocabulary, default 4096; 0 = full),
# DATASETS (default gsm8k,xsum,humaneval,mt_bench).
set -euo pipefail
cd "$(dirname "$0")/../.."
RESULTS=${1:-results}
shift || true
SPECREPRO=${SPECREPRO:-.venv/bin/specrepro}
METHODS=${METHODS:-sps,self_sd}
CONTROLS=${CONTROLS:-beta_ts,cali_ts}
COMMON=(model=smollm2_135m dataset=${DATASETS:-gsm8k,xsum,humaneval,mt_bench} dataset.limit=${LIMIT:-10}
  decoding=greedy timing.paired=true hardware.threads=${THREADS:-1} results_dir="$RESULTS" "$@")
EESD=(method=eesd method.draft_vocab=${DRAFT_VOCAB:-4096})
"$SPECREPRO" run -m "${EESD[@]}" method.control="$CONTROLS" "${COMMON[@]}"
"$SPECREPRO" run -m "${EESD[@]}" method.control=fixed method.k=1 "${COMMON[@]}"
"$SPECREPRO" run -m "${EESD[@]}" method.control=fixed method.k=2 method.tree_width=4 "${COMMON[@]}"
"$SPECREPRO" run -m "${EESD[@]}" method.control=beta_ts method.beta_decision=break_even "${COMMON[@]}"
# with the tree, a round of K = 2 verifies 6 rows and K = 3 7 (1.16 AR steps here): cap K at 2
"$SPECREPRO" run -m "${EESD[@]}" method.control=beta_ts method.beta_decision=break_even method.beta_break_even=0.15 \
  method.k_max=2 method.tree_width=4 "${COMMON[@]}"
"$SPECREPRO" run -m method=sar_draft method.variant=block method.draft_vocab=4096 method.k=2 "${COMMON[@]}"
"$SPECREPRO" run -m method="$METHODS" "${COMMON[@]}"
for table in eesd_table1 eesd_table2 eesd_table3; do "$SPECREPRO" table "$table" --results-dir "$RESULTS"; done
