"""``Tuning``: every knob of the engine in one frozen value, and the policies derived from it.

An engine reads its tuning once, at construction (``Engine(..., tuning=None)`` reads the
environment then, with :meth:`Tuning.from_env`: the one place the package reads it); nothing below
it reads ``os.environ``, and the plan of its data path is made from it (``_plan.py``).
``engine.stats()["tuning"]`` and ``uring-kv info`` print what is in force. Two kinds of fields:

- **settings** (``URING_KV_<NAME>``): documented in ``docs/configuration.md``, kept across versions;
- **diagnostics** (``URING_KV_DEBUG_<NAME>``): A/B switches that turn off one mechanism to measure
  what it buys or to isolate a fault; they may change or go in any version.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# Largest block whose pumped reads and writes go without IOSQE_ASYNC on a buffered file: a page-cache
# hit is then copied inside io_uring_enter on the loop thread (a few µs at this size).
PUMP_INLINE_BYTES = 32 << 10
# ... and only while all slots together hold at most this much: a reap pass (which refills each slot
# at most once) or a pump's start then copies at most this much on the loop (32 × 128 KiB took
# 1.3 ms on the CPU machine).
INLINE_PASS_BYTES = 1 << 20
# The ring thread runs by default ('auto') where the process may use at least this many CPUs.
RING_THREAD_CPUS = 8
RING_THREAD_MODES = ("auto", "on", "off")
# The native copier's threads poll this long (µs) for their next job or event before they sleep, by
# default where the process may use RING_THREAD_CPUS CPUs or more.
COPIER_POLL_US = 200
COPIER_POLL_MAX_US = 1_000_000  # a second: beyond it a thread would rather sleep


def _cores_to_spare(cpus: int | None) -> bool:
    """Whether the process may run on RING_THREAD_CPUS CPUs or more (``cpus``: how many; default:
    its affinity): where the automatic settings give a thread a core of its own."""
    return (cpus if cpus is not None else len(os.sched_getaffinity(0))) >= RING_THREAD_CPUS


def _count(env: Mapping[str, str], name: str, default: int, what: str = "a count") -> int:
    raw = env.get(name)
    if raw is None:
        return default
    if not raw.strip().isdigit():
        raise ValueError(f"{name} must be {what} >= 0, got {raw!r}")
    return int(raw)


def _switch(env: Mapping[str, str], name: str, default: bool | None) -> bool | None:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    if raw not in ("0", "1"):
        raise ValueError(f"{name} must be 0 or 1, got {raw!r}")
    return raw == "1"


@dataclass(frozen=True)
class Tuning:
    """The engine's knobs. Build one with :meth:`from_env` (what ``Engine`` does by default) or
    directly, e.g. ``Tuning(io="threads")``; ``dataclasses.replace`` makes variants."""

    # ---- settings (URING_KV_<NAME>)
    io: str = "auto"  # 'auto', 'uring' or 'threads' (the Engine's io= argument wins)
    completions_per_callback: int = 0  # io_uring: most handlers per loop callback (0: all reaped)
    reap_budget_us: int = 100  # io_uring: how long one reap may refill pumps inline (0: one pass)
    iowq_workers: int = 0  # io_uring: cap on io-wq workers (0: the kernel's default)
    # io_uring: while a demand load's pump runs, a prefetch's pump starts an I/O only below this many
    # pump I/Os in flight (None: a quarter of the depth; 0: no cap)
    prefetch_depth: int | None = None
    host_inline_bytes: int = 1 << 20  # CPU mode: copy calls up to this size run on the loop (0: never)
    copy_lanes: int = 0  # GPU mode, Python submit threads per direction (0: 1 staged, else 2)
    reserve_space: bool = False  # allocate the whole block file at open (fallocate), not as blocks are written
    ring_thread: str = "auto"  # io_uring: a C thread moves the native pumps ('on', 'off', 'auto': RING_THREAD_CPUS+)
    cuda_mapped: bool = True  # the kernel copy path reads and writes the pinned host slots (False: device staging)
    copier_poll_us: int | None = None  # native copier: µs its threads poll before sleeping (None: auto)
    # ---- diagnostics (URING_KV_DEBUG_<NAME>)
    sqe_async: bool | None = None  # force IOSQE_ASYNC on (True) or off (False) for every SQE
    pumps: bool = True  # False: every batch runs in the Python pump, none in native ones
    pump_scatter: bool = True  # False: pumped CPU loads go through the slot, never straight to the caches
    pump_gather: bool = True  # False: pumped CPU stores go through the slot, never straight from the caches
    native_copier: bool = True  # False: the Python copy threads and bridge
    cuda_staged: bool = True  # False: no device staging + scatter kernel
    cuda_batch: bool = True  # False: no cuMemcpyBatchAsync (one driver call per piece)
    start_hop: bool = True  # False: a batch does not yield the loop between its set-up and first I/O
    huge_pages: bool = True  # False: no MADV_HUGEPAGE on the staging slots (see _memory.HostBuffer)

    def __post_init__(self) -> None:
        if self.io not in ("auto", "uring", "threads"):
            raise ValueError(f"I/O mode must be 'auto', 'uring' or 'threads', got {self.io!r}")
        if self.ring_thread not in RING_THREAD_MODES:
            raise ValueError(f"Tuning.ring_thread must be 'auto', 'on' or 'off', got {self.ring_thread!r}")
        poll = self.copier_poll_us
        if poll is not None and (isinstance(poll, bool) or not isinstance(poll, int)
                                 or not 0 <= poll <= COPIER_POLL_MAX_US):
            raise ValueError(f"Tuning.copier_poll_us must be None or an integer from 0 to {COPIER_POLL_MAX_US}, "
                             f"got {poll!r}")
        cap = self.prefetch_depth
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 0):
            raise ValueError(f"Tuning.prefetch_depth must be None or an integer >= 0, got {cap!r}")
        for name in ("completions_per_callback", "reap_budget_us", "iowq_workers", "host_inline_bytes",
                     "copy_lanes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"Tuning.{name} must be an integer >= 0, got {value!r}")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Tuning:
        """The defaults, overridden by the ``URING_KV_*`` variables of ``env`` (default: the
        process environment); a malformed value raises ValueError naming the variable."""
        env = os.environ if env is None else env
        d = cls()
        io = env.get("URING_KV_IO") or d.io
        if io not in ("auto", "uring", "threads"):
            raise ValueError(f"URING_KV_IO must be 'auto', 'uring' or 'threads', got {io!r}")
        ring_thread = env.get("URING_KV_RING_THREAD") or d.ring_thread
        if ring_thread not in RING_THREAD_MODES:
            raise ValueError(f"URING_KV_RING_THREAD must be 'auto', 'on' or 'off', got {ring_thread!r}")

        def on(name: str, default: bool) -> bool:
            value = _switch(env, f"URING_KV_DEBUG_{name}", default)
            return default if value is None else value

        return cls(
            io=io,
            completions_per_callback=_count(env, "URING_KV_COMPLETIONS_PER_CALLBACK", d.completions_per_callback),
            reap_budget_us=_count(env, "URING_KV_REAP_BUDGET_US", d.reap_budget_us, "a number of µs"),
            iowq_workers=_count(env, "URING_KV_IOWQ_WORKERS", d.iowq_workers),
            prefetch_depth=None if env.get("URING_KV_PREFETCH_DEPTH", "auto") in ("", "auto")
            else _count(env, "URING_KV_PREFETCH_DEPTH", 0, "'auto' or a number of I/Os"),
            host_inline_bytes=_count(env, "URING_KV_HOST_INLINE_BYTES", d.host_inline_bytes, "a byte count"),
            copy_lanes=_count(env, "URING_KV_COPY_LANES", d.copy_lanes),
            reserve_space=bool(_switch(env, "URING_KV_RESERVE_SPACE", d.reserve_space)),
            ring_thread=ring_thread,
            cuda_mapped=bool(_switch(env, "URING_KV_CUDA_MAPPED", d.cuda_mapped)),
            copier_poll_us=None if env.get("URING_KV_COPIER_POLL_US", "auto") in ("", "auto")
            else _count(env, "URING_KV_COPIER_POLL_US", 0, "'auto' or a number of µs"),
            sqe_async=_switch(env, "URING_KV_DEBUG_SQE_ASYNC", d.sqe_async),
            pumps=on("PUMP", d.pumps),
            pump_scatter=on("PUMP_SCATTER", d.pump_scatter),
            pump_gather=on("PUMP_GATHER", d.pump_gather),
            native_copier=on("NATIVE_COPIER", d.native_copier),
            cuda_staged=on("CUDA_STAGED", d.cuda_staged),
            cuda_batch=on("CUDA_BATCH", d.cuda_batch),
            start_hop=on("START_HOP", d.start_hop),
            huge_pages=on("HUGE_PAGES", d.huge_pages),
        )

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    # ---- policies derived from the knobs and an engine's geometry
    def wants_ring_thread(self, cpus: int | None = None) -> bool:
        """Whether an io_uring engine's native pumps are moved by the ring thread: 'on', 'off', or
        ('auto') where the process may run on RING_THREAD_CPUS CPUs or more (``cpus``: how many;
        default: its affinity). The thread spends a core's share the loop no longer spends; on
        fewer CPUs the loop, the thread, the copier and io-wq's workers wait for each other."""
        if self.ring_thread != "auto":
            return self.ring_thread == "on"
        return _cores_to_spare(cpus)

    def copier_poll(self, cpus: int | None = None) -> int:
        """µs the native copier's threads poll before they sleep: ``copier_poll_us``, or (None)
        COPIER_POLL_US where the process may run on RING_THREAD_CPUS CPUs or more (``cpus``), else
        0. On the H100 machine (2026-12-07) 200 µs halved a 128 KiB slot's copy phase (160–183 →
        99–110 µs) at the same CPU per GB; on two cores a polling thread takes the core the
        others wait for."""
        if self.copier_poll_us is not None:
            return self.copier_poll_us
        return COPIER_POLL_US if _cores_to_spare(cpus) else 0

    @staticmethod
    def copies_inline(num_slots: int, stride: int) -> bool:
        """Whether all slots together hold at most INLINE_PASS_BYTES: then a reap pass (which
        refills each slot at most once) or a pump's start may copy every slot's block on the loop.
        CPU mode's pumps copy inline only then, and only then submit O_DIRECT without IOSQE_ASYNC;
        beyond, copies are jobs for the native copier, as in GPU mode."""
        return num_slots * stride <= INLINE_PASS_BYTES

    def pump_inline(self, num_slots: int, stride: int) -> bool:
        """Whether native pumps submit without IOSQE_ASYNC: blocks up to PUMP_INLINE_BYTES while the
        slots copy inline. Handing each to an io-wq worker then costs more than the copy, and the
        reap's budget bounds how long it holds the loop."""
        return self.sqe_async is not True and stride <= PUMP_INLINE_BYTES and self.copies_inline(num_slots, stride)

    def sqe_flags(self, gpu: bool, direct: bool, num_slots: int, stride: int) -> tuple[bool, bool]:
        """(IOSQE_ASYNC on reads, on writes), measured on the H200 machine (2026-12-03):

        - reads of a buffered file: a page-cache hit would be copied inside io_uring_enter, on the
          loop thread;
        - O_DIRECT reads and writes wherever the copies are the native copier's (GPU mode, and CPU
          mode once the slots hold over INLINE_PASS_BYTES): the submission goes through the block
          layer and waits there when the device's queue is full. Handing it to io-wq took the
          bridge delay's p99 at 128 KiB from 112–215 to 45–74 µs in GPU mode and from 240–251 to
          39–63 µs in CPU mode, at the same throughput. CPU mode's inline-copy set-ups keep it
          inline (their 16 KiB O_DIRECT loads reach the ring ceiling so);
        - never writes to a buffered file: forced onto io-wq, hot 2 MiB stores burned ~9x the CPU
          and held the loop up to 5.4 ms (waiting for a core), at the same throughput as without.
        """
        if self.sqe_async is not None:
            return self.sqe_async, self.sqe_async
        direct_async = gpu or not self.copies_inline(num_slots, stride)
        return direct_async or not direct, direct_async and direct

    @staticmethod
    def staging_slots(io_depth: int, stride: int, gpu: bool, direct: bool = True) -> int:
        """Staging slots that keep ``io_depth`` I/Os in flight (``stride``: the padded block), the
        same under any tuning:

        - half the depth again wherever the copies are jobs for the native copier, so that each
          slot spends a copy turnaround between its read and the next (0.80× of the ring ceiling at
          128 KiB without, 0.91–0.95× with 16 on the H200): on a GPU, and in CPU mode once the
          slots hold over INLINE_PASS_BYTES together;
        - in CPU mode's smaller O_DIRECT set-ups, whose pumps copy each block on the loop, as many
          as the depth while all slots still hold at most INLINE_PASS_BYTES: a reap then submits
          its refills through the spare slots before it copies (16 KiB loads: 0.86× of the ring
          ceiling without, 0.94× with 32);
        - none for buffered files there: their pumps read straight into the caches.
        """
        if gpu or not Tuning.copies_inline(io_depth, stride):
            return io_depth + io_depth // 2
        if not direct:
            return io_depth
        return io_depth + max(0, min(io_depth, INLINE_PASS_BYTES // stride - io_depth))
