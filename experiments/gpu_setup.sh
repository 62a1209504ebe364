#!/usr/bin/env bash
# On a lent GPU machine, after the calls have carried every part experiments/gpu_carry.sh made: join the parts,
# check the whole against its sha256, install the wheels and this checkout into the machine's python3 (no index,
# no dependencies: the machine's own torch stays), and put carried artifacts under results/artifacts/.
# Says in one line which part is missing or damaged (carry that part again) and exits 1.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
carried=.gpucarry
read -r sum parts < "$carried/1/manifest" 2>/dev/null \
  || { echo "gpu_setup: no $carried/1/manifest: carry $carried/1 first" >&2; exit 1; }
for ((k = 1; k <= parts; k++)); do
  [ -f "$carried/$k/part" ] || { echo "gpu_setup: part $k of $parts is missing: carry $carried/$k" >&2; exit 1; }
done
unpacked=$(mktemp -d)
trap 'rm -rf "$unpacked"' EXIT
for ((k = 1; k <= parts; k++)); do cat "$carried/$k/part"; done > "$unpacked/carry.tar"
echo "$sum  $unpacked/carry.tar" | sha256sum --check --status \
  || { echo "gpu_setup: the joined parts do not match their sha256: carry them again" >&2; exit 1; }
tar -C "$unpacked" -xf "$unpacked/carry.tar"
"$python" -m pip install -q --no-index --no-deps --no-compile "$unpacked"/wheels/*.whl
# an editable install maps specrepro.conf to conf/ (from PYTHONPATH=src it would not be a package)
"$python" -m pip install -q --no-index --no-deps --no-build-isolation -e .
mkdir -p results/artifacts && cp -r "$unpacked"/results/artifacts/. results/artifacts/
echo "gpu_setup: installed $parts part(s); commit $(cat "$carried/1/commit")"
