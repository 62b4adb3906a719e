"""What the engine needs from an I/O path (:class:`IOBackend`), and what both backends share.

``submit()`` a batch of :class:`Op` and each op's ``on_done(res)`` is later called *on the loop
thread* with the byte count or ``-errno``. An op, and the memory it names, belongs to the kernel (or
the worker thread) until ``on_done`` runs; nothing here frees or reuses a buffer early, and a
cancelled awaiter does not change that. Two backends implement it: io_uring on the loop
(``uring.py``, which also runs native pumps) and a thread pool (``threads.py``).
"""

from __future__ import annotations

import errno
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from uring_kv._loop import LoopServices
from uring_kv._native import os_error
from uring_kv._trace import Trace


@dataclass(slots=True, eq=False)
class Op:
    """One read or write of ``length`` bytes at file ``offset`` to/from memory at ``addr``."""

    write: bool
    fd: int
    addr: int
    length: int
    offset: int
    on_done: Callable[[int], None]
    buf_index: int = -1  # index of a registered (fixed) buffer holding addr, or -1
    keep: object = field(default=None)  # kept alive until on_done has run
    later: bool = False  # a prefetch's read: submitted after the demand loads' reads, before writes


def check_result(res: int, expected: int, what: str) -> None:
    """Raise for a failed (negative) or short result; the one place results become exceptions."""
    if res < 0:
        raise os_error(res, what)
    if res != expected:
        raise OSError(errno.EIO, f"{what}: short transfer ({res} of {expected} bytes)")


class IOBackend(Protocol):
    """What the engine needs from an I/O path. Methods are called on the event loop thread."""

    name: str
    description: str
    fixed_buffers: bool  # ops may name registered buffers by index

    @property
    def inflight(self) -> int:
        """Ops submitted whose ``on_done`` has not run yet (and slots lent to native pumps)."""

    def submit(self, ops: Sequence[Op]) -> None:
        """Start every op; each one's ``on_done`` runs exactly once, later, on the loop thread."""

    def register_buffers(self, regions: Sequence[tuple[int, int]]) -> bool:
        """Offer memory regions for fixed-buffer I/O; True when ops may name them by index."""

    def register_file(self, fd: int) -> None:
        """Offer an fd for fixed-file I/O (an optimisation; ops keep naming the real fd)."""

    async def drain(self) -> None:
        """Wait until nothing is in flight."""

    async def transfer(self, write: bool, fd: int, addr: int, length: int, offset: int,
                       buf_index: int = -1, keep: object = None) -> int:
        """One op, awaited. Cancelling the awaiter leaves the op running to its completion."""

    def stats(self) -> dict[str, Any]:
        """What it shows of itself in ``Engine.stats()``: ``io`` (its description), ``fixed_buffers``."""

    def phases(self, clear: bool = False) -> dict[str, Any]:
        """Diagnostics: where native pumps' slots spent their time (see ``Engine.slot_phases``);
        {} where nothing runs in them."""

    def close(self) -> None:
        """Release the backend. Raises RuntimeError while ops are in flight (their memory is still in use)."""


class OpsInFlight:
    """The bookkeeping both backends share: the count of ops in flight, running their handlers
    (one that raises is reported, the others still run), :meth:`drain` and :meth:`transfer`."""

    def __init__(self, services: LoopServices, trace: Trace | None) -> None:
        self._svc = services
        self.inflight = 0
        self.fixed_buffers = False
        self._idle: Any = None  # a future while drain() waits
        self._trace = trace if trace is not None else Trace()  # Engine.trace's (diagnostics)

    def _finished(self, op: Op, res: int) -> None:
        self.inflight -= 1
        try:
            op.on_done(res)
        except Exception as exc:  # one bad handler must not stop the others
            self._svc.report("uring_kv I/O completion handler failed", exc)
        self._wake_drain()

    def _wake_drain(self) -> None:
        """Let a waiting drain() go on once nothing is in flight."""
        if self.inflight == 0 and self._idle is not None and not self._idle.done():
            self._idle.set_result(None)

    async def drain(self) -> None:
        """Wait until no op is in flight."""
        while self.inflight:
            self._idle = self._svc.create_future()
            await self._svc.wait(self._idle)
        self._idle = None

    async def transfer(self, write: bool, fd: int, addr: int, length: int, offset: int,
                       buf_index: int = -1, keep: object = None) -> int:
        """Convenience: one op, awaited. Cancelling the awaiter leaves the op running to its completion."""
        fut = self._svc.create_future()
        self.submit([Op(write, fd, addr, length, offset, fut.set_result, buf_index, keep)])
        res: int = await self._svc.wait(fut)
        check_result(res, length, f"{'write' if write else 'read'} of {length} bytes at offset {offset}")
        return res

    description: str  # the backend's, in words

    def stats(self) -> dict[str, Any]:
        return {"io": self.description, "fixed_buffers": self.fixed_buffers}

    def phases(self, clear: bool = False) -> dict[str, Any]:
        return {}

    def submit(self, ops: Sequence[Op]) -> None:
        raise NotImplementedError

    def register_buffers(self, regions: Sequence[tuple[int, int]]) -> bool:
        return False

    def register_file(self, fd: int) -> None:
        return None
