"""Where a pumped load batch's time goes, beside the ring ceiling on the same blocks.

Outside the bench (no baselines in between, no lag probe unless asked), loads random 256-block
batches through one engine (O_DIRECT, 32 layers, 48 slots at depth 32 as the bench sets up on a
GPU) and times each batch in three parts: from the call to its first reads submitted (validation,
pump set-up, ordering after the caller's stream, slots handed over), from there to the pump
finishing (every block read and copied), and from there to the call returning. Each batch is
followed (or, with ``--swap``, preceded) by the ring ceiling's C loop on the same blocks.
``--ticker`` runs the bench's lag probe around each uring_kv batch, as the bench does.
``--idle-ms G`` leaves the process idle for G ms before each batch of either method (the bench's
other methods leave uring_kv's threads idle for ~0.7 s between its batches).

    python lab/batch_phases.py [--block-size 131072] [--rounds 24] [--device cuda] [--swap] [--ticker]
                                 [--idle-ms 0]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import statistics
import tempfile
import time
from typing import Any

import torch

from uring_kv import Engine
from uring_kv.bench.ceilings import RingCeiling
from uring_kv.bench.lagprobe import LagTicker

stamps: dict[str, float] = {}


def _tracer(event: str, kind: Any, count: int) -> None:
    """The engine's diagnostic hook: the first hand-over of slots (before, after) and the finish."""
    now = time.perf_counter()
    if event == "grow":
        stamps.setdefault("grow", now)
    elif event == "grown":
        stamps.setdefault("submitted", now)
    elif event == "finished":
        stamps["finished"] = now


async def main(args: argparse.Namespace) -> None:
    layers, block = 32, args.block_size
    blocks = (1 << 30) // block
    caches = [torch.zeros(256, block // layers // 2, dtype=torch.float16, device=args.device) for _ in range(layers)]
    path = os.path.join(tempfile.gettempdir(), f"uring-kv-batch-phases-{os.getpid()}.bin")
    rows: list[tuple[float, float, float, float]] = []
    async with Engine(caches, path, blocks, 48, direct=True, io_depth=32) as engine:
        engine.trace(_tracer)
        for first in range(0, blocks, 256):
            await engine.store_batch(list(range(256)), list(range(first, first + 256)))
        ceiling = RingCeiling(engine.file.fd, engine.file.stride, 32)
        rng = random.Random(3)
        for round_index in range(args.rounds + 2):  # two unmeasured rounds first
            disk, gpu = rng.sample(range(blocks), 256), rng.sample(range(256), 256)
            if args.swap:
                await asyncio.sleep(args.idle_ms / 1e3)
                ceiling_s = await asyncio.to_thread(ceiling.run, False, disk, gpu)
            await asyncio.sleep(args.idle_ms / 1e3)
            with LagTicker() if args.ticker else contextlib.nullcontext():
                stamps.clear()
                start = time.perf_counter()
                await engine.load_batch(disk, gpu)
                end = time.perf_counter()
            if not args.swap:
                await asyncio.sleep(args.idle_ms / 1e3)
                ceiling_s = await asyncio.to_thread(ceiling.run, False, disk, gpu)
            if round_index >= 2:
                rows.append((stamps["submitted"] - start, stamps["finished"] - stamps["submitted"],
                             end - stamps["finished"], ceiling_s))
        ceiling.close()
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    names = ("call -> reads submitted", "submitted -> pump finished", "finished -> call returned")
    for column, name in enumerate(names):
        values = [row[column] * 1e3 for row in rows]
        print(f"{name:28} p50 {statistics.median(values):7.3f} ms  max {max(values):7.3f} ms")
    total = sum(row[0] + row[1] + row[2] for row in rows)
    ceiling_total = sum(row[3] for row in rows)
    print(f"{'whole batch':28} p50 {statistics.median(row[0] + row[1] + row[2] for row in rows) * 1e3:7.3f} ms;"
          f" ring ceiling p50 {statistics.median(row[3] for row in rows) * 1e3:.3f} ms")
    print(f"ring ceiling / uring_kv: {ceiling_total / total:.3f} (whole batches), "
          f"{ceiling_total / sum(row[1] for row in rows):.3f} (submitted -> finished)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--block-size", type=int, default=128 << 10)
    parser.add_argument("--rounds", type=int, default=24)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--swap", action="store_true", help="the ring ceiling reads each batch first")
    parser.add_argument("--ticker", action="store_true", help="the bench's lag probe around each batch")
    parser.add_argument("--idle-ms", type=float, default=0.0, help="idle time before each batch of either method")
    asyncio.run(main(parser.parse_args()))
