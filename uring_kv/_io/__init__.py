"""Block I/O: an :class:`IOBackend` (``base.py``) is io_uring on the event loop (``uring.py``, where
native pumps also run) or a thread pool doing preadv/pwritev (``threads.py``). This face is the one
place that names both: :func:`ring_for` says whether io_uring runs here (an engine asks before it
makes its plan), :func:`backend_for` makes an engine's backend from its plan, and
:func:`open_backend` makes one for tools and tests."""

from __future__ import annotations

import warnings

from uring_kv._io.base import IOBackend, Op, check_result
from uring_kv._io.threads import ThreadBackend
from uring_kv._io.uring import NativePumps, UringBackend, open_ring
from uring_kv._loop import LoopServices, current_services
from uring_kv._native import NativeRing
from uring_kv._plan import Plan
from uring_kv._trace import Trace
from uring_kv._tuning import Tuning
from uring_kv.errors import UringUnavailable

__all__ = ["IOBackend", "NativePumps", "Op", "ThreadBackend", "UringBackend", "backend_for", "check_result",
           "open_backend", "ring_for"]

MODES = ("auto", "uring", "threads")


def ring_for(mode: str, services: LoopServices, entries: int = 256,
             thread: bool = False) -> tuple[NativeRing | None, str]:
    """A ring for I/O mode ``mode`` ('auto', 'uring' or 'threads') and '', or None and why the
    thread pool runs instead: 'threads' asks for it; 'auto' falls back to it with one
    RuntimeWarning naming the cause; 'uring' raises :class:`UringUnavailable` instead.
    ``thread``: a ring for the ring thread (see ``_io/uring.py``)."""
    if mode not in MODES:
        raise ValueError(f"I/O mode must be 'auto', 'uring' or 'threads', got {mode!r}")
    if mode == "threads":
        return None, "io='threads'"
    try:
        return open_ring(services.report, entries, thread=thread), ""
    except UringUnavailable as exc:
        if mode == "uring":
            raise
        warnings.warn(f"uring_kv: {exc}; using the thread-pool fallback", RuntimeWarning, stacklevel=3)
        return None, str(exc)


def open_backend(mode: str = "auto", *, services: LoopServices | None = None, async_io: bool = False,
                 entries: int = 256, workers: int = 8, depth: int | None = None, async_writes: bool | None = None,
                 tuning: Tuning | None = None) -> IOBackend:
    """The backend for ``mode`` (see :func:`ring_for`). ``depth``: at most this many ops in flight
    (the rest wait their turn, reads before writes); None: as many as the backend takes.
    ``tuning``: the ring's knobs (default: :class:`Tuning`'s defaults)."""
    services = services or current_services()
    ring, reason = ring_for(mode, services, entries)
    if ring is None:
        return ThreadBackend(services, min(workers, depth) if depth else workers, reason=reason)
    return UringBackend(services, entries, async_io, depth=depth, async_writes=async_writes, tuning=tuning, ring=ring)


def backend_for(plan: Plan, services: LoopServices, ring: NativeRing | None, tuning: Tuning, trace: Trace,
                workers: int = 8, store_aging_s: float = 0.0) -> tuple[IOBackend, UringBackend | None]:
    """An engine's backend as its plan has it, and the same as a :class:`UringBackend` where native
    pumps may run on it (else None): on ``ring`` with the plan's IOSQE_ASYNC flags and depth, or
    the thread pool (as many workers as the depth allows). A write that has waited
    ``store_aging_s`` for room (0: no aging) goes before any read."""
    if plan.io == "threads":
        threads = ThreadBackend(services, min(workers, plan.depth) if plan.depth else workers, reason=plan.io_reason,
                                trace=trace, store_aging_s=store_aging_s)
        return threads, None
    assert ring is not None
    uring = UringBackend(services, async_io=plan.async_reads, async_writes=plan.async_writes, depth=plan.depth,
                         tuning=tuning, ring=ring, trace=trace, store_aging_s=store_aging_s)
    return uring, uring
