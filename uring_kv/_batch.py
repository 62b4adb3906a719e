"""A batch (one ``load_batch``/``store_batch`` call) from admission to its end: its futures, the
handle the caller gets, and the books (``Batches``): the active set, the event recorded after its
last copy, the per-direction metrics, the error naming every failed block."""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field
from typing import Any

from uring_kv._loop import LoopServices
from uring_kv._pressure import Pressure, Ticket
from uring_kv._staging import Kind
from uring_kv.errors import BlockIOError
from uring_kv.metrics import DirectionMetrics

bind = functools.partial  # handler(arg, *completion args): a C-level call, no Python frame of its own


@dataclass(eq=False)
class Batch:
    kind: Kind
    remaining: int  # blocks not finished (0 once its pump finished)
    done: Any  # future: every block finished (BlockIOError naming the failed ones)
    enqueued: Any  # future: every copy enqueued; its result is the event of the last one
    to_enqueue: int  # blocks whose copy is not enqueued yet (nor will be: failed, skipped)
    failures: dict[int, int] = field(default_factory=dict)  # disk block → errno
    last_event: Any = None  # for the caller: fires once every copy of the batch is done
    copied: bool = False  # some copy of this batch was enqueued
    marking: bool = False  # the copier was asked for the batch's event
    size: int = 0
    skipped: int = 0  # blocks never started (the batch was cancelled)
    created: float = field(default_factory=time.monotonic)
    ticket: Ticket | None = None  # its call's place in the back-pressure books


class TransferHandle:
    """A batch whose copies are enqueued. ``event`` (GPU mode) fires when every block has arrived
    on the device (load) or in the staging slots (store); ``await handle`` waits until the batch is
    complete (resident on the device, or written to the file) and raises its I/O errors."""

    def __init__(self, batch: Batch, event: Any, services: LoopServices) -> None:
        self._batch = batch
        self.event = event
        self._svc = services

    def wait_on(self, stream: Any) -> None:
        """Make ``stream`` wait for this batch's copies (GPU mode)."""
        if self.event is not None:
            stream.wait_event(self.event)

    def __await__(self) -> Any:
        # Through wait(): a cancelled awaiter must not cancel the batch's own future, which the
        # engine still needs to see finish.
        return self._svc.wait(self._batch.done).__await__()


class Batches:
    """An open engine's active batches and their accounting (into the engine's ``metrics``, per
    direction); ``copier``'s ``marker()`` makes a batch's last event."""

    def __init__(self, services: LoopServices, copier: Any, metrics: dict[Kind, DirectionMetrics],
                 pressure: Pressure, block_bytes: int) -> None:
        self.services = services
        self.copier = copier
        self.pressure = pressure
        self._block_bytes = block_bytes
        self.active: set[Batch] = set()
        self.metrics = metrics

    def new(self, kind: Kind, count: int, ticket: Ticket | None = None) -> Batch:
        create = self.services.create_future
        batch = Batch(kind, count, create(), create(), count, size=count, ticket=ticket)
        self.active.add(batch)
        if count == 0:
            self.check(batch)
        return batch

    def enqueued_some(self, batch: Batch, count: int, copied: bool) -> None:
        """``count`` more blocks of ``batch`` had their copy enqueued (``copied``) or never will."""
        batch.to_enqueue -= count
        if copied:
            batch.copied = True
        self.check_enqueued(batch)

    def check_enqueued(self, batch: Batch) -> None:
        if batch.to_enqueue == 0 and not batch.marking and not batch.enqueued.done():
            if batch.copied:  # one event for the caller, recorded after the batch's last copy
                batch.marking = True
                self.copier.marker(batch.kind is Kind.STORE, bind(self._marked, batch))
            else:
                batch.enqueued.set_result(None)

    def _marked(self, batch: Batch, event: Any) -> None:
        batch.last_event = event
        if not batch.enqueued.done():
            batch.enqueued.set_result(event)

    def pump_finished(self, batch: Batch, failures: dict[int, int], started: int, skipped: int, unwaited: int,
                      settled: bool, event: bool) -> None:
        """``batch``'s pump has finished: it started ``started`` blocks, ``unwaited`` of them in a
        slot taken without waiting, and never started ``skipped`` (cancelled); ``failures``: disk
        block → errno. ``settled``: its copies are all done (a native pump's), so the batch is
        enqueued, with an event that has fired (GPU: recorded now) where the caller gets one
        (``event``)."""
        batch.failures.update(failures)
        batch.skipped = skipped
        batch.remaining = batch.to_enqueue = 0
        if settled:
            if started and event:
                batch.last_event = self.copier.settled_event(batch.kind is Kind.STORE)
            batch.enqueued.set_result(batch.last_event)
        self.check(batch, unwaited)

    def started(self, batch: Batch) -> None:
        """``batch`` took its first slot: its call is in flight (back-pressure)."""
        if batch.ticket is not None:
            self.pressure.start(batch.ticket)

    def slot_waited(self, kind: Kind, seconds: float) -> None:
        """A batch of ``kind`` waited ``seconds`` for a slot (the metrics' slot wait)."""
        self.metrics[kind].slot_wait_s.observe(seconds)

    def check(self, batch: Batch, unwaited: int = 0) -> None:
        """Finish ``batch`` once none of its blocks remains: metrics (``unwaited``: blocks that took
        a slot without waiting), then its future."""
        self.check_enqueued(batch)
        if batch.remaining > 0 or batch.done.done():
            return
        self.active.discard(batch)
        moved = batch.size - len(batch.failures) - batch.skipped
        self.metrics[batch.kind].batch_done(moved, moved * self._block_bytes, len(batch.failures), batch.skipped,
                                            time.monotonic() - batch.created, unwaited)
        if batch.ticket is not None:
            self.pressure.end(batch.ticket, moved * self._block_bytes)
        if batch.failures:
            batch.done.set_exception(BlockIOError("load" if batch.kind is Kind.LOAD else "store", batch.failures))
        else:
            batch.done.set_result(None)
        if batch.failures and not batch.done.cancelled():
            batch.done.exception()  # mark retrieved: a cancelled caller may never look at it
