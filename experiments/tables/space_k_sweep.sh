#!/usr/bin/env bash
# SPACE (000) k sweep on the embedded model: k = 2..6 from one SAR-SFT checkpoint (trained with k = 6:
# `specrepro train method=space`), fp32 and bf16 (row-invariant), 5 XSum prompts, paired timing. space_main.sh runs it too.
# Usage: experiments/tables/space_k_sweep.sh [results dir] [extra overrides...]; SWEEP_LIMIT (default 5); KS (default
# 2,3,4,5,6: at most the checkpoint's training k, 3 for training=space_grouped_k3, 2 for space_grouped_k2).
set -euo pipefail
cd "$(dirname "$0")/../.."
RESULTS=${1:-results}
shift || true
SPECREPRO=${SPECREPRO:-.venv/bin/specrepro}
SPACE=${SPACE:-space-smollm2_135m}
SWEEP=(model.name=smollm2_135m_space model.source=artifact model.id="$SPACE" method=space method.k=${KS:-2,3,4,5,6}
  dataset=xsum dataset.limit=${SWEEP_LIMIT:-5} timing.paired=true hardware.threads=${THREADS:-1} results_dir="$RESULTS")
"$SPECREPRO" run -m "${SWEEP[@]}" hardware.dtype=float32 "$@"
"$SPECREPRO" run -m "${SWEEP[@]}" hardware.dtype=bfloat16 hardware.row_invariant=true "$@"  # bf16 lossless needs it
"$SPECREPRO" table space_k_sweep --results-dir "$RESULTS"
