#!/usr/bin/env bash
# One call on the GPU machine doing all of a change's GPU work: build the package from this tree,
# run the CUDA tests, then `uring-kv bench` in GPU mode on the disk and a RAM-backed file (KvikIO
# too where its wheels were carried). Run from the project root there, after
# `source .gpu-kit/env.sh` (built with GPU_KIT_EXTRA="kvikio-cu13 libkvikio-cu13 rapids-logger
# cuda-pathfinder nvidia-cufile" for the KvikIO rows). Results under $OUT (default /tmp/out).
#
#   lab/gpu_check.sh [TEST_SECONDS] [bench options...]
set -uo pipefail
out=${OUT:-/tmp/out}
mkdir -p "$out"
tests=${1:-300}
shift || true
root=$(pwd)
python3 -m pip install -q --no-deps --no-build-isolation --target /tmp/site . 2>&1 | grep -v -i warning
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$out/gpu.txt"
python3 -P -c "import kvikio; print('kvikio', kvikio.__version__)" 2>&1 | tail -1
cd /tmp || exit 1
timeout "$tests" python3 -P -m pytest -q -p no:cacheprovider -c "$root/pyproject.toml" --rootdir "$root" \
  "$root/tests" -k "cuda or gpu or native_copier or staged" -x > "$out/tests.txt" 2>&1
echo "tests: exit $?; $(tail -1 "$out/tests.txt")"
python3 -P -m uring_kv bench --device cuda --no-sweep "$@" --json "$out/bench.json" > "$out/bench.txt" 2>&1
echo "bench: exit $?"
cat "$out/bench.txt" | grep -v "^bench:"
