"""Staging slots: one host slab cut into slots, a Lease per slot, and a fair, load-first pool.

Why a slot is only ever released by a completion
------------------------------------------------
A staging slot is shared by three actors that do not know about each other: the kernel (a read or
write into the slot), the copy engine (an H2D or D2H copy reading or writing it) and the Python
coroutine that asked for the transfer. The coroutine is the one actor that can vanish at any moment:
it can be cancelled, raise, or return early. The classic corruption bug in KV offloaders is a slot
handed out again because the *coroutine* finished ("the batch returned, so its slots are free") while
the previous copy was still reading it: the next read then overwrites bytes on their way to the GPU.
The usual fix, a blocking drain at the end of every call, costs the overlap between calls.

Here a slot belongs to a :class:`Lease`, and a lease moves forward only when the actor holding it
says it is finished:

    FREE -> RESERVED -> PUMPING --(the pump hands the slot back)--> FREE

Every batch runs in a *pump* (see ``_driver.py``): a native one (``csrc/pump.c``) or the Python one
(``_pypump.py``). The batch's driver acquires a slot (RESERVED: granted, nothing submitted; it may
wait in the queue for it) and hands it to the pump (PUMPING); the free slots beside it go to the
pump directly (:meth:`SlotPool.take_for_pump`). The pump carries one block after another through
the slot, each read then copy (load) or copy then write (store), and hands the slot back only once
the last block's I/O completion *and* its copy (a memcpy, or a copy whose event has fired) are done.
The driver releases the lease then, and only then: from the pump's progress handler, which runs
after completions, never from a coroutine's ``finally``, an exception or a cancellation. A cancelled
batch stops its pump from starting blocks; the blocks in flight run to their completions, which
hand their slots back.

The single exception is a RESERVED lease (granted, never handed to a pump) whose holder was
cancelled before it used it: nobody else has seen that slot, so it goes straight back
(:meth:`SlotPool.release_unused`).

Acquisition is FIFO within a class, and loads (latency-critical) are served before stores. Every
transition is checked: a wrong one raises instead of silently sharing a slot.
"""

from __future__ import annotations

import enum
import time
from collections import deque
from typing import Any

from uring_kv._loop import LoopServices
from uring_kv._memory import HostBuffer
from uring_kv._native import counters


class LeaseState(enum.Enum):
    FREE = "free"
    RESERVED = "reserved"  # granted to a batch, not yet handed to its pump
    PUMPING = "pumping"  # a pump's, until it hands the slot back


class Kind(enum.IntEnum):
    LOAD = 0
    STORE = 1


class LeaseError(RuntimeError):
    """A lease was moved out of order: a bug that could have shared a slot between two transfers."""


class Lease:
    """Ownership of one staging slot, from its grant to a batch until its pump hands it back."""

    __slots__ = ("addr", "index", "kind", "since", "state")

    def __init__(self, index: int, addr: int) -> None:
        self.index = index  # also the registered-buffer index of the slot
        self.addr = addr
        self.state = LeaseState.FREE
        self.kind = Kind.LOAD
        self.since = 0.0

    def hand_to_pump(self) -> None:
        """RESERVED → PUMPING: the batch's pump now owns the slot until it hands it back."""
        if self.state is not LeaseState.RESERVED:
            raise LeaseError(f"slot {self.index}: expected reserved, found {self.state.value}")
        self.state = LeaseState.PUMPING

    def __repr__(self) -> str:
        return f"<Lease slot={self.index} {self.kind.name.lower()} {self.state.value}>"


class SlotPool:
    """``num_slots`` slots of ``stride`` bytes in one page-aligned slab (on huge pages where the
    kernel gives them: see :class:`HostBuffer`)."""

    def __init__(self, num_slots: int, stride: int, services: LoopServices, huge_pages: bool) -> None:
        self._svc = services
        self.slab = HostBuffer(num_slots * stride, huge_pages)
        self.stride = stride
        self.leases = [Lease(i, self.slab.addr + i * stride) for i in range(num_slots)]
        self._free: deque[Lease] = deque(self.leases)
        self._waiters: tuple[deque[Any], deque[Any]] = (deque(), deque())  # futures of Lease
        # Per kind: waiters not yet granted nor cancelled. C memory: native pumps read it before
        # they reuse a slot, and hand the slot back instead while somebody waits.
        self._waiting = counters(2)
        self.reissues = 0  # leases handed out, for tests and metrics

    @property
    def held(self) -> int:
        return len(self.leases) - len(self._free)

    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def waiting(self) -> Any:
        """The waiter counts ([loads, stores]) as C memory, for native pumps."""
        return self._waiting

    def _grant(self, lease: Lease, kind: Kind) -> Lease:
        lease.state = LeaseState.RESERVED
        lease.kind = kind
        lease.since = time.monotonic()
        self.reissues += 1
        return lease

    def _may_bypass(self, kind: Kind) -> bool:
        if kind is Kind.LOAD:
            return not self._waiting[Kind.LOAD]
        return not self._waiting[Kind.LOAD] and not self._waiting[Kind.STORE]

    def try_acquire(self, kind: Kind, limit: int) -> list[Lease]:
        """Up to ``limit`` free leases now, without jumping the queue."""
        got: list[Lease] = []
        if self._may_bypass(kind):
            while self._free and len(got) < limit:
                got.append(self._grant(self._free.popleft(), kind))
        return got

    def take_for_pump(self, kind: Kind, limit: int) -> list[Lease]:
        """Up to ``limit`` free leases handed straight to a native pump (FREE → PUMPING, i.e.
        :meth:`try_acquire` and :meth:`Lease.hand_to_pump` in one pass), without jumping the queue."""
        got: list[Lease] = []
        free = self._free
        count = min(limit, len(free))
        if count > 0 and self._may_bypass(kind):
            now, pumping = time.monotonic(), LeaseState.PUMPING
            for _ in range(count):
                lease = free.popleft()
                lease.state, lease.kind, lease.since = pumping, kind, now
                got.append(lease)
            self.reissues += count
        return got

    async def acquire(self, kind: Kind) -> Lease:
        """A RESERVED lease, in FIFO order within ``kind``; loads go first."""
        got = self.try_acquire(kind, 1)
        if got:
            return got[0]
        fut = self._svc.create_future()
        self._waiters[kind].append(fut)
        self._waiting[kind] += 1
        try:
            lease: Lease = await self._svc.wait(fut)
        except self._svc.cancelled:
            if fut.cancel():
                self._waiting[kind] -= 1
            else:  # already granted, but never used by anybody
                self.release_unused(fut.result())
            raise
        return lease

    def release_unused(self, lease: Lease) -> None:
        """Return a lease that is still RESERVED: nothing was submitted with it."""
        if lease.state is not LeaseState.RESERVED:
            raise LeaseError(f"slot {lease.index}: only a reserved lease can be returned unused, "
                             f"found {lease.state.value}")
        self._hand_on(lease)

    def release(self, lease: Lease) -> None:
        """Called once the pump handed the slot back: its last user (kernel or copy) is done."""
        if lease.state is not LeaseState.PUMPING:
            raise LeaseError(f"slot {lease.index}: cannot release a {lease.kind.name.lower()} lease "
                             f"in state {lease.state.value}")
        self._hand_on(lease)

    def _hand_on(self, lease: Lease) -> None:
        lease.state = LeaseState.FREE
        for kind in (Kind.LOAD, Kind.STORE):
            queue = self._waiters[kind]
            while queue:
                fut = queue.popleft()
                if not fut.done():
                    self._waiting[kind] -= 1
                    fut.set_result(self._grant(lease, kind))
                    return
        self._free.append(lease)

    def stats(self) -> dict[str, Any]:
        """What it shows of itself in ``Engine.stats()``: ``pinned_bytes``, ``huge_pages``."""
        return {"pinned_bytes": self.slab.size, "huge_pages": self.slab.huge_pages}

    def oldest_age(self) -> float:
        held = [lease.since for lease in self.leases if lease.state is not LeaseState.FREE]
        return time.monotonic() - min(held) if held else 0.0

    def close(self) -> None:
        """Free the slab. Only once no lease is held (the caller checks)."""
        self.slab.close()
