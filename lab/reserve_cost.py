"""What reserving the block file's space costs at open: ``Engine.open()`` with and without
``Tuning(reserve_space=True)`` for files of several sizes in ``--dir``, each opened ``--rounds``
times (a fresh unnamed file each time), median and maximum. Prints a table and, with ``--json``,
writes the figures. Needs the free space of the largest size in ``--dir``.

    python -P lab/reserve_cost.py [--dir /var/tmp] [--sizes 1G,16G,64G] [--rounds 3] [--json OUT]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import time
from typing import Any

import torch

from uring_kv import Engine, Tuning

BLOCK = 2 << 20  # 2 MiB blocks: the size only sets how many there are


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    return int(float(text[:-1]) * units[text[-1].upper()]) if text[-1].upper() in units else int(text)


async def open_seconds(directory: str, nbytes: int, reserve: bool) -> tuple[float, bool]:
    caches = [torch.zeros(1, BLOCK, dtype=torch.uint8)]
    engine = Engine(caches, os.path.join(directory, "kv.bin"), nbytes // BLOCK, num_slots=2,
                    tuning=Tuning(reserve_space=reserve))
    start = time.perf_counter()
    await engine.open()
    took = time.perf_counter() - start
    reserved = engine.stats()["reserved"]
    await engine.aclose()
    return took, reserved


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default="/var/tmp")
    parser.add_argument("--sizes", default="1G,16G,64G")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json")
    args = parser.parse_args()
    stat = os.statvfs(args.dir)
    rows: list[dict[str, Any]] = []
    print(f"{'size':>8} {'reserve':>8} {'median ms':>10} {'max ms':>8}  reserved")
    for text in args.sizes.split(","):
        nbytes = parse_size(text)
        for reserve in (False, True):
            times, reserved = [], False
            for _ in range(args.rounds):
                took, reserved = await open_seconds(args.dir, nbytes, reserve)
                times.append(took * 1e3)
            row = {"size": text, "bytes": nbytes, "reserve": reserve, "median_ms": statistics.median(times),
                   "max_ms": max(times), "reserved": reserved}
            rows.append(row)
            print(f"{text:>8} {reserve!s:>8} {row['median_ms']:>10.1f} {row['max_ms']:>8.1f}  {reserved}")
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"dir": args.dir, "free_bytes": stat.f_bavail * stat.f_frsize, "machine": platform.node(),
                       "kernel": platform.release(), "rows": rows}, out, indent=1)


if __name__ == "__main__":
    asyncio.run(main())
