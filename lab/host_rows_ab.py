"""Stores (and loads) between page-aligned host rows and a file, the way a framework's host pool
(vLLM's primary region, SGLang's host pool) meets the engine in CPU mode: GB/s and process CPU
seconds per GB, one environment variable's values alternating in the same process tree.

    python lab/host_rows_ab.py [--path /dev/shm] [--rounds 3] [--var URING_KV_DEBUG_PUMP_GATHER] [--values 0,1]

Each (round, value) runs in a fresh subprocess (the engine reads its tuning at construction; a
fresh process also starts with a cold allocator); rows: one block per row, 32 tensors' pieces laid
side by side as the engine's layout expects.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

CHILD = r"""
import asyncio, json, mmap, os, resource, sys, tempfile, time
import numpy as np, torch
from uring_kv import Engine

def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime

async def main(path, block, rows, batches):
    layers = 32
    piece = block // layers
    regions = [mmap.mmap(-1, rows * piece) for _ in range(layers)]  # page-aligned, as host pools are
    caches = {f"l{i}": torch.from_numpy(np.frombuffer(m, dtype=np.uint8).reshape(rows, piece))
              for i, m in enumerate(regions)}
    for t in caches.values():
        t.copy_(torch.randint(0, 255, t.shape, dtype=torch.uint8))
    out = {}
    with tempfile.TemporaryDirectory(dir=path) as d:
        async with Engine(caches, os.path.join(d, "kv.bin"), rows * 2, 48) as e:
            st = e.stats()
            out["direct"], out["from_rows"] = st["direct"], st["stores_from_caches"]
            out["into_rows"] = st["loads_into_caches"]
            for op in ("store", "load"):
                await (e.store_batch(list(range(rows)), list(range(rows))) if op == "store" else
                       e.load_batch(list(range(rows)), list(range(rows))))  # warm-up
                c0, t0 = cpu(), time.perf_counter()
                for i in range(batches):
                    disk = [(i % 2) * rows + r for r in range(rows)]
                    if op == "store":
                        await e.store_batch(list(range(rows)), disk)
                    else:
                        await e.load_batch(disk, list(range(rows)))
                dt, dc = time.perf_counter() - t0, cpu() - c0
                gb = batches * rows * block / 1e9
                out[op] = {"gbps": round(gb / dt, 3), "core_s_per_gb": round(dc / gb, 3)}
    print(json.dumps(out))

asyncio.run(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])))
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--path", default="/dev/shm")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--var", default="URING_KV_DEBUG_PUMP_GATHER")
    ap.add_argument("--values", default="0,1")
    ap.add_argument("--json")
    args = ap.parse_args()
    results = []
    for block, rows, batches in ((128 << 10, 256, 16), (2 << 20, 64, 8)):
        for r in range(args.rounds):
            for value in args.values.split(","):
                env = {**os.environ, args.var: value}
                command = [sys.executable, "-c", CHILD, args.path, str(block), str(rows), str(batches)]
                done = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
                measured = json.loads(done.stdout.strip().splitlines()[-1])
                row = {"block": block, "round": r + 1, args.var: value, **measured}
                results.append(row)
                print(f"{block >> 10:5d} KiB  round {r + 1}  {args.var}={value}  "
                      f"store {row['store']['gbps']:6.2f} GB/s {row['store']['core_s_per_gb']:5.2f} core-s/GB  "
                      f"load {row['load']['gbps']:6.2f} GB/s {row['load']['core_s_per_gb']:5.2f} core-s/GB  "
                      f"(direct={row['direct']}, from_rows={row['from_rows']}, into_rows={row['into_rows']})",
                      flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
