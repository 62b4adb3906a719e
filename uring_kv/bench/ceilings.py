"""The machine's limits for ``uring-kv bench``, and the I/O depth that reaches the disk's.

* ``ring ceiling``: a C loop on io_uring with registered buffers at the same depth, no Python.
* ``fio``: fio's io_uring engine at the same block size, depth and file (O_DIRECT, random
  offsets): the ceiling users already trust, when ``fio`` is on PATH.
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

import torch

from uring_kv._memory import HostBuffer
from uring_kv._native import ring_loop
from uring_kv.bench.results import Row, process_cpu_seconds

DEPTHS = (4, 8, 16, 32, 64, 128)  # I/O depths the sizing sweep tries on the ring ceiling


class RingCeiling:
    """The disk's ceiling: the C loop on io_uring, registered buffers, a fixed depth, no Python."""

    def __init__(self, fd: int, stride: int, depth: int) -> None:
        self.fd, self.stride, self.depth = fd, stride, depth
        self.buffer = HostBuffer(stride * depth, huge_pages=True)  # as the engine's slots: see HostBuffer

    def run(self, store: bool, disk_blocks: list[int], gpu_blocks: list[int]) -> float:
        """The C loop's seconds for the batch."""
        return self.run_measured(store, disk_blocks, gpu_blocks)[0]

    def run_measured(self, store: bool, disk_blocks: list[int], gpu_blocks: list[int]) -> tuple[float, float]:
        """The C loop's seconds and the process's CPU seconds during it (a store's keeping and
        putting back of the blocks' bytes, below, is neither)."""
        offsets = [d * self.stride for d in disk_blocks]
        if not store:
            cpu0 = process_cpu_seconds()
            elapsed = ring_loop(self.fd, False, self.depth, self.stride, offsets, self.buffer.addr, True) / 1e9
            return elapsed, process_cpu_seconds() - cpu0
        # The ceiling writes whatever its buffer holds: keep the blocks' bytes (aligned, for O_DIRECT)
        # and put them back afterwards.
        snapshot = HostBuffer(self.stride * len(offsets))
        views = [snapshot.view[i * self.stride:(i + 1) * self.stride] for i in range(len(offsets))]
        for view, offset in zip(views, offsets, strict=True):
            os.preadv(self.fd, [view], offset)
        cpu0 = process_cpu_seconds()
        elapsed = ring_loop(self.fd, True, self.depth, self.stride, offsets, self.buffer.addr, True) / 1e9
        cpu = process_cpu_seconds() - cpu0
        for view, offset in zip(views, offsets, strict=True):
            os.pwritev(self.fd, [view], offset)
            view.release()
        snapshot.close()
        return elapsed, cpu

    def close(self) -> None:
        self.buffer.close()


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
