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

Acquisition is FIFO within a class (:class:`IOClass`), and the classes are served by urgency:
demand loads (a request waits for them now) before prefetches (loads that may be needed soon)
before stores, here and in the pumps (a pump hands its slot back, rather than starting its next
block in it, when a batch of its class or a more urgent one waits). Stores age: once the oldest
waiting store has waited ``STORE_AGING_S``, the next slot freed is its, and no other call takes a
free slot past it, so a stream of loads delays a store by at most that plus the blocks then in
flight. Every transition is checked: a wrong one raises instead of silently sharing a slot.
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
    """A batch's direction."""

    LOAD = 0
    STORE = 1


class IOClass(enum.IntEnum):
    """A call's urgency: slots and I/O room go to the lower value first."""

    DEMAND = 0  # a load a request is waiting for
    PREFETCH = 1  # a load that may be needed soon: never ahead of a demand load
    STORE = 2

    @property
    def kind(self) -> Kind:
        return Kind.STORE if self is IOClass.STORE else Kind.LOAD


STORE_AGING_S = 0.05  # a store waiting this long for a slot, or for I/O room, is served before any load


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


class _Waiter:
    """A call waiting in :meth:`SlotPool.acquire`: its future, its class, since when, for whom."""

    __slots__ = ("cls", "fut", "owner", "since")

    def __init__(self, fut: Any, cls: IOClass, owner: Any) -> None:
        self.fut, self.cls, self.owner, self.since = fut, cls, owner, time.monotonic()


class SlotPool:
    """``num_slots`` slots of ``stride`` bytes in one page-aligned slab (on huge pages where the
    kernel gives them: see :class:`HostBuffer`)."""

    def __init__(self, num_slots: int, stride: int, services: LoopServices, huge_pages: bool) -> None:
        self._svc = services
        self.slab = HostBuffer(num_slots * stride, huge_pages)
        self.stride = stride
        self.leases = [Lease(i, self.slab.addr + i * stride) for i in range(num_slots)]
        self._free: deque[Lease] = deque(self.leases)
        self._waiters: tuple[deque[_Waiter], ...] = tuple(deque() for _ in IOClass)  # per class, in arrival order
        # Per class: waiters not yet granted nor cancelled. C memory: native pumps read it before
        # they reuse a slot, and hand the slot back instead while somebody of their class or a
        # more urgent one waits.
        self._waiting = counters(len(IOClass))
        self.reissues = 0  # leases handed out, for tests and metrics

    @property
    def held(self) -> int:
        return len(self.leases) - len(self._free)

    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def waiting(self) -> Any:
        """The waiter counts per :class:`IOClass` as C memory, for native pumps."""
        return self._waiting

    def _grant(self, lease: Lease, cls: IOClass) -> Lease:
        lease.state = LeaseState.RESERVED
        lease.kind = cls.kind
        lease.since = time.monotonic()
        self.reissues += 1
        return lease

    def _store_aged(self) -> bool:
        """The oldest waiting store has waited STORE_AGING_S: it goes first."""
        queue = self._waiters[IOClass.STORE]
        while queue and queue[0].fut.done():  # cancelled
            queue.popleft()
        return bool(queue) and time.monotonic() - queue[0].since >= STORE_AGING_S

    def _may_bypass(self, cls: IOClass) -> bool:
        """Whether a call of ``cls`` may take a free slot now: nobody of its class or a more urgent
        one waits, and no store has aged."""
        waiting = self._waiting
        if any(waiting[c] for c in range(cls + 1)):
            return False
        return cls is IOClass.STORE or not waiting[IOClass.STORE] or not self._store_aged()

    def try_acquire(self, cls: IOClass, limit: int) -> list[Lease]:
        """Up to ``limit`` free leases now, without jumping the queue."""
        got: list[Lease] = []
        if self._free and self._may_bypass(cls):
            while self._free and len(got) < limit:
                got.append(self._grant(self._free.popleft(), cls))
        return got

    def take_for_pump(self, cls: IOClass, limit: int) -> list[Lease]:
        """Up to ``limit`` free leases handed straight to a native pump (FREE → PUMPING, i.e.
        :meth:`try_acquire` and :meth:`Lease.hand_to_pump` in one pass), without jumping the queue."""
        got: list[Lease] = []
        free = self._free
        count = min(limit, len(free))
        if count > 0 and self._may_bypass(cls):
            now, pumping, kind = time.monotonic(), LeaseState.PUMPING, cls.kind
            for _ in range(count):
                lease = free.popleft()
                lease.state, lease.kind, lease.since = pumping, kind, now
                got.append(lease)
            self.reissues += count
        return got

    async def acquire(self, cls: IOClass, owner: Any = None) -> Lease:
        """A RESERVED lease, in FIFO order within ``cls``, the classes by urgency (see the module
        docstring); :meth:`reclass` moves the waiting call of ``owner`` to another class."""
        got = self.try_acquire(cls, 1)
        if got:
            return got[0]
        waiter = _Waiter(self._svc.create_future(), cls, owner)
        self._waiters[cls].append(waiter)
        self._waiting[cls] += 1
        try:
            lease: Lease = await self._svc.wait(waiter.fut)
        except self._svc.cancelled:
            if waiter.fut.cancel():
                self._waiting[waiter.cls] -= 1
            else:  # already granted, but never used by anybody
                self.release_unused(waiter.fut.result())
            raise
        return lease

    def reclass(self, owner: Any, cls: IOClass) -> None:
        """Move the call of ``owner`` waiting in :meth:`acquire` (if it waits) to ``cls``, behind
        that class's waiters."""
        for old, queue in enumerate(self._waiters):
            for i, waiter in enumerate(queue):
                if waiter.owner is owner and not waiter.fut.done():
                    del queue[i]
                    self._waiting[old] -= 1
                    waiter.cls = cls
                    self._waiters[cls].append(waiter)
                    self._waiting[cls] += 1
                    return

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
        order = _AGED_ORDER if self._waiting[IOClass.STORE] and self._store_aged() else _ORDER
        for cls in order:
            queue = self._waiters[cls]
            while queue:
                fut = queue.popleft().fut
                if not fut.done():
                    self._waiting[cls] -= 1
                    fut.set_result(self._grant(lease, cls))
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


_ORDER = (IOClass.DEMAND, IOClass.PREFETCH, IOClass.STORE)
_AGED_ORDER = (IOClass.STORE, IOClass.DEMAND, IOClass.PREFETCH)
