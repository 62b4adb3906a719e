"""The batch driver: every batch, from admission to its end, through one path.

A batch is admitted into a *pump* (a native one, in C, or the Python one, ``_pypump.py``) with its
hazards registered whole (``_blocks.HazardTable``). The driver then waits for those hazards, drops
the blocks of a load that hold nothing to trust, and keeps the pump supplied with slots: a pump
refills its slots itself and needs the driver only to queue for a slot when it holds none (at the
start, or after handing every slot to other waiting batches). When the pump has finished, the
driver settles the batch: which blocks the file now holds, the failures, the hazards cleared, the
caller's future. Cancelling a batch's coroutine stops its pump from starting blocks; the blocks in
flight finish, and their slots come back through the pump, never through the coroutine.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any, Protocol

from uring_kv._args import ADMIT_BLOCKS, Args
from uring_kv._batch import Batch, Batches, TransferHandle, bind
from uring_kv._blocks import Contents, HazardTable
from uring_kv._copy import Copier
from uring_kv._file import BlockFile
from uring_kv._io import IOBackend, NativePumps
from uring_kv._loop import LoopServices
from uring_kv._native import PumpsBusy
from uring_kv._plan import Plan
from uring_kv._pressure import Pressure, Ticket
from uring_kv._pypump import PyPumps
from uring_kv._staging import IOClass, Kind, Lease, SlotPool
from uring_kv._trace import Trace
from uring_kv.metrics import DirectionMetrics


class Pump(Protocol):
    """A batch's pump: a native one on io_uring (``_io.uring.RingPump``) or the Python one
    (``_pypump.PyPump``). It carries blocks through the slots it is given and hands each back once
    the last block in it is done (its I/O and its copy)."""

    nblocks: int
    # its copies count down ``batch.to_enqueue`` (the Python pump), rather than being all settled
    # when it finishes (a native one)
    copies_marked: bool

    @property
    def started(self) -> int:
        """Blocks started."""

    @property
    def slots(self) -> int:
        """Slots it holds now."""

    @property
    def unstarted_slots(self) -> int:
        """Slots it holds that wait for I/O room to start their next block (under a depth cap)."""

    @property
    def finished(self) -> bool:
        """Nothing in flight and nothing more will start."""

    @property
    def stopped(self) -> bool: ...

    def stop(self) -> None:
        """Start no further block (those in flight finish)."""

    def set_class(self, cls: IOClass) -> None:
        """Its class from now on: which waiting batches it hands its slots to, and (native) its
        turn for I/O room."""

    def keep_only(self, positions: list[int]) -> None:
        """Before any block started: carry only the blocks at ``positions`` (ascending)."""

    def give(self, indices: list[int], addrs: list[int]) -> None:
        """More slots (pool index, address), PUMPING already: its own until it hands them back."""

    def take_released(self) -> list[int]:
        """Pool indices of the slots handed back since the last call."""

    def failures(self) -> list[tuple[int, int]]:
        """(block position, errno) of every block that failed."""

    def close(self) -> None: ...


@dataclass(frozen=True)
class Parts:
    """What an open engine's batches run on, built from its plan when it opens: the block file,
    the slot pool, the I/O backend, the copier, and the native pumps on the ring (None where the
    plan runs none)."""

    file: BlockFile
    pool: SlotPool
    io: IOBackend
    copier: Copier
    native: NativePumps | None


class Run:
    """A batch in its pump. ``phase_done`` stands for all its reads (load) or writes (store);
    ``deps`` are the hazards it waits for before its first block starts. Its pump is made with it,
    by ``pump_for(on_progress)``: the pump's progress handler is the driver's ``progress(run)``."""

    __slots__ = ("batch", "deps", "disk", "disk_c", "finished", "handle_event", "phase_done", "pump", "waits", "wake")

    def __init__(self, batch: Batch, disk: list[int], disk_c: Any, phase_done: Any,
                 progress: Callable[[Run], None], pump_for: Callable[[Callable[[], None]], Pump]) -> None:
        self.batch = batch
        self.disk = disk
        self.disk_c = disk_c  # the disk blocks as a C int64 array
        self.phase_done = phase_done
        self.deps: dict[int, Any] = {}  # by id: filled as the batch is registered
        self.wake: Any = None  # the driver waits on it while the pump holds slots
        self.waits = 0  # slot waits observed by the driver
        self.finished = False
        self.handle_event = True  # the caller gets a handle whose event must be made (not load/store_batch)
        self.pump = pump_for(functools.partial(progress, self))

    @property
    def cls(self) -> IOClass:
        """Its class now (a prefetch may be made a demand load while it runs)."""
        ticket = self.batch.ticket
        if ticket is not None:
            return ticket.cls
        return IOClass.STORE if self.batch.kind is Kind.STORE else IOClass.DEMAND


class Driver:
    """Admits and drives the batches of one open engine (see the module docstring), on ``parts``
    as its ``plan`` has them; ``metrics`` and ``pressure``: the engine's, per direction; ``trace``:
    Engine.trace's."""

    def __init__(self, services: LoopServices, plan: Plan, parts: Parts, contents: Contents, hazards: HazardTable,
                 metrics: dict[Kind, DirectionMetrics], pressure: Pressure, trace: Trace) -> None:
        self._svc, self._plan, self._trace = services, plan, trace
        self._file, self._pool, self._io, self._copier = parts.file, parts.pool, parts.io, parts.copier
        self._native = parts.native
        self._contents, self._hazards = contents, hazards
        self._gpu = plan.copier != "host"
        self.batches = Batches(services, parts.copier, metrics, pressure, parts.file.block_bytes)
        self._python = PyPumps(services, parts.io, parts.copier, parts.file, contents, self.batches,
                               parts.pool.waiting, plan.copy_call_blocks, plan.checksums)
        self.pumped = 0  # batches run in native pumps
        self._prefetches: dict[Ticket, Run] = {}  # prefetch runs not finished, by their call's ticket

    def stats(self) -> dict[str, Any]:
        """``active_batches``, and ``pumped_batches``: how many ran in native pumps."""
        return {"active_batches": len(self.batches.active), "pumped_batches": self.pumped}

    def close(self) -> None:
        self._python.close()

    def upgrade(self, ticket: Ticket) -> None:
        """The call of ``ticket`` (a prefetch, its ticket already of its new class) is a demand load
        from now on: if it waits for a slot, it waits with the demand loads; its pump hands slots
        to, and takes I/O room as, a demand load. The blocks it has read stay read."""
        run = self._prefetches.pop(ticket, None)
        if run is None or run.finished:
            return
        self._pool.reclass(ticket, ticket.cls)
        run.pump.set_class(ticket.cls)

    # ---- admission
    def admit(self, kind: Kind, args: Args, native: bool, ticket: Ticket | None = None) -> Generator[None, None, Run]:
        """A run for the call's batch, its hazards registered (ADMIT_BLOCKS per step). ``native``:
        a native pump may carry it (when the engine has them and one is free); ``ticket``: the
        call's place in the back-pressure books, ended with the batch."""
        disk, n = args.disk, len(args.disk)
        batch = self.batches.new(kind, n, ticket)
        if self._gpu and (args.after is not None or n):
            # Every copy of this batch, whenever enqueued, runs after the caller's work: ``after``,
            # or by default whatever the caller's current stream holds now.
            self._copier.order_after(kind is Kind.STORE, args.after)
        run = Run(batch, disk, args.disk_c, self._svc.create_future(), self._progress,
                  functools.partial(self._pump, kind, args, batch, native))
        if ticket is not None and ticket.cls is IOClass.PREFETCH:
            self._prefetches[ticket] = run  # until it ends: upgrade() finds it
        register, phase_done, deps = self._hazards.register, run.phase_done, run.deps
        for lo in range(0, n, ADMIT_BLOCKS):
            if lo:
                yield
            register(kind, disk[lo:lo + ADMIT_BLOCKS], phase_done, deps)
        return run

    def _pump(self, kind: Kind, args: Args, batch: Batch, native: bool, on_progress: Callable[[], None]) -> Pump:
        """A native pump for the batch where one may carry it and one is free, else a Python one;
        either of the call's class."""
        n = len(args.disk)
        pump: Pump | None = None
        if native and self._native is not None and n:
            try:
                pump = self._native.pump(kind is Kind.STORE, self._file.offsets(args.disk_c, n), args.gpu_c, n,
                                         on_progress)
                self.pumped += 1
            except PumpsBusy:
                pass
        if pump is None:
            pump = self._python.pump(kind, batch, args.disk, args.gpu, on_progress, self._trace.fn)
        if batch.ticket is not None:
            pump.set_class(batch.ticket.cls)
        return pump

    # ---- driving
    async def run(self, run: Run, wait: bool) -> TransferHandle:
        """Drive ``run``; ``wait``: return once the batch is complete (else once its copies are
        enqueued). Cancelled, it returns (raising) only once the blocks it started have finished."""
        run.handle_event = not wait  # awaited whole, the handle never reaches the caller
        try:
            handle = await self._drive(run)
            if wait:
                await handle
            return handle
        except self._svc.cancelled:
            # The pump stopped starting blocks. Those already handed to the kernel or the DMA engine
            # still read or write the caller's blocks: give control back only once they are done.
            await self._svc.wait_through_cancellation(run.batch.done)
            raise

    async def _drive(self, run: Run) -> TransferHandle:
        batch, pump, kind, svc, pool = run.batch, run.pump, run.batch.kind, self._svc, self._pool
        try:
            if self._plan.start_hop:
                await svc.yield_to_io()
            for dep in run.deps.values():
                if not dep.done():
                    await svc.wait(dep)
            if kind is Kind.LOAD and run.disk and self._contents.first_unheld(run.disk_c, len(run.disk)) >= 0:
                # checked now: the stores it waited for may have failed
                await svc.run_steps(self._drop_unstored(run))
            while pump.started < pump.nblocks:
                if pump.slots == 0:
                    waited = time.monotonic()
                    lease = await pool.acquire(run.cls, run.batch.ticket)
                    if run.finished:
                        # The ring thread ran the pump's last blocks while this waited (it read the
                        # pump holding no slot a moment before): a slot given now would never be
                        # taken back.
                        pool.release_unused(lease)
                        break
                    self.batches.slot_waited(kind, time.monotonic() - waited)
                    run.waits += 1
                    lease.hand_to_pump()
                    self.batches.started(batch)
                    leases = [lease]  # and whatever else is free for the blocks left, in one hand-over
                    if (left := pump.nblocks - pump.started - 1) > 0 and pool.free:
                        leases += pool.take_for_pump(run.cls, left)
                    self._grow(run, leases)
                else:
                    run.wake = svc.create_future()
                    await svc.wait(run.wake)
        finally:
            pump.stop()
            self._progress(run)
        await svc.wait(batch.enqueued)
        return TransferHandle(batch, batch.last_event, svc)

    def _drop_unstored(self, run: Run) -> Generator[None, None, None]:
        """Before its first block starts: fail the blocks of a load that hold no stored bytes
        (never stored, or their last store failed), and leave the pump the others."""
        contents, failures = self._contents, run.batch.failures
        stored = contents.stored
        keep = []
        for position, d in enumerate(run.disk):
            if position and not position % ADMIT_BLOCKS:
                yield
            if stored[d >> 6] >> (d & 63) & 1:
                keep.append(position)
            else:
                failures[d] = contents.error(d)
        run.pump.keep_only(keep)
        run.disk = [run.disk[position] for position in keep]

    def _grow(self, run: Run, leases: list[Lease]) -> None:
        """Give the pump ``leases`` (PUMPING already): their slots are its until it hands them back."""
        tracer = self._trace.fn
        if tracer is not None:
            tracer("grow", run.batch.kind, len(leases))
        run.pump.give([lease.index for lease in leases], [lease.addr for lease in leases])
        if tracer is not None:
            tracer("grown", run.batch.kind, len(leases))
        self._progress(run)

    def _progress(self, run: Run) -> None:
        """After the pump moved: release the slots it handed back, offer it free slots, finish."""
        if run.finished:
            return
        pump, pool = run.pump, self._pool
        released = pump.take_released()
        if released:
            leases, release = pool.leases, pool.release
            for index in released:
                release(leases[index])  # PUMPING → FREE: the pump's last I/O and copy in it are done
        left = pump.nblocks - pump.started - pump.unstarted_slots  # blocks no slot is meant for yet
        if left > 0 and pump.slots and pool.free and not pump.stopped:
            more = pool.take_for_pump(run.cls, left)
            if more:
                self._grow(run, more)
                return
        if pump.finished:
            self._finish(run)
        elif pump.slots == 0 and run.wake is not None and not run.wake.done():
            run.wake.set_result(None)

    def _finish(self, run: Run) -> None:
        tracer = self._trace.fn
        if tracer is not None:
            tracer("finished", run.batch.kind, run.pump.started)
        run.finished = True
        if run.batch.ticket is not None:
            self._prefetches.pop(run.batch.ticket, None)
        pump = run.pump
        pump.close()
        batch, disk, started = run.batch, run.disk, pump.started
        failures = {disk[position]: code for position, code in pump.failures()}
        pending = [dep for dep in run.deps.values() if not dep.done()]
        if pending:  # cancelled before its hazards cleared: a later batch may rely on this order
            self._svc.when_all(pending, bind(self._phase_finished, run))
        else:
            self._phase_finished(run)
        if batch.kind is Kind.STORE:  # (nothing runs in between: whoever waited for the store sees this)
            self._contents.store_done(run.disk_c, started, failures)
        if run.wake is not None and not run.wake.done():
            run.wake.set_result(None)
        # (a native pump's copies are all done: the batch's event is one that has fired)
        self.batches.pump_finished(batch, failures, started, len(disk) - started, max(0, started - run.waits),
                                   settled=not pump.copies_marked, event=run.handle_event)

    def _phase_finished(self, run: Run) -> None:
        run.phase_done.set_result(None)
        if run.batch.kind is Kind.LOAD:
            self._hazards.loads_done(run.phase_done)
        else:
            self._stores_cleared(run.disk, run.phase_done, 0)

    def _stores_cleared(self, disk: list[int], fut: Any, start: int) -> None:
        """Drop ``fut`` (done), the writes of a store, from the hazards, ADMIT_BLOCKS entries per
        loop callback: until then a call finds it done, which costs it nothing."""
        end = start + ADMIT_BLOCKS
        self._hazards.stores_done(disk[start:end], fut)
        if end < len(disk):
            self._svc.call_soon(self._stores_cleared, disk, fut, end)
