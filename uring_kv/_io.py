"""Block I/O backends: io_uring on the event loop, or a thread pool doing preadv/pwritev.

Both serve one interface, :class:`IOBackend`: ``submit()`` a batch of :class:`Op` and each op's
``on_done(res)`` is later called *on the loop thread* with the byte count or ``-errno``. An op, and
the memory it names, belongs to the kernel (or the worker thread) until ``on_done`` runs; nothing here
frees or reuses a buffer early, and a cancelled awaiter does not change that.

Some facts about io_uring that shape the ring backend:

* cffi releases the GIL around every C call, so submission and reaping are batched in C.
* The eventfd registered with the ring is only a hint: on each wake-up we read it, then drain the CQ
  completely. Many CQEs per tick are normal.
* With SINGLE_ISSUER|DEFER_TASKRUN only the creating thread may submit or reap, and completions are
  posted only when it asks (``io_uring_get_events``). The ring is created, used and closed on the loop
  thread; that is checked on every submit.
* Buffered reads that hit the page cache complete inline inside ``io_uring_enter``, on the loop thread.
  ``async_io=True`` sets IOSQE_ASYNC on every read SQE (and every write SQE, unless
  ``async_writes=False``) so the work goes to io-wq threads instead. Native pumps of small blocks
  may go inline anyway (``pump(inline=True)``): their C reap loop bounds the time it holds the loop
  (``reap_budget_ns``) and asks for another loop turn for the rest.
"""

from __future__ import annotations

import contextlib
import errno
import os
import threading
import warnings
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

from uring_kv._loop import LoopServices, current_services
from uring_kv._memory import view_of
from uring_kv._native import (
    BlockCopier,
    CopyJobs,
    NativePump,
    NativeRing,
    Opcode,
    PumpCopies,
    SetupFlag,
    SqeFlag,
    os_error,
)
from uring_kv._tuning import Tuning
from uring_kv.errors import UringUnavailable


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


def check_result(res: int, expected: int, what: str) -> None:
    """Raise for a failed (negative) or short result; the one place results become exceptions."""
    if res < 0:
        raise os_error(res, what)
    if res != expected:
        raise OSError(errno.EIO, f"{what}: short transfer ({res} of {expected} bytes)")


class PumpRing(Protocol):
    """What a backend that runs native pumps offers besides :class:`IOBackend` (io_uring's; see
    :class:`UringBackend` for each method)."""

    def pump(self, write: bool, fd: int, stride: int, blocks: BlockCopier, offsets: Any, cache_blocks: Any,
             nblocks: int, waiting: Any, max_slots: int, on_progress: Callable[[], None], inline: bool = False,
             scatter: bool = False, copies: PumpCopies | None = None) -> RingPump: ...

    def copies_done(self, jobs: CopyJobs) -> list[tuple[int, int, int, int]]: ...


class RingPump(NativePump):
    """A native pump on a :class:`UringBackend`'s ring, as the batch driver's pump: the slots it is
    given and hands back count as in flight for the backend (its ``drain`` waits for them)."""

    __slots__ = ("_backend",)
    _backend: UringBackend
    copies_marked = False  # its copies are all settled when it finishes (see _driver.Pump)

    def give(self, indices: list[int], addrs: list[int]) -> None:
        """More slots (pool index = registered-buffer index, address); each counts as in flight
        until handed back."""
        self._backend.pump_slots(self, indices, addrs)

    def take_released(self) -> list[int]:
        released = super().take_released()
        if released:
            self._backend.pump_returned(len(released))
        return released

    def close(self) -> None:
        self._backend.pump_done(self)


class IOBackend(ABC):
    """What the engine needs from an I/O path. Methods are called on the event loop thread."""

    name: str
    description: str

    def __init__(self, services: LoopServices | None) -> None:
        self._svc = services or current_services()
        self.inflight = 0
        self.fixed_buffers = False
        self._idle: Any = None  # a future while drain() waits
        # Engine.trace's tracer (diagnostics): the ring's submissions and reaps, see UringBackend
        self.tracer: Callable[[str, Any, int], None] | None = None

    def pump_ring(self) -> PumpRing | None:
        """This backend as a ring that runs native pumps, or None (its batches run in the Python pump)."""
        return None

    @abstractmethod
    def submit(self, ops: Sequence[Op]) -> None:
        """Start every op; each one's ``on_done`` runs exactly once, later, on the loop thread."""

    def register_buffers(self, regions: Sequence[tuple[int, int]]) -> bool:
        """Offer memory regions for fixed-buffer I/O; True when ops may name them by index."""
        return False

    def register_file(self, fd: int) -> None:
        """Offer an fd for fixed-file I/O (an optimisation; ops keep naming the real fd)."""
        return None

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

    @abstractmethod
    def close(self) -> None:
        """Release the backend. Raises RuntimeError while ops are in flight (their memory is still in use)."""

    async def transfer(self, write: bool, fd: int, addr: int, length: int, offset: int,
                       buf_index: int = -1, keep: object = None) -> int:
        """Convenience: one op, awaited. Cancelling the awaiter leaves the op running to its completion."""
        fut = self._svc.create_future()
        self.submit([Op(write, fd, addr, length, offset, fut.set_result, buf_index, keep)])
        res: int = await self._svc.wait(fut)
        check_result(res, length, f"{'write' if write else 'read'} of {length} bytes at offset {offset}")
        return res


_FLAG_LADDER = (
    SetupFlag.SINGLE_ISSUER | SetupFlag.DEFER_TASKRUN | SetupFlag.SUBMIT_ALL,
    SetupFlag.COOP_TASKRUN | SetupFlag.SUBMIT_ALL,
    SetupFlag.SUBMIT_ALL,
    SetupFlag.NONE,
)


def flag_names(flags: int) -> str:
    names = [f.name for f in SetupFlag if f and f & flags and f.name]
    return "|".join(names) or "none"


class UringBackend(IOBackend):
    """io_uring, completions delivered through an eventfd watched by the loop (``add_reader``)."""

    name = "uring"

    def __init__(self, services: LoopServices | None = None, entries: int = 256,
                 async_io: bool = False, flags: Sequence[SetupFlag] = _FLAG_LADDER, depth: int | None = None,
                 async_writes: bool | None = None, tuning: Tuning | None = None) -> None:
        tuning = tuning if tuning is not None else Tuning.from_env()
        per_callback = tuning.completions_per_callback
        super().__init__(services)
        self._owner = threading.get_ident()
        ring: NativeRing | None = None
        for candidate in flags:
            try:
                ring = NativeRing(entries, entries * 4, candidate)
                break
            except OSError as exc:
                if exc.errno != errno.EINVAL:  # EINVAL: these flags are too new; anything else is final
                    raise UringUnavailable(_unavailable_reason(exc)) from exc
        if ring is None:
            raise UringUnavailable("io_uring_setup refused every flag combination (EINVAL)")
        self._ring = ring
        self.setup_flags = ring.flags
        self.async_io = async_io
        self.async_writes = async_io if async_writes is None else async_writes
        # the flags of read SQEs, of write SQEs
        self._sqe_flags = tuple(int(SqeFlag.ASYNC) if on else 0 for on in (async_io, self.async_writes))
        # URING_KV_IOWQ_WORKERS caps the io-wq workers that IOSQE_ASYNC work goes to (the kernel's
        # default is 4 per CPU): page-cache copies on every core leave the loop thread waiting
        # for a core.
        workers = tuning.iowq_workers
        capped = ""
        if workers:
            with contextlib.suppress(OSError):  # kernels before 5.15: no cap
                ring.iowq_max_workers(workers)
                capped = f", io-wq <= {workers}"
        which = {(True, True): ", IOSQE_ASYNC", (True, False): ", IOSQE_ASYNC on reads",
                 (False, True): ", IOSQE_ASYNC on writes", (False, False): ""}[(async_io, self.async_writes)]
        self.description = f"io_uring ({flag_names(ring.flags)}{which}{capped})"
        self._efd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._ring.register_eventfd(self._efd)
        self._svc.add_reader(self._efd, self._on_wakeup)
        self._pending: dict[int, Op] = {}
        self._pump_handlers: dict[NativePump, Callable[[], None]] = {}
        self._next_user_data = 1
        # Ops waiting for room in flight (the CQ's size, or the depth): reads, then writes; reads go
        # first, as loads get slots first.
        self._backlog: tuple[deque[Op], deque[Op]] = (deque(), deque())
        # Never more in flight than the CQ can hold, nor than ``depth``: ops beyond wait in the backlog.
        self._capacity = min(ring.cq_entries, depth) if depth else ring.cq_entries
        self._fixed_fd: dict[int, int] = {}
        self._completed: deque[tuple[int, int]] = deque()  # reaped, handler not yet run
        self._continuing = False  # a _run_completions callback is scheduled
        self.completions_per_callback = per_callback or 1 << 30  # 0: every completion reaped
        self.wakeups = 0
        self._pump_slots = 0  # slots held by native pumps: each may have an op in flight
        self._reap_again = False  # an _on_wakeup is scheduled: the last reap ran out of budget
        ring.reap_budget_ns = tuning.reap_budget_us * 1000
        ring.pump_depth(self._capacity)  # pumps whose slots outnumber the depth park the rest

    def pump_ring(self) -> PumpRing | None:
        return self

    def pump(self, write: bool, fd: int, stride: int, blocks: BlockCopier, offsets: Any, cache_blocks: Any,
             nblocks: int, waiting: Any, max_slots: int,
             on_progress: Callable[[], None], inline: bool = False, scatter: bool = False,
             copies: PumpCopies | None = None) -> RingPump:
        """A native pump on this ring (see :class:`NativePump`, also for ``scatter`` and ``copies``);
        ``on_progress()`` runs on the loop after each reap (or collection of its copy jobs, see
        :meth:`copies_done`) in which the pump moved. ``inline``: no IOSQE_ASYNC on its SQEs even
        when the backend sets it (page-cache hits are copied inside the submission, on this
        thread). Raises :class:`PumpsBusy` when none is free."""
        sqe_flags = 0 if inline else self._sqe_flags[write]
        if fd in self._fixed_fd:
            fd, sqe_flags = self._fixed_fd[fd], sqe_flags | _FIXED_FILE
        pump = RingPump(self._ring, write, fd, sqe_flags, self.fixed_buffers, stride, blocks, offsets,
                        cache_blocks, nblocks, waiting, max_slots, scatter, copies)
        pump._backend = self
        self._pump_handlers[pump] = on_progress
        return pump

    def copies_done(self, jobs: CopyJobs) -> list[tuple[int, int, int, int]]:
        """The native copier's finished jobs (see :meth:`NativeRing.collect`): those of this ring's
        pumps are handled in C, then the handlers of the pumps that moved run."""
        self._check_owner()
        ring = self._ring
        done = ring.collect(jobs)
        self._pumps_moved(ring)
        self._flush()  # slots the pumps handed back leave room for ops in the backlog
        return done

    def _pumps_moved(self, ring: NativeRing) -> None:
        if ring.refill_error is not None:
            self._svc.report("uring_kv could not submit pump refills", ring.refill_error)
        handlers = self._pump_handlers
        for pump in ring.touched:
            # (a reap that took more than one C call may name a pump twice; the first handler
            # may have finished it)
            handler = handlers.get(pump)
            if handler is None:
                continue
            try:
                handler()
            except Exception as exc:  # one bad handler must not stop the others
                self._svc.report("uring_kv pump handler failed", exc)

    def pump_slots(self, pump: NativePump, slots: Sequence[int], addrs: Sequence[int]) -> None:
        """Give ``pump`` more slots (pool index = registered-buffer index, address); each counts
        as in flight until handed back."""
        self._check_owner()
        self.inflight += len(slots)
        self._pump_slots += len(slots)
        pump.add_slots(slots, addrs, slots)

    def pump_returned(self, count: int) -> None:
        """``count`` pump slots were handed back: nothing of theirs is in flight any more."""
        self.inflight -= count
        self._pump_slots -= count
        self._wake_drain()

    def pump_done(self, pump: NativePump) -> None:
        pump.detach()
        self._pump_handlers.pop(pump, None)

    def register_buffers(self, regions: Sequence[tuple[int, int]]) -> bool:
        if len(regions) > 1 << 16:  # an SQE names a registered buffer in 16 bits (the kernel takes 16384)
            return False
        try:
            self._ring.register_buffers(regions)
        except OSError:  # ENOMEM under a small RLIMIT_MEMLOCK, EFAULT on odd memory: plain ops work
            return False
        self.fixed_buffers = True
        return True

    def register_file(self, fd: int) -> None:
        if self._fixed_fd:
            return
        try:
            self._ring.register_files([fd])
        except OSError:
            return
        self._fixed_fd[fd] = 0

    def _check_owner(self) -> None:
        if threading.get_ident() != self._owner:
            raise RuntimeError("io_uring ops must be submitted from the event loop thread that created the ring")

    def submit(self, ops: Sequence[Op]) -> None:
        self._check_owner()
        self.inflight += len(ops)
        backlog = self._backlog
        for op in ops:
            backlog[op.write].append(op)
        self._flush()

    def _flush(self) -> None:
        room = self._capacity - len(self._pending) - self._pump_slots
        reads, writes = self._backlog
        if room <= 0 or not (reads or writes):
            return
        sqes = []
        pending, fixed_fd = self._pending, self._fixed_fd
        use_fixed = self.fixed_buffers
        while (reads or writes) and room > 0:
            op = reads.popleft() if reads else writes.popleft()
            room -= 1
            user_data = self._next_user_data
            self._next_user_data += 1
            pending[user_data] = op
            fixed = op.buf_index >= 0 and use_fixed
            fd, sqe_flags = op.fd, self._sqe_flags[op.write]
            if fd in fixed_fd:
                fd, sqe_flags = fixed_fd[fd], sqe_flags | _FIXED_FILE
            # (a slot's index names a registered buffer only when the slots are registered, which
            # caps them below the SQE's 16-bit field; unregistered slots may be more: they pass 0)
            sqes.append((_OPCODES[op.write][fixed], sqe_flags, op.buf_index if fixed else 0, fd, op.addr, op.length,
                         op.offset, user_data))
        tracer = self.tracer
        if tracer is not None:
            tracer("submit", None, len(sqes))
        self._ring.submit(sqes)
        if tracer is not None:
            tracer("submitted", None, self.io_in_flight())

    def _on_wakeup(self) -> None:
        if self._efd < 0:  # a reap scheduled for a later turn, after close()
            return
        self.wakeups += 1
        with contextlib.suppress(BlockingIOError):  # the eventfd is only a hint
            os.eventfd_read(self._efd)
        ring = self._ring
        tracer = self.tracer
        if tracer is None:
            self._completed.extend(ring.reap())
        else:
            done_before = ring.pump_done
            tracer("reap", None, self.io_in_flight())
            reaped = ring.reap()
            self._completed.extend(reaped)
            tracer("reaped", None, len(reaped) + ring.pump_done - done_before)
        if ring.more and not self._reap_again:  # completions left over for a later loop turn
            self._reap_again = True
            self._svc.call_soon(self._reap_later)
        self._pumps_moved(ring)
        if not self._continuing:
            self._run_completions()

    def io_in_flight(self) -> int:
        """Reads and writes submitted to the ring and not yet reaped, pumps' and the others'."""
        return len(self._pending) + self._ring.pump_io()[0]

    def _reap_later(self) -> None:
        self._reap_again = False
        self._on_wakeup()

    def _run_completions(self) -> None:
        """Run up to ``completions_per_callback`` handlers, then, if more are reaped, let the loop
        go round before the rest: whatever those handlers scheduled (copies, slot hand-backs, the
        batch task submitting into freed slots) runs in between, and no callback grows with the
        size of a completion round."""
        self._continuing = False
        completed, pending = self._completed, self._pending
        for _ in range(min(len(completed), self.completions_per_callback)):
            user_data, res = completed.popleft()
            self._finished(pending.pop(user_data), res)
        self._flush()
        if completed:
            self._continuing = True
            self._svc.call_soon(self._run_completions)

    def close(self) -> None:
        if self.inflight:
            raise RuntimeError(f"{self.inflight} io_uring ops still in flight; drain() first")
        if self._efd < 0:
            return
        self._svc.remove_reader(self._efd)
        self._ring.close()
        os.close(self._efd)
        self._efd = -1


# (write, fixed buffer) → opcode, as plain ints: enum arithmetic per op is measurably slow.
_OPCODES = ((int(Opcode.READ), int(Opcode.READ_FIXED)), (int(Opcode.WRITE), int(Opcode.WRITE_FIXED)))
_FIXED_FILE = int(SqeFlag.FIXED_FILE)


def _unavailable_reason(exc: OSError) -> str:
    hint = {
        errno.EPERM: "blocked by seccomp (containers) or kernel.io_uring_disabled",
        errno.ENOSYS: "the kernel (or sandbox, e.g. gVisor) has no io_uring",
        errno.ENOMEM: "not enough locked memory for the ring (RLIMIT_MEMLOCK)",
    }.get(exc.errno or 0, "")
    name = errno.errorcode.get(exc.errno or 0, str(exc.errno))
    return f"io_uring_setup failed with {name}" + (f" ({hint})" if hint else "")


class ThreadBackend(IOBackend):
    """The fallback: a thread pool doing preadv/pwritev, same interface and completion rules."""

    name = "threads"

    def __init__(self, services: LoopServices | None = None, workers: int = 8,
                 reason: str = "") -> None:
        super().__init__(services)
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


def open_backend(mode: str | None = None, *, services: LoopServices | None = None,
                 async_io: bool = False, entries: int = 256, workers: int = 8, depth: int | None = None,
                 async_writes: bool | None = None, tuning: Tuning | None = None) -> IOBackend:
    """The backend for ``mode`` ('auto', 'uring' or 'threads'; default ``tuning.io``, whose own
    default is ``Tuning.from_env()``'s: ``$URING_KV_IO`` or 'auto').

    'auto' falls back to threads with one RuntimeWarning naming the cause; 'uring' raises
    :class:`UringUnavailable` instead of falling back. ``depth``: at most this many ops in flight
    (the rest wait their turn, reads before writes); None: as many as the backend takes.
    """
    if depth:
        workers = min(workers, depth)
    tuning = tuning if tuning is not None else Tuning.from_env()
    mode = mode or tuning.io
    if mode not in ("auto", "uring", "threads"):
        raise ValueError(f"I/O mode must be 'auto', 'uring' or 'threads', got {mode!r}")
    if mode == "threads":
        return ThreadBackend(services, workers, reason="io='threads'")
    try:
        return UringBackend(services, entries, async_io, depth=depth, async_writes=async_writes, tuning=tuning)
    except UringUnavailable as exc:
        if mode == "uring":
            raise
        warnings.warn(f"uring_kv: {exc}; using the thread-pool fallback", RuntimeWarning, stacklevel=2)
        return ThreadBackend(services, workers, reason=str(exc))
