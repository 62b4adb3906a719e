"""The io_uring backend: block I/O on a ring driven from the event loop, and the native pumps on it.

Some facts about io_uring that shape it:

* cffi releases the GIL around every C call, so submission and reaping are batched in C.
* The eventfd registered with the ring is only a hint: on each wake-up we read it, then drain the CQ
  completely. Many CQEs per tick are normal.
* With SINGLE_ISSUER|DEFER_TASKRUN only the creating thread may submit or reap, and completions are
  posted only when it asks (``io_uring_get_events``). The ring is created, used and closed on the loop
  thread; that is checked on every submit.
* Buffered reads that hit the page cache complete inline inside ``io_uring_enter``, on the loop thread.
  ``async_io=True`` sets IOSQE_ASYNC on every read SQE (and every write SQE, unless
  ``async_writes=False``) so the work goes to io-wq threads instead. Native pumps of small blocks
  may go inline anyway (``inline=True``): their C reap loop bounds the time it holds the loop
  (``NativeRing.reap_budget``) and asks for another loop turn for the rest.

Ops of the Python pump go through :meth:`UringBackend.submit` (a handler each); a native pump
(:class:`RingPump`, made by :class:`NativePumps`) runs its blocks in C on the same ring, and the
ring's reap moves it and calls its progress handler (``NativeRing``).

A ring made for the ring thread (``open_ring(thread=True)``, csrc/ringthread.c) is opened without
SINGLE_ISSUER and DEFER_TASKRUN: the thread reaps and submits refills while the loop submits its
own ops and hands slots over, both under the ring's lock. Its eventfd is then the thread's, written
only when the loop has something to take; the thread starts with the first op, once the buffers
and the file are registered.
"""

from __future__ import annotations

import contextlib
import errno
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from uring_kv._bridge import job_error
from uring_kv._io.base import Op, OpsInFlight
from uring_kv._loop import LoopServices, current_services
from uring_kv._native import BlockCopier, NativePump, NativeRing, Opcode, PumpCopies, SetupFlag, SqeFlag
from uring_kv._trace import Trace
from uring_kv._tuning import Tuning
from uring_kv.errors import UringUnavailable

FLAG_LADDER = (
    SetupFlag.SINGLE_ISSUER | SetupFlag.DEFER_TASKRUN | SetupFlag.SUBMIT_ALL,
    SetupFlag.COOP_TASKRUN | SetupFlag.SUBMIT_ALL,
    SetupFlag.SUBMIT_ALL,
    SetupFlag.NONE,
)


def flag_names(flags: int) -> str:
    names = [f.name for f in SetupFlag if f and f & flags and f.name]
    return "|".join(names) or "none"


# A ring the ring thread and the loop share: two submitters, completions posted without waiting for
# one of them to ask (no SINGLE_ISSUER, no DEFER_TASKRUN), nor for the loop's thread to enter the
# kernel (no COOP_TASKRUN: the loop may sleep in epoll while the kernel has its completions).
THREAD_FLAG_LADDER = (SetupFlag.SUBMIT_ALL, SetupFlag.NONE)


def open_ring(report: Callable[[str, BaseException], None], entries: int = 256,
              flags: Sequence[SetupFlag] | None = None, thread: bool = False) -> NativeRing:
    """A ring with the newest setup flags the kernel takes (each of ``flags`` in turn, EINVAL
    meaning too new; default: FLAG_LADDER, or THREAD_FLAG_LADDER for a ring thread's);
    :class:`UringUnavailable` naming the cause when there is none. ``report``: where the ring
    reports a pump handler that raised (the loop services'); ``thread``: for the ring thread."""
    if flags is None:
        flags = THREAD_FLAG_LADDER if thread else FLAG_LADDER
    for candidate in flags:
        try:
            return NativeRing(entries, entries * 4, candidate, report, thread)
        except OSError as exc:
            if exc.errno != errno.EINVAL:  # EINVAL: these flags are too new; anything else is final
                raise UringUnavailable(_unavailable_reason(exc)) from exc
    raise UringUnavailable("io_uring_setup refused every flag combination (EINVAL)")


def _unavailable_reason(exc: OSError) -> str:
    hint = {
        errno.EPERM: "blocked by seccomp (containers) or kernel.io_uring_disabled",
        errno.ENOSYS: "the kernel (or sandbox, e.g. gVisor) has no io_uring",
        errno.ENOMEM: "not enough locked memory for the ring (RLIMIT_MEMLOCK)",
    }.get(exc.errno or 0, "")
    name = errno.errorcode.get(exc.errno or 0, str(exc.errno))
    return f"io_uring_setup failed with {name}" + (f" ({hint})" if hint else "")


# (write, fixed buffer) → opcode, as plain ints: enum arithmetic per op is measurably slow.
_OPCODES = ((int(Opcode.READ), int(Opcode.READ_FIXED)), (int(Opcode.WRITE), int(Opcode.WRITE_FIXED)))
_FIXED_FILE = int(SqeFlag.FIXED_FILE)


class UringBackend(OpsInFlight):
    """io_uring, completions delivered through an eventfd watched by the loop (``add_reader``).

    ``ring``: the ring to run on (default: one opened here down ``flags``); ``depth``: at most this
    many ops in flight (None: the CQ's size); ``tuning``: its ``completions_per_callback``,
    ``reap_budget_us`` and ``iowq_workers`` (default: :class:`Tuning`'s defaults);
    ``store_aging_s``: a write (a store pump's slot) that has waited this long for room under the
    depth goes before any read (0: never)."""

    name = "uring"

    def __init__(self, services: LoopServices | None = None, entries: int = 256,
                 async_io: bool = False, flags: Sequence[SetupFlag] | None = None, depth: int | None = None,
                 async_writes: bool | None = None, tuning: Tuning | None = None, ring: NativeRing | None = None,
                 trace: Trace | None = None, store_aging_s: float = 0.0) -> None:
        services = services or current_services()
        super().__init__(services, trace)
        self._store_aging_s = store_aging_s
        tuning = tuning if tuning is not None else Tuning()
        self._owner = threading.get_ident()
        ring = ring if ring is not None else open_ring(services.report, entries, flags)
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
        self._thread_due = ring.thread  # the ring thread starts with the first op (see _start)
        if ring.thread:
            self.description += ", ring thread"
        else:
            self._ring.register_eventfd(self._efd)
        self._svc.add_reader(self._efd, self._on_wakeup)
        self._pending: dict[int, Op] = {}
        self._next_user_data = 1
        # Ops waiting for room in flight (the CQ's size, or the depth), by class as slots are: [0]
        # demand loads' reads, [2] prefetches' reads (Op.later), [1] writes, submitted in that order,
        # except that a write waiting store_aging_s (0: never) goes first (_written_since: when each came).
        self._backlog: tuple[deque[Op], deque[Op], deque[Op]] = (deque(), deque(), deque())
        self._written_since: deque[float] = deque()
        # Never more in flight than the CQ can hold, nor than ``depth``: ops beyond wait in the backlog.
        self._capacity = min(ring.cq_entries, depth) if depth else ring.cq_entries
        self._fixed_fd: dict[int, int] = {}
        self._completed: deque[tuple[int, int]] = deque()  # reaped, handler not yet run
        self._continuing = False  # a _run_completions callback is scheduled
        self.completions_per_callback = tuning.completions_per_callback or 1 << 30  # 0: every completion reaped
        self.wakeups = 0
        self._pump_slots = 0  # slots held by native pumps: each may have an op in flight
        self._reap_again = False  # an _on_wakeup is scheduled: the last reap ran out of budget
        ring.reap_budget(tuning.reap_budget_us * 1000)
        # pumps whose slots outnumber the depth park the rest; while a demand load's pump runs,
        # prefetches start I/O only below a quarter of the depth (Tuning.prefetch_depth)
        auto = max(1, self._capacity // 4)
        self.prefetch_depth = auto if tuning.prefetch_depth is None else tuning.prefetch_depth
        ring.pump_depth(self._capacity, store_aging_s, self.prefetch_depth)

    def pumps(self, fd: int, stride: int, blocks: BlockCopier, waiting: Any, max_slots: int, inline: bool,
              scatter: tuple[bool, bool], copies: PumpCopies | None) -> NativePumps:
        """Native pumps on this ring for one engine's batches, with what they all share: the file
        (``fd``, ``stride``), the caches (``blocks``), the slot pool's waiter counts and size, and
        the plan's choices (``inline``: no IOSQE_ASYNC on their SQEs; ``scatter``: (loads read
        straight into the caches, stores write straight from them); ``copies``: copies are native
        copier jobs, else memcpys in the reap). Made once the buffers and the file are registered."""
        sqe_flags = [0 if inline else flags for flags in self._sqe_flags]
        if fd in self._fixed_fd:
            fd, sqe_flags = self._fixed_fd[fd], [flags | _FIXED_FILE for flags in sqe_flags]
        return NativePumps(self, self._ring, fd, (sqe_flags[0], sqe_flags[1]), self.fixed_buffers, stride, blocks,
                           waiting, max_slots, scatter, copies)

    def pump_slots(self, pump: NativePump, slots: Sequence[int], addrs: Sequence[int]) -> None:
        """Give ``pump`` more slots (pool index = registered-buffer index, address); each counts
        as in flight until handed back."""
        self._check_owner()
        if self._thread_due:
            self._start_thread()
        self.inflight += len(slots)
        self._pump_slots += len(slots)
        pump.add_slots(slots, addrs, slots)

    def pump_returned(self, count: int) -> None:
        """``count`` pump slots were handed back: nothing of theirs is in flight any more, and ops
        waiting in the backlog may take their room (no CQE may come to let them in)."""
        self.inflight -= count
        self._pump_slots -= count
        self._wake_drain()
        if any(self._backlog):
            self._flush()

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

    def _start_thread(self) -> None:
        """Start the ring thread: its polls are in flight from now on, so after the registrations
        (which some kernels make wait for a ring with nothing in flight)."""
        self._thread_due = False
        self._ring.start_thread(self._efd)

    @property
    def ring_thread(self) -> bool:
        """The ring thread moves the pumps (or will, from the first op)."""
        return self._ring.thread

    def thread_wakeups(self) -> tuple[int, int]:
        """(the ring thread's wake-ups, how many of them woke the loop); (0, 0) without it."""
        return self._ring.thread_wakeups() if self._ring.threaded else (0, 0)

    def watch_copier(self, jobs: Any) -> None:
        """The ring thread collects the pumps' copy jobs of ``jobs`` (a ``CopyJobs``)."""
        self._ring.watch_copier(jobs)

    def _check_owner(self) -> None:
        if threading.get_ident() != self._owner:
            raise RuntimeError("io_uring ops must be submitted from the event loop thread that created the ring")

    def submit(self, ops: Sequence[Op]) -> None:
        self._check_owner()
        if self._thread_due:
            self._start_thread()
        self.inflight += len(ops)
        backlog = self._backlog
        for op in ops:
            backlog[1 if op.write else 2 if op.later else 0].append(op)
            if op.write:
                self._written_since.append(time.monotonic())
        self._flush()

    def _flush(self) -> None:
        room = self._capacity - len(self._pending) - self._pump_slots
        reads, writes, later = self._backlog
        if room <= 0 or not (reads or writes or later):
            return
        sqes = []
        pending, fixed_fd = self._pending, self._fixed_fd
        use_fixed = self.fixed_buffers
        written_since = self._written_since
        aged = time.monotonic() - self._store_aging_s if writes and (reads or later) and self._store_aging_s else None
        while (reads or writes or later) and room > 0:
            if writes and ((aged is not None and written_since[0] <= aged) or not (reads or later)):
                op = writes.popleft()
                written_since.popleft()
            else:
                op = reads.popleft() if reads else later.popleft()
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
        tracer = self._trace.fn
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
        tracer = self._trace.fn
        if tracer is None:
            self._completed.extend(ring.reap())  # (the pumps that moved have had their handlers run)
        else:
            done_before = ring.pump_done
            tracer("reap", None, self.io_in_flight())
            reaped = ring.reap()
            self._completed.extend(reaped)
            tracer("reaped", None, len(reaped) + ring.pump_done - done_before)
        if ring.threaded:
            for rc, where in ring.job_fails():  # a pump's copy job, handled by the ring thread: its
                if (error := job_error(rc, where)) is not None:  # blocks failed with EIO, say why
                    self._svc.report("uring_kv copy failed", error)
        if ring.more and not self._reap_again:  # completions left over for a later loop turn
            self._reap_again = True
            self._svc.call_soon(self._reap_later)
        if not self._continuing:
            self._run_completions()

    def stats(self) -> dict[str, Any]:
        """Also ``loop_wakeups`` (the loop's wake-ups for the ring), ``ring_thread_wakeups`` (the
        ring thread's, 0 without it) and ``prefetch_depth`` (while a demand load's pump runs, the
        pump I/Os in flight below which a prefetch may start one; 0: no cap)."""
        return {**super().stats(), "loop_wakeups": self.wakeups, "ring_thread_wakeups": self.thread_wakeups()[0],
                "prefetch_depth": self.prefetch_depth}

    def phases(self, clear: bool = False) -> dict[str, Any]:
        return {"pump_" + name: value for name, value in self._ring.phases(clear).items()}

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


class RingPump(NativePump):
    """A native pump on a :class:`UringBackend`'s ring, as the batch driver's pump: the slots it is
    given and hands back count as in flight for the backend (its ``drain`` waits for them)."""

    __slots__ = ("_backend",)
    copies_marked = False  # its copies are all settled when it finishes (see _driver.Pump)

    def __init__(self, backend: UringBackend, ring: NativeRing, write: bool, fd: int, sqe_flags: int,
                 fixed_buffers: bool, stride: int, blocks: BlockCopier, offsets: Any, cache_blocks: Any,
                 nblocks: int, waiting: Any, max_slots: int, scatter: bool, copies: PumpCopies | None,
                 on_progress: Callable[[], None]) -> None:
        super().__init__(ring, write, fd, sqe_flags, fixed_buffers, stride, blocks, offsets, cache_blocks, nblocks,
                         waiting, max_slots, scatter, copies, on_progress)
        self._backend = backend

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
        self.detach()


class NativePumps:
    """Native pumps of one engine on a :class:`UringBackend`'s ring (see :meth:`UringBackend.pumps`):
    what they all share, fixed when the engine opens; :meth:`pump` makes one for a batch."""

    def __init__(self, backend: UringBackend, ring: NativeRing, fd: int, sqe_flags: tuple[int, int],
                 fixed_buffers: bool, stride: int, blocks: BlockCopier, waiting: Any, max_slots: int,
                 scatter: tuple[bool, bool], copies: PumpCopies | None) -> None:
        self._backend, self._ring, self._fd, self._sqe_flags = backend, ring, fd, sqe_flags
        self._fixed_buffers, self._stride, self._blocks = fixed_buffers, stride, blocks
        self._waiting, self._max_slots, self._scatter, self._copies = waiting, max_slots, scatter, copies

    def pump(self, write: bool, offsets: Any, cache_blocks: Any, nblocks: int,
             on_progress: Callable[[], None]) -> RingPump:
        """A pump for a batch of ``nblocks`` blocks (``offsets``: uint64 file offsets, ``cache_blocks``:
        int64 cache blocks, both C arrays); ``on_progress()`` runs on the loop after each reap or
        collection of copy jobs in which it moved. Raises ``PumpsBusy`` when none is free."""
        return RingPump(self._backend, self._ring, write, self._fd, self._sqe_flags[write], self._fixed_buffers,
                        self._stride, self._blocks, offsets, cache_blocks, nblocks, self._waiting, self._max_slots,
                        self._scatter[write], self._copies, on_progress)
