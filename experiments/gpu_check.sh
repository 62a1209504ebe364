#!/usr/bin/env bash
# The GPU checks in one command, on a machine with a CUDA card, sized to one call of a lent machine. Most wanted
# first, each under a time limit and all together under BUDGET_S, each writing what it measured as soon as it has it
# (the bench after every timed prompt, so a bench cut short still returns the prompts it timed):
#   1. experiments/bench_gpu.py at the setting of results/gpu/ (5 prompts x 256 new tokens), bf16, with compiled `ar`
#      checking only the guards that tell its graphs apart (--differentiating-guards), compiled `ar` on weights
#      folded into its graphs (--freezing), and compiled `ar` and `pld` with every step at one width, 32 as
#      hardware=cuda_bf16_compiled_exact (--row-invariant: is bf16 `pld` then token-identical to its `ar`, and at
#      what cost) beside it;
#   2. tests/test_cuda.py: every decoder's greedy output equals ar's on the GPU, compiled steps included;
#   3. experiments/profile_steps.py in bf16 (128 tokens, with --differentiating-guards --freezing): compiled `ar`'s wall
#      against kernel milliseconds and launches per token, to results/gpu/profile_steps_<card>_bf16.json;
#   4. the bench again in fp32, the same settings beside compiled `ar`.
# Usage: bash experiments/gpu_check.sh OUT_DIR [bench_gpu.py options, e.g. --model llama2_7b_chat]
# Writes results/gpu/bench_gpu_<card>_<dtype>.json and .md and the profile's JSON, copied to OUT_DIR, and
# OUT_DIR/gpu_check.log (nvidia-smi, then each step's output): six files, within the eight a lent machine's call
# returns. Seconds: BUDGET_S (540) for all steps, LONG_S (330) a bench, TESTS_S (200) the tests, PROFILE_S (240) the
# profile, MIN_S (60): a step with less left is skipped and said so. All four take more than one call: split them,
# STEPS="bench_bf16 tests_cuda" then STEPS="profile_bf16 bench_fp32".
# STEPS names the steps to run (default: bench_bf16 tests_cuda profile_bf16 bench_fp32); PYTHON picks the interpreter; METHODS and
# TRAINED_METHODS the bench's methods beside ar and pld (below); AR_SETTINGS the compiled-`ar` settings the benches
# and the profile time beside compiled `ar` (default: --differentiating-guards --freezing).
# On a checkout copied without .git, SPECREPRO_COMMIT names its commit (experiments/gpu_carry.sh writes it down).
set -uo pipefail
out=${1:?usage: bash experiments/gpu_check.sh OUT_DIR [bench_gpu.py options]}
shift
python=${PYTHON:-python3}
mkdir -p "$out"
card=$("$python" -c "import re, torch; print(re.sub(r'^NVIDIA ', '', torch.cuda.get_device_name()).split()[0].lower())" \
  2>/dev/null) || { echo "gpu_check: no CUDA device visible to $python" >&2; exit 1; }
carried_commit="$(dirname "$0")/../.gpucarry/1/commit"
[ -n "${SPECREPRO_COMMIT:-}" ] || [ ! -f "$carried_commit" ] || export SPECREPRO_COMMIT=$(cat "$carried_commit")
log="$out/gpu_check.log"
nvidia-smi > "$log" 2>&1 || true
failed=0
steps=" ${STEPS:-bench_bf16 tests_cuda profile_bf16 bench_fp32} "
deadline=$(( SECONDS + ${BUDGET_S:-540} ))

step() {  # step NAME LIMIT COMMAND...: run one check (when STEPS names it) under its limit and the budget left
  local name=$1 limit=$2
  shift 2
  [[ $steps == *" $name "* ]] || return 0
  local left=$(( deadline - SECONDS ))
  (( limit > left )) && limit=$left
  if (( limit < ${MIN_S:-60} )); then
    echo "gpu_check: $name skipped: $left s of BUDGET_S left" | tee -a "$log" >&2
    failed=1
    return 0
  fi
  echo "gpu_check: $name (at most $limit s)" | tee -a "$log" >&2
  timeout "$limit" "$@" > "$out/.$name.log" 2>&1
  local rc=$?
  tail -n 25 "$out/.$name.log"
  cat "$out/.$name.log" >> "$log" && rm "$out/.$name.log"
  local why="its output is in $(basename "$log")"
  [ "$rc" -ne 124 ] || why="past its limit"
  [ "$rc" -eq 0 ] || { echo "gpu_check: $name exited with $rc ($why)" | tee -a "$log" >&2; failed=1; }
}

written() {  # written NAME LIMIT FILES COMMAND...: a step whose FILES (space-separated) go to results/gpu/, where they
  # are committed and which their regenerating command names (not a lent machine's OUT_DIR), then to OUT_DIR if this
  # step wrote them
  local name=$1 limit=$2 files=$3
  shift 3
  [[ $steps == *" $name "* ]] || return 0
  mkdir -p results/gpu && touch "$out/.started"
  step "$name" "$limit" "$@"
  local file
  for file in $files; do
    [ "$file" -nt "$out/.started" ] && [ "$(realpath "$out")" != "$(realpath results/gpu)" ] && cp "$file" "$out"/
  done
  rm -f "$out/.started"
}

bench() {  # bench NAME SUFFIX [bench_gpu.py options]: its JSON and page
  local name=$1 page="results/gpu/bench_gpu_${card}_$2"
  shift 2
  written "$name" "${LONG_S:-330}" "$page.json $page.md" \
    "$python" experiments/bench_gpu.py --json "$page.json" --markdown "$page.md" "$@"
}

# the bench's methods beside ar and pld: METHODS always (jacobi needs nothing trained), TRAINED_METHODS where their
# artifacts were carried (results/gpu/README.md's trained drafters); a --methods option given here overrides METHODS
trained="sar_draft method.draft_vocab=4096 method.k=2;self_sd_tree;eesd method.draft_vocab=4096;eesd_tree_break_even;eagle_tree_small"
methods=(--methods "${METHODS-jacobi}" --trained-methods "${TRAINED_METHODS-$trained}")
read -ra ar_settings <<< "${AR_SETTINGS---differentiating-guards --freezing}"
bench bench_bf16 bf16 --widths 1,4,16,32 --row-invariant "${ar_settings[@]}" "${methods[@]}" "$@"
step tests_cuda "${TESTS_S:-200}" "$python" -m pytest -x -q -p no:cacheprovider tests/test_cuda.py
profile="results/gpu/profile_steps_${card}_bf16.json"
written profile_bf16 "${PROFILE_S:-240}" "$profile" \
  "$python" experiments/profile_steps.py --dtype bfloat16 --tokens 128 "${ar_settings[@]}" --json "$profile"
bench bench_fp32 fp32 --dtype float32 "${ar_settings[@]}" "${methods[@]}" "$@"
exit $failed
