"""What a pause before a load batch changes inside it: the loop's sleeps and wake-ups, the reaps.

On the H200 machine a 128 KiB load batch that follows a pause took 1-2 ms longer than one right
after another (H200 machine, 2026-12-03). This loads random 256-block batches
through one engine (O_DIRECT, 32 layers, 48 slots at depth 32 as the bench sets up on a GPU, or ``--slots``),
alternating runs of batches back to back with runs where each batch follows ``--idle-ms`` of
sleep, and times inside each batch: the loop's ``select()`` calls (how long it slept), the ring's
wake-ups (completions found per reap, reads in flight before and after it, how long after
``select()`` returned it ran), the copier's collections, the reads in flight over the batch
(time-weighted), how long the first completion took and how long the batch ran after the last.
"In flight" counts the pump's reads from submission until their completion is reaped (a read the
disk has finished stays counted until the loop reaps it).

    python lab/pause_trace.py [--block-size 131072] [--rounds 6] [--per-round 4] [--idle-ms 100] [--slots 48]
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import os
import random
import statistics
import tempfile
import time
from collections import defaultdict
from typing import Any

import torch

from uring_kv import Engine, _bridge, _driver, _io

trace: dict[str, list[Any]] = defaultdict(list)
live = [False]
runs: list[Any] = []
ring: list[Any] = []  # the engine's ring, for the reads in flight after a collection
_wakeup, _collect, _grow, _finish = (_io.UringBackend._on_wakeup, _bridge.NativeLink._collect, _driver.Driver._grow,
                                     _driver.Driver._finish)


def _traced_wakeup(self: _io.UringBackend) -> None:
    if not live[0]:
        _wakeup(self)
        return
    start = time.perf_counter()
    before = self._ring.pump_io()[0]
    started = sum(run.pump.started for run in runs)
    _wakeup(self)
    after = self._ring.pump_io()[0]
    found = before - after + sum(run.pump.started for run in runs) - started
    end = time.perf_counter()
    trace["reap"].append((start, end, found, before))
    trace["inflight"].append((end, after))


def _traced_collect(self: Any) -> None:
    start = time.perf_counter()
    _collect(self)
    if live[0]:
        end = time.perf_counter()
        trace["collect"].append((start, end))
        if ring:
            trace["inflight"].append((end, ring[0].pump_io()[0]))


def _traced_grow(self: _driver.Driver, run: Any, leases: Any) -> None:
    if run not in runs:
        runs.append(run)
        trace["submitted"].append(time.perf_counter())
    _grow(self, run, leases)
    if live[0] and ring:
        trace["inflight"].append((time.perf_counter(), ring[0].pump_io()[0]))


def _traced_finish(self: _driver.Driver, run: Any) -> None:
    trace["finished"].append(time.perf_counter())
    _finish(self, run)


def _q(values: list[float]) -> str:
    if not values:
        return "-"
    ordered = sorted(values)
    return f"p50 {statistics.median(ordered):8.1f}  p90 {ordered[9 * len(ordered) // 10]:8.1f}"


def _summary(batches: list[dict[str, Any]]) -> dict[str, str]:
    sleeps = [s for b in batches for s in b["sleeps"]]
    reaps = [r for b in batches for r in b["reaps"]]
    out = {
        "batch ms": _q([b["ms"] for b in batches]),
        "call -> first reads submitted, us": _q([b["start_us"] for b in batches]),
        "loop asleep in select(), % of the batch": _q([b["asleep"] * 100 for b in batches]),
        "select() sleeps, us": _q([s * 1e6 for s in sleeps]),
        "ring wake-ups per batch": _q([float(len(b["reaps"])) for b in batches]),
        "completions found per wake-up": _q([float(r[2]) for r in reaps]),
        "reads in flight before a reap": _q([float(r[3]) for r in reaps]),
        "select() return -> reap, us": _q([r[4] * 1e6 for r in reaps if r[4] is not None]),
        "reap callback, us": _q([(r[1] - r[0]) * 1e6 for r in reaps]),
        "collections per batch": _q([float(b["collections"]) for b in batches]),
        "reads in flight (until reaped), time-weighted": _q([b["inflight_mean"] for b in batches]),
        "reads in flight after a reap": _q([float(r[5]) for b in batches for r in b["reaps"] if r[5] is not None]),
        "first reads submitted -> first completion, us": _q([b["first_us"] for b in batches]),
        "last completion reaped -> batch done, us": _q([b["tail_us"] for b in batches]),
    }
    return out


async def main(args: argparse.Namespace) -> None:
    _io.UringBackend._on_wakeup = _traced_wakeup  # type: ignore[method-assign]
    _bridge.NativeLink._collect = _traced_collect  # type: ignore[method-assign]
    _driver.Driver._grow = _traced_grow  # type: ignore[method-assign]
    _driver.Driver._finish = _traced_finish  # type: ignore[method-assign]
    loop = asyncio.get_running_loop()
    selector = loop._selector  # type: ignore[attr-defined]
    select = selector.select

    def traced_select(timeout: float | None = None) -> Any:
        start = time.perf_counter()
        ready = select(timeout)
        if live[0]:
            trace["select"].append((start, time.perf_counter()))
        return ready

    selector.select = traced_select
    layers, block = 32, args.block_size
    blocks = (1 << 30) // block
    caches = [torch.zeros(256, block // layers // 2, dtype=torch.float16, device=args.device) for _ in range(layers)]
    path = os.path.join(tempfile.gettempdir(), f"uring-kv-pause-trace-{os.getpid()}.bin")
    results: dict[str, list[dict[str, Any]]] = {"back to back": [], f"after {args.idle_ms:g} ms idle": []}
    async with Engine(caches, path, blocks, args.slots, direct=True, io_depth=32) as engine:
        ring.append(engine.io._ring)  # type: ignore[attr-defined]
        for first in range(0, blocks, 256):
            await engine.store_batch(list(range(256)), list(range(first, first + 256)))
        rng = random.Random(7)
        for round_index in range(args.rounds + 1):  # the first round is not measured
            conditions = list(results) if round_index % 2 else list(results)[::-1]
            for condition in conditions:
                for _ in range(args.per_round):
                    if condition != "back to back":
                        await asyncio.sleep(args.idle_ms / 1e3)
                    disk, gpu = rng.sample(range(blocks), 256), rng.sample(range(256), 256)
                    trace.clear()
                    runs.clear()
                    live[0] = True
                    start = time.perf_counter()
                    await engine.load_batch(disk, gpu)
                    end = time.perf_counter()
                    live[0] = False
                    if round_index:
                        results[condition].append(_batch(start, end))
    print(f"{args.device}, {block >> 10} KiB, {args.slots} slots at depth 32, "
          f"{args.rounds} rounds x {args.per_round} batches per condition")
    summaries = {condition: _summary(batches) for condition, batches in results.items()}
    names = list(summaries)
    print(f"{'':46} {names[0]:>26} {names[1]:>26}")
    for key in summaries[names[0]]:
        print(f"{key:46} {summaries[names[0]][key]:>26} {summaries[names[1]][key]:>26}")


def _batch(start: float, end: float) -> dict[str, Any]:
    selects = [s for s in trace["select"] if start <= s[0] < end]
    returns = [s[1] for s in selects]
    reaps = []
    after = {t: n for t, n in trace["inflight"]}
    for reap in trace["reap"]:
        i = bisect.bisect_right(returns, reap[0]) - 1
        reaps.append((*reap, reap[0] - returns[i] if i >= 0 else None, after.get(reap[1])))
    submitted = trace["submitted"][0] if trace["submitted"] else start
    found = [r for r in reaps if r[2] > 0]
    # Reads in flight between callbacks, weighted by how long each count held, from the first submission.
    steps = sorted((t, n) for t, n in trace["inflight"] if submitted <= t <= end)
    weighted = sum(n * (nxt[0] - t) for (t, n), nxt in zip(steps, [*steps[1:], (end, 0)], strict=True))
    return {
        "ms": (end - start) * 1e3,
        "start_us": (trace["submitted"][0] - start) * 1e6 if trace["submitted"] else float("nan"),
        "asleep": sum(s[1] - s[0] for s in selects) / (end - start),
        "sleeps": [s[1] - s[0] for s in selects],
        "reaps": reaps,
        "collections": len(trace["collect"]),
        "inflight_mean": weighted / (end - submitted),
        "first_us": (found[0][1] - submitted) * 1e6 if found else float("nan"),
        "tail_us": (end - found[-1][1]) * 1e6 if found else float("nan"),
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--block-size", type=int, default=128 << 10)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--per-round", type=int, default=4, help="batches per condition and round")
    parser.add_argument("--idle-ms", type=float, default=100.0)
    parser.add_argument("--slots", type=int, default=48, help="staging slots (the I/O depth stays 32)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    asyncio.run(main(parser.parse_args()))
