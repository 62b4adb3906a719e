"""``uring-kv bench``: uring_kv against the usual ways of moving KV blocks, and against ceilings.

Every method runs in the same process, on the same file, with the same random batches, and every
method's last batch is checked byte for byte: each 8-byte word of disk block ``d`` holds
``d << 32 | word``, so a block landing in the wrong place, torn or stale is caught.

Methods (load; stores mirror them):
* ``uring_kv``: ``Engine.load_batch``.
* ``serial``: one thread, two staging buffers, blocking preadv per block, a copy and an event per
  slot, drained at the end of each call (the shape of vLLM's DiskBackend).
* ``threads``: N threads each doing pread into its own bounce buffer, then the copy.
* ``ring ceiling``: a C loop on io_uring with registered buffers, same block size and depth, no Python.
* ``pcie ceiling`` (GPU): one large pinned copy.
The event loop's lag is sampled while each method runs (a probe process writing to a pipe the loop watches).
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
import statistics
import struct
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from uring_kv._engine import PUMP_INLINE_PASS_BYTES, Engine, slots_copy_inline
from uring_kv._file import round_up
from uring_kv._memory import HostBuffer
from uring_kv._native import ring_loop

BASELINES = ("serial", "threads", "ceiling")  # --baselines names: serial, threads<N>, ring ceiling


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
    slots: int = 32  # uring_kv's I/O depth and the ring ceiling's
    spare_slots: int | None = None  # uring_kv's staging slots beyond that depth (None: see spare_slots())
    threads: int = 8
    direct: bool | None = None  # None: both cold (O_DIRECT) and hot (buffered, page cache)
    device: str = "auto"
    checksum: bool = False  # also measure uring_kv with checksum=True ("uring_kv+crc32c")
    baselines: tuple[str, ...] = BASELINES  # which of the others run beside uring_kv


@dataclass
class Row:
    op: str
    case: str
    block_bytes: int
    method: str
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

    def copy_block(self, staging: torch.Tensor, gpu_block: int, to_staging: bool) -> None:
        """Per-tensor async copies between a staging buffer and one GPU block (the baselines' way)."""
        per = self.per_layer
        for layer, cache in enumerate(self.caches):
            part = staging[layer * per:(layer + 1) * per]
            target = cache[gpu_block].view(torch.uint8)
            if to_staging:
                part.copy_(target, non_blocking=True)
            else:
                target.copy_(part, non_blocking=True)

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


class SerialBaseline:
    """One thread, two staging slots, blocking I/O per block, copy + event per slot, drain per call."""

    def __init__(self, work: Workload, fd: int, stride: int) -> None:
        self.work, self.fd, self.stride = work, fd, stride
        self.buffer = HostBuffer(2 * stride)
        self.host = torch.frombuffer(self.buffer.view, dtype=torch.uint8)
        self.gpu = work.device.type == "cuda"
        if self.gpu:
            torch.cuda.cudart().cudaHostRegister(self.buffer.addr, self.buffer.size, 0)
            self.stream = torch.cuda.Stream(work.device)

    def _slot(self, index: int) -> torch.Tensor:
        return self.host[index * self.stride:(index + 1) * self.stride]

    def run(self, store: bool, disk_blocks: list[int], gpu_blocks: list[int]) -> None:
        events: list[Any] = [None, None]
        for i, (disk_block, gpu_block) in enumerate(zip(disk_blocks, gpu_blocks, strict=True)):
            slot = i % 2
            if events[slot] is not None:
                events[slot].synchronize()
            view = self.buffer.view[slot * self.stride:(slot + 1) * self.stride]
            staging = self._slot(slot)
            if not store:
                os.preadv(self.fd, [view], disk_block * self.stride)
            with torch.cuda.stream(self.stream) if self.gpu else contextlib.nullcontext():
                self.work.copy_block(staging, gpu_block, to_staging=store)
                if self.gpu:
                    events[slot] = torch.cuda.Event()
                    events[slot].record(self.stream)
            if store:
                if events[slot] is not None:
                    events[slot].synchronize()
                os.pwritev(self.fd, [view], disk_block * self.stride)
        for event in events:  # the end-of-call drain
            if event is not None:
                event.synchronize()

    def close(self) -> None:
        if self.gpu:
            torch.cuda.cudart().cudaHostUnregister(self.buffer.addr)
        del self.host
        self.buffer.close()


class ThreadPoolBaseline:
    """N threads, each with its own bounce buffer: pread then copy (and the reverse for stores)."""

    def __init__(self, work: Workload, fd: int, stride: int, threads: int) -> None:
        self.work, self.fd, self.stride = work, fd, stride
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="bench-pool")
        self.local = threading.local()
        self.buffers: list[HostBuffer] = []
        self.gpu = work.device.type == "cuda"
        self.lock = threading.Lock()

    def _state(self) -> tuple[HostBuffer, torch.Tensor, Any]:
        state = getattr(self.local, "state", None)
        if state is None:
            buffer = HostBuffer(self.stride)
            if self.gpu:
                torch.cuda.cudart().cudaHostRegister(buffer.addr, buffer.size, 0)
            stream = torch.cuda.Stream(self.work.device) if self.gpu else None
            state = (buffer, torch.frombuffer(buffer.view, dtype=torch.uint8), stream)
            with self.lock:
                self.buffers.append(buffer)
            self.local.state = state
        return state

    def _one(self, store: bool, disk_block: int, gpu_block: int) -> None:
        buffer, host, stream = self._state()
        if not store:
            os.preadv(self.fd, [buffer.view], disk_block * self.stride)
        with torch.cuda.stream(stream) if self.gpu else contextlib.nullcontext():
            self.work.copy_block(host, gpu_block, to_staging=store)
            if self.gpu:
                stream.synchronize()
        if store:
            os.pwritev(self.fd, [buffer.view], disk_block * self.stride)

    def run(self, store: bool, disk_blocks: list[int], gpu_blocks: list[int]) -> None:
        list(self.pool.map(lambda pair: self._one(store, *pair), zip(disk_blocks, gpu_blocks, strict=True)))

    def close(self) -> None:
        self.pool.shutdown()
        for buffer in self.buffers:
            if self.gpu:
                torch.cuda.cudart().cudaHostUnregister(buffer.addr)
            buffer.close()


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


async def _verify_file(fd: int, stride: int, work: Workload, disk_blocks: list[int]) -> bool:
    """Read blocks back with plain preadv and check their words (for store rows)."""
    buffer = HostBuffer(stride)
    ok = True
    words = work.per_layer // 8 * work.config.layers
    for disk_block in disk_blocks[:16]:
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


def _row(work: Workload, op: str, case: str, method: str, tally: _Tally) -> Row:
    moved = len(tally.latencies) * work.config.batch
    elapsed = sum(tally.latencies)
    return Row(op, case, work.block_bytes, method, moved * work.block_bytes / elapsed / 1e9, moved / elapsed,
               _percentile(tally.latencies, 0.5) * 1e3, _percentile(tally.latencies, 0.99) * 1e3, tally.cpu_s,
               max(tally.lag, default=0.0) * 1e3, _percentile(tally.lag, 0.99) * 1e3, tally.verified,
               max(tally.timer_lag, default=0.0) * 1e3, _percentile(tally.timer_lag, 0.99) * 1e3,
               [round(x * 1e3, 3) for x in tally.latencies], lag_samples=len(tally.lag),
               lag_ms=[x * 1e3 for x in tally.lag])


class RingCeiling:
    """The disk's ceiling: the C loop on io_uring, registered buffers, depth = slots, no Python."""

    def __init__(self, fd: int, stride: int, depth: int) -> None:
        self.fd, self.stride, self.depth = fd, stride, depth
        self.buffer = HostBuffer(stride * depth)

    def run(self, store: bool, disk_blocks: list[int], gpu_blocks: list[int]) -> float:
        offsets = [d * self.stride for d in disk_blocks]
        if not store:
            return ring_loop(self.fd, False, self.depth, self.stride, offsets, self.buffer.addr, True) / 1e9
        # The ceiling writes whatever its buffer holds: keep the blocks' bytes (aligned, for O_DIRECT)
        # and put them back afterwards.
        snapshot = HostBuffer(self.stride * len(offsets))
        views = [snapshot.view[i * self.stride:(i + 1) * self.stride] for i in range(len(offsets))]
        for view, offset in zip(views, offsets, strict=True):
            os.preadv(self.fd, [view], offset)
        elapsed = ring_loop(self.fd, True, self.depth, self.stride, offsets, self.buffer.addr, True) / 1e9
        for view, offset in zip(views, offsets, strict=True):
            os.pwritev(self.fd, [view], offset)
            view.release()
        snapshot.close()
        return elapsed

    def close(self) -> None:
        self.buffer.close()


async def bench_block_size(config: BenchConfig, block_bytes: int, device: torch.device, directory: str,
                           progress: Callable[[str], None]) -> tuple[list[Row], dict[str, Any]]:
    work = Workload(config, block_bytes, device)
    rows: list[Row] = []
    extra: dict[str, Any] = {}
    cases = [("cold", True), ("hot", False)] if config.direct is None else [
        ("cold" if config.direct else "hot", config.direct)]
    for case, direct in cases:
        spare = spare_slots(config, device, block_bytes, direct)
        path = os.path.join(directory, f"uring-kv-bench-{os.getpid()}-{block_bytes}-{case}.bin")
        async with Engine(work.caches, path, work.num_disk_blocks, config.slots + spare,
                          direct=None if direct else False, checksum=config.checksum,
                          io_depth=config.slots) as engine:
            if direct and not engine.file.direct:
                extra[f"{case}_note"] = f"O_DIRECT unavailable: {engine.file.reason}; 'cold' is buffered"
            progress(f"{block_bytes >> 10} KiB {case}: writing {work.num_disk_blocks} blocks")
            await _prefill(engine, work)
            fd, stride = engine.file.fd, engine.file.stride
            if not direct:
                await asyncio.to_thread(_warm, fd, stride * work.num_disk_blocks)
            stats = engine.stats()
            # the slot count can differ between the cases (spare_slots): each case's, and the first's
            extra.update({f"pinned_bytes_{case}": stats["pinned_bytes"], f"slots_{case}": config.slots + spare})
            extra.setdefault("pinned_bytes", stats["pinned_bytes"])
            extra.setdefault("slots", config.slots + spare)
            extra.update(io_depth=stats["io_depth"],
                         io=stats["io"], copy=stats["copy"], batches=work.batches)

            async def uring_kv(store: bool, disk_blocks: list[int], gpu_blocks: list[int],
                               checksum: bool = False) -> None:
                engine.checksum = checksum  # the prefill stored sums for every block when asked to
                if store:
                    await engine.store_batch(gpu_blocks, disk_blocks)
                else:
                    await engine.load_batch(disk_blocks, gpu_blocks)

            methods: dict[str, Method] = {"uring_kv": uring_kv}
            others: list[SerialBaseline | ThreadPoolBaseline | RingCeiling] = []  # only those asked for
            if "serial" in config.baselines:
                others.append(serial := SerialBaseline(work, fd, stride))
                methods["serial"] = functools.partial(_in_thread, serial.run)
            if "threads" in config.baselines:
                others.append(pool := ThreadPoolBaseline(work, fd, stride, config.threads))
                methods[f"threads{config.threads}"] = functools.partial(_in_thread, pool.run)
            if "ceiling" in config.baselines:
                others.append(ceiling := RingCeiling(fd, stride, config.slots))
                methods["ring ceiling"] = functools.partial(_in_thread_timed, ceiling.run)
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
                extra[f"bridge_us_{case}_{op}"] = {  # None: no copy went through the bridge (CPU inline)
                    "p50": round(_percentile(delivery, 0.5), 1), "p99": round(_percentile(delivery, 0.99), 1),
                } if delivery else None
            # batches run in native pumps (else block by block), the prefill's included
            extra[f"pumped_batches_{case}"] = engine.stats()["pumped_batches"]
            for other in others:
                other.close()
    if device.type == "cuda":
        rows.extend(_pcie_ceiling(device))
    _ratios(rows)
    return rows, extra


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
        rows.append(Row(op, "pcie", size, "pcie ceiling", size / elapsed / 1e9, 0.0, elapsed * 1e3,
                        elapsed * 1e3, 0.0, 0.0, 0.0, True))
    return rows


def _ratios(rows: list[Row]) -> None:
    for row in rows:
        if row.method != "uring_kv":
            continue
        for other in rows:
            if (other.op, other.case, other.block_bytes) == (row.op, row.case, row.block_bytes) and other is not row:
                row.ratios[other.method] = row.gbps / other.gbps if other.gbps else float("inf")
        for other in rows:
            if other.method == "pcie ceiling" and other.op == row.op:
                row.ratios["pcie ceiling"] = row.gbps / other.gbps


# A row should measure more than a few short batches: 4 batches of 256 blocks of 128 KiB last ~70 ms
# on the H200's disk, whose throughput moves by ±20 % from one batch to the next, and the ratio to
# the ring ceiling read 0.77–0.95 from run to run (0.88–0.93 with 16; benchmarks.md).
DEFAULT_BATCH_BYTES = 512 << 20  # what each method moves per row by default, in 4 to 16 batches


def batches_for(config: BenchConfig, block_bytes: int) -> int:
    """Measured batches per method at ``block_bytes``: ``config.batches``, or by default enough
    to move DEFAULT_BATCH_BYTES, at least 4 and at most 16 (2 MiB: 4; 128 KiB: 16)."""
    if config.batches is not None:
        return config.batches
    per_batch = config.batch * block_bytes
    return max(4, min(16, -(-DEFAULT_BATCH_BYTES // per_batch)))


def spare_slots(config: BenchConfig, device: torch.device, block_bytes: int, direct: bool = True) -> int:
    """uring_kv's slots beyond the I/O depth (an explicit ``--spare-slots`` always wins):

    - half the depth again wherever the copies are jobs for the native copier, so that each slot
      spends a copy turnaround between its read and the next (benchmarks.md: 0.80× of the ring
      ceiling at 128 KiB without, 0.91–0.95× with 16 on the H200): on a GPU, and in CPU mode once
      the slots hold over 1 MiB together;
    - in CPU mode's smaller O_DIRECT set-ups, whose pumps copy each block on the loop, as many as
      the depth while all slots still hold at most 1 MiB: a reap then submits its refills through
      the spare slots before it copies (16 KiB loads: 0.86× of the ring ceiling without, 0.94× with
      32, benchmarks.md 2026-12-04);
    - none for buffered files there: their pumps read straight into the caches, nothing to wait for.
    """
    if config.spare_slots is not None:
        return config.spare_slots
    # The engine's slot stride is the block rounded up to the file's DIO alignment, which the bench
    # learns only once the engine is open; 4 KiB is the usual alignment's upper end, so "inline"
    # here means inline there too. Where they can differ (blocks far below 4 KiB with hundreds of
    # slots; alignments over 4 KiB), the engine runs a slower path, never a wrong one.
    stride = round_up(block_bytes, 4096)
    if device.type == "cuda" or not slots_copy_inline(config.slots, stride):
        return config.slots // 2
    if not direct:
        return 0
    return max(0, min(config.slots, PUMP_INLINE_PASS_BYTES // stride - config.slots))


async def run_bench(config: BenchConfig, progress: Callable[[str], None]) -> dict[str, Any]:
    if config.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(config.device)
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
        "rows": [{k: v for k, v in asdict(row).items() if k != "lag_ms"} for row in rows],
        "extra": extras,
        "all_verified": all(row.verified for row in rows),
        "median_lag_ms": statistics.median([r.lag_max_ms for r in rows if r.method == "uring_kv"] or [0.0]),
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


def render(result: dict[str, Any], console: Any) -> None:
    from rich.table import Table

    table = Table(title=f"uring-kv bench on {result['device']} ({result['machine']['date']})")
    for column in ("op", "case", "block", "method", "GB/s", "blocks/s", "p50 ms", "p99 ms", "CPU s",
                   "lag max ms", "lag p99 ms", "ok", "uring_kv ÷ this"):
        table.add_column(column, justify="right" if column not in ("op", "case", "method") else "left")
    rows = result["rows"]
    for row in rows:
        mine = next((r for r in rows if r["method"] == "uring_kv" and r["op"] == row["op"]
                     and r["case"] == row["case"] and r["block_bytes"] == row["block_bytes"]), None)
        ratio = ""
        if mine is not None and row["method"] in mine["ratios"]:
            ratio = f"{mine['ratios'][row['method']]:.2f}×"
        if row["method"] == "pcie ceiling":
            ratio = ""
        table.add_row(row["op"], row["case"], f"{row['block_bytes'] >> 10} KiB", row["method"], f"{row['gbps']:.2f}",
                      f"{row['blocks_per_s']:.0f}", f"{row['p50_ms']:.2f}", f"{row['p99_ms']:.2f}",
                      f"{row['cpu_s']:.2f}", f"{row['lag_max_ms']:.2f}", f"{row['lag_p99_ms']:.3f}",
                      "yes" if row["verified"] else "NO", ratio)
    console.print(table)
    for key, what in (("uring_kv_lag", "while uring_kv ran (all rows"),
                      ("idle_loop_lag", "while idle (the ring ceiling's rows")):
        lag = result.get(key)
        if lag and lag["samples"]:
            console.print(f"event loop {what}, {lag['samples']} samples of 1 ms): lag max {lag['max_ms']:.2f} ms, "
                          f"p99 {lag['p99_ms']:.3f} ms, p50 {lag['p50_ms']:.3f} ms")
    for size, extra in result["extra"].items():
        console.print(f"{int(size) >> 10} KiB: " + ", ".join(f"{k}={v}" for k, v in extra.items()))


def plot(result: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, op in zip(axes, ("load", "store"), strict=True):
        rows = [r for r in result["rows"] if r["op"] == op and r["case"] != "pcie"]
        labels = sorted({f"{r['method']} ({r['case']})" for r in rows})
        sizes = sorted({r["block_bytes"] for r in rows})
        width = 0.8 / max(1, len(labels))
        for i, label in enumerate(labels):
            values = [next((r["gbps"] for r in rows if f"{r['method']} ({r['case']})" == label
                            and r["block_bytes"] == s), 0.0) for s in sizes]
            ax.bar([x + i * width for x in range(len(sizes))], values, width, label=label)
        ax.set_xticks([x + 0.4 - width / 2 for x in range(len(sizes))], [f"{s >> 10} KiB" for s in sizes])
        ax.set_ylabel("GB/s")
        ax.set_title(op)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)


def to_json(result: dict[str, Any]) -> str:
    return json.dumps(result, indent=2)
