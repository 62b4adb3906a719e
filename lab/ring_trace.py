"""How full the ring stays during CPU-mode loads: a diagnostic for the O_DIRECT target.

Loads random batches through one engine with its ring traced (``Engine.trace``), then prints the
time-weighted number of reads in flight, completions per wake-up, and for each completion round
how long the loop took from the wake-up to the ring being refilled past half what it held.

The counts are the ring's: every read submitted and not yet reaped, native pumps' included. Native
pumps (the default) refill the ring inside the reap, so a round is refilled when its reap returns;
batches in the Python pump (``URING_KV_DEBUG_PUMP=0``) refill it at a later submission.

    python lab/ring_trace.py --block-kib 16 --direct --batches 20
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import random
import statistics
import tempfile
import time
from dataclasses import dataclass
from typing import Any

import torch

from uring_kv import Engine


@dataclass
class Point:
    """A traced span of the ring (t to end) and the reads in flight before it and after it."""

    kind: str  # "submit", "wake" (a reap) or "grow" (a pump's first reads, submitted without a count)
    t: float
    before: int | None
    end: float
    after: int | None = None
    found: int = 0  # completions a wake-up reaped


points: list[Point] = []
sqes = [0]


def tracer(event: str, kind: Any, count: int) -> None:
    now = time.perf_counter()
    if event == "submit":
        sqes[0] = count
    elif event == "submitted":
        points.append(Point("submit", now, count - sqes[0], now, count))
    elif event == "reap":
        points.append(Point("wake", now, count, now))
    elif event == "grow":
        points.append(Point("grow", now, None, now))
    elif event in ("reaped", "grown"):  # closes the last span of its kind
        span = next((p for p in reversed(points) if p.kind == ("wake" if event == "reaped" else "grow")), None)
        if span is None:  # opened before the trace was set
            return
        span.end = now
        if event == "reaped":
            span.found = count


def held_after() -> list[int]:
    """Reads in flight after each span. Reads join the count when submitted and native pumps' leave
    it when reaped, inside the spans (the Python side's leave it when handled, before its next
    submission), so a span's after is the next span's before where that is known; a reap followed
    by a pump's start (the reap that ended the batch before) is taken as having refilled nothing."""
    held = []
    for p, nxt in zip(points, [*points[1:], None], strict=True):
        if p.after is not None:
            held.append(p.after)
        elif nxt is not None and nxt.before is not None:
            held.append(nxt.before)
        else:
            held.append(p.before - p.found if p.before is not None else 0)
    return held


async def main(args: argparse.Namespace) -> None:
    disk_blocks, gpu_blocks, layers = 4096, 1024, 4
    per_layer = args.block_kib * 1024 // layers // 4
    caches = [torch.zeros(gpu_blocks, per_layer, dtype=torch.float32) for _ in range(layers)]
    path = os.path.join(args.path or tempfile.gettempdir(), f"uring-kv-trace-{os.getpid()}.bin")
    async with Engine(caches, path, disk_blocks, num_slots=args.slots, direct=args.direct) as engine:
        for first in range(0, disk_blocks, gpu_blocks):
            await engine.store_batch(list(range(gpu_blocks)), list(range(first, first + gpu_blocks)))
        rng = random.Random(0)
        engine.trace(tracer)
        start = time.perf_counter()
        for _ in range(args.batches):
            disk, gpu = rng.sample(range(disk_blocks), args.batch), rng.sample(range(gpu_blocks), args.batch)
            await engine.load_batch(disk, gpu)
        elapsed = time.perf_counter() - start
        engine.trace(None)
        stats = engine.stats()
        print(f"{stats['io']}, O_DIRECT={stats['direct']}, copy: {stats['copy']}")
    print(f"{args.batches * args.batch / elapsed:.0f} blocks/s")
    held = held_after()
    area = 0.0
    for i, (p, nxt) in enumerate(itertools.pairwise(points)):
        area += (held[i] if p.before is None else p.before) * (p.end - p.t) + held[i] * (nxt.t - p.end)
    print(f"reads in flight, time-weighted: {area / (points[-1].t - points[0].t):.1f} of {args.slots}")
    wakes = [i for i, p in enumerate(points) if p.kind == "wake" and p.found > 0]
    print(f"wake-ups: {sum(p.kind == 'wake' for p in points)}, with completions: {len(wakes)}; at those, "
          f"{statistics.mean(points[i].found for i in wakes):.1f} completions and "
          f"{statistics.mean(points[i].before or 0 for i in wakes):.1f} reads in flight on average")
    gaps = []  # wake-up → the span that leaves the ring refilled past half, per round (not past a batch's end)
    for i in wakes:
        half = (points[i].before or 0) // 2
        j = next((j for j in range(i, len(points)) if points[j].kind == "grow" or held[j] > half), None)
        if j is not None and points[j].kind != "grow":
            gaps.append((points[j].end - points[i].t) * 1e3)
    if gaps:
        print(f"wake-up → ring refilled: median {statistics.median(gaps):.2f} ms, max {max(gaps):.2f} ms")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--block-kib", type=int, default=16)
    parser.add_argument("--direct", action="store_true")
    parser.add_argument("--slots", type=int, default=32)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--batches", type=int, default=20)
    parser.add_argument("--path")
    asyncio.run(main(parser.parse_args()))
