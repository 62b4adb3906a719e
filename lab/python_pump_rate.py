"""Blocks per second of batches that run outside native pumps: the thread-pool backend, io_uring
with native pumps off, and checksums. Run it against two builds (``PYTHONPATH`` decides which
``uring_kv`` is imported) to compare them on the same machine, e.g.

    PYTHONPATH=/tmp/old-site python -P lab/python_pump_rate.py
    python -P lab/python_pump_rate.py

Each case stores then loads ``--blocks`` blocks of ``--block-size`` bytes (CPU tensors, a buffered
temp file, so the page cache serves the loads and Python's per-block cost decides), ``--rounds``
times; it prints the median rate of each direction and checks every loaded byte.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time

import torch

from uring_kv import Engine

CASES = {
    "threads": ({"URING_KV_IO": "threads"}, False),
    "uring, no native pumps": ({"URING_KV_IO": "uring", "URING_KV_PUMP": "0", "URING_KV_DEBUG_PUMP": "0"}, False),
    "uring, checksums": ({"URING_KV_IO": "uring"}, True),
}


async def one_case(blocks: int, block_size: int, rounds: int, checksum: bool, directory: str) -> tuple[float, float]:
    caches = [torch.randint(0, 255, (blocks, block_size), dtype=torch.uint8)]
    want = caches[0].clone()
    stores, loads = [], []
    async with Engine(caches, os.path.join(directory, "kv"), blocks, num_slots=16, direct=False,
                      checksum=checksum) as engine:
        for _ in range(rounds):
            start = time.perf_counter()
            await engine.store_batch(list(range(blocks)), list(range(blocks)))
            stores.append(blocks / (time.perf_counter() - start))
            caches[0].zero_()
            start = time.perf_counter()
            await engine.load_batch(list(range(blocks)), list(range(blocks)))
            loads.append(blocks / (time.perf_counter() - start))
            if not torch.equal(caches[0], want):
                raise SystemExit("wrong bytes after a load")
    return statistics.median(stores), statistics.median(loads)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=4096)
    parser.add_argument("--block-size", type=int, default=16384)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    import uring_kv

    print(f"uring_kv from {os.path.dirname(uring_kv.__file__)}; {args.blocks} blocks of {args.block_size} bytes, "
          f"median of {args.rounds}")
    for name, (env, checksum) in CASES.items():
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            with tempfile.TemporaryDirectory() as directory:
                store, load = asyncio.run(one_case(args.blocks, args.block_size, args.rounds, checksum, directory))
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        print(f"{name:<24} store {store:>9.0f} blocks/s   load {load:>9.0f} blocks/s")


if __name__ == "__main__":
    main()
