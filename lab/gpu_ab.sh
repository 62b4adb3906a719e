#!/usr/bin/env bash
# One call on the GPU machine for a change of the GPU copy path: build the package from this tree,
# run the CUDA tests, then `uring-kv bench` in GPU mode on a RAM-backed file under two environments
# in turn (lab/env_ab.sh), and print where uring_kv's slots spent their time in each run
# (`Engine.slot_phases`, kept in the bench JSON). Run from the project root there, after
# `source .gpu-kit/env.sh`. Results under $OUT (default /tmp/out).
#
#   lab/gpu_ab.sh TEST_SECONDS "A_ENV" "B_ENV" ROUNDS [bench options...]
#
# e.g. lab/gpu_ab.sh 150 URING_KV_CUDA_MAPPED=0 URING_KV_CUDA_MAPPED=1 2 --threads 16
set -uo pipefail
[ $# -ge 4 ] || { sed -n 2,10p "$0"; exit 2; }
out=${OUT:-/tmp/out}
tests=$1 a=$2 b=$3 rounds=$4
shift 4
mkdir -p "$out"
root=$(pwd)
python3 -m pip install -q --no-deps --no-build-isolation --target /tmp/site . 2>&1 | grep -v -i warning
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$out/gpu.txt"
(cd /tmp && timeout "$tests" python3 -P -m pytest -q -p no:cacheprovider -c "$root/pyproject.toml" \
  --rootdir "$root" "$root/tests" -k "cuda or gpu or native_copier or staged" > "$out/tests.txt" 2>&1)
echo "tests: exit $?; $(tail -1 "$out/tests.txt")"
grep -E "^(FAILED|ERROR)" "$out/tests.txt" | head -20
bash lab/env_ab.sh "$a" "$b" "$rounds" "$out/ab" --device cuda --path /dev/shm --no-ram --direct --no-sweep \
  --peers kvikio,ceiling --size 512M "$@" | tee "$out/ab.txt"
python3 - "$out/ab" <<'PY'
import glob, json, os, sys
for path in sorted(glob.glob(f"{sys.argv[1]}/*.json")):
    doc = json.load(open(path))
    ceil = {(r["op"], r["block_bytes"] >> 10): r["gbps"] for r in doc["rows"] if r["method"] == "copy ceiling"}
    for size, extra in sorted(doc.get("extra", {}).items()):
        if not isinstance(extra, dict) or "cold" not in extra:
            continue
        for op in ("load", "store"):
            ph = extra["cold"].get(f"slot_phases_{op}") or {}
            jobs = (ph.get("copy_jobs") or {}).get(op) or {}
            print(f"{os.path.basename(path):8s} {size:>6s} {op:5s} copy ceiling {ceil.get((op, int(size) >> 10), 0):6.2f}"
                  f"  io {ph.get('pump_io', {}).get('mean_us')} us  copy {ph.get('pump_copy', {}).get('mean_us')} us"
                  f"  job: {jobs.get('blocks', 0) / max(1, jobs.get('jobs', 0)):.1f} blocks, queued"
                  f" {jobs.get('queued_us')} enqueue {jobs.get('enqueue_us')} run {jobs.get('run_us')}"
                  f" handover {jobs.get('handover_us')} us")
PY
