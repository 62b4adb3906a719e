"""A pumped batch's start with and without its loop yield (``Tuning.start_hop``, ``URING_KV_DEBUG_START_HOP``), A/B.

``lag``: random 256-block O_DIRECT loads through one engine (32 layers, 48 slots, depth 32),
the hop on and off alternating every round of 10 batches, the bench's pipe probe around them.
Prints, per arm, the probe's lag pooled over all rounds, the lag of a task woken by the probe's
callback (as a stream reader or a zmq socket would be) and the median batch time; ``--json``
writes the same.

``bench``: ``uring-kv bench`` with the hop set by ``--hop on|off``, the remaining arguments
passed on (run it alternately for an A/B of the whole bench).

    python lab/start_hop_ab.py lag [--device cpu] [--rounds 20] [--block-kib 128] [--json F]
    python lab/start_hop_ab.py bench --hop off -- --json off.json
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import json
import os
import random
import statistics
import sys
import tempfile
import time
from typing import Any

import torch

from uring_kv import Engine, Tuning
from uring_kv.bench.lagprobe import LagTicker


class TaskTicker(LagTicker):
    """The bench's probe, and a task woken by its callback: how late that task runs."""

    def __enter__(self) -> TaskTicker:
        self.task_samples: list[float] = []
        self._pending: list[float] = []
        self._woken = asyncio.Event()
        super().__enter__()
        self._waiter = asyncio.get_running_loop().create_task(self._wake())
        return self

    def _on_probe(self) -> None:
        sent = self._prober.drain()
        now = time.monotonic()
        self.samples.extend(max(0.0, now - stamp) for stamp in sent)
        self._pending.extend(sent)
        self._woken.set()

    async def _wake(self) -> None:
        while True:
            await self._woken.wait()
            self._woken.clear()
            now = time.monotonic()
            self.task_samples.extend(max(0.0, now - stamp) for stamp in self._pending)
            self._pending.clear()

    def __exit__(self, *exc: object) -> None:
        self._waiter.cancel()
        super().__exit__(*exc)


def _us(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * q))] * 1e6


async def lag(args: argparse.Namespace) -> dict[str, Any]:
    layers, block = 32, args.block_kib << 10
    blocks = (512 << 20) // block
    caches = [torch.zeros(256, block // layers // 2, dtype=torch.float16, device=args.device)
              for _ in range(layers)]
    path = os.path.join(args.dir or tempfile.gettempdir(), "start_hop_ab.bin")
    probe: dict[bool, list[float]] = {True: [], False: []}
    woken: dict[bool, list[float]] = {True: [], False: []}
    batch_s: dict[bool, list[float]] = {True: [], False: []}
    tuning = Tuning.from_env()
    engines = {hop: Engine(caches, f"{path}.{hop}", blocks, 48, direct=True, io_depth=32,
                           tuning=dataclasses.replace(tuning, start_hop=hop)) for hop in (True, False)}
    async with engines[True], engines[False]:
        for engine in engines.values():
            for first in range(0, blocks, 256):
                await engine.store_batch(list(range(256)), list(range(first, first + 256)))
        rng = random.Random(1)
        gc.collect()
        gc.freeze()
        for round_index in range(args.rounds):
            for hop in ((True, False) if round_index % 2 else (False, True)):
                engine = engines[hop]
                with TaskTicker() as ticker:
                    await asyncio.sleep(0.01)
                    for _ in range(10):
                        disk, gpu = rng.sample(range(blocks), 256), rng.sample(range(256), 256)
                        start = time.perf_counter()
                        await engine.load_batch(disk, gpu)
                        batch_s[hop].append(time.perf_counter() - start)
                probe[hop] += ticker.samples
                woken[hop] += ticker.task_samples
    out = {}
    for hop in (True, False):
        p, t = probe[hop], woken[hop]
        row = dict(samples=len(p), p50_us=_us(p, .5), p90_us=_us(p, .9), p99_us=_us(p, .99), max_us=max(p) * 1e6,
                   task_p50_us=_us(t, .5), task_p99_us=_us(t, .99), task_max_us=max(t) * 1e6,
                   batch_p50_ms=statistics.median(batch_s[hop]) * 1e3)
        out["on" if hop else "off"] = row
        print(f"hop {'on ' if hop else 'off'} n={row['samples']:6} lag p50 {row['p50_us']:6.1f} "
              f"p90 {row['p90_us']:6.1f} p99 {row['p99_us']:7.1f} max {row['max_us']:8.1f} us; "
              f"task p50 {row['task_p50_us']:6.1f} p99 {row['task_p99_us']:7.1f} "
              f"max {row['task_max_us']:8.1f}; batch p50 {row['batch_p50_ms']:.2f} ms")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="what", required=True)
    lag_args = sub.add_parser("lag")
    lag_args.add_argument("--device", default="cpu")
    lag_args.add_argument("--rounds", type=int, default=20)
    lag_args.add_argument("--block-kib", type=int, default=128)
    lag_args.add_argument("--dir", default=None, help="directory of the block file (default: temp)")
    lag_args.add_argument("--json", default=None)
    bench_args = sub.add_parser("bench")
    bench_args.add_argument("--hop", choices=["on", "off"], required=True)
    bench_args.add_argument("rest", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    if args.what == "bench":
        from uring_kv.cli import main as cli_main

        os.environ["URING_KV_DEBUG_START_HOP"] = "1" if args.hop == "on" else "0"
        rest = args.rest[1:] if args.rest[:1] == ["--"] else args.rest
        return cli_main(["bench", *rest])
    result = asyncio.run(lag(args))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
