#!/usr/bin/env bash
# The GPU checks in one command, on a machine with a CUDA card. Quickest and most wanted first, each with a time
# limit, each writing what it measured as soon as it has it (a machine lent for minutes may be taken back):
#   1. experiments/bench_gpu.py, short (3 GSM8K prompts x 128 new tokens, bf16);
#   2. experiments/bench_gpu.py at the setting of results/gpu/ (5 prompts x 256 new tokens), bf16;
#   3. tests/test_cuda.py: every decoder's greedy output equals ar's on the GPU, compiled steps included;
#   4. the bench again in fp32.
# Usage: bash experiments/gpu_check.sh OUT_DIR [bench_gpu.py options, e.g. --model llama2_7b_chat]
# Writes OUT_DIR/bench_gpu_<card>_<dtype>[_short].json, the two long ones' results pages (.md) and a .log beside each
# step; limits in seconds: SHORT_S (240), LONG_S (360), TESTS_S (300); STEPS names the steps to run (all four by
# default: bench_short bench_bf16 tests_cuda bench_fp32); PYTHON picks the interpreter.
set -uo pipefail
out=${1:?usage: bash experiments/gpu_check.sh OUT_DIR [bench_gpu.py options]}
shift
python=${PYTHON:-python}
mkdir -p "$out"
card=$("$python" -c "import re, torch; print(re.sub(r'^NVIDIA ', '', torch.cuda.get_device_name()).split()[0].lower())" \
  2>/dev/null) || { echo "gpu_check: no CUDA device visible to $python" >&2; exit 1; }
nvidia-smi > "$out/nvidia-smi.txt" 2>&1 || true
failed=0
steps=" ${STEPS:-bench_short bench_bf16 tests_cuda bench_fp32} "

step() {  # step NAME LIMIT COMMAND...: run one check (when STEPS names it) under a time limit, output in OUT_DIR/NAME.log
  local name=$1 limit=$2
  shift 2
  [[ $steps == *" $name "* ]] || return 0
  echo "gpu_check: $name (at most $limit s)" >&2
  timeout "$limit" "$@" > "$out/$name.log" 2>&1
  local rc=$?
  tail -n 25 "$out/$name.log"
  [ "$rc" -eq 0 ] || { echo "gpu_check: $name exited with $rc (124: past its limit)" >&2; failed=1; }
}

step bench_short "${SHORT_S:-240}" "$python" experiments/bench_gpu.py --limit 3 --max-new-tokens 128 \
  --json "$out/bench_gpu_${card}_bf16_short.json" "$@"
step bench_bf16 "${LONG_S:-360}" "$python" experiments/bench_gpu.py --json "$out/bench_gpu_${card}_bf16.json" \
  --markdown "$out/bench_gpu_${card}_bf16.md" "$@"
step tests_cuda "${TESTS_S:-300}" "$python" -m pytest -x -q tests/test_cuda.py
step bench_fp32 "${LONG_S:-360}" "$python" experiments/bench_gpu.py --dtype float32 \
  --json "$out/bench_gpu_${card}_fp32.json" --markdown "$out/bench_gpu_${card}_fp32.md" "$@"
exit $failed
