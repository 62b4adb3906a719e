"""The bridges: finished copies become loop callbacks (one thread per engine, or the native copier's eventfd).

Why a thread, and why this shape
--------------------------------
A staging slot may only go back to the pool once the copy reading or writing it has finished on the
GPU, and only the CUDA event recorded after that copy knows when. The loop cannot wait for it:
``Event.query()`` holds the GIL and polling it from the loop is a busy-wait; ``synchronize()``
blocks. So one thread per engine does the waiting:

* it sleeps on a condition variable while nothing is pending (no CPU when idle);
* it blocks in ``synchronize()`` on the *oldest* pending event (events are created with
  ``blocking=True``, so the wait sleeps in the driver instead of spinning, and the GIL is released);
* when it wakes it sweeps every later event that has also fired (``query()``, a few calls at most),
  and hands the whole batch to the loop with one ``call_soon_threadsafe``.

The loop then runs each completion handler; the handlers release leases. A handler whose batch was
cancelled still runs: that is exactly what keeps a cancelled batch's slots out of the pool until the
DMA engine is done with them. Per-delivery latency (event fired → handler ran) is kept for the bench.

The native copier (``csrc/copier.c``) has its bridge in C; its finished jobs reach the loop through
an eventfd, and :class:`NativeLink` is the loop's side of that: it runs their handlers the same way.
"""

from __future__ import annotations

import functools
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Protocol

from uring_kv._cuda import CudaError
from uring_kv._loop import LoopServices
from uring_kv._native import FAIL_WAIT, PUMP_TAG, CopyJobs
from uring_kv._trace import Trace

# Takes the native copier's finished jobs where native pumps queue jobs there too: their ring's
# collection (``NativeRing.collect``), which moves the pumps' slots on in the same C call.
Collect = Callable[[CopyJobs], list[tuple[int, int, int, int]]]


class Waitable(Protocol):
    error: BaseException | None  # set when the copy or the wait for it failed

    def synchronize(self) -> None: ...
    def query(self) -> bool: ...


class Bridge:
    """Watches events on a thread; ``on_done`` callbacks run on the loop, in batches."""

    def __init__(self, services: LoopServices, trace: Trace | None = None, name: str = "uring-kv-bridge") -> None:
        self._svc = services
        self.trace = trace if trace is not None else Trace()  # Engine.trace's, for the native copier's collections
        self._items: deque[tuple[Waitable, Callable[[], None]]] = deque()
        self._cv = threading.Condition()
        self._stopping = False
        self.pending = 0  # watched and not yet delivered (loop-side count)
        self.delivery_ns: deque[int] = deque(maxlen=100_000)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def services(self) -> LoopServices:
        """The loop's services (the native copier's eventfd is watched through them)."""
        return self._svc

    def call_soon(self, fn: Callable[..., None], *args: object) -> None:
        """Run ``fn(*args)`` on the loop in a later callback (from the loop thread)."""
        self._svc.call_soon(fn, *args)

    def call_soon_threadsafe(self, fn: Callable[..., None], *args: object) -> None:
        """Run ``fn(*args)`` on the loop, from any thread (the copiers' submit threads use it)."""
        self._svc.call_soon_threadsafe(fn, *args)

    def watch(self, event: Waitable, on_done: Callable[[], None]) -> None:
        self.pending += 1
        with self._cv:
            self._items.append((event, on_done))
            self._cv.notify()

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._items and not self._stopping:
                    self._cv.wait()
                if not self._items:
                    return
                head_event = self._items[0][0]
            _wait(head_event)
            fired_ns = time.perf_counter_ns()
            with self._cv:
                batch = [self._items.popleft()]
                kept: deque[tuple[Waitable, Callable[[], None]]] = deque()
                while self._items:
                    item = self._items.popleft()
                    (batch if _fired(item[0]) else kept).append(item)
                self._items = kept
            try:
                self._svc.call_soon_threadsafe(self._deliver, batch, fired_ns)
            except RuntimeError:  # the loop is closed: nobody is left to hand slots back to
                return

    def _deliver(self, batch: list[tuple[Waitable, Callable[[], None]]], fired_ns: int) -> None:
        self.delivery_ns.append(time.perf_counter_ns() - fired_ns)
        for _event, on_done in batch:
            self.pending -= 1
            try:
                on_done()
            except Exception as exc:
                self._svc.report("uring_kv copy completion handler failed", exc)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self) -> None:
        """Stop after every watched event has been delivered (blocks until the thread exits)."""
        with self._cv:
            self._stopping = True
            self._cv.notify()
        if threading.current_thread() is not self._thread:  # (a handler it ran dropped the engine)
            self._thread.join()


# An event whose wait fails (a CUDA error: the context is broken) is delivered as failed, with the
# exception in its ``error``, rather than never: the engine then fails its blocks (EIO) instead of
# waiting for them forever with the bridge thread gone.
def _wait(event: Waitable) -> None:
    try:
        event.synchronize()
    except Exception as exc:
        _failed(event, exc)


def _fired(event: Waitable) -> bool:
    try:
        return event.query()
    except Exception as exc:
        _failed(event, exc)
        return True


def _failed(event: Waitable, exc: Exception) -> None:
    if event.error is None:
        event.error = exc


class NativeLink:
    """The loop's side of the native copier (``CopyJobs``): each job's handler by token, and the
    copier's eventfd watched by the loop; one reader callback runs the handlers of every job
    finished since the last one, in the order the jobs finished, each with its error or None.
    ``collect``: how the finished jobs are taken where native pumps queue jobs there too (their
    ring's collection, which handles theirs in C); else :meth:`CopyJobs.done`."""

    def __init__(self, jobs: CopyJobs, bridge: Bridge, collect: Collect | None = None) -> None:
        self.jobs = jobs
        self._bridge = bridge
        self._svc = bridge.services
        self._trace = bridge.trace
        self._handlers: dict[int, Callable[[BaseException | None], None]] = {}
        self._next = 0
        self._take: Callable[[], list[tuple[int, int, int, int]]] = (
            functools.partial(collect, jobs) if collect is not None else jobs.done)
        self._svc.add_reader(jobs.fd, self._collect)

    @property
    def pending(self) -> int:
        """Jobs queued and not yet handled on the loop: those with handlers, and pumps'."""
        return len(self._handlers) + self.jobs.pump_jobs

    def _token(self, handler: Callable[[BaseException | None], None]) -> int:
        token = self._next
        self._next += 1
        self._handlers[token] = handler
        return token

    def copy(self, to_slot: bool, slot_addrs: Sequence[int], gpu_blocks: Sequence[int],
             handler: Callable[[BaseException | None], None], dev_slots: Sequence[int] | None = None,
             event: int = 0) -> None:
        """Queue a copy; a copy that cannot be queued (no memory for the job) is delivered as failed
        on a later loop turn, like one that failed on the thread: nothing was enqueued for it."""
        token = self._token(handler)
        try:
            self.jobs.put(token, to_slot, slot_addrs, gpu_blocks, dev_slots, event)
        except Exception as exc:
            self._svc.call_soon(self._deliver, token, exc)

    def mark(self, to_slot: bool, handler: Callable[[BaseException | None], None]) -> None:
        token = self._token(handler)
        try:
            self.jobs.mark(token, to_slot)
        except BaseException:
            del self._handlers[token]
            raise

    def _deliver(self, token: int, error: BaseException | None) -> None:
        try:
            self._handlers.pop(token)(error)
        except Exception as exc:
            self._svc.report("uring_kv copy completion handler failed", exc)

    def _collect(self) -> None:
        now = time.monotonic_ns()  # CLOCK_MONOTONIC, the clock the C threads stamp with
        tracer = self._trace.fn
        if tracer is not None:
            tracer("collect", None, self.pending)
        taken = self._take()
        if tracer is not None:
            tracer("collected", None, len(taken))
        for token, rc, where, done_ns in taken:
            self._bridge.delivery_ns.append(now - done_ns)
            if not token & PUMP_TAG:
                self._deliver(token, job_error(rc, where))
            elif (error := job_error(rc, where)) is not None:  # a pump's job, handled in C: its
                self._svc.report("uring_kv copy failed", error)  # blocks failed with EIO, say why

    def close(self) -> None:
        """Stop watching, then run what is queued and stop the threads (blocking)."""
        self._svc.remove_reader(self.jobs.fd)
        self.jobs.close()


def job_error(rc: int, where: int) -> BaseException | None:
    """The error a native copy job's result stands for (None: it succeeded)."""
    if not rc:
        return None
    return CudaError(rc, "waiting for block copies" if where == FAIL_WAIT else "enqueueing block copies")
