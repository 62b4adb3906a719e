"""The thread-pool backend: preadv/pwritev on worker threads, for where io_uring cannot run (Docker's
default seccomp refuses it, gVisor has none) or is not wanted (``io='threads'``). Same interface and
completion rules as the ring: each op's handler runs on the loop thread, after the op is done.
Ops waiting for a worker go in the I/O classes' order, as at the ring's backlog: demand loads'
reads, then prefetches' reads (``Op.later``), then writes, except that a write waiting
``store_aging_s`` (0: never) goes first."""

from __future__ import annotations

import errno
import os
import threading
import time
from collections import deque
from collections.abc import Sequence

from uring_kv._io.base import Op, OpsInFlight
from uring_kv._loop import LoopServices, current_services
from uring_kv._memory import view_of
from uring_kv._trace import Trace


class ThreadBackend(OpsInFlight):
    """``workers`` threads doing preadv/pwritev (``reason``: why, for the description), taking the
    waiting ops by class: [0] demand reads, [1] prefetch reads, [2] writes."""

    name = "threads"

    def __init__(self, services: LoopServices | None = None, workers: int = 8, reason: str = "",
                 trace: Trace | None = None, store_aging_s: float = 0.0) -> None:
        super().__init__(services or current_services(), trace)
        self._store_aging_s = store_aging_s
        self.reason = reason
        self.description = f"thread pool ({workers} threads{', ' + reason if reason else ''})"
        if workers < 1:
            raise ValueError(f"the thread pool needs at least one worker, got {workers}")
        self._waiting: tuple[deque[Op], deque[Op], deque[Op]] = (deque(), deque(), deque())
        self._written_since: deque[float] = deque()  # when each waiting write came
        self._ready = threading.Condition()
        self._closing = False
        self._workers: list[threading.Thread] = []
        try:
            for i in range(workers):
                worker = threading.Thread(target=self._work, name=f"uring-kv-io-{i}", daemon=True)
                worker.start()
                self._workers.append(worker)
        except BaseException:
            self._stop()
            raise

    def submit(self, ops: Sequence[Op]) -> None:
        waiting = self._waiting
        with self._ready:
            if self._closing:
                raise RuntimeError("uring_kv: the thread pool is closed")
            self.inflight += len(ops)
            for op in ops:
                waiting[2 if op.write else 1 if op.later else 0].append(op)
                if op.write:
                    self._written_since.append(time.monotonic())
            self._ready.notify(len(ops))

    def _next(self) -> Op | None:
        """The next op by class (None: closing and nothing left)."""
        with self._ready:
            while True:
                writes = self._waiting[2]
                if writes and self._store_aging_s and self._written_since[0] <= time.monotonic() - self._store_aging_s:
                    self._written_since.popleft()
                    return writes.popleft()
                for queue in self._waiting:
                    if queue:
                        if queue is writes:
                            self._written_since.popleft()
                        return queue.popleft()
                if self._closing:
                    return None
                self._ready.wait()

    def _work(self) -> None:
        while True:
            op = self._next()
            if op is None:
                return
            try:
                self._run(op)
            except BaseException as exc:  # (not an OSError of the call): the op fails, the worker lives on
                try:
                    self._svc.call_soon_threadsafe(self._svc.report, "uring_kv thread-pool I/O failed", exc)
                    self._svc.call_soon_threadsafe(self._finished, op, -errno.EIO)
                except RuntimeError:  # the loop has closed: nobody waits for the op any more
                    pass
            del op  # an idle worker holds no op (nor the memory its owner keeps alive)

    def _run(self, op: Op) -> None:
        view = view_of(op.addr, op.length)
        try:
            res = os.pwritev(op.fd, [view], op.offset) if op.write else os.preadv(op.fd, [view], op.offset)
        except OSError as exc:
            res = -(exc.errno or errno.EIO)
        finally:
            view.release()
        self._svc.call_soon_threadsafe(self._finished, op, res)

    def close(self) -> None:
        if self.inflight:
            raise RuntimeError(f"{self.inflight} thread-pool ops still in flight; drain() first")
        self._stop()

    def _stop(self) -> None:
        with self._ready:
            self._closing = True
            self._ready.notify_all()
        for worker in self._workers:
            worker.join()
