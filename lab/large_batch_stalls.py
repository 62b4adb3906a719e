"""The longest event-loop callbacks while one very large batch is stored and loaded.

Times every asyncio callback and every garbage-collector pass while a ``--blocks``-block store and
load run (twice each: the first pair pays for growing the file and warming the allocator), and
prints per call its wall time, callback count, longest callback and longest collections. This is
the check behind the large-batch admission rule in docs/reliability.md.

    python -P lab/large_batch_stalls.py --blocks 50000 --io uring --device cpu
"""

from __future__ import annotations

import argparse
import asyncio
import asyncio.events
import gc
import os
import tempfile
import time
from typing import Any

import torch

from uring_kv import Engine

callbacks: list[tuple[float, str]] = []
collections: list[tuple[float, int]] = []
_run = asyncio.events.Handle._run
_gc_start = [0.0]


def _timed_run(self: Any) -> None:
    start = time.perf_counter()
    _run(self)
    callbacks.append((time.perf_counter() - start, repr(self._callback)[:70]))


def _on_gc(phase: str, info: dict[str, int]) -> None:
    if phase == "start":
        _gc_start[0] = time.perf_counter()
    else:
        collections.append((time.perf_counter() - _gc_start[0], info["generation"]))


async def main(args: argparse.Namespace) -> None:
    n = args.blocks
    cache = torch.randn(n, args.block_kib * 256, device=args.device)
    blocks = list(range(n))
    print(f"{n} blocks of {args.block_kib} KiB, io={args.io}, device={args.device}, python gc on")
    print(f"{'call':<8} {'wall ms':>8} {'callbacks':>9} {'max cb ms':>9} {'>1 ms':>6}  longest gc passes (ms, gen)")
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        async with Engine([cache], os.path.join(d, "kv.bin"), n, io=args.io) as engine:
            for what in ("store", "load", "store", "load"):
                callbacks.clear()
                collections.clear()
                start = time.perf_counter()
                if what == "store":
                    await engine.store_batch(blocks, blocks)
                else:
                    await engine.load_batch(blocks, blocks)
                wall = time.perf_counter() - start
                longest = max(callbacks)
                over = sum(1 for t, _ in callbacks if t > 1e-3)
                gcs = sorted(collections, reverse=True)[:3]
                print(f"{what:<8} {wall * 1e3:8.0f} {len(callbacks):9d} {longest[0] * 1e3:9.2f} {over:6d}  "
                      + " ".join(f"{t * 1e3:.1f}/{g}" for t, g in gcs))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--blocks", type=int, default=50_000)
    parser.add_argument("--block-kib", type=int, default=4)
    parser.add_argument("--io", default="uring", choices=["uring", "threads"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dir", default=None, help="where the block file goes (default: the temp dir)")
    asyncio.events.Handle._run = _timed_run  # type: ignore[method-assign]
    gc.callbacks.append(_on_gc)
    asyncio.run(main(parser.parse_args()))
