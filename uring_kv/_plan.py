"""``Plan``: every choice an engine's data path makes, computed once when it opens, from its
:class:`Tuning`, its geometry (:class:`Geometry`: the caches, the file, the slots) and what the
machine can do (io_uring here or not; the staged CUDA path built or not).

The parts are built from the plan and given what they need at construction: the I/O backend (its
IOSQE_ASYNC flags, its depth), the copier (host or CUDA, staged or per piece, native or Python
threads, what is copied inline), the native pumps (whether batches run in them, where their copies
go, whether loads read straight into the cache rows). No part looks at another to find out what
was chosen, and nothing is decided twice. ``Engine.stats()["plan"]`` and ``uring-kv info`` show it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from uring_kv._native import STAGED_MAX
from uring_kv._tuning import Tuning

COPY_CALL_PIECES = 128  # most tensor×block pieces per copy call of the Python pump (per-piece paths)
PUMP_SCATTER_MAX_TENSORS = 1024  # IOV_MAX: the most iovecs one readv takes


@dataclass(frozen=True)
class Geometry:
    """What decides an engine's data path besides its tuning: the caches (``gpu``, ``tensors``,
    ``block_bytes``: one block of every tensor; ``rows_aligned``: every tensor's rows start on the
    file's memory alignment and are a multiple of its alignment long), the file
    (``direct``, ``stride``: a block's bytes in it), the slots (``num_slots``, ``io_depth``),
    ``checksum`` and ``slowed`` (a ``copy_delay`` for tests)."""

    gpu: bool
    direct: bool
    stride: int
    num_slots: int
    io_depth: int
    tensors: int
    block_bytes: int
    rows_aligned: bool
    checksum: bool
    slowed: bool


@dataclass(frozen=True)
class Plan:
    """The data path of one open engine (see the module docstring); each field one choice."""

    io: str  # 'uring' or 'threads' (the thread pool: asked for, or io_uring unavailable here)
    io_reason: str  # why the thread pool ('' on io_uring)
    async_reads: bool  # io_uring: IOSQE_ASYNC on read SQEs (the kernel's work goes to io-wq threads)
    async_writes: bool  # io_uring: IOSQE_ASYNC on write SQEs
    depth: int | None  # at most this many reads and writes in flight (None: as many as the slots)
    copier: str  # 'host' (memcpy); CUDA: 'staged' (a copy per block + a scatter kernel), 'mapped' (the
    #              kernel alone, over the bus from the pinned slots) or 'pieces' (a copy per piece)
    staged_error: str  # why the staged path (or its mapped form) is not taken where it was asked for ('' otherwise)
    native_copier: bool  # copies off the loop run on the native copier's C threads, not Python threads
    copy_lanes: int  # CUDA: submit streams (and Python threads, without the native copier) per direction
    copy_batch: bool  # CUDA per piece: all of a call's pieces in one cuMemcpyBatchAsync where the driver has it
    copier_poll_us: int  # native copier: µs its threads poll for their next job (the bridge: event) before sleeping
    inline_copy_blocks: int  # CPU mode: copy calls of up to this many blocks run on the loop (0: none)
    copy_call_blocks: int  # blocks per copy call (one kernel launch staged; COPY_CALL_PIECES pieces otherwise)
    pumps: bool  # batches run in native pumps (C, no Python per block) where they can; else the Python pump
    pump_copies: str  # the pumps' copies: 'reap' (memcpys in the reap), 'jobs' (native copier jobs); '' without pumps
    pump_inline: bool  # pumps' SQEs go without IOSQE_ASYNC (small blocks; page-cache hits copied in the submission)
    ring_thread: bool  # a C thread reaps the ring and moves the pumps; the loop hears of batch ends only
    into_rows: bool  # pumped loads read straight into the cache rows (a readv each), not through the slot
    from_rows: bool  # pumped stores write straight from the cache rows (a writev each), not through the slot
    checksums: bool  # a crc32c of every block written, verified on load (summed off the loop, in the Python pump)
    start_hop: bool  # a batch gives the loop three turns between its set-up and its first I/O

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def make_plan(tuning: Tuning, geometry: Geometry, uring: bool, io_reason: str, staged: bool,
              staged_error: str = "", ring_thread: bool = False, mapped: bool = False) -> Plan:
    """The plan for ``geometry`` under ``tuning``, where io_uring runs (``uring``; else the thread
    pool, for ``io_reason``) and the staged CUDA path was built (``staged``, ``mapped`` when in its
    mapped form; else ``staged_error`` says why, when it was asked for)."""
    g = geometry
    async_reads, async_writes = tuning.sqe_flags(g.gpu, g.direct, g.num_slots, g.stride) if uring else (False, False)
    if g.gpu:
        copier = ("mapped" if mapped else "staged") if staged else "pieces"
        native_copier = tuning.native_copier and staged  # the native copier runs staged copies only
        lanes = 1 if native_copier else tuning.copy_lanes or (1 if staged else 2)
        inline_blocks = 0
    else:
        copier, native_copier, lanes = "host", tuning.native_copier, 0
        # A memcpy of up to host_inline_bytes takes tens of µs on the loop; handing it to a thread
        # and back costs more. A copy_delay (tests widening race windows) sends every call to the thread.
        inline_blocks = 0 if g.slowed else tuning.host_inline_bytes // max(1, g.block_bytes)
    call_blocks = STAGED_MAX if copier in ("staged", "mapped") else max(1, COPY_CALL_PIECES // g.tensors)
    # Batches on io_uring run in native pumps unless something per block needs Python (checksums).
    # Their copies are memcpys in the reap while a block's copy may run on the loop (CPU mode's
    # inline copies) and all slots together hold at most INLINE_PASS_BYTES (a pump's start, and a
    # reap pass over a full CQ, copy every slot's block on the loop: 32 × 128 KiB took 1.3 ms on the
    # CPU machine); else jobs for the native copier (GPU mode, large or slowed host copies, many
    # slots), whose finished jobs the ring collects (their slots move on in C).
    reap_copies = not g.gpu and inline_blocks >= 1 and Tuning.copies_inline(g.num_slots, g.stride)
    pumps = uring and tuning.pumps and not g.checksum and (reap_copies or native_copier)
    # CPU-mode pumped loads read straight into the cache tensors from a buffered file, or with
    # O_DIRECT where every piece of every block is aligned memory of an aligned length (page-aligned
    # host pools as vLLM's and SGLang's everywhere; torch's own tensors on tmpfs, whose O_DIRECT takes
    # any 8-byte-aligned buffer); IOV_MAX bounds the pieces.
    # Stores the same way from the rows (a writev each): the copy into the slot goes. A native pump's
    # store counts as enqueued only once it has finished, so no caller sees it done while a write
    # still reads its rows.
    rows = pumps and not g.gpu and (not g.direct or g.rows_aligned) and g.tensors <= PUMP_SCATTER_MAX_TENSORS
    into_rows, from_rows = rows and tuning.pump_scatter, rows and tuning.pump_gather
    return Plan(
        io="uring" if uring else "threads",
        io_reason=io_reason,
        async_reads=async_reads,
        async_writes=async_writes,
        depth=g.io_depth if g.io_depth < g.num_slots else None,
        copier=copier,
        staged_error=staged_error if g.gpu and tuning.cuda_staged and not (staged and mapped == tuning.cuda_mapped)
        else "",
        native_copier=native_copier,
        copy_lanes=lanes,
        copy_batch=tuning.cuda_batch and g.gpu and not staged,
        copier_poll_us=tuning.copier_poll() if native_copier else 0,
        inline_copy_blocks=inline_blocks,
        copy_call_blocks=call_blocks,
        pumps=pumps,
        pump_copies=("reap" if reap_copies else "jobs") if pumps else "",
        pump_inline=pumps and tuning.pump_inline(g.num_slots, g.stride),
        ring_thread=uring and ring_thread,
        into_rows=into_rows,
        from_rows=from_rows,
        checksums=g.checksum,
        start_hop=tuning.start_hop,
    )

