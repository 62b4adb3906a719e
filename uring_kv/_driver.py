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
from typing import Any

from uring_kv._args import ADMIT_BLOCKS, Args
from uring_kv._batch import Batch, Batches, TransferHandle, bind
from uring_kv._blocks import Contents, HazardTable
from uring_kv._copy import HostCopier
from uring_kv._file import BlockFile
from uring_kv._io import IOBackend, PumpRing, RingPump
from uring_kv._loop import LoopServices
from uring_kv._native import STAGED_MAX, BlockCopier, PumpCopies, PumpsBusy, first_unset
from uring_kv._pypump import PyPump, Summer
from uring_kv._staging import Kind, Lease, SlotPool
from uring_kv._tuning import Tuning

COPY_CALL_PIECES = 128  # most tensor×block pieces per copy call of the Python pump
PUMP_SCATTER_MAX_TENSORS = 1024  # IOV_MAX: the most iovecs one readv takes


# A batch's pump: a native one on io_uring (``_io.RingPump``) or the Python one. Both offer
# ``nblocks``, ``started``, ``slots`` (held), ``unstarted_slots``, ``finished``, ``stopped``, and
# ``stop()``, ``keep_only(positions)``, ``give(indices, addrs)``, ``take_released()``,
# ``failures()``, ``close()``; ``copies_marked``: its copies count down ``batch.to_enqueue`` (the
# Python pump) rather than being all settled when it finishes (a native one).
Pump = RingPump | PyPump


@dataclass(eq=False)
class Run:
    """A batch in its pump. ``phase_done`` stands for all its reads (load) or writes (store);
    ``deps`` are the hazards it waits for before its first block starts."""

    batch: Batch
    disk: list[int]
    deps: list[Any]
    phase_done: Any
    pump: Pump
    disk_c: Any  # the disk blocks as a C int64 array
    wake: Any = None  # the driver waits on it while the pump holds slots
    waits: int = 0  # slot waits observed by the driver
    finished: bool = False
    handle_event: bool = True  # the caller gets a handle whose event must be made (not load/store_batch)


class Driver:
    """Admits and drives the batches of one open engine (see the module docstring)."""

    def __init__(self, services: LoopServices, tuning: Tuning, file: BlockFile, pool: SlotPool, io: IOBackend,
                 copier: Any, blocks: BlockCopier, contents: Contents, hazards: HazardTable, batches: Batches,
                 gpu: bool, checksum: bool, tensors: list[Any], tensor_block_bytes: list[int]) -> None:
        self._svc, self._file, self._pool, self._io, self._copier = services, file, pool, io, copier
        self._blocks, self._contents, self._hazards, self._batches = blocks, contents, hazards, batches
        self._gpu = gpu
        self.summer = Summer(services, file.stride) if checksum else None
        staged = getattr(copier, "staged", False)
        self._copy_call_blocks = STAGED_MAX if staged else max(1, COPY_CALL_PIECES // len(tensors))
        self.pumped = 0  # batches run in native pumps
        self._start_hop = tuning.start_hop
        self.tracer: Callable[[str, Kind | None, int], None] | None = None  # see Engine.trace
        # Batches on io_uring run in native pumps unless something per block needs Python
        # (checksums). Their copies are memcpys in the reap when a block's copy may run on the loop
        # (CPU mode's inline copies; under a depth below the slot count the spare slots park, and a
        # reap refills through them before it copies) and all slots together hold at most
        # INLINE_PASS_BYTES (a pump's start, and a reap pass over a full CQ, copy every slot's block
        # on the loop: 32 × 128 KiB took 1.3 ms on the CPU machine); else jobs for the native copier
        # (GPU mode, large or slowed host copies, many slots), whose finished jobs the ring then
        # collects (their slots move on in C).
        ring = io.pump_ring() if tuning.pumps else None
        few_slots = tuning.copies_inline(len(pool.leases), file.stride)
        inline = isinstance(copier, HostCopier) and copier.inline_blocks >= 1 and few_slots
        link = copier.link
        self._pump_inline = tuning.pump_inline(len(pool.leases), file.stride)
        self._pump_copies: PumpCopies | None = None
        self.native = ring is not None and not checksum and (inline or link is not None)
        self._ring: PumpRing | None = ring if self.native else None
        if ring is not None and self.native and not inline and link is not None:
            dev_slots = copier.pump_dev_slots([lease.addr for lease in pool.leases])
            self._pump_copies = PumpCopies(link.jobs, self._copy_call_blocks, dev_slots)
            link.take = functools.partial(ring.copies_done, link.jobs)
        # Native loads read straight into the cache tensors in CPU mode: from a buffered file, or with
        # O_DIRECT where every piece of every block starts and ends on the file's alignment (rows of
        # page-aligned memory, as vLLM's and SGLang's host pools are); IOV_MAX bounds the pieces.
        align = file.alignment
        aligned = all(int(t.data_ptr()) % align == 0 and nbytes % align == 0
                      for t, nbytes in zip(tensors, tensor_block_bytes, strict=True))
        self.scatter = (not gpu and (not file.direct or aligned) and len(tensors) <= PUMP_SCATTER_MAX_TENSORS
                        and tuning.pump_scatter)

    def close(self) -> None:
        if self.summer is not None:
            self.summer.close()

    # ---- admission
    def admit(self, kind: Kind, args: Args, native: bool) -> Generator[None, None, Run]:
        """A run for the call's batch, its hazards registered (ADMIT_BLOCKS per step). ``native``:
        a native pump may carry it (when the engine has them and one is free)."""
        disk, n = args.disk, len(args.disk)
        batch = self._batches.new(kind, n)
        if self._gpu and (args.after is not None or n):
            # Every copy of this batch, whenever enqueued, runs after the caller's work: ``after``,
            # or by default whatever the caller's current stream holds now.
            self._copier.order_after(kind is Kind.STORE, args.after)
        holder: list[Run] = []

        def progress() -> None:
            self._progress(holder[0])

        pump: Pump | None = None
        if native and self._ring is not None and n:
            file, ring = self._file, self._ring
            try:
                pump = ring.pump(kind is Kind.STORE, file.fd, file.stride, self._blocks,
                                 file.offsets(args.disk_c, n), args.gpu_c, n, self._pool.waiting,
                                 len(self._pool.leases), progress, inline=self._pump_inline,
                                 scatter=kind is Kind.LOAD and self.scatter, copies=self._pump_copies)
                self.pumped += 1
            except PumpsBusy:
                pump = None
        if pump is None:
            pump = PyPump(kind, batch, self._batches, self._svc, self._io, self._copier, self._file,
                          self._contents, disk, args.gpu, self._pool.waiting, self._copy_call_blocks, self.summer,
                          progress)
            pump.tracer = self.tracer
        phase_done = self._svc.create_future()
        deps: dict[int, Any] = {}
        register = self._hazards.register
        for lo in range(0, n, ADMIT_BLOCKS):
            if lo:
                yield
            register(kind, disk[lo:lo + ADMIT_BLOCKS], phase_done, deps)
        run = Run(batch, disk, list(deps.values()), phase_done, pump, args.disk_c)
        holder.append(run)
        return run

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
            if self._start_hop:
                await svc.yield_to_io()
            for dep in run.deps:
                if not dep.done():
                    await svc.wait(dep)
            if kind is Kind.LOAD and run.disk and first_unset(run.disk_c, len(run.disk), self._contents.stored) >= 0:
                # checked now: the stores it waited for may have failed
                await svc.run_steps(self._drop_unstored(run))
            while pump.started < pump.nblocks:
                if pump.slots == 0:
                    waited = time.monotonic()
                    lease = await pool.acquire(kind)
                    self._batches.metrics[kind].slot_wait_s.observe(time.monotonic() - waited)
                    run.waits += 1
                    lease.hand_to_pump()
                    leases = [lease]  # and whatever else is free for the blocks left, in one hand-over
                    if (left := pump.nblocks - pump.started - 1) > 0 and pool.free:
                        leases += pool.take_for_pump(kind, left)
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
        tracer = self.tracer
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
            more = pool.take_for_pump(run.batch.kind, left)
            if more:
                self._grow(run, more)
                return
        if pump.finished:
            self._finish(run)
        elif pump.slots == 0 and run.wake is not None and not run.wake.done():
            run.wake.set_result(None)

    def _finish(self, run: Run) -> None:
        if self.tracer is not None:
            self.tracer("finished", run.batch.kind, run.pump.started)
        run.finished = True
        pump = run.pump
        pump.close()
        batch, disk, started = run.batch, run.disk, pump.started
        failures = {disk[position]: code for position, code in pump.failures()}
        batch.failures.update(failures)
        batch.skipped = len(disk) - started
        if batch.kind is Kind.STORE:
            contents = self._contents
            contents.written(run.disk_c, started)
            for d, code in failures.items():  # a failed write leaves no bytes to trust
                contents.unstore(d, code)
        pending = [dep for dep in run.deps if not dep.done()]
        if pending:  # cancelled before its hazards cleared: a later batch may rely on this order
            self._svc.when_all(pending, bind(self._phase_finished, run))
        else:
            self._phase_finished(run)
        self._batches.metrics[batch.kind].slot_wait_s.observe(0.0, max(0, started - run.waits))
        batch.remaining = batch.to_enqueue = 0
        if not pump.copies_marked:  # every copy is done: an event that has fired (GPU: once recorded)
            if started and run.handle_event:
                batch.last_event = self._copier.settled_event(batch.kind is Kind.STORE)
            batch.enqueued.set_result(batch.last_event)
        if run.wake is not None and not run.wake.done():
            run.wake.set_result(None)
        self._batches.check(batch)

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
