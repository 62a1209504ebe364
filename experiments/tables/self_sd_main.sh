#!/usr/bin/env bash
# Draft & Verify (002) main table on the embedded model: self_sd (two arms, below) on CNN/DM, XSum (1-shot,
# the dataset configs' default) and HumanEval, greedy, fp32; CNN/DM again in bf16 with row-invariant forwards
# (greedy stays token-identical to bf16 ar); HumanEval sampled 10 times
# (decoding=sample: T 0.6, top-p 0.95) for pass@10. All with paired timing. Each self_sd run first makes its ar
# reference run (the table's ar row). Find the skip set first (same results_dir): specrepro train method=self_sd
# Usage: experiments/tables/self_sd_main.sh [results dir] [extra overrides...]
# LIMIT (prompts per dataset, default 10), PASS10_LIMIT (HumanEval problems sampled 10 times, default 3),
# SKIP_SET (a self_sd_skip_set artifact; default: the newest). The table reads SKIP_SET too: set, the self_sd rows are
# that set's runs; unset, the newest self_sd run per cell.
set -euo pipefail
cd "$(dirname "$0")/../.."
RESULTS=${1:-results}
shift || true
SPECREPRO=${SPECREPRO:-.venv/bin/specrepro}
# ARMS (default both): paper = the adaptive draft exit; tree = fixed K=1, a token tree of the draft's top 4 and a
# draft vocabulary of the 4096 most frequent ShareGPT tokens + the prompt's (beyond the paper).
declare -A ARM_OVERRIDES=([paper]="method.control=adaptive"
                          [tree]="method.control=fixed method.k=1 method.tree_width=4 method.draft_vocab=4096")
for arm in ${ARMS:-paper tree}; do
  read -ra ARM <<< "${ARM_OVERRIDES[$arm]}"
  COMMON=(model=smollm2_135m method=self_sd method.skip_set=${SKIP_SET:-self_sd_skip_set} "${ARM[@]}" timing.paired=true
          hardware.threads=${THREADS:-1} results_dir="$RESULTS" "$@")
  "$SPECREPRO" run -m dataset=cnn_dm,xsum,humaneval dataset.limit=${LIMIT:-10} decoding=greedy "${COMMON[@]}"
  "$SPECREPRO" run dataset=cnn_dm dataset.limit=${LIMIT:-10} decoding=greedy hardware.dtype=bfloat16 hardware.row_invariant=true "${COMMON[@]}"
  "$SPECREPRO" run dataset=humaneval dataset.limit=${PASS10_LIMIT:-3} decoding=sample "${COMMON[@]}"
done
"$SPECREPRO" table self_sd_main --results-dir "$RESULTS"
