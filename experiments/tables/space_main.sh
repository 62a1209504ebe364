#!/usr/bin/env bash
# SPACE (000) tables on the embedded model: space_main (ar on base / SFT control / SAR-SFT, SPACE on SAR-SFT)
# and space_k_sweep (k = 2..6, fp32 and bf16). Train both checkpoints first:
#   specrepro train method=space                                  # SAR-SFT  -> space-smollm2_135m-*
#   specrepro train method=space training=space_sft_control       # SFT control -> space_sft_control-smollm2_135m-*
# or the grouped, self-distilled recipe and its control (training=space_grouped, training=space_grouped_sft_control);
# name the exact artifacts with SPACE=... SFT=... so runs of different checkpoints cannot be confused.
# Usage: experiments/tables/space_main.sh [results dir] [extra overrides...]
# LIMIT (prompts per dataset, default 10), SWEEP_LIMIT (k sweep, default 5), PASS10_LIMIT (HumanEval problems
# sampled 10 times at T 0.6, top-k 10, top-p 0.95, default 3; the paper's temperature is not stated).
set -euo pipefail
cd "$(dirname "$0")/../.."
RESULTS=${1:-results}
shift || true
SPECREPRO=${SPECREPRO:-.venv/bin/specrepro}
SPACE=${SPACE:-space-smollm2_135m}                 # artifact name or prefix (newest)
SFT=${SFT:-space_sft_control-smollm2_135m}
COMMON=(hardware.threads=${THREADS:-1} results_dir="$RESULTS" "$@")
SAR_SFT=(model.name=smollm2_135m_space model.source=artifact model.id="$SPACE")
MT_BENCH=(dataset=mt_bench dataset.ids_path=experiments/tables/mt_bench_8_ids.json)
"$SPECREPRO" run -m "${SAR_SFT[@]}" method=space dataset=xsum,humaneval dataset.limit=${LIMIT:-10} timing.paired=true \
  "${COMMON[@]}"
"$SPECREPRO" run -m "${SAR_SFT[@]}" method=space method.k=2,3,4,5,6 hardware.dtype=float32,bfloat16 dataset=xsum \
  dataset.limit=${SWEEP_LIMIT:-5} timing.paired=true "${COMMON[@]}"
"$SPECREPRO" run "${SAR_SFT[@]}" method=space "${MT_BENCH[@]}" timing.paired=true "${COMMON[@]}"
"$SPECREPRO" run -m model=smollm2_135m method=ar dataset=xsum,humaneval dataset.limit=${LIMIT:-10} "${COMMON[@]}"
"$SPECREPRO" run "${SAR_SFT[@]}" method=space dataset=humaneval dataset.limit=${PASS10_LIMIT:-3} decoding=sample \
  decoding.num_samples=10 decoding.top_k=10 decoding.top_p=0.95 "${COMMON[@]}"
"$SPECREPRO" run -m model=smollm2_135m model.name=smollm2_135m_sft model.source=artifact model.id="$SFT" method=ar \
  dataset=xsum,humaneval dataset.limit=${LIMIT:-10} "${COMMON[@]}"
"$SPECREPRO" table space_main --results-dir "$RESULTS"
"$SPECREPRO" table space_k_sweep --results-dir "$RESULTS"
