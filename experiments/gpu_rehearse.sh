#!/usr/bin/env bash
# Rehearse a lent GPU machine's calls here, on the CPU, before spending its minutes. A lent machine's python3 holds
# torch and its image's packages, not this project's dependencies: this makes a fresh venv with torch and only the
# image's packages the GPU path imports (IMAGE below; the device library's package list names them all), carries
# and installs the rest into it as on the machine (gpu_carry.sh, then gpu_setup.sh, in a clone of this commit),
# then runs gpu_check.sh's bench and test steps (a probe that names a card "rehearsal"; the bench on the CPU, one
# prompt, eager backend), its profile script (4 tokens) and gpu_leaderboard.sh's rows at smoke size. A module the machine lacks shows in a log as
# one line naming it; a trained row whose artifact was not named here is not run, and the log names what it lacks.
# Usage: bash experiments/gpu_rehearse.sh [ARTIFACT_DIR ...]   (what gpu_carry.sh would carry; takes ~15 minutes)
# REHEARSE_DIR (/tmp/gpu_rehearse): the venv, the clone and the two calls' OUT_DIRs. Needs the package index.
set -euo pipefail
cd "$(dirname "$0")/.."
dir=$(realpath -m "${REHEARSE_DIR:-/tmp/gpu_rehearse}")
image=(accelerate numpy huggingface_hub pandas pyarrow xxhash fsspec requests httpx pyyaml regex safetensors tokenizers
  peft filelock aiohttp jinja2 psutil tqdm scipy matplotlib sentencepiece joblib absl-py six click pytest)
artifacts=()
for artifact in "$@"; do artifacts+=("$(realpath "$artifact")"); done
rm -rf "$dir" && mkdir -p "$dir"
python3 -m venv "$dir/venv"
python="$dir/venv/bin/python"
"$python" -m pip install -q "torch==2.13.0"
"$python" -m pip install -q -c constraints.txt "${image[@]}"
git clone -q . "$dir/checkout"
cd "$dir/checkout"
PY_VERSION=$("$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])') PYTHON=python3 \
  bash experiments/gpu_carry.sh "${artifacts[@]}"
rm -rf .git  # as on the lent machine, whose copy of the checkout has none: provenance reads the carried commit
PYTHON="$python" bash experiments/gpu_setup.sh

probe="$dir/python"  # gpu_check.sh's card probe answers "rehearsal"; everything else runs in the venv
printf '#!/bin/sh\ncase "$2" in *get_device_name*) echo rehearsal; exit 0;; esac\nexec %s "$@"\n' "$python" > "$probe"
chmod +x "$probe"
failed=0
PYTHON="$probe" STEPS="bench_bf16 tests_cuda" AR_SETTINGS=--differentiating-guards BUDGET_S=1800 LONG_S=1200 \
  bash experiments/gpu_check.sh "$dir/check_out" --device cpu --backend eager --threads 1 --limit 1 \
  --max-new-tokens 8 > /dev/null || failed=1
"$python" experiments/profile_steps.py --device cpu --backend eager --dtype bfloat16 --tokens 4 --differentiating-guards \
  --json "$dir/check_out/profile_steps.json" >> "$dir/check_out/gpu_check.log" 2>&1 \
  && echo "gpu_check: profile_bf16 ran (on the CPU, 4 tokens)" >> "$dir/check_out/gpu_check.log" || failed=1
PYTHON="$python" HARDWARE=default BUDGET_S=3600 \
  ROW_OVERRIDES="decoding.max_new_tokens=8 timing.warmup_tokens=2 hardware.threads=1 dataset.limit=1" \
  bash experiments/gpu_leaderboard.sh "$dir/leaderboard_out" 2> /dev/null || failed=1
mkdir -p "$dir/packed" && tar -C "$dir/packed" -xzf "$dir/leaderboard_out/specbench_gpu_runs.tar.gz" || failed=1
"$python" - "$dir/packed" "$(cat .gpucarry/1/commit)" >> "$dir/leaderboard_out/gpu_leaderboard.log" <<'PY' || failed=1
import json, pathlib, sys
runs = list(pathlib.Path(sys.argv[1]).glob("runs/*/metrics.json"))
commits = {json.loads(path.read_text())["provenance"]["code"]["commit"] for path in runs}
print(f"gpu_leaderboard: the {len(runs)} packed runs' provenance names commit(s) {', '.join(map(str, sorted(commits, key=str)))}")
sys.exit(commits != {sys.argv[2]})
PY
grep -h "^gpu_check:\|^gpu_leaderboard:\|is not installed" "$dir/check_out/gpu_check.log" \
  "$dir/leaderboard_out/gpu_leaderboard.log" | awk '!seen[$0]++'
echo "gpu_rehearse: $([ "$failed" = 0 ] && echo "every step passed" || echo "a step failed"); logs in $dir/*_out/"
exit $failed
