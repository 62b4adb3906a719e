"""Measuring methods against each other: every method runs every batch, in an order that rotates,
with its time, CPU time and the loop's lag taken, and its last batch checked byte for byte."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field

from uring_kv.bench.lagprobe import LagTicker
from uring_kv.bench.results import Row, kind_of, percentile, process_cpu_seconds
from uring_kv.bench.workload import Workload, scrub_blocks, sync, verify_file

# A method moves one batch; it may return its own elapsed seconds and the process's CPU seconds
# in them (the ring ceiling counts only its C loop).
Method = Callable[[bool, list[int], list[int]], Awaitable[tuple[float, float] | None]]


@dataclass
class Tally:
    latencies: list[float] = field(default_factory=list)
    cpu_s: float = 0.0
    lag: list[float] = field(default_factory=list)
    timer_lag: list[float] = field(default_factory=list)
    verified: bool = False


@contextlib.contextmanager
def frozen_heap(enabled: bool) -> Iterator[None]:
    """Collect, then move every object alive now out of the collector's reach while measuring.

    A full collection walks every tracked object, and a process that imported torch has hundreds
    of thousands: 30–140 ms during which the loop (whichever thread allocates triggers it) stops.
    Serving frameworks freeze their heap after start-up for this reason (vLLM calls
    ``gc.freeze()``); the bench does the same, so that its lag figures show the engine rather than
    when the collector happened to run. ``--no-gc-freeze`` measures without it."""
    if not enabled:
        yield
        return
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


async def measure(work: Workload, methods: dict[str, Method], op: str, fd: int, stride: int) -> dict[str, Tally]:
    """Every method runs every batch; the order rotates per batch so no method always goes first
    (on virtual disks the first reader of a block can pay a host-cache miss the others do not).
    The first ``warmup`` rounds are not counted: a first call can pay one-off costs (thread
    start-up, lazy CUDA loading, a virtual disk waking up) that say nothing about steady state."""
    tallies = {name: Tally() for name in methods}
    names = list(methods)
    store = op == "store"
    last = len(work.load_batches) - 1
    for round_index, (disk_blocks, gpu_blocks) in enumerate(zip(work.load_batches, work.gpu_order, strict=True)):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            if store:
                work.fill_gpu_as(disk_blocks, gpu_blocks)
                if round_index == last:  # the checked round: the file must get every block from this method
                    await asyncio.to_thread(scrub_blocks, fd, stride, disk_blocks)
            elif round_index == last:
                work.scrub()
            sync(work.device)
            tally = tallies[name]
            cpu0 = process_cpu_seconds()
            with LagTicker(name, work.config.lag_watch) as ticker:
                start = time.perf_counter()
                own = await methods[name](store, disk_blocks, gpu_blocks)
                elapsed = time.perf_counter() - start
                cpu = process_cpu_seconds() - cpu0
            if own is not None:
                elapsed, cpu = own
            if round_index < work.config.warmup:
                continue
            tally.latencies.append(elapsed)
            tally.cpu_s += cpu
            tally.lag.extend(ticker.samples)
            tally.timer_lag.extend(ticker.timer_samples)
            if round_index == last:
                if store:
                    # the ceilings write no file of their own (the ring's writes put back what was there)
                    tally.verified = name in ("ring ceiling", "copy ceiling") or \
                        await verify_file(fd, stride, work, disk_blocks)
                else:
                    sync(work.device)
                    tally.verified = name == "ring ceiling" or work.verify(disk_blocks, gpu_blocks)
    return tallies


def to_row(work: Workload, op: str, case: str, method: str, tally: Tally) -> Row:
    """A method's row from its tally: rates over the measured batches, latency percentiles, lag."""
    moved = len(tally.latencies) * work.config.batch
    elapsed = sum(tally.latencies)
    gigabytes = moved * work.block_bytes / 1e9
    return Row(op, case, work.block_bytes, method, kind_of(method), moved * work.block_bytes / elapsed / 1e9,
               moved / elapsed, percentile(tally.latencies, 0.5) * 1e3, percentile(tally.latencies, 0.99) * 1e3,
               tally.cpu_s, max(tally.lag, default=0.0) * 1e3, percentile(tally.lag, 0.99) * 1e3, tally.verified,
               max(tally.timer_lag, default=0.0) * 1e3, percentile(tally.timer_lag, 0.99) * 1e3,
               [round(x * 1e3, 3) for x in tally.latencies], lag_samples=len(tally.lag),
               lag_ms=[x * 1e3 for x in tally.lag], core_s_per_gb=tally.cpu_s / gigabytes if gigabytes else 0.0)
