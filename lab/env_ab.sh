#!/usr/bin/env bash
# Does one setting of the engine beat another? Runs `uring-kv bench` with the same options under two
# environments in turn (A, B, A, B, ...), keeping each run's JSON, then prints uring_kv's GB/s,
# core-seconds per GB and loop lag (max) per file (disk, RAM-backed), operation, block size and
# case, run by run. The installed uring_kv runs both.
#
#   lab/env_ab.sh "A_ENV" "B_ENV" ROUNDS OUT_DIR [bench options...]
#
# e.g. lab/env_ab.sh URING_KV_RING_THREAD=off URING_KV_RING_THREAD=on 2 /tmp/ab --direct --no-sweep
# (each *_ENV: space-separated NAME=VALUE pairs, as `env` takes them).
set -euo pipefail
[ $# -ge 4 ] || { sed -n 2,10p "$0"; exit 2; }
a=$1 b=$2 rounds=$3 out=$4
shift 4
mkdir -p "$out"
for r in $(seq 1 "$rounds"); do
  for name in a b; do
    vars=$a; [ $name = b ] && vars=$b
    echo "== $name ($vars), round $r"
    # shellcheck disable=SC2086
    env $vars python3 -P -m uring_kv bench "$@" --json "$out/$name-$r.json" > "$out/$name-$r.txt" 2>&1 ||
      { tail -20 "$out/$name-$r.txt"; exit 1; }
  done
done
python3 - "$out" "$rounds" "$a" "$b" <<'PY'
import json, sys
out, rounds, env_a, env_b = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
table = {}
for name in "ab":
    for r in range(1, rounds + 1):
        doc = json.load(open(f"{out}/{name}-{r}.json"))
        for file, rows in (("disk", doc["rows"]), ("ram", (doc.get("ram") or {}).get("rows", []))):
            for row in rows:
                if row["method"] == "uring_kv":
                    key = (file, row["op"], row["block_bytes"] >> 10, row["case"])
                    cell = f"{row['gbps']:.2f} ({row.get('core_s_per_gb') or 0:.2f}, {row.get('lag_max_ms') or 0:.1f})"
                    table.setdefault(key, {}).setdefault(name, []).append(cell)
print(f"A: {env_a}   B: {env_b}   cells: GB/s (core-s/GB, loop lag max ms), one per round")
print(f"{'file':<5} {'op':<6} {'KiB':>5} {'case':<5} {'A':<44} {'B':<44}")
for (file, op, kib, case), runs in sorted(table.items()):
    print(f"{file:<5} {op:<6} {kib:>5} {case:<5} {'; '.join(runs.get('a', [])):<44} {'; '.join(runs.get('b', [])):<44}")
PY
