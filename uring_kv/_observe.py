"""What an engine shows of itself: its metrics, its stats (what it chose, and why), and the
diagnostics tools read beside it (the block file's descriptor, copy delivery times, the batch
tracer). A mixin of :class:`uring_kv.Engine`, reading the parts the engine builds at ``open()``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from uring_kv._batch import Batches
from uring_kv._bridge import Bridge
from uring_kv._copy import CudaCopier, HostCopier
from uring_kv._driver import Driver
from uring_kv._file import BlockFile
from uring_kv._io import IOBackend
from uring_kv._loop import LoopServices
from uring_kv._staging import Kind, SlotPool
from uring_kv._tuning import Tuning


class Observed:
    """Metrics, stats and diagnostics of an engine (the attributes below are the engine's)."""

    pool: SlotPool
    io: IOBackend
    bridge: Bridge
    copier: HostCopier | CudaCopier
    file: BlockFile
    io_depth: int
    tuning: Tuning
    _svc: LoopServices
    _state: str
    _batches: Batches
    _driver: Driver | None
    _tracer: Callable[[str, Kind | None, int], None] | None

    def _gauges(self) -> dict[str, Any]:
        """What is held or in flight right now (all zero once closed)."""
        is_open = hasattr(self, "pool") and self._state != "closed"
        return {"leases_held": self.pool.held if is_open else 0,
                "io_inflight": self.io.inflight if is_open else 0,
                "copies_pending": self.bridge.pending + self.copier.pending if is_open else 0,
                "oldest_lease_age_s": self.pool.oldest_age() if is_open else 0.0}

    def metrics(self) -> dict[str, Any]:
        """A snapshot: per direction (``load``, ``store``) bytes, blocks, failures, cancelled blocks,
        batches and histograms of batch latency and slot wait; gauges for leases held, copies
        pending, I/O in flight and the oldest lease's age."""
        snapshot: dict[str, Any] = {kind.name.lower(): m.snapshot() for kind, m in self._batches.metrics.items()}
        snapshot.update(self._gauges())
        return snapshot

    def stats(self) -> dict[str, Any]:
        """The gauges of :meth:`metrics`, the number of active batches, how many batches ran in
        native pumps, and what the engine chose here: I/O path, copy path, O_DIRECT, how the file is
        kept unnamed, fixed buffers, pinned bytes, whether the slots were advised onto huge pages
        (``huge_pages``), event loop, and whether pumped loads read straight
        into the caches (``loads_into_caches``: CPU mode, buffered or with every piece aligned), and the
        :class:`Tuning` in force (``tuning``, a dict). ``direct_reason``: why the file is buffered
        ('' under O_DIRECT); ``stride``: bytes a block takes in the file (block ``d`` at ``d * stride``);
        ``reserved``: whether the whole file was allocated at open (``Tuning.reserve_space``), and
        ``reserve_reason`` why not ('' when it was)."""
        return {
            **self._gauges(),
            "active_batches": len(self._batches.active),
            "pumped_batches": self._driver.pumped if self._driver is not None else 0,
            "io": self.io.description,
            "copy": self.copier.description,
            "direct": self.file.direct,
            "direct_reason": self.file.reason,
            "file": self.file.naming,
            "reserved": self.file.reserved,
            "reserve_reason": self.file.reserve_reason,
            "stride": self.file.stride,
            "fixed_buffers": self.io.fixed_buffers,
            "pinned_bytes": self.pool.slab.size,
            "huge_pages": self.pool.slab.huge_pages,
            "io_depth": self.io_depth,
            "loop": self._svc.name,
            "loads_into_caches": self._driver is not None and self._driver.native and self._driver.scatter,
            "tuning": self.tuning.as_dict(),
        }

    def fileno(self) -> int:
        """The block file's descriptor (block ``d`` at ``d * stats()["stride"]``), for tools that read
        it beside the engine, such as the bench's peers; valid while the engine is open."""
        return int(self.file.fd)

    def delivery_times(self, clear: bool = False) -> list[int]:
        """Diagnostics (may change): ns from each finished copy (CUDA event or copier job) to the
        loop taking it, the last 100,000; ``clear`` empties the record after reading it."""
        times = list(self.bridge.delivery_ns)
        if clear:
            self.bridge.delivery_ns.clear()
        return times

    def trace(self, tracer: Callable[[str, Kind | None, int], None] | None) -> None:
        """Diagnostics (for timing studies; may change): ``tracer(event, kind, count)`` runs on the
        loop's thread at these points (``None`` stops it; it may be set before or after ``open()``):

        ========================  ======  =====================================================
        event                     kind    count
        ========================  ======  =====================================================
        ``grow`` / ``grown``      batch   slots given to a batch's pump; before, and after its
                                          first I/O was submitted
        ``finished``              batch   blocks the batch's pump started
        ``submit``/``submitted``  None    io_uring: SQEs about to be submitted; after, the
                                          reads and writes in flight, not yet reaped
        ``reap`` / ``reaped``     None    io_uring wake-up: I/Os in flight before the reap;
                                          after, completions it found (pumps' included)
        ``collect``/``collected`` None    native copier: jobs pending; after, jobs taken
        ``copy``/``copy_queued``  batch   Python pump: blocks whose copies it queues, around
                                          the copier calls
        ``block_*``               batch   Python pump, a block's position in its batch:
                                          ``start``, ``read`` (handled), ``copy`` (queued),
                                          ``copied`` (done), ``write`` (submitted), ``written``
        ========================  ======  =====================================================

        Native pumps (the default) report only the first six; ``URING_KV_DEBUG_PUMP=0`` runs every
        batch in the Python pump. A tracer that raises breaks the batch it ran in."""
        self._tracer = tracer
        self._apply_tracer()

    def _apply_tracer(self) -> None:
        """Hand the tracer to the parts open() built (the pumps get it from the driver)."""
        tracer = self._tracer
        if self._driver is not None:
            self._driver.tracer = tracer
            self.io.tracer = tracer
            link = self.copier.link
            if link is not None:
                link.tracer = tracer
