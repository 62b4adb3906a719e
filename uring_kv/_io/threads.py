"""The thread-pool backend: preadv/pwritev on worker threads, for where io_uring cannot run (Docker's
default seccomp refuses it, gVisor has none) or is not wanted (``io='threads'``). Same interface and
completion rules as the ring: each op's handler runs on the loop thread, after the op is done."""

from __future__ import annotations

import errno
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from uring_kv._io.base import Op, OpsInFlight
from uring_kv._loop import LoopServices, current_services
from uring_kv._memory import view_of
from uring_kv._trace import Trace


class ThreadBackend(OpsInFlight):
    """A thread pool of ``workers`` threads doing preadv/pwritev (``reason``: why, for the description)."""

    name = "threads"

    def __init__(self, services: LoopServices | None = None, workers: int = 8, reason: str = "",
                 trace: Trace | None = None) -> None:
        super().__init__(services or current_services(), trace)
        self.reason = reason
        self.description = f"thread pool ({workers} threads{', ' + reason if reason else ''})"
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="uring-kv-io")

    def submit(self, ops: Sequence[Op]) -> None:
        self.inflight += len(ops)
        for op in ops:
            self._pool.submit(self._run, op)

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
        self._pool.shutdown(wait=True)
