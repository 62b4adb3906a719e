"""What a bench run does: :class:`BenchConfig`, its defaults, and the figures that follow from it
(measured batches per block size, uring_kv's staging slots). Imports no torch."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from uring_kv import Tuning
from uring_kv._file import round_up

if TYPE_CHECKING:
    import torch

# --peers names: vLLM's DiskBackend, a thread pool, KvikIO, fio, the ring ceiling
PEERS = ("vllm-disk", "threads", "kvikio", "fio", "ceiling")


@dataclass
class BenchConfig:
    path: str | None = None
    size: int = 1 << 30
    block_sizes: list[int] = field(default_factory=lambda: [128 << 10, 2 << 20])
    layers: int = 32
    batch: int = 256
    batches: int | None = None  # measured rounds per block size (None: batches_for's default)
    warmup: int = 1  # unmeasured rounds first (every method), on batches of their own
    gc_freeze: bool = True  # collect and freeze the heap before measuring (see measure.frozen_heap)
    io_depth: int = 32  # reads and writes in flight: uring_kv's, the ring ceiling's and fio's
    slots: int | None = None  # uring_kv's staging slots (None: see staging_slots())
    threads: int = 8  # of the thread pool and of KvikIO
    direct: bool | None = None  # None: both cold (O_DIRECT) and hot (buffered, page cache)
    device: str = "auto"
    checksum: bool = False  # also measure uring_kv with checksum=True ("uring_kv+crc32c")
    peers: tuple[str, ...] = PEERS  # which of the others run beside uring_kv
    sweep: bool = True  # time the ring ceiling at several depths for the sizing advice
    # The same run again on a RAM-backed file (ram_directory()), where the disk is not the limit:
    # the engine's own ceiling, beside the disk's figures
    ram: bool = True
    ram_path: str = "/dev/shm"
    # Diagnostics, not command-line options (lab/loop_stalls.py): Engine.trace's tracer for
    # uring_kv's engines, and LagTicker's ``watch`` for every method measured
    tracer: Callable[[str, Any, int], None] | None = None
    lag_watch: Callable[[str, str, list[float], float], None] | None = None


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
    return Tuning.staging_slots(config.io_depth, stride, device.type == "cuda", direct)


def largest_file(config: BenchConfig) -> int:
    """Bytes of the largest block file the run makes (each case's file is removed before the next
    is made): what the directory must have free."""
    return max(max(config.batch, config.size // b) * round_up(b, 4096) for b in config.block_sizes)
