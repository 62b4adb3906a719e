"""``uring-kv bench-mix``: demand loads arriving at a steady rate while a store flood and a prefetch
flood saturate the file, per class latency and throughput, for each method on the same file system
and the same workload; the demand loads alone (an idle engine) are the reference.

The classes, as a serving engine makes them:

* ``demand``: loads of ``--demand-blocks`` random blocks (a request scheduled now), arriving open
  loop at ``--rate`` calls a second for ``--duration`` seconds: the schedule is fixed before the
  phase starts (:func:`demand_schedule`), and each call's latency runs from its scheduled arrival
  to its completion, so a late start and any queueing count.
* ``store``: ``--store-tasks`` tasks, each storing ``--store-batch`` blocks a call, back to back, to
  blocks of its own (offloads after prefills).
* ``prefetch``: ``--prefetch-tasks`` tasks, each loading ``--prefetch-batch`` random blocks a call,
  back to back, from a region of the file the demand loads do not touch.

Per method, after ``--warmup`` seconds of demand loads not measured, two phases: ``idle`` (the demand
schedule alone) and ``flood`` (the floods started, ``--warmup`` seconds, a schedule of the same
shape, the floods stopped). Per class and phase: calls, GB/s
(the class's bytes over the phase), p50/p99/max latency (a flood call's from its start); demand
under flood also p99 ÷ its idle p99.

The methods (``--methods``): ``uring_kv``, :class:`uring_kv.Engine` through its public API with its
I/O classes (the prefetches made with a :class:`uring_kv.Prefetch`: demand loads, then
prefetches, then stores); ``uring_kv-1class``, the same engine with every load a demand load (the
rule before the classes: loads ahead of stores, first come first served among loads); ``vllm-fs``,
a port of vLLM's file-system tier's dual-queue pool and per-file I/O (``bench/fs_tier.py``).

Latency is taken where the caller learns of a completion (its ``await`` returns, on the loop), for
every method alike.

Bytes: the file holds the identity pattern (word ``w`` of block ``d``: ``d << 32 | w``); every
load's rows are checked and scrubbed off the loop after its latency is taken; the store region is
read back and checked after each flood.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import datetime
import json
import os
import platform
import random
import shutil
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from uring_kv.bench.args import Defaults, Parser, UsageError, at_least, byte_size, check_free_space, usable_directory
from uring_kv.bench.results import percentile, progress_printer

if TYPE_CHECKING:
    import numpy as np

METHODS = ("uring_kv", "uring_kv-1class", "vllm-fs")
CLASSES = ("demand", "prefetch", "store")
PHASES = ("idle", "flood")
UNIT = 4096  # blocks are whole pages: O_DIRECT, and vLLM's rows
DEMAND_GROUPS = 32  # demand calls in flight at most, each with rows of its own (a 33rd waits, and that counts)


@dataclass(frozen=True)
class MixConfig:
    path: str
    size: int = 512 << 20
    block_bytes: int = 128 << 10
    demand_blocks: int = 8
    rate: float = 100.0
    duration: float = 5.0
    warmup: float = 0.5
    store_tasks: int = 4
    store_batch: int = 64
    prefetch_tasks: int = 2
    prefetch_batch: int = 64
    slots: int = 48
    io_depth: int = 32
    methods: tuple[str, ...] = METHODS
    gc_freeze: bool = True  # the heap collected and frozen while measuring (bench/measure.py's frozen_heap)
    seed: int = 0

    @property
    def num_blocks(self) -> int:
        return self.size // self.block_bytes

    @property
    def store_region(self) -> range:
        return range(0, self.store_tasks * self.store_batch)

    @property
    def prefetch_region(self) -> range:
        rest = self.num_blocks - len(self.store_region)
        return range(len(self.store_region), len(self.store_region) + rest // 2)

    @property
    def demand_region(self) -> range:
        return range(self.prefetch_region.stop, self.num_blocks)

    @property
    def rows(self) -> int:
        return (self.store_tasks * self.store_batch + self.prefetch_tasks * self.prefetch_batch
                + DEMAND_GROUPS * self.demand_blocks)


def demand_schedule(config: MixConfig, phase: str, duration: float | None = None) -> list[tuple[float, list[int]]]:
    """The demand calls of one phase: (seconds after the phase's start, the disk blocks to load),
    ``rate × duration`` calls ``1 / rate`` apart (``duration``: the config's unless given), blocks
    drawn from the demand region, other blocks in each phase (a block read in one phase may sit in
    a cache below the file in the next)."""
    rng = random.Random(f"{config.seed}-{phase}")
    calls = round(config.rate * (config.duration if duration is None else duration))
    region = config.demand_region
    return [(i / config.rate, [region[n] for n in rng.sample(range(len(region)), config.demand_blocks)])
            for i in range(calls)]


class Method(Protocol):
    """What the bench drives: loads and stores of disk blocks to and from cache rows, each returning
    the ``time.perf_counter()`` at which it completed."""

    name: str
    rule: str

    @property
    def facts(self) -> dict[str, Any]: ...

    async def load(self, disk_blocks: list[int], rows: list[int]) -> float: ...

    async def prefetch(self, disk_blocks: list[int], rows: list[int]) -> float: ...

    async def store(self, rows: list[int], disk_blocks: list[int]) -> float: ...

    async def close(self) -> None: ...


class EngineMethod:
    """``uring_kv``: one :class:`uring_kv.Engine`, its public calls only; ``classes``: prefetches
    made with a :class:`uring_kv.Prefetch` (else every load is a demand load)."""

    def __init__(self, engine: Any, slots: int, classes: bool) -> None:
        self.engine = engine
        self.slots = slots
        self.classes = classes
        self.name = "uring_kv" if classes else "uring_kv-1class"
        self.rule = "demand > prefetch > store" if classes else "loads first"

    @property
    def facts(self) -> dict[str, Any]:
        stats = self.engine.stats()
        return {"io": stats["io"], "o_direct": stats["direct"], "slots": self.slots,
                "io_depth": stats["io_depth"], "loads_into_caches": stats["loads_into_caches"]}

    async def load(self, disk_blocks: list[int], rows: list[int]) -> float:
        await self.engine.load_batch(disk_blocks, rows)
        return time.perf_counter()

    async def prefetch(self, disk_blocks: list[int], rows: list[int]) -> float:
        from uring_kv import Prefetch

        await self.engine.load_batch(disk_blocks, rows, prefetch=Prefetch() if self.classes else None)
        return time.perf_counter()

    async def store(self, rows: list[int], disk_blocks: list[int]) -> float:
        await self.engine.store_batch(rows, disk_blocks)
        return time.perf_counter()

    async def close(self) -> None:
        await self.engine.aclose()


@dataclass
class MixRow:
    """One class of one method in one phase."""
    method: str
    rule: str
    phase: str
    cls: str
    calls: int
    blocks_per_call: int
    gbps: float
    p50_ms: float
    p99_ms: float
    max_ms: float
    verified: bool
    p99_vs_idle: float | None = None  # demand under flood: its p99 ÷ the same method's idle p99
    start_lag_ms: dict[str, float] = field(default_factory=dict)  # demand: call start − scheduled arrival


class _Rows:
    """The cache rows, as the methods see them (one page-aligned region, ``block_bytes`` a row) and as
    int64 words for the checks: the store tasks' rows, then the prefetch tasks', then the demand
    groups'."""

    def __init__(self, config: MixConfig) -> None:
        import numpy as np

        from uring_kv._memory import HostBuffer, view_of

        self.config = config
        # the threads that check and scrub loaded rows: the rows' own, so that closing them waits for
        # any still running (a call that failed or was cancelled leaves its check running)
        self.checker = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="bench-mix-check")
        self.buffer = HostBuffer(config.rows * config.block_bytes)
        # views of the address, not of the buffer's own view: the buffer closes whoever still holds them
        self.words = np.frombuffer(view_of(self.buffer.addr, self.buffer.size), dtype=np.int64).reshape(
            config.rows, -1)
        self.store_first = 0
        self.prefetch_first = config.store_tasks * config.store_batch
        self.demand_first = self.prefetch_first + config.prefetch_tasks * config.prefetch_batch

    def tensor(self) -> Any:
        import torch

        from uring_kv._memory import view_of

        return torch.frombuffer(view_of(self.buffer.addr, self.buffer.size), dtype=torch.uint8).view(
            self.config.rows, self.config.block_bytes)

    async def check(self, first: int, disk_blocks: list[int]) -> bool:
        """Rows ``first``.. hold ``disk_blocks``' identity pattern (then scrubbed), on a checker thread."""
        return await asyncio.get_running_loop().run_in_executor(
            self.checker, _check_and_scrub, self.words[first:first + len(disk_blocks)], disk_blocks)

    def close(self) -> None:
        self.checker.shutdown(wait=True)  # no check may still write the rows when they are unmapped
        del self.words
        self.buffer.close()


def _check_and_scrub(words: np.ndarray, disk_blocks: list[int]) -> bool:
    from uring_kv.bench.workload import holds_identity

    return holds_identity(words, disk_blocks, scrub=True)


@dataclass
class _Tally:
    latencies: list[float] = field(default_factory=list)
    lags: list[float] = field(default_factory=list)
    first: float = float("inf")
    last: float = 0.0
    verified: bool = True

    def add(self, started: float, done: float) -> None:
        """A call from ``started`` (a demand load's scheduled arrival) to ``done``."""
        self.latencies.append(done - started)
        self.first = min(self.first, started)
        self.last = max(self.last, done)


async def _demand(method: Method, rows: _Rows, schedule: list[tuple[float, list[int]]]) -> _Tally:
    loop = asyncio.get_running_loop()
    tally = _Tally()
    groups: asyncio.Queue[int] = asyncio.Queue()
    for group in range(DEMAND_GROUPS):
        groups.put_nowait(rows.demand_first + group * rows.config.demand_blocks)

    async def call(arrival: float, disk_blocks: list[int]) -> None:
        tally.lags.append(time.perf_counter() - arrival)
        first = await groups.get()
        try:
            tally.add(arrival, await method.load(disk_blocks, list(range(first, first + len(disk_blocks)))))
            tally.verified &= await rows.check(first, disk_blocks)
        finally:
            groups.put_nowait(first)

    if not schedule:
        return tally
    tasks: list[asyncio.Task[None]] = []
    all_arrived = loop.create_future()

    def arrive(arrival: float, disk_blocks: list[int]) -> None:
        tasks.append(asyncio.ensure_future(call(arrival, disk_blocks)))
        if len(tasks) == len(schedule):
            all_arrived.set_result(None)

    # the loop's timers run on its clock; the arrivals are kept on perf_counter's, as the completions
    start, base = time.perf_counter() + 0.01, loop.time() + 0.01
    for offset, disk_blocks in schedule:
        loop.call_at(base + offset, arrive, start + offset, disk_blocks)
    await all_arrived
    await asyncio.gather(*tasks)
    return tally


async def _flood(method: Method, rows: _Rows, cls: str, task: int, stop: asyncio.Event, tally: _Tally) -> None:
    config = rows.config
    rng = random.Random(f"{config.seed}-{cls}-{task}")
    if cls == "store":
        first, count = rows.store_first + task * config.store_batch, config.store_batch
        disk_blocks = list(config.store_region[task * count:(task + 1) * count])
    else:
        first, count = rows.prefetch_first + task * config.prefetch_batch, config.prefetch_batch
    row_list = list(range(first, first + count))
    while not stop.is_set():
        started = time.perf_counter()
        if cls == "store":
            tally.add(started, await method.store(row_list, disk_blocks))
            continue
        region = config.prefetch_region
        blocks = [region[n] for n in rng.sample(range(len(region)), count)]
        tally.add(started, await method.prefetch(blocks, row_list))
        tally.verified &= await rows.check(first, blocks)


async def _prefill(method: Method, rows: _Rows) -> None:
    """Every block of the file through ``method`` (the store rows as the source, the identity
    pattern stamped in), the store rows left holding their own blocks' pattern."""
    from uring_kv.bench.workload import stamp_identity

    config = rows.config
    chunk = min(config.rows, max(len(config.store_region), 64))
    for first in [*range(chunk, config.num_blocks, chunk), 0]:
        disk_blocks = list(range(first, min(first + chunk, config.num_blocks)))
        stamp_identity(rows.words[:len(disk_blocks)], disk_blocks)
        await method.store(list(range(len(disk_blocks))), disk_blocks)


async def _store_readback(method: Method, rows: _Rows) -> bool:
    """The store region read back (into the store rows, scrubbed first) and checked; the store rows
    stamped again for the next flood."""
    from uring_kv.bench.workload import stamp_identity

    config = rows.config
    disk_blocks = list(config.store_region)
    if not disk_blocks:
        return True
    words = rows.words[:len(disk_blocks)]
    words.fill(-1)
    await method.load(disk_blocks, list(range(len(disk_blocks))))
    ok = _check_and_scrub(words, disk_blocks)
    stamp_identity(words, disk_blocks)
    return ok


def _row(method: Method, phase: str, cls: str, tally: _Tally, blocks_per_call: int, block_bytes: int) -> MixRow:
    calls = len(tally.latencies)
    span = tally.last - tally.first if calls else 0.0
    row = MixRow(method.name, method.rule, phase, cls, calls, blocks_per_call,
                 calls * blocks_per_call * block_bytes / span / 1e9 if span > 0 else 0.0,
                 percentile(tally.latencies, 0.5) * 1e3, percentile(tally.latencies, 0.99) * 1e3,
                 max(tally.latencies, default=0.0) * 1e3, tally.verified)
    if tally.lags:
        row.start_lag_ms = {"min": min(tally.lags) * 1e3, "p99": percentile(tally.lags, 0.99) * 1e3,
                            "max": max(tally.lags) * 1e3}
    return row


async def _phases(method: Method, rows: _Rows, progress: Callable[[str], None]) -> list[MixRow]:
    config = rows.config
    # unmeasured: a fresh engine's or pool's first calls (workers started, rows faulted in)
    await _demand(method, rows, demand_schedule(config, "warm-up", config.warmup))
    schedule = demand_schedule(config, "idle")
    result = []
    progress(f"{method.name}: demand loads alone, {len(schedule)} calls")
    idle = _row(method, "idle", "demand", await _demand(method, rows, schedule), config.demand_blocks,
                config.block_bytes)
    result.append(idle)
    progress(f"{method.name}: demand loads under the store and prefetch floods")
    stop = asyncio.Event()
    tallies = {"store": _Tally(), "prefetch": _Tally()}
    floods = [asyncio.ensure_future(_flood(method, rows, cls, task, stop, tallies[cls]))
              for cls, tasks in (("store", config.store_tasks), ("prefetch", config.prefetch_tasks))
              for task in range(tasks)]
    try:
        await asyncio.sleep(config.warmup)
        demand = _row(method, "flood", "demand", await _demand(method, rows, demand_schedule(config, "flood")),
                      config.demand_blocks, config.block_bytes)
    finally:
        stop.set()
        await asyncio.gather(*floods)
    demand.p99_vs_idle = demand.p99_ms / idle.p99_ms if idle.p99_ms else None
    tallies["store"].verified = await _store_readback(method, rows)
    result += [demand, _row(method, "flood", "prefetch", tallies["prefetch"], config.prefetch_batch,
                            config.block_bytes),
               _row(method, "flood", "store", tallies["store"], config.store_batch, config.block_bytes)]
    return result


@asynccontextmanager
async def _opened(name: str, rows: _Rows) -> AsyncIterator[Method]:
    config = rows.config
    if name.startswith("uring_kv"):
        from uring_kv import Engine

        path = os.path.join(config.path, f"uring-kv-mix-{os.getpid()}.bin")
        engine = Engine([rows.tensor()], path, config.num_blocks, config.slots, io_depth=config.io_depth)
        await engine.open()
        method: Method = EngineMethod(engine, config.slots, classes=name == "uring_kv")
    else:
        from uring_kv.bench.fs_tier import FsTier, FsTierMethod

        root = tempfile.mkdtemp(prefix="uring-kv-mix-fs-", dir=config.path)
        try:
            method = FsTierMethod(FsTier(root, config.block_bytes, rows.buffer.addr))
        except BaseException:
            shutil.rmtree(root, ignore_errors=True)
            raise
    try:
        yield method
    finally:
        await method.close()
        if not name.startswith("uring_kv"):
            shutil.rmtree(root, ignore_errors=True)


async def run_mix(config: MixConfig, progress: Callable[[str], None] = lambda message: None) -> dict[str, Any]:
    """Every method of ``config``, one after the other on the same rows and schedule: the JSON-ready
    result (config, machine, each method's facts, the rows, whether every byte checked)."""
    from uring_kv.bench.measure import frozen_heap

    rows = _Rows(config)
    results: list[MixRow] = []
    facts: dict[str, Any] = {}
    try:
        for name in config.methods:
            async with _opened(name, rows) as method:
                progress(f"{name}: writing {config.num_blocks} blocks of {config.block_bytes >> 10} KiB")
                await _prefill(method, rows)
                facts[name] = {"rule": method.rule, **method.facts}
                with frozen_heap(config.gc_freeze):
                    results += await _phases(method, rows, progress)
    finally:
        rows.close()
    return {"config": asdict(config), "machine": _machine(), "methods": facts,
            "rows": [asdict(row) for row in results], "all_verified": all(row.verified for row in results)}


def _machine() -> dict[str, Any]:
    return {"host": platform.node(), "cpus": os.cpu_count(), "kernel": platform.release(),
            "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")}


def render(result: dict[str, Any], console: Any) -> None:
    """The table: a row per method, phase and class; the set-up above it."""
    from rich.table import Table

    config, machine = result["config"], result["machine"]
    console.print(f"uring-kv bench-mix · {config['path']} · {config['block_bytes'] >> 10} KiB blocks · "
                  f"demand {config['demand_blocks']} blocks × {config['rate']:g}/s for {config['duration']:g} s · "
                  f"store {config['store_tasks']} × {config['store_batch']} · prefetch "
                  f"{config['prefetch_tasks']} × {config['prefetch_batch']} · {machine['cpus']} CPUs · "
                  f"{machine['date']}")
    for name, facts in result["methods"].items():
        console.print(f"  {name}: " + ", ".join(f"{k}={v}" for k, v in facts.items()))
    table = Table(show_edge=False, pad_edge=False)
    for header in ("method", "phase", "class", "calls", "GB/s", "p50 ms", "p99 ms", "max ms", "÷ idle", "late",
                   "ok"):
        table.add_column(header, justify="left" if header in ("method", "phase", "class", "ok") else "right",
                         no_wrap=header == "method")
    for row in result["rows"]:
        ratio = row["p99_vs_idle"]
        table.add_row(f"{row['method']} · {row['rule']}", row["phase"], row["cls"], str(row["calls"]),
                      f"{row['gbps']:.2f}", f"{row['p50_ms']:.2f}", f"{row['p99_ms']:.2f}", f"{row['max_ms']:.2f}",
                      f"{ratio:.1f}×" if ratio is not None else "",
                      f"{row['start_lag_ms']['p99']:.2f}" if row["start_lag_ms"] else "",
                      "yes" if row["verified"] else "NO")
    console.print(table)
    console.print("latency: from the scheduled arrival (demand) or the call (floods) to the caller's await "
                  "returning; ÷ idle: p99 under the floods ÷ p99 alone; late: p99 ms from a demand call's "
                  "scheduled arrival to its start (the loop's timer); ok: every load's bytes checked")


def add_command(commands: argparse._SubParsersAction[Parser]) -> None:
    """The command's arguments, in ``uring-kv``'s parser (:func:`command` runs it)."""
    defaults = MixConfig(path="")
    parser = commands.add_parser("bench-mix", formatter_class=Defaults,
                                 help="demand loads at a steady rate under store and prefetch floods, per class "
                                      "latency, against vLLM's fs tier pool")
    parser.add_argument("--path", help="directory for the file(s) (default: the temp directory; /dev/shm: "
                                       "RAM-backed)")
    parser.add_argument("--size", type=byte_size, default=defaults.size, help="file size")
    parser.add_argument("--block-size", type=byte_size, default=defaults.block_bytes,
                        help="bytes per block (a multiple of 4096)")
    parser.add_argument("--demand-blocks", type=at_least(1), default=defaults.demand_blocks,
                        help="blocks per demand load")
    parser.add_argument("--rate", type=_positive, default=defaults.rate, help="demand loads a second (open loop)")
    parser.add_argument("--duration", type=_positive, default=defaults.duration,
                        help="seconds of demand loads per phase")
    parser.add_argument("--warmup", type=_non_negative, default=defaults.warmup,
                        help="seconds of demand loads before the measured ones, and of the floods before "
                             "the demand loads under them")
    parser.add_argument("--store-tasks", type=at_least(0), default=defaults.store_tasks,
                        help="tasks storing back to back")
    parser.add_argument("--store-batch", type=at_least(1), default=defaults.store_batch, help="blocks per store")
    parser.add_argument("--prefetch-tasks", type=at_least(0), default=defaults.prefetch_tasks,
                        help="tasks loading back to back (prefetches)")
    parser.add_argument("--prefetch-batch", type=at_least(1), default=defaults.prefetch_batch,
                        help="blocks per prefetch")
    parser.add_argument("--slots", type=at_least(1), default=defaults.slots, help="uring_kv's staging slots")
    parser.add_argument("--io-depth", type=at_least(1), default=defaults.io_depth,
                        help="uring_kv's reads and writes in flight")
    parser.add_argument("--no-gc-freeze", dest="gc_freeze", action="store_false",
                        help="do not collect and freeze the heap before measuring (a full collection stops "
                             "the loop for tens of ms in a process that imported torch)")
    parser.add_argument("--methods", type=_methods, default=METHODS,
                        help="comma-separated: uring_kv, uring_kv-1class, vllm-fs")
    parser.add_argument("--json", help="write the result as JSON to this file")
    parser.set_defaults(func=command)


def _positive(text: str) -> float:
    value = _number(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text!r}")
    return value


def _non_negative(text: str) -> float:
    value = _number(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text!r}")
    return value


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None


def _methods(text: str) -> tuple[str, ...]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in METHODS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of {', '.join(METHODS)}, got {text!r}")
    return tuple(name for name in METHODS if name in names)


def command(args: argparse.Namespace) -> int:
    """Checks what the parser cannot (the block size, room for the regions, the directory and its
    free space), runs the bench, prints the table, writes the JSON; 1 if a byte did not check."""
    from rich.console import Console

    if args.block_size % UNIT:
        raise UsageError(f"--block-size {args.block_size}: blocks are whole pages (a multiple of {UNIT} bytes)")
    config = MixConfig(path=usable_directory(args.path), size=args.size, block_bytes=args.block_size,
                       demand_blocks=args.demand_blocks, rate=args.rate, duration=args.duration, warmup=args.warmup,
                       store_tasks=args.store_tasks, store_batch=args.store_batch,
                       prefetch_tasks=args.prefetch_tasks, prefetch_batch=args.prefetch_batch, slots=args.slots,
                       io_depth=args.io_depth, methods=args.methods, gc_freeze=args.gc_freeze)
    if (len(config.prefetch_region) < max(config.prefetch_batch, 1)
            or len(config.demand_region) < config.demand_blocks):
        need = (len(config.store_region) + max(config.prefetch_batch, config.demand_blocks) * 2) * config.block_bytes
        raise UsageError(f"--size {config.size}: too small for the store region, a prefetch and a demand load "
                         f"(at least {need >> 20 or 1} MiB here)")
    # one method's files at a time; the fs tier's may hold each store block twice while the cleaner catches up
    check_free_space(config.path, config.size + 2 * len(config.store_region) * config.block_bytes + (16 << 20))
    result = asyncio.run(run_mix(config, progress_printer("bench-mix")))
    screen = Console(highlight=False)
    if not screen.is_terminal and "COLUMNS" not in os.environ:
        screen = Console(highlight=False, width=120)
    render(result, screen)
    if args.json:
        with open(args.json, "w") as out:
            json.dump(result, out, indent=2)
    print(f"verified: {'all' if result['all_verified'] else 'NOT ALL'}")
    if not result["all_verified"]:
        print("bench-mix: some bytes did not check", file=sys.stderr)
    return 0 if result["all_verified"] else 1
