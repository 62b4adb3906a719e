"""How full the ring stays during CPU-mode loads: a diagnostic for the O_DIRECT target.

Loads random batches through one engine with the ring's submit and wake-up paths timed, then
prints the time-weighted number of reads in flight, completions per wake-up, and for each
completion round how long the loop took from the wake-up to the next submission.

    python lab/ring_trace.py --block-kib 16 --direct --batches 20
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import tempfile
import time

import torch

from uring_kv import Engine, _io

events: list[tuple[float, int, str]] = []  # (time, reads in flight after, "submit" | "wake")
_flush, _wakeup = _io.UringBackend._flush, _io.UringBackend._on_wakeup


def _traced_flush(self: _io.UringBackend) -> None:
    _flush(self)
    events.append((time.perf_counter(), len(self._pending), "submit"))


def _traced_wakeup(self: _io.UringBackend) -> None:
    events.append((time.perf_counter(), len(self._pending), "wake"))
    _wakeup(self)


async def main(args: argparse.Namespace) -> None:
    _io.UringBackend._flush = _traced_flush  # type: ignore[method-assign]
    _io.UringBackend._on_wakeup = _traced_wakeup  # type: ignore[method-assign]
    disk_blocks, gpu_blocks, layers = 4096, 1024, 4
    per_layer = args.block_kib * 1024 // layers // 4
    caches = [torch.zeros(gpu_blocks, per_layer, dtype=torch.float32) for _ in range(layers)]
    path = os.path.join(args.path or tempfile.gettempdir(), f"uring-kv-trace-{os.getpid()}.bin")
    async with Engine(caches, path, disk_blocks, num_slots=args.slots, direct=args.direct) as engine:
        for first in range(0, disk_blocks, gpu_blocks):
            await engine.store_batch(list(range(gpu_blocks)), list(range(first, first + gpu_blocks)))
        rng = random.Random(0)
        events.clear()
        start = time.perf_counter()
        for _ in range(args.batches):
            disk, gpu = rng.sample(range(disk_blocks), args.batch), rng.sample(range(gpu_blocks), args.batch)
            await engine.load_batch(disk, gpu)
        elapsed = time.perf_counter() - start
        print(f"{engine.stats()['io']}, O_DIRECT={engine.file.direct}, copy: {engine.stats()['copy']}")
    print(f"{args.batches * args.batch / elapsed:.0f} blocks/s")
    area, (last_t, last_n, _) = 0.0, events[0]
    for t, n, _kind in events[1:]:
        area += last_n * (t - last_t)
        last_t, last_n = t, n
    print(f"reads in flight, time-weighted: {area / (last_t - events[0][0]):.1f} of {args.slots}")
    wakes = [i for i, e in enumerate(events) if e[2] == "wake" and e[1] > 0]
    print(f"wake-ups with completions: {len(wakes)}; reads in flight at those wake-ups: "
          f"{statistics.mean(events[i][1] for i in wakes):.1f} on average")
    gaps = []  # wake-up → the next submission that refills the ring, per round
    for i in wakes:
        nxt = next((e for e in events[i + 1:] if e[2] == "submit" and e[1] > events[i][1] // 2), None)
        if nxt is not None:
            gaps.append((nxt[0] - events[i][0]) * 1e3)
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
