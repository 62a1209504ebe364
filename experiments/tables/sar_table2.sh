#!/usr/bin/env bash
# SAR (001) Table 2 on the embedded model: trains one sar_draft head per variant (simplified = the paper's SAR,
# block = Medusa, redrafter = ReDrafter, lstm), each with its own output layer W_3 over a 4,096-token draft
# vocabulary, on references + the target's own continuations (training=sar_draft_distilled; training skips
# finished artifacts), then decodes GSM8K and sql_context with paired timing (ar timed right before each sample),
# and GSM8K again in bf16 with row-invariant forwards.
# Usage: experiments/tables/sar_table2.sh [results dir] [extra run overrides...]
# LIMIT (prompts per dataset, default 10), VARIANTS (default simplified,block,redrafter,lstm), K (draft length,
# default 2), DRAFT_VOCAB (default 4096).
set -euo pipefail
cd "$(dirname "$0")/../.."
RESULTS=${1:-results}
shift || true
SPECREPRO=${SPECREPRO:-.venv/bin/specrepro}
HEADS=(model=smollm2_135m method=sar_draft method.variant="${VARIANTS:-simplified,block,redrafter,lstm}"
  method.draft_vocab=${DRAFT_VOCAB:-4096} hardware.threads=${THREADS:-1} results_dir="$RESULTS")
"$SPECREPRO" train -m "${HEADS[@]}" training=sar_draft_distilled
"$SPECREPRO" run -m "${HEADS[@]}" method.k=${K:-2} dataset=gsm8k,sql_context dataset.limit=${LIMIT:-10} \
  decoding=greedy timing.paired=true "$@"
"$SPECREPRO" run -m "${HEADS[@]}" method.k=${K:-2} dataset=gsm8k dataset.limit=${LIMIT:-10} decoding=greedy \
  timing.paired=true hardware.dtype=bfloat16 hardware.row_invariant=true "$@"
"$SPECREPRO" table sar_table2 --results-dir "$RESULTS"
