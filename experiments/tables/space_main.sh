#!/usr/bin/env bash
# SPACE (000) tables on the embedded model: space_main (ar on base / SFT control / SAR-SFT, SPACE on SAR-SFT)
# and space_k_sweep (k = 2..6, fp32 and row-invariant bf16). Train both checkpoints first:
#   specrepro train method=space                                  # SAR-SFT  -> space-smollm2_135m-*
#   specrepro train method=space training=space_sft_control       # SFT control -> space_sft_control-smollm2_135m-*
# or the grouped, self-distilled recipe and its control (training=space_grouped, training=space_grouped_sft_control);
# name the exact artifacts with SPACE=... SFT=... so runs of different checkpoints cannot be confused.
# Usage: experiments/tables/space_main.sh [results dir] [extra overrides...]
# K (the main runs' k, default 5 as the paper), KS (the sweep's, default 2,3,4,5,6; both at most the checkpoint's
# training k: 3 for training=space_grouped_k3, 2 for space_grouped_k2), LIMIT (prompts per dataset, default 10),
# SWEEP_LIMIT (k sweep, default 5), PASS10_LIMIT (HumanEval problems sampled 10 times at T 0.6, top-k 10,
# top-p 0.95, default 3; the paper's temperature is not stated).
# MT-Bench runs are judged by judge=local unless overridden (e.g. judge=openai); the quality runs (ar on each
# checkpoint) also score the NLL of the references under their weights (reference_nll=true).
set -euo pipefail
cd "$(dirname "$0")/../.."
RESULTS=${1:-results}
shift || true
SPECREPRO=${SPECREPRO:-.venv/bin/specrepro}
SPACE=${SPACE:-space-smollm2_135m}                 # artifact name or prefix (newest)
SFT=${SFT:-space_sft_control-smollm2_135m}
export K=${K:-5}  # the table's SPACE row selects and names this k
COMMON=(hardware.threads=${THREADS:-1} results_dir="$RESULTS" "$@")
BASE=(model=smollm2_135m)
SFT_CONTROL=(model=smollm2_135m model.name=smollm2_135m_sft model.source=artifact model.id="$SFT")
SAR_SFT=(model.name=smollm2_135m_space model.source=artifact model.id="$SPACE")
TASKS=(dataset=xsum,humaneval dataset.limit=${LIMIT:-10})
MT_BENCH=(dataset=mt_bench dataset.ids_path=mt_bench/one_per_category_ids.json judge=local reference_nll=true)
# speed: SPACE on SAR-SFT, lossless against ar on the same checkpoint
"$SPECREPRO" run -m "${SAR_SFT[@]}" method=space method.k=$K "${TASKS[@]}" timing.paired=true "${COMMON[@]}"
SWEEP=("${SAR_SFT[@]}" method=space method.k=${KS:-2,3,4,5,6} dataset=xsum dataset.limit=${SWEEP_LIMIT:-5} timing.paired=true)
"$SPECREPRO" run -m "${SWEEP[@]}" hardware.dtype=float32 "${COMMON[@]}"
"$SPECREPRO" run -m "${SWEEP[@]}" hardware.dtype=bfloat16 hardware.row_invariant=true "${COMMON[@]}"
"$SPECREPRO" run "${SAR_SFT[@]}" method=space method.k=$K "${MT_BENCH[@]}" timing.paired=true "${COMMON[@]}"
"$SPECREPRO" run "${SAR_SFT[@]}" method=space method.k=$K dataset=humaneval dataset.limit=${PASS10_LIMIT:-3} decoding=sample \
  decoding.num_samples=10 decoding.top_k=10 decoding.top_p=0.95 "${COMMON[@]}"
# quality of each checkpoint under ar: ROUGE-L, pass@1, the judge's MT-Bench score, reference NLL
for MODEL in BASE SFT_CONTROL SAR_SFT; do
  declare -n OVERRIDES=$MODEL
  "$SPECREPRO" run -m "${OVERRIDES[@]}" method=ar "${TASKS[@]}" reference_nll=true "${COMMON[@]}"
  "$SPECREPRO" run "${OVERRIDES[@]}" method=ar "${MT_BENCH[@]}" "${COMMON[@]}"
done
"$SPECREPRO" table space_main --results-dir "$RESULTS"
"$SPECREPRO" table space_k_sweep --results-dir "$RESULTS"
