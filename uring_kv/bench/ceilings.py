"""The machine's limits for ``uring-kv bench``, and the I/O depth that reaches the disk's.

* ``ring ceiling``: a C loop on io_uring with registered buffers at the same depth, no Python.
* ``fio``: fio's io_uring engine at the same block size, depth and file (O_DIRECT, random
  offsets): the ceiling users already trust, when ``fio`` is on PATH.
* ``copy ceiling``: the engine's own copy path and nothing else: a batch's blocks moved between
  staging slots filled beforehand and the cache rows, no file, no ring, no loop. On a GPU that is
  the kernel path the engine takes under the same tuning (staged: one driver copy per block
  between pinned slots and device staging, one scatter/gather kernel per call; mapped: the kernel
  alone, reading or writing the pinned slots over the bus): the H2D (loads) and D2H (stores)
  ceiling; in CPU mode the memcpy of the host copier. A load cannot go faster than the lower of
  this and the ring ceiling.
* ``rows ceiling``: where the engine moves the cache rows itself (CPU mode's pumps reading each
  block straight into its rows, writing it straight from them: no copy of its own, so no copy
  ceiling), the ring ceiling's C loop doing exactly those I/Os: a readv (writev) of one iovec per
  tensor between the file and the rows, at the same depth, no Python. Landing bytes in rows spread
  over the cache tensors costs more than filling one small buffer the ring ceiling reuses; a load
  or store cannot go faster than this.
* ``pcie ceiling``: 1 GiB copies between pinned host memory and the GPU, each way (GPU only).

The depth sweep times the ring ceiling's loads at each of :data:`DEPTHS`; :func:`recommend_depth`
picks the sizing advice from it.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import time
from collections.abc import Callable

import torch

from uring_kv import _cuda
from uring_kv._memory import HostBuffer
from uring_kv._native import BlockCopier, ring_loop
from uring_kv.bench.results import Row, process_cpu_seconds

DEPTHS = (4, 8, 16, 32, 64, 128)  # I/O depths the sizing sweep tries on the ring ceiling


class RingCeiling:
    """The disk's ceiling: the C loop on io_uring, registered buffers, a fixed depth, no Python.

    Two ways to submit, and the ceiling is the faster: inline (the kernel starts each I/O inside
    io_uring_enter: on a disk the submission only queues it) and IOSQE_ASYNC (handed to the
    kernel's io-wq workers: on a RAM-backed file the only way for more than one thread to copy, as
    the engine's GPU-mode submissions do). The first batch of each operation runs both and keeps the
    faster for the rest (:attr:`modes`); ``async_io`` fixes the mode instead."""

    def __init__(self, fd: int, stride: int, depth: int, async_io: bool | None = None) -> None:
        self.fd, self.stride, self.depth = fd, stride, depth
        self.buffer = HostBuffer(stride * depth, huge_pages=True)  # as the engine's slots: see HostBuffer
        self.modes: dict[bool, bool] = {} if async_io is None else {False: async_io, True: async_io}

    @property
    def description(self) -> str:
        """The submission mode each operation ran with."""
        return _modes_said(self.modes)

    def run(self, store: bool, disk_blocks: list[int], gpu_blocks: list[int]) -> float:
        """The C loop's seconds for the batch."""
        return self.run_measured(store, disk_blocks, gpu_blocks)[0]

    def run_measured(self, store: bool, disk_blocks: list[int], gpu_blocks: list[int]) -> tuple[float, float]:
        """The C loop's seconds and the process's CPU seconds during it (a store's keeping and
        putting back of the blocks' bytes, below, is neither)."""
        return _faster_mode(self.modes, store, lambda mode: self._once(store, disk_blocks, mode))

    def _once(self, store: bool, disk_blocks: list[int], async_io: bool) -> tuple[float, float]:
        offsets = [d * self.stride for d in disk_blocks]
        if not store:
            cpu0 = process_cpu_seconds()
            elapsed = ring_loop(self.fd, False, self.depth, self.stride, offsets, self.buffer.addr, True,
                                async_io) / 1e9
            return elapsed, process_cpu_seconds() - cpu0
        # The ceiling writes whatever its buffer holds: keep the blocks' bytes (aligned, for O_DIRECT)
        # and put them back afterwards.
        snapshot = HostBuffer(self.stride * len(offsets))
        views = [snapshot.view[i * self.stride:(i + 1) * self.stride] for i in range(len(offsets))]
        for view, offset in zip(views, offsets, strict=True):
            os.preadv(self.fd, [view], offset)
        cpu0 = process_cpu_seconds()
        elapsed = ring_loop(self.fd, True, self.depth, self.stride, offsets, self.buffer.addr, True, async_io) / 1e9
        cpu = process_cpu_seconds() - cpu0
        for view, offset in zip(views, offsets, strict=True):
            os.pwritev(self.fd, [view], offset)
            view.release()
        snapshot.close()
        return elapsed, cpu

    def close(self) -> None:
        self.buffer.close()


def _modes_said(modes: dict[bool, bool]) -> str:
    """The submission mode (``modes``: IOSQE_ASYNC or not) each operation ran with, in words."""
    said = {False: "inline", True: "IOSQE_ASYNC (io-wq)"}
    return ", ".join(f"{'stores' if store else 'loads'} {said[mode]}" for store, mode in sorted(modes.items()))


def _faster_mode(modes: dict[bool, bool], store: bool,
                 once: Callable[[bool], tuple[float, float]]) -> tuple[float, float]:
    """``once(async_io)`` in the submission mode ``modes`` holds for the operation; the first time,
    in both modes, keeping the faster in ``modes`` (and its timing)."""
    if store not in modes:
        timed = {mode: once(mode) for mode in (False, True)}
        modes[store] = min(timed, key=lambda mode: timed[mode][0])
        return timed[modes[store]]
    return once(modes[store])


class RowsCeiling:
    """The ring ceiling where the engine moves the cache rows itself (see the module docstring):
    the same C loop and depth, each I/O a readv (writev) of block ``b``'s rows of every tensor of
    ``caches`` (``block_bytes[t]`` bytes at ``b * block_bytes[t]`` of tensor t). Its loads land in the
    caches and its stores write the file, checked like any method's. The submission mode is chosen
    as the ring ceiling's (:attr:`modes`)."""

    def __init__(self, caches: list[torch.Tensor], block_bytes: list[int], fd: int, stride: int, depth: int) -> None:
        self.fd, self.stride, self.depth = fd, stride, depth
        self.table = BlockCopier([t.data_ptr() for t in caches], block_bytes, [0] * len(caches))
        self.modes: dict[bool, bool] = {}

    @property
    def description(self) -> str:
        return "the ring's C loop, a readv (writev) per block straight into (from) the cache rows; " + \
            _modes_said(self.modes)

    def run_measured(self, store: bool, disk_blocks: list[int], gpu_blocks: list[int]) -> tuple[float, float]:
        """The C loop's seconds and the process's CPU seconds during it."""
        return _faster_mode(self.modes, store, lambda mode: self._once(store, disk_blocks, gpu_blocks, mode))

    def _once(self, store: bool, disk_blocks: list[int], gpu_blocks: list[int], async_io: bool) -> tuple[float, float]:
        offsets = [d * self.stride for d in disk_blocks]
        cpu0 = process_cpu_seconds()
        elapsed = ring_loop(self.fd, store, self.depth, 0, offsets, 0, False, async_io,
                            rows=(self.table, gpu_blocks)) / 1e9
        return elapsed, process_cpu_seconds() - cpu0

    def close(self) -> None:
        pass


class CopyCeiling:
    """The engine's copy path alone, between ``batch`` staging slots of ``stride`` bytes and the
    cache tensors ``caches`` (each block of tensor t: ``block_bytes[t]`` bytes at
    ``slot_offsets[t]`` of its slot, as the engine lays it out; ``mapped``: the kernel path's mapped
    form, as the engine's plan says). A load's slots are filled from the
    file before the clock starts, so its rows can be checked like any method's."""

    def __init__(self, caches: list[torch.Tensor], block_bytes: list[int], slot_offsets: list[int], fd: int,
                 stride: int, batch: int, mapped: bool = False) -> None:
        self.fd, self.stride = fd, stride
        self.device = caches[0].device
        self.blocks = BlockCopier([t.data_ptr() for t in caches], block_bytes, slot_offsets)
        self.slots = HostBuffer(stride * batch, huge_pages=True)
        self.addrs = [self.slots.addr + i * stride for i in range(batch)]
        self.staging: _cuda.Staging | None = None
        self.registered = False
        if self.device.type == "cuda":
            _cuda.host_register(self.slots.addr, self.slots.size)
            self.registered = True
            gpu = _cuda.Device(self.device)
            self.ctx = gpu.context()
            self.stream = gpu.stream()
            self.staging = _cuda.Staging(self.device, self.blocks, self.slots.addr, stride, batch,
                                         self.blocks.bytes_per_block, mapped)
            self.event = _cuda.CudaEvent(self.ctx)

    @property
    def description(self) -> str:
        if self.staging is None:
            return "host memcpy"
        return "mapped: the scatter kernel alone" if self.staging.mapped else "staged H2D/D2H copies"

    def run_measured(self, store: bool, disk_blocks: list[int], gpu_blocks: list[int]) -> tuple[float, float]:
        """Seconds and process CPU seconds of one batch's copies (rows to slots for a store)."""
        addrs = self.addrs[:len(gpu_blocks)]
        if not store:
            for addr, block in zip(addrs, disk_blocks, strict=True):
                view = self.slots.view_at(addr, self.stride)
                os.preadv(self.fd, [view], block * self.stride)
                view.release()
        cpu0 = process_cpu_seconds()
        start = time.perf_counter()
        if self.staging is None:
            self.blocks.host(store, addrs, gpu_blocks)
        else:
            self.staging.enqueue(self.ctx, self.event, store, addrs, gpu_blocks, int(self.stream.cuda_stream))
            self.event.synchronize()
        return time.perf_counter() - start, process_cpu_seconds() - cpu0

    def close(self) -> None:
        if self.registered:
            _cuda.host_unregister(self.slots.addr)
            self.registered = False
        self.slots.close()


def depth_sweep(fd: int, stride: int, batches: list[list[int]]) -> dict[int, float]:
    """GB/s of the ring ceiling's loads at each of DEPTHS over ``batches`` (the sizing advice)."""
    rates: dict[int, float] = {}
    for depth in (d for d in DEPTHS if d <= len(batches[0])):  # deeper than a batch changes nothing
        ceiling = RingCeiling(fd, stride, depth)
        try:
            ceiling.run(False, batches[0], [])  # warm-up
            seconds = sum(ceiling.run(False, blocks, []) for blocks in batches)
        finally:
            ceiling.close()
        rates[depth] = len(batches) * len(batches[0]) * stride / seconds / 1e9
    return rates


def recommend_depth(sweep: dict[int, float], share: float = 0.95) -> int:
    """The smallest I/O depth whose rate reaches ``share`` of the best in the sweep."""
    best = max(sweep.values())
    return min(depth for depth, rate in sweep.items() if rate >= share * best)


def fio_path() -> str | None:
    return shutil.which("fio")


def run_fio(path: str, store: bool, block_bytes: int, depth: int, file_bytes: int, io_bytes: int) -> float:
    """fio's io_uring engine on ``path`` (O_DIRECT, random offsets, ``depth`` in flight): GB/s.
    Its writes leave fio's bytes in the file: run it after the methods whose stores are verified."""
    fio = fio_path()
    if fio is None:
        raise RuntimeError("fio is not on PATH")
    command = [fio, "--name=ceiling", f"--filename={path}", f"--rw={'randwrite' if store else 'randread'}",
               f"--bs={block_bytes}", f"--iodepth={depth}", "--ioengine=io_uring", "--direct=1",
               f"--size={file_bytes}", f"--io_size={io_bytes}", "--numjobs=1", "--randrepeat=0",
               "--output-format=json"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    if done.returncode:
        said = done.stderr.strip().splitlines()
        raise RuntimeError(f"fio failed: {said[-1] if said else f'exit status {done.returncode}'}")
    with contextlib.suppress(ValueError):
        job = json.loads(done.stdout[done.stdout.index("{"):])["jobs"][0]
        return float(job["write" if store else "read"]["bw_bytes"]) / 1e9
    raise RuntimeError("fio printed no JSON result")


def pcie_ceiling(device: torch.device) -> list[Row]:
    """The host-device link's rate each way: five 1 GiB copies between pinned memory and ``device``."""
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
