"""What durability costs a block store: puts and gets of a plain store against a persistent one
without fsync and with fsync (per put batch), and a plain store with checksums (to tell the cost of
the crc32c and the Python pump it needs apart from the index's).

Each configuration gets a fresh store of ``--capacity`` blocks in ``--dir``, fills it, then runs
``--puts`` puts of ``--batch`` new keys (each evicting as many), ``--concurrency`` of them in
flight, then loads every held key once in batches of ``--batch``. Prints a table and, with
``--json``, writes the figures. CPU caches; the page cache is not dropped, so gets mostly read
memory.

    python -P lab/persist_cost.py [--dir /tmp] [--block-kib 128] [--batch 16] [--puts 200] [--concurrency 1]
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import platform
import shutil
import statistics
import tempfile
import time
from typing import Any

import torch

from uring_kv import BlockStore

CONFIGS = {
    "plain": {},
    "plain, checksum": {"checksum": True},
    "persistent, fsync=False": {"persistent": True, "fsync": False},
    "persistent, fsync=True": {"persistent": True, "fsync": True},
}


def key(i: int) -> bytes:
    return hashlib.sha256(b"%d" % i).digest()


async def measure(name: str, options: dict[str, Any], args: argparse.Namespace, directory: str) -> dict[str, Any]:
    rows = args.batch * args.concurrency
    elems = args.block_kib * 1024 // 2 // 2  # two bf16 tensors
    caches = {f"t{i}": torch.randn(rows, elems).to(torch.bfloat16) for i in range(2)}
    path = os.path.join(directory, "kv.bin")
    store = BlockStore(caches, path, args.capacity, args.slots, **options)
    async with store:
        next_key = 0

        async def put_batches(count: int, latencies: list[float], lane: int) -> None:
            nonlocal next_key
            lane_rows = list(range(lane * args.batch, (lane + 1) * args.batch))
            for _ in range(count):
                keys = [key(next_key + i) for i in range(args.batch)]
                next_key += args.batch
                started = time.perf_counter()
                await store.put(keys, lane_rows)
                latencies.append(time.perf_counter() - started)

        await put_batches(args.capacity // args.batch, [], 0)  # fill: every later put evicts
        put_lat: list[float] = []
        started = time.perf_counter()
        await asyncio.gather(*(put_batches(args.puts // args.concurrency, put_lat, lane)
                               for lane in range(args.concurrency)))
        put_s = time.perf_counter() - started
        held = [key(i) for i in range(next_key) if store.contains(key(i))]  # what the store still holds
        get_lat: list[float] = []
        started = time.perf_counter()
        for first in range(0, len(held) - args.batch + 1, args.batch):
            t0 = time.perf_counter()
            await store.get(held[first:first + args.batch], range(args.batch))
            get_lat.append(time.perf_counter() - t0)
        get_s = time.perf_counter() - started
        direct = store.engine.file.direct
    block_bytes = store.engine.block_bytes
    put_blocks = len(put_lat) * args.batch
    get_blocks = len(get_lat) * args.batch
    return {"config": name, "direct": direct, "put_blocks_per_s": put_blocks / put_s,
            "put_mb_per_s": put_blocks * block_bytes / put_s / 1e6,
            "put_p50_ms": statistics.median(put_lat) * 1e3,
            "put_p99_ms": sorted(put_lat)[int(len(put_lat) * 0.99) - 1] * 1e3,
            "get_blocks_per_s": get_blocks / get_s, "get_p50_ms": statistics.median(get_lat) * 1e3}


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", default=tempfile.gettempdir())
    parser.add_argument("--block-kib", type=int, default=128)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--puts", type=int, default=200, help="timed puts (after the fill)")
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--capacity", type=int, default=512)
    parser.add_argument("--slots", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=3, help="rounds over the configs; medians are shown")
    parser.add_argument("--only", action="append", choices=list(CONFIGS), help="run only these configs")
    parser.add_argument("--json")
    args = parser.parse_args()
    configs = {name: options for name, options in CONFIGS.items() if not args.only or name in args.only}
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in configs}
    for _ in range(args.repeat):  # the configs in rotation, so that a slow spell hits them all
        for name, options in configs.items():
            directory = tempfile.mkdtemp(prefix="uring-kv-persist-cost-", dir=args.dir)
            try:
                runs[name].append(await measure(name, options, args, directory))
            finally:
                shutil.rmtree(directory)
    results = [{field: (statistics.median(r[field] for r in rounds) if isinstance(rounds[0][field], float)
                        else rounds[0][field]) for field in rounds[0]} for rounds in runs.values()]
    print(f"{platform.node()} {os.cpu_count()} CPUs, dir {args.dir}, {args.block_kib} KiB blocks, batch "
          f"{args.batch}, {args.concurrency} put(s) in flight, {args.puts} puts, O_DIRECT {results[0]['direct']}, "
          f"medians of {args.repeat}")
    print(f"{'config':<26} {'put blk/s':>10} {'put MB/s':>9} {'put p50 ms':>11} {'put p99 ms':>11} "
          f"{'get blk/s':>10} {'get p50 ms':>11}")
    for r in results:
        print(f"{r['config']:<26} {r['put_blocks_per_s']:>10.0f} {r['put_mb_per_s']:>9.0f} {r['put_p50_ms']:>11.2f} "
              f"{r['put_p99_ms']:>11.2f} {r['get_blocks_per_s']:>10.0f} {r['get_p50_ms']:>11.2f}")
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"args": vars(args), "results": results, "runs": runs}, out, indent=2)


if __name__ == "__main__":
    asyncio.run(main())
