"""``uring-kv bench``: uring_kv against what a user would run instead, and against the machine's limits.

Every method runs in the same process, on the same file, with the same random batches, and every
method's last batch is checked byte for byte: each 8-byte word of disk block ``d`` holds
``d << 32 | word``, so a block landing in the wrong place, torn or stale is caught.

The methods are uring_kv (``Engine.load_batch`` / ``store_batch``) and the peers and ceilings of
``_peers.py`` (vLLM's DiskBackend, a thread pool, KvikIO, fio, the ring ceiling; the PCIe ceiling
on a GPU). The event loop's lag is sampled while each method runs (a probe process writing to a
pipe the loop watches). ``_report.py`` turns the result into the verdict, the table and the plot.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import json
import os
import random
import resource
import struct
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from uring_kv import _peers
from uring_kv._engine import Engine
from uring_kv._file import round_up
from uring_kv._memory import HostBuffer
from uring_kv._tuning import Tuning

# --peers names: vLLM's DiskBackend, a thread pool, KvikIO, fio, the ring ceiling
PEERS = ("vllm-disk", "threads", "kvikio", "fio", "ceiling")
DEPTHS = (4, 8, 16, 32, 64, 128)  # I/O depths the sizing sweep tries on the ring ceiling


@dataclass
class BenchConfig:
    path: str | None = None
    size: int = 1 << 30
    block_sizes: list[int] = field(default_factory=lambda: [128 << 10, 2 << 20])
    layers: int = 32
    batch: int = 256
    batches: int | None = None  # measured rounds per block size (None: batches_for's default)
    warmup: int = 1  # unmeasured rounds first (every method), on batches of their own
    gc_freeze: bool = True  # collect and freeze the heap before measuring (see _frozen_heap)
    io_depth: int = 32  # reads and writes in flight: uring_kv's, the ring ceiling's and fio's
    slots: int | None = None  # uring_kv's staging slots (None: see staging_slots())
    threads: int = 8  # of the thread pool and of KvikIO
    direct: bool | None = None  # None: both cold (O_DIRECT) and hot (buffered, page cache)
    device: str = "auto"
    checksum: bool = False  # also measure uring_kv with checksum=True ("uring_kv+crc32c")
    peers: tuple[str, ...] = PEERS  # which of the others run beside uring_kv
    sweep: bool = True  # time the ring ceiling at several depths for the sizing advice


@dataclass
class Row:
    op: str
    case: str
    block_bytes: int
    method: str
    kind: str  # "uring_kv", "peer" or "ceiling"
    gbps: float
    blocks_per_s: float
    p50_ms: float
    p99_ms: float
    cpu_s: float
    lag_max_ms: float
    lag_p99_ms: float
    verified: bool
    timer_lag_max_ms: float = 0.0
    timer_lag_p99_ms: float = 0.0
    batch_ms: list[float] = field(default_factory=list)  # every measured batch, in order
    ratios: dict[str, float] = field(default_factory=dict)
    lag_samples: int = 0  # probe samples behind lag_max_ms / lag_p99_ms (1 per ms of the row's batches)
    lag_ms: list[float] = field(default_factory=list, repr=False)  # those samples (pooled per run, not in the JSON)


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class _Prober:
    """A child process that writes its CLOCK_MONOTONIC time (8 bytes) into a pipe every
    ``period`` seconds, for the life of this process. Being another process, its own late wake-ups
    and its need for a GIL never show as the loop's lag: a sample is taken from the time it wrote."""

    _CODE = (
        "import os, struct, sys, time\n"
        "fd, period = int(sys.argv[1]), float(sys.argv[2])\n"
        "due = time.monotonic()\n"
        "while True:\n"
        "    due += period\n"
        "    wait = due - time.monotonic()\n"
        "    if wait > 0:\n"
        "        time.sleep(wait)\n"
        "    else:\n"
        "        due = time.monotonic()\n"
        "    try:\n"
        "        os.write(fd, struct.pack('d', time.monotonic()))\n"
        "    except OSError:\n"  # the reading end is gone: this process has exited
        "        break\n"
    )
    _shared: _Prober | None = None

    def __init__(self, period: float) -> None:
        import subprocess

        self.fd, write_fd = os.pipe()
        os.set_blocking(self.fd, False)
        try:
            self._child = subprocess.Popen([sys.executable, "-c", self._CODE, str(write_fd), str(period)],
                                           pass_fds=(write_fd,), stdin=subprocess.DEVNULL)
        finally:
            os.close(write_fd)
        self._pending = b""
        import select

        select.select([self.fd], [], [], 10.0)  # up once it has written (an interpreter starts in ~50 ms)

    @classmethod
    def shared(cls, period: float) -> _Prober:
        if cls._shared is None:
            cls._shared = cls(period)
            import atexit

            atexit.register(cls._shared.close)
        return cls._shared

    def drain(self) -> list[float]:
        """The send times of every sample written since the last call."""
        while True:
            try:
                chunk = os.read(self.fd, 4096)
            except BlockingIOError:
                break
            if not chunk:
                break
            self._pending += chunk
        whole = len(self._pending) // 8 * 8
        sent = [value for (value,) in struct.iter_unpack("d", self._pending[:whole])]
        self._pending = self._pending[whole:]
        return sent

    def close(self) -> None:
        os.close(self.fd)
        self._child.wait(timeout=5)


class LagTicker:
    """The event loop's responsiveness while a method runs, sampled every millisecond two ways.

    ``samples`` (the "lag" columns): another process writes its clock into a pipe the loop watches
    (``add_reader``, as a socket wakes a server's loop), every 1 ms; a sample is how long after the
    write the loop ran the reader callback. It counts every way the loop can be kept from running:
    a long callback, a wait for the GIL, the loop thread not being scheduled; and nothing else (the
    writer's own scheduling delays are its own, taken out by stamping the time it wrote).

    ``timer_samples``: how late a task's ``asyncio.sleep(0.001)`` wakes up. asyncio passes epoll
    a timeout in whole milliseconds, rounded up, so a loop woken by I/O part-way through a tick
    sleeps up to ~1 ms past the timer even when it has nothing to do; this measures that rounding
    as much as any stall, and is kept for comparison (JSON only).
    """

    PERIOD = 0.001

    def __init__(self) -> None:
        self.samples: list[float] = []
        self.timer_samples: list[float] = []
        self._task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._prober = _Prober.shared(self.PERIOD)

    async def _timer(self) -> None:
        while True:
            start = time.perf_counter()
            await asyncio.sleep(self.PERIOD)
            self.timer_samples.append(max(0.0, time.perf_counter() - start - self.PERIOD))

    def _on_probe(self) -> None:
        now = time.monotonic()
        self.samples.extend(max(0.0, now - sent) for sent in self._prober.drain())

    def __enter__(self) -> LagTicker:
        self._loop = asyncio.get_running_loop()
        self._prober.drain()  # written while nobody measured
        self._loop.add_reader(self._prober.fd, self._on_probe)
        self._task = self._loop.create_task(self._timer())
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._task is not None and self._loop is not None
        self._task.cancel()
        self._loop.remove_reader(self._prober.fd)


@contextlib.contextmanager
def _frozen_heap(enabled: bool) -> Iterator[None]:
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


def identity_words(disk_blocks: list[int], first_word: int, words: int, device: torch.device | str) -> torch.Tensor:
    """[len(disk_blocks), words] int64: word w of disk block d holds ``d << 32 | w``."""
    column = torch.arange(first_word, first_word + words, dtype=torch.int64, device=device)
    row = torch.tensor(disk_blocks, dtype=torch.int64, device=device) << 32
    return row[:, None] | column[None, :]


class Workload:
    """The caches, the file's content and the batches for one block size."""

    def __init__(self, config: BenchConfig, block_bytes: int, device: torch.device) -> None:
        self.config = config
        self.device = device
        per_layer = block_bytes // config.layers
        if per_layer % 64 or per_layer == 0:
            raise ValueError(f"block size {block_bytes} does not split into {config.layers} layers "
                             "of 64-byte multiples")
        self.block_bytes = block_bytes
        self.per_layer = per_layer
        self.gpu_blocks = config.batch
        self.num_disk_blocks = max(config.batch, config.size // block_bytes)
        self.caches = [torch.empty(self.gpu_blocks, per_layer // 2, dtype=torch.bfloat16, device=device)
                       for _ in range(config.layers)]
        rng = random.Random(block_bytes)
        self.batches = batches_for(config, block_bytes)
        rounds = config.warmup + self.batches
        self.load_batches = [rng.sample(range(self.num_disk_blocks), config.batch) for _ in range(rounds)]
        self.gpu_order = [rng.sample(range(self.gpu_blocks), config.batch) for _ in range(rounds)]

    def _pattern(self, disk_blocks: list[int], layer: int) -> torch.Tensor:
        words = self.per_layer // 8
        return identity_words(disk_blocks, layer * words, words, self.device)

    def fill_gpu_as(self, disk_blocks: list[int], gpu_blocks: list[int]) -> None:
        index = torch.tensor(gpu_blocks, device=self.device)
        for layer, cache in enumerate(self.caches):
            cache.view(torch.int64).index_copy_(0, index, self._pattern(disk_blocks, layer))

    def scrub(self) -> None:
        for cache in self.caches:
            cache.view(torch.int64).fill_(-1)

    def verify(self, disk_blocks: list[int], gpu_blocks: list[int]) -> bool:
        index = torch.tensor(gpu_blocks, device=self.device)
        return all(torch.equal(cache.view(torch.int64).index_select(0, index), self._pattern(disk_blocks, layer))
                   for layer, cache in enumerate(self.caches))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class _Tally:
    latencies: list[float] = field(default_factory=list)
    cpu_s: float = 0.0
    lag: list[float] = field(default_factory=list)
    timer_lag: list[float] = field(default_factory=list)
    verified: bool = False


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _scrub_blocks(fd: int, stride: int, disk_blocks: list[int]) -> None:
    """Zero the blocks in the file (plain pwritev, aligned for O_DIRECT): a store checked after this
    must have written every one of them itself."""
    buffer = HostBuffer(stride)
    try:
        for disk_block in disk_blocks:
            os.pwritev(fd, [buffer.view], disk_block * stride)
    finally:
        buffer.close()


async def _verify_file(fd: int, stride: int, work: Workload, disk_blocks: list[int]) -> bool:
    """Read the blocks back with plain preadv and check their words (for store rows)."""
    buffer = HostBuffer(stride)
    ok = True
    words = work.per_layer // 8 * work.config.layers
    for disk_block in disk_blocks:
        await asyncio.to_thread(os.preadv, fd, [buffer.view], disk_block * stride)
        got = torch.frombuffer(buffer.view, dtype=torch.int64)[:words]
        ok &= torch.equal(got, identity_words([disk_block], 0, words, "cpu")[0])
        del got
    buffer.close()
    return ok


async def _prefill(engine: Engine, work: Workload) -> None:
    """Write every disk block's identity pattern through the engine itself."""
    for first in range(0, work.num_disk_blocks, work.gpu_blocks):
        disk_blocks = list(range(first, min(first + work.gpu_blocks, work.num_disk_blocks)))
        gpu_blocks = list(range(len(disk_blocks)))
        work.fill_gpu_as(disk_blocks, gpu_blocks)
        await engine.store_batch(gpu_blocks, disk_blocks)


# A method moves one batch; it may return its own elapsed seconds (the ceiling times only its C loop).
Method = Callable[[bool, list[int], list[int]], Awaitable[float | None]]


async def _measure(work: Workload, methods: dict[str, Method], op: str, fd: int, stride: int) -> dict[str, _Tally]:
    """Every method runs every batch; the order rotates per batch so no method always goes first
    (on virtual disks the first reader of a block can pay a host-cache miss the others do not).
    The first ``warmup`` rounds are not counted: a first call can pay one-off costs (thread
    start-up, lazy CUDA loading, a virtual disk waking up) that say nothing about steady state."""
    tallies = {name: _Tally() for name in methods}
    names = list(methods)
    store = op == "store"
    last = len(work.load_batches) - 1
    for round_index, (disk_blocks, gpu_blocks) in enumerate(zip(work.load_batches, work.gpu_order, strict=True)):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            if store:
                work.fill_gpu_as(disk_blocks, gpu_blocks)
                if round_index == last:  # the checked round: the file must get every block from this method
                    await asyncio.to_thread(_scrub_blocks, fd, stride, disk_blocks)
            elif round_index == last:
                work.scrub()
            _sync(work.device)
            tally = tallies[name]
            cpu0 = _cpu_seconds()
            with LagTicker() as ticker:
                start = time.perf_counter()
                own = await methods[name](store, disk_blocks, gpu_blocks)
                elapsed = time.perf_counter() - start if own is None else own
            if round_index < work.config.warmup:
                continue
            tally.latencies.append(elapsed)
            tally.cpu_s += _cpu_seconds() - cpu0
            tally.lag.extend(ticker.samples)
            tally.timer_lag.extend(ticker.timer_samples)
            if round_index == last:
                if store:
                    tally.verified = name == "ring ceiling" or await _verify_file(fd, stride, work, disk_blocks)
                else:
                    _sync(work.device)
                    tally.verified = name == "ring ceiling" or work.verify(disk_blocks, gpu_blocks)
    return tallies


def kind_of(method: str) -> str:
    """"uring_kv", "peer" or "ceiling"."""
    if method.startswith("uring_kv"):
        return "uring_kv"
    return "ceiling" if method in ("ring ceiling", "fio", "pcie ceiling") else "peer"


def _row(work: Workload, op: str, case: str, method: str, tally: _Tally) -> Row:
    moved = len(tally.latencies) * work.config.batch
    elapsed = sum(tally.latencies)
    return Row(op, case, work.block_bytes, method, kind_of(method), moved * work.block_bytes / elapsed / 1e9,
               moved / elapsed, _percentile(tally.latencies, 0.5) * 1e3, _percentile(tally.latencies, 0.99) * 1e3,
               tally.cpu_s, max(tally.lag, default=0.0) * 1e3, _percentile(tally.lag, 0.99) * 1e3, tally.verified,
               max(tally.timer_lag, default=0.0) * 1e3, _percentile(tally.timer_lag, 0.99) * 1e3,
               [round(x * 1e3, 3) for x in tally.latencies], lag_samples=len(tally.lag),
               lag_ms=[x * 1e3 for x in tally.lag])


class _Closing:
    """The peers of one case, closed together whatever happens."""

    def __init__(self) -> None:
        self.items: list[Any] = []

    def add(self, item: Any) -> Any:
        self.items.append(item)
        return item

    def close(self) -> None:
        for item in reversed(self.items):
            item.close()
        self.items.clear()


def _depth_sweep(fd: int, stride: int, work: Workload) -> dict[int, float]:
    """GB/s of the ring ceiling's loads at each of DEPTHS, two batches each (the sizing advice)."""
    rates: dict[int, float] = {}
    batches = work.load_batches[:2]
    for depth in (d for d in DEPTHS if d <= len(batches[0])):  # deeper than a batch changes nothing
        ceiling = _peers.RingCeiling(fd, stride, depth)
        try:
            ceiling.run(False, batches[0], [])  # warm-up
            seconds = sum(ceiling.run(False, blocks, []) for blocks in batches)
        finally:
            ceiling.close()
        rates[depth] = len(batches) * len(batches[0]) * stride / seconds / 1e9
    return rates


async def bench_block_size(config: BenchConfig, block_bytes: int, device: torch.device, directory: str,
                           progress: Callable[[str], None]) -> tuple[list[Row], dict[str, Any]]:
    work = Workload(config, block_bytes, device)
    rows: list[Row] = []
    extra: dict[str, Any] = {"batches": work.batches, "notes": {}}
    cases = [("cold", True), ("hot", False)] if config.direct is None else [
        ("cold" if config.direct else "hot", config.direct)]
    for case, direct in cases:
        slots = staging_slots(config, device, block_bytes, direct)
        path = os.path.join(directory, f"uring-kv-bench-{os.getpid()}-{block_bytes}-{case}.bin")
        async with Engine(work.caches, path, work.num_disk_blocks, slots,
                          direct=None if direct else False, checksum=config.checksum,
                          io_depth=config.io_depth) as engine:
            if direct and not engine.file.direct:
                extra["notes"][case] = f"O_DIRECT unavailable: {engine.file.reason}; 'cold' is buffered"
            progress(f"{block_bytes >> 10} KiB {case}: writing {work.num_disk_blocks} blocks")
            await _prefill(engine, work)
            fd, stride = engine.file.fd, engine.file.stride
            if not direct:
                await asyncio.to_thread(_warm, fd, stride * work.num_disk_blocks)
            stats = engine.stats()
            extra[case] = {"slots": slots, "io_depth": stats["io_depth"], "pinned_bytes": stats["pinned_bytes"],
                           "direct": engine.file.direct, "file_bytes": stride * work.num_disk_blocks,
                           "stride": stride, "io": stats["io"], "copy": stats["copy"]}
            if case == "cold" and config.sweep:
                progress(f"{block_bytes >> 10} KiB cold: the ring ceiling at depths {', '.join(map(str, DEPTHS))}")
                extra["depth_sweep"] = await asyncio.to_thread(_depth_sweep, fd, stride, work)

            async def uring_kv(store: bool, disk_blocks: list[int], gpu_blocks: list[int],
                               checksum: bool = False) -> None:
                engine.checksum = checksum  # the prefill stored sums for every block when asked to
                if store:
                    await engine.store_batch(gpu_blocks, disk_blocks)
                else:
                    await engine.load_batch(disk_blocks, gpu_blocks)

            methods: dict[str, Method] = {"uring_kv": uring_kv}
            peers = _Closing()
            try:
                _add_peers(config, work, engine, direct, methods, peers, extra)
                if config.checksum:
                    methods["uring_kv+crc32c"] = functools.partial(uring_kv, checksum=True)
                ops = ["load", "store"] if case == "cold" or config.direct is not None else ["load"]
                for op in ops:
                    progress(f"{block_bytes >> 10} KiB {case} {op}: {', '.join(methods)} (rotating)")
                    engine.bridge.delivery_ns.clear()
                    with _frozen_heap(config.gc_freeze):
                        tallies = await _measure(work, methods, op, fd, stride)
                    rows.extend(_row(work, op, case, name, tally) for name, tally in tallies.items())
                    delivery = [x / 1e3 for x in engine.bridge.delivery_ns]
                    extra[case][f"bridge_us_{op}"] = {  # None: no copy went through the bridge (CPU inline)
                        "p50": round(_percentile(delivery, 0.5), 1), "p99": round(_percentile(delivery, 0.99), 1),
                    } if delivery else None
                    if "fio" in config.peers and direct and engine.file.direct and _peers.fio_path():
                        progress(f"{block_bytes >> 10} KiB {case} {op}: fio")
                        moved = work.batches * config.batch * stride
                        gbps = await asyncio.to_thread(_peers.run_fio, _reopenable(fd), op == "store", stride,
                                                       config.io_depth, stride * work.num_disk_blocks, moved)
                        rows.append(Row(op, case, block_bytes, "fio", "ceiling", gbps, gbps * 1e9 / stride, 0.0, 0.0,
                                        0.0, 0.0, 0.0, True))
                # batches run in native pumps (else block by block), the prefill's included
                extra[case]["pumped_batches"] = engine.stats()["pumped_batches"]
            finally:
                peers.close()
    if "fio" in config.peers and not _peers.fio_path():
        extra["notes"]["fio"] = "not on PATH (apt-get install fio)"
    if device.type == "cuda":
        rows.extend(_pcie_ceiling(device))
    _ratios(rows)
    return rows, extra


def _add_peers(config: BenchConfig, work: Workload, engine: Engine, direct: bool, methods: dict[str, Method],
               peers: _Closing, extra: dict[str, Any]) -> None:
    """The peers asked for, on the engine's file and the bench's caches."""
    fd, stride = engine.file.fd, engine.file.stride
    if "vllm-disk" in config.peers:
        vllm = peers.add(_peers.VllmDisk(work.caches, work.per_layer, work.device, fd, stride))
        methods[vllm.name] = functools.partial(_in_thread, vllm.run)
    if "threads" in config.peers:
        pool = peers.add(_peers.ThreadPool(work.caches, work.per_layer, work.device, fd, stride, config.threads))
        methods[pool.name] = functools.partial(_in_thread, pool.run)
    if "kvikio" in config.peers:
        problem = _peers.kvikio_problem(work.device)
        if problem:
            extra["notes"]["kvikio"] = problem
        else:
            kvikio = peers.add(_peers.Kvikio(work.caches, work.per_layer, work.device, _reopenable(fd), stride,
                                             config.threads, config.batch, engine.file.direct))
            extra["notes"]["kvikio"] = f"{config.threads} threads, {kvikio.mode} mode"
            methods[kvikio.name] = functools.partial(_in_thread, kvikio.run)
    if "ceiling" in config.peers:
        ceiling = peers.add(_peers.RingCeiling(fd, stride, engine.io_depth))
        methods["ring ceiling"] = functools.partial(_in_thread_timed, ceiling.run)


def _reopenable(fd: int) -> str:
    """A path other processes and libraries can open the engine's file by: it has no name (it is
    made unnamed, or unlinked at once), but /proc/PID/fd/N reopens the same file."""
    return f"/proc/{os.getpid()}/fd/{fd}"


async def _in_thread(run: Callable[[bool, list[int], list[int]], None], store: bool, disk_blocks: list[int],
                     gpu_blocks: list[int]) -> None:
    await asyncio.to_thread(run, store, disk_blocks, gpu_blocks)


async def _in_thread_timed(run: Callable[[bool, list[int], list[int]], float], store: bool,
                           disk_blocks: list[int], gpu_blocks: list[int]) -> float:
    return await asyncio.to_thread(run, store, disk_blocks, gpu_blocks)


def _warm(fd: int, length: int) -> None:
    chunk = bytearray(8 << 20)
    offset = 0
    while offset < length:
        got = os.preadv(fd, [chunk], offset)
        if got <= 0:
            break
        offset += got


def _pcie_ceiling(device: torch.device) -> list[Row]:
    size = 1 << 30
    host = torch.empty(size, dtype=torch.uint8).pin_memory()
    dev = torch.empty(size, dtype=torch.uint8, device=device)
    rows = []
    for op, (dst, src) in (("load", (dev, host)), ("store", (host, dev))):
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        for _ in range(5):
            dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize(device)
        elapsed = (time.perf_counter() - start) / 5
        rows.append(Row(op, "pcie", size, "pcie ceiling", "ceiling", size / elapsed / 1e9, 0.0, elapsed * 1e3,
                        elapsed * 1e3, 0.0, 0.0, 0.0, True))
    return rows


def _ratios(rows: list[Row]) -> None:
    """``ratios[X]`` of a uring_kv row: its GB/s ÷ X's on the same operation, case and block size
    (the PCIe ceiling: on the same operation). Above 1: uring_kv moved the bytes faster; for a
    ceiling, the fraction of that limit uring_kv reached."""
    for row in rows:
        if row.method != "uring_kv":
            continue
        for other in rows:
            same = (other.op, other.case, other.block_bytes) == (row.op, row.case, row.block_bytes)
            if other is not row and (same or (other.method == "pcie ceiling" and other.op == row.op)):
                row.ratios[other.method] = row.gbps / other.gbps if other.gbps else float("inf")


# A row should measure more than a few short batches: 4 batches of 256 blocks of 128 KiB last ~70 ms
# on the H200's disk, whose throughput moves by ±20 % from one batch to the next, and the ratio to
# the ring ceiling read 0.77–0.95 from run to run (0.88–0.93 with 16).
DEFAULT_BATCH_BYTES = 512 << 20  # what each method moves per row by default, in 4 to 16 batches


def batches_for(config: BenchConfig, block_bytes: int) -> int:
    """Measured batches per method at ``block_bytes``: ``config.batches``, or by default enough
    to move DEFAULT_BATCH_BYTES, at least 4 and at most 16 (2 MiB: 4; 128 KiB: 16)."""
    if config.batches is not None:
        return config.batches
    per_batch = config.batch * block_bytes
    return max(4, min(16, -(-DEFAULT_BATCH_BYTES // per_batch)))


def staging_slots(config: BenchConfig, device: torch.device, block_bytes: int, direct: bool = True) -> int:
    """uring_kv's staging slots: ``config.slots`` when given, else what :meth:`Tuning.staging_slots`
    advises for the I/O depth."""
    if config.slots is not None:
        return config.slots
    # The engine's slot stride is the block rounded up to the file's DIO alignment, which the bench
    # learns only once the engine is open; 4 KiB is the usual alignment's upper end, so "inline"
    # here means inline there too. Where they can differ (blocks far below 4 KiB with hundreds of
    # slots; alignments over 4 KiB), the engine runs a slower path, never a wrong one.
    stride = round_up(block_bytes, 4096)
    return Tuning.from_env().staging_slots(config.io_depth, stride, device.type == "cuda", direct)


def recommend_depth(sweep: dict[int, float], share: float = 0.95) -> int:
    """The smallest I/O depth whose rate reaches ``share`` of the best in the sweep."""
    best = max(sweep.values())
    return min(depth for depth, rate in sweep.items() if rate >= share * best)


def _filesystem(directory: str) -> str:
    """The type of the filesystem holding ``directory`` (from /proc/self/mountinfo), or "?"."""
    target, best, kind = os.path.realpath(directory), "", "?"
    with contextlib.suppress(OSError), open("/proc/self/mountinfo") as mounts:
        for line in mounts:
            fields = line.split()
            point = fields[4].encode().decode("unicode_escape")
            fstype = fields[fields.index("-") + 1]
            inside = target == point or target.startswith(point.rstrip("/") + "/")
            if inside and len(point) >= len(best):
                best, kind = point, fstype
    return kind


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


async def run_bench(config: BenchConfig, progress: Callable[[str], None]) -> dict[str, Any]:
    device = resolve_device(config.device)
    directory = config.path or tempfile.gettempdir()
    rows: list[Row] = []
    extras: dict[str, Any] = {}
    for block_bytes in config.block_sizes:
        got, extra = await bench_block_size(config, block_bytes, device, directory, progress)
        rows.extend(got)
        extras[str(block_bytes)] = extra
    return {
        "machine": {"kernel": os.uname().release, "cpus": os.cpu_count(), "python": sys.version.split()[0],
                    "torch": torch.__version__,
                    "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
                    "date": time.strftime("%Y-%m-%d")},
        "config": asdict(config),
        "device": str(device),
        "path": os.path.realpath(directory),
        "filesystem": _filesystem(directory),
        "rows": [{k: v for k, v in asdict(row).items() if k != "lag_ms"} for row in rows],
        "extra": extras,
        "all_verified": all(row.verified for row in rows),
        "uring_kv_lag": pooled_lag(rows),
        # The same probe while the loop had nothing to do (the ceiling's C loop runs on a worker
        # thread): the host's own wake-up latency, the floor under every lag figure of the run.
        "idle_loop_lag": pooled_lag(rows, "ring ceiling"),
    }


def pooled_lag(rows: list[Row], method: str = "uring_kv") -> dict[str, float | int]:
    """The loop's lag over the whole run while ``method`` moved blocks: every probe sample of
    every one of its rows together. A row of short batches holds few samples (a 128 KiB batch
    takes a few milliseconds, so its p99 is its maximum); pooled, the p99 rests on thousands."""
    lag = [x for row in rows if row.method == method for x in row.lag_ms]
    return {"samples": len(lag), "max_ms": round(max(lag, default=0.0), 3),
            "p99_ms": round(_percentile(lag, 0.99), 3), "p50_ms": round(_percentile(lag, 0.5), 3)}


def to_json(result: dict[str, Any]) -> str:
    return json.dumps(result, indent=2)
