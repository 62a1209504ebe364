#!/usr/bin/env bash
# SAR (001) Table 2 on the embedded model: trains one sar_draft head per variant (simplified = the paper's SAR,
# block = Medusa, redrafter = ReDrafter, lstm), each with its own output layer W_3 over a 4,096-token draft
# vocabulary, on references + the target's own continuations (TRAINING, default sar_draft_onpolicy: EESD's cached
# bf16 continuations and 800 steps; the target's hidden states of the training rows are computed once and shared by
# the four heads, then each head takes 4-10 min on 1 thread; training skips finished artifacts), then decodes GSM8K
# and sql_context with paired timing (ar timed right before each sample), and GSM8K again in bf16 with row-invariant
# forwards, then every head with a token tree (method.tree_width=4, beyond the paper).
# Usage: experiments/tables/sar_table2.sh [results dir] [extra run overrides...]
# LIMIT (prompts per dataset, default 10), VARIANTS (default simplified,block,redrafter,lstm), K (draft length,
# default 2), DRAFT_VOCAB (default 4096), TREE_VARIANTS (default: VARIANTS).
set -euo pipefail
cd "$(dirname "$0")/../.."
RESULTS=${1:-results}
shift || true
SPECREPRO=${SPECREPRO:-.venv/bin/specrepro}
COMMON=(model=smollm2_135m method=sar_draft method.draft_vocab=${DRAFT_VOCAB:-4096} hardware.threads=${THREADS:-1}
  results_dir="$RESULTS")
HEADS=("${COMMON[@]}" method.variant="${VARIANTS:-simplified,block,redrafter,lstm}")
"$SPECREPRO" train -m "${HEADS[@]}" training=${TRAINING:-sar_draft_onpolicy}
"$SPECREPRO" run -m "${HEADS[@]}" method.k=${K:-2} dataset=gsm8k,sql_context dataset.limit=${LIMIT:-10} \
  decoding=greedy timing.paired=true "$@"
"$SPECREPRO" run -m "${HEADS[@]}" method.k=${K:-2} dataset=gsm8k dataset.limit=${LIMIT:-10} decoding=greedy \
  timing.paired=true hardware.dtype=bfloat16 hardware.row_invariant=true "$@"
# beyond the paper: the head's top 4 at the first draft position verified as a token tree (6 rows at K = 2)
"$SPECREPRO" run -m "${COMMON[@]}" method.variant="${TREE_VARIANTS:-${VARIANTS:-simplified,block,redrafter,lstm}}" method.k=${K:-2} \
  method.tree_width=4 dataset=gsm8k,sql_context dataset.limit=${LIMIT:-10} decoding=greedy timing.paired=true "$@"
"$SPECREPRO" table sar_table2 --results-dir "$RESULTS"
