#!/usr/bin/env bash
# Does one build of uring_kv bench within noise of another? Installs two source trees side by side
# and runs `uring-kv bench` with the same options on each in turn (A, B, A, B, ...), keeping each
# run's JSON, then prints uring_kv's GB/s per operation, block size and case, run by run.
#
#   lab/builds_ab.sh A_DIR B_DIR ROUNDS OUT_DIR [bench options...]
#
# A_DIR, B_DIR: source trees (e.g. `git archive COMMIT | tar -x -C /tmp/a`). Each is installed
# with pip --no-build-isolation --no-deps (cffi and setuptools must be importable) into
# /tmp/builds-ab/{a,b}, which goes first on PYTHONPATH for its runs.
set -euo pipefail
[ $# -ge 4 ] || { sed -n 2,10p "$0"; exit 2; }
a=$1 b=$2 rounds=$3 out=$4
shift 4
mkdir -p "$out"
for name in a b; do
  src=$a; [ $name = b ] && src=$b
  src=$(cd "$src" && pwd)  # a path, never a package name to pip
  rm -rf "/tmp/builds-ab/$name"
  python3 -m pip install -q --no-build-isolation --no-deps --no-index --target "/tmp/builds-ab/$name" "$src"
done
for r in $(seq 1 "$rounds"); do
  for name in a b; do
    echo "== build $name, round $r"
    PYTHONPATH=/tmp/builds-ab/$name${PYTHONPATH:+:$PYTHONPATH} \
      python3 -P -m uring_kv bench "$@" --json "$out/$name-$r.json" > "$out/$name-$r.txt" 2>&1 ||
      { tail -20 "$out/$name-$r.txt"; exit 1; }
  done
done
python3 - "$out" "$rounds" <<'EOF'
import json, sys
out, rounds = sys.argv[1], int(sys.argv[2])
table = {}
for name in "ab":
    for r in range(1, rounds + 1):
        for row in json.load(open(f"{out}/{name}-{r}.json"))["rows"]:
            if row["method"] == "uring_kv":
                key = (row["op"], row["block_bytes"] >> 10, row["case"])
                table.setdefault(key, {}).setdefault(name, []).append(row["gbps"])
print(f"{'op':<6} {'KiB':>5} {'case':<5} {'A GB/s':<24} {'B GB/s':<24}")
for (op, kib, case), runs in sorted(table.items()):
    fmt = lambda v: ", ".join(f"{x:.2f}" for x in v)
    print(f"{op:<6} {kib:>5} {case:<5} {fmt(runs.get('a', [])):<24} {fmt(runs.get('b', [])):<24}")
EOF
