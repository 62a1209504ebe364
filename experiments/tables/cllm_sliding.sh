#!/usr/bin/env bash
# CLLM (004) beyond the paper: Jacobi with a sliding window (method.sliding=true: the state stays at n - 1 guesses)
# against the paper's shrinking block, on the base model and on a CLLM trained with n = 4, GSM8K (CLLM's prompt,
# 0-shot) in fp32 and bf16 (row-invariant, so still lossless) and 8 MT-Bench questions; paired timing.
# Usage: CLLM4=<artifact> experiments/tables/cllm_sliding.sh [results dir] [extra overrides...]
# CLLM4: a CLLM trained with n = 4 (specrepro train method=cllm training.stage=trajectories|train
# training.block_size=4); LIMIT (GSM8K problems, default 10). The options match cllm_block_size.sh, so its
# block-mode runs are reused. The table reads CLLM4 and LIMIT too, so its cells are this artifact's runs.
set -euo pipefail
cd "$(dirname "$0")/../.."
RESULTS=${1:-results}
shift || true
SPECREPRO=${SPECREPRO:-.venv/bin/specrepro}
: "${CLLM4:?set CLLM4 to the artifact of a CLLM trained with n = 4}"
GSM8K=(dataset=gsm8k dataset.template=cllm dataset.prompt_style=completion dataset.few_shot=0 "dataset.cut_at=[Question]"
  dataset.limit=${LIMIT:-10})
MT_BENCH=(dataset=mt_bench dataset.ids_path=mt_bench/one_per_category_ids.json judge=local)
COMMON=(decoding=greedy timing.paired=true reference_nll=true hardware.threads=${THREADS:-1} results_dir="$RESULTS" "$@")
BF16=(hardware.dtype=bfloat16 hardware.row_invariant=true)
BASE=(model=smollm2_135m method=jacobi)
CLLM4_MODEL=(model=smollm2_135m model.name=smollm2_135m_cllm_n4 model.source=artifact model.id="$CLLM4" method=cllm)
"$SPECREPRO" run -m "${CLLM4_MODEL[@]}" "${GSM8K[@]}" method.block_size=3,4,5,8 method.sliding=false,true "${COMMON[@]}"
"$SPECREPRO" run -m "${BASE[@]}" "${GSM8K[@]}" method.block_size=4 method.sliding=false,true "${COMMON[@]}"
"$SPECREPRO" run -m "${CLLM4_MODEL[@]}" "${GSM8K[@]}" method.block_size=4 method.sliding=false,true "${COMMON[@]}" "${BF16[@]}"
"$SPECREPRO" run -m "${CLLM4_MODEL[@]}" "${MT_BENCH[@]}" method.block_size=4 method.sliding=false,true "${COMMON[@]}"
"$SPECREPRO" table cllm_sliding --results-dir "$RESULTS"
