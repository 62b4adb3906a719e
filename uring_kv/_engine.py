"""The engine: its public methods, argument checks and lifecycle. Orchestration only.

It never calls the kernel or CUDA itself: reads and writes go through an ``IOBackend``, copies through a
copier, both driven by the batch driver (``_driver.py``) through pumps; leases move only in the
pumps' completions (see ``_staging``). ``open()`` computes the engine's plan once (``_plan.py``) and
builds the parts from it. A call is checked, then admitted (its hazards registered, in call order),
then driven. Everything after a block's submission is driven by completions, so cancelling a call
stops *new* submissions but never frees a slot that the kernel or the DMA engine still uses. What it
shows of itself (metrics, stats) each part reports, and the engine puts together.
"""

from __future__ import annotations

import contextlib
import functools
import os
import warnings
from collections import deque
from collections.abc import Callable, Generator, Mapping, Sequence
from typing import Any

from uring_kv._args import check_call, check_disk_size, index_bytes
from uring_kv._batch import TransferHandle
from uring_kv._blocks import Contents, HazardTable
from uring_kv._bridge import Bridge
from uring_kv._copy import CudaCopier, HostCopier, staged_kernel_preparer, staged_path
from uring_kv._cuda import host_register, host_unregister
from uring_kv._driver import Driver, Parts, Run
from uring_kv._file import BlockFile
from uring_kv._io import IOBackend, NativePumps, UringBackend, backend_for, ring_for
from uring_kv._layout import CacheLayout
from uring_kv._loop import LoopServices, OpenClose, current_services
from uring_kv._native import BlockCopier, PumpCopies, bitmap
from uring_kv._plan import Geometry, Plan, make_plan
from uring_kv._prefetch import Prefetch
from uring_kv._pressure import Pressure, Ticket, class_budgets
from uring_kv._staging import STORE_AGING_S, IOClass, Kind, SlotPool
from uring_kv._trace import Trace
from uring_kv._tuning import Tuning
from uring_kv.errors import EngineClosedError
from uring_kv.metrics import DirectionMetrics

__all__ = ["Engine", "TransferHandle"]


class Engine(OpenClose):
    """Loads and stores KV-cache blocks between ``caches`` and a private file beside ``path``.

    ``path``: where the block file lives. The file never takes this name (or any): it is made
    unnamed in ``path``'s directory (resolved once, at construction), mode 0600, so no other
    process can open it and none of its bytes outlive the process, even under SIGKILL. Whatever
    exists at ``path`` is left alone.
    ``caches``: mapping name → tensor (or a sequence of tensors), all on one device, dim 0 the block
    index, each block one contiguous run of its tensor's own bytes. A disk block holds one block
    of every tensor, padded to the I/O alignment. Or a :class:`CacheLayout` made of them (the
    stores make one and hand it to their engines: the caches are checked once).
    ``num_disk_blocks``: the file's size in blocks. Loading a block that was never stored, or
    whose last store failed, fails that block (``ENODATA``, or the store's errno).
    Use as ``async with Engine(...) as engine`` (or ``await engine.open()`` … ``await engine.aclose()``),
    under asyncio or trio (directly or through anyio): ``open()`` binds the engine to the loop it runs on.

    ``num_slots``: staging slots (pinned host memory = num_slots × padded block size).
    ``io_depth``: at most this many reads and writes in flight (default: ``num_slots``). Fewer than
    the slots leaves spare slots for blocks between their I/O and the end of their copy, so a slot's
    turnaround through the copy does not take an I/O out of flight (GPU mode). In CPU mode with
    O_DIRECT and small blocks (memcpys in the reap), spare slots let a reap submit the next reads
    before it copies the blocks that just completed (``num_slots = 2 × io_depth`` while the slots
    hold at most 1 MiB).
    ``direct``: True requires O_DIRECT, False never uses it, None (default) probes and falls back.
    ``io``: 'auto' (default, or ``$URING_KV_IO``), 'uring' or 'threads'.
    ``copy_delay``: for tests: hold every copy back about this many seconds (a host sleep in CPU
    mode, a sleeping kernel on the copy stream in GPU mode), to widen race windows.
    ``tuning``: a :class:`Tuning` (default: ``Tuning.from_env()``, read here, once).
    ``checksum``: keep a crc32c of every block written and verify it on load; a mismatch fails the
    block with ``EBADMSG``. Sums live in memory, like the file itself, for the engine's lifetime.
    ``keep_file``: the file is ``path`` itself, opened if it exists (a regular file of this user,
    mode 0600, not a symlink) or created 0600, locked against other processes, never shrunk, and
    kept at close: the persistent store's file (:class:`uring_kv.BlockStore` ``persistent=True``).
    Its blocks are trusted only once :meth:`adopt` names them.
    ``budgets``: class name ("load" for demand loads, "prefetch", "store") → bytes: past that many
    bytes of the class queued and in flight, a call of it fails at once with
    :class:`~uring_kv.errors.EngineBusyError` (EBUSY) instead of queueing (a call finding nothing
    of its class pending always goes). What each class has queued and in flight, and its recent
    service rate, are in :meth:`metrics`. Slots and I/O room go to demand loads, then prefetches
    (``load_batch(..., prefetch=...)``), then stores; a store that has waited 50 ms for a slot,
    or for I/O room under the depth, goes first (``_staging.STORE_AGING_S``).
    """

    def __init__(self, caches: Any, path: str | os.PathLike[str], num_disk_blocks: int, num_slots: int = 16,
                 *, direct: bool | None = None, io: str | None = None, copy_delay: float = 0.0,
                 checksum: bool = False, io_depth: int | None = None, tuning: Tuning | None = None,
                 keep_file: bool = False, budgets: Mapping[str, int] | None = None) -> None:
        if isinstance(num_disk_blocks, bool) or not isinstance(num_disk_blocks, int) or num_disk_blocks < 1:
            raise ValueError(f"num_disk_blocks must be a positive integer, got {num_disk_blocks!r}")
        if isinstance(num_slots, bool) or not isinstance(num_slots, int) or num_slots < 1:
            raise ValueError(f"num_slots must be a positive integer, got {num_slots!r}")
        if copy_delay < 0:
            raise ValueError(f"copy_delay must be >= 0, got {copy_delay}")
        if io_depth is not None and (isinstance(io_depth, bool) or not isinstance(io_depth, int) or io_depth < 1):
            raise ValueError(f"io_depth must be a positive integer or None, got {io_depth!r}")
        self.io_depth = min(io_depth, num_slots) if io_depth is not None else num_slots
        if tuning is not None and not isinstance(tuning, Tuning):
            raise TypeError(f"tuning must be a uring_kv.Tuning, got {type(tuning).__name__}")
        self.tuning = tuning if tuning is not None else Tuning.from_env()
        self.layout = layout = CacheLayout.of(caches)
        self.names = list(layout.names)
        self.device = layout.device
        self.gpu = layout.gpu
        self.num_gpu_blocks = layout.num_rows
        self._seen_gpu = bitmap(self.num_gpu_blocks)  # scratch for the repeat checks of a call
        self.block_bytes = total = layout.block_bytes
        # Resolved once: a later chdir must not change which directory the file is made in.
        self.path = os.path.abspath(os.fspath(path))
        check_disk_size(num_disk_blocks, total)
        try:
            # what the file holds (a load of a block it does not hold fails, naming why); scratch for
            # the repeat check of a store's disk blocks
            self._contents, self._seen_disk = Contents(num_disk_blocks), bitmap(num_disk_blocks)
        except MemoryError:
            raise ValueError(f"num_disk_blocks={num_disk_blocks}: no memory for its index "
                             f"({index_bytes(num_disk_blocks)} bytes)") from None
        self.num_disk_blocks = num_disk_blocks
        self.num_slots = num_slots
        self._direct = direct
        self._io_mode = io
        self._copy_delay = copy_delay
        if checksum:
            try:
                import crc32c  # noqa: F401
            except ImportError as exc:
                raise ImportError("checksum=True needs the crc32c package (pip install crc32c)") from exc
        self.checksum = checksum
        self.keep_file = keep_file
        self._state = "new"
        self._svc: LoopServices  # the loop's services, from open()
        self._open_done: Any = None  # futures: open() finished (however), the closing finished
        self._close_done: Any = None
        self._hazards = HazardTable()
        self._admitting: deque[Any] = deque()  # futures: the calls being admitted, in call order
        self._metrics = {Kind.LOAD: DirectionMetrics(), Kind.STORE: DirectionMetrics()}
        self._pressure = Pressure(class_budgets(budgets))  # per class: queued, in flight, served, budget
        self._trace = Trace()  # Engine.trace's tracer, held by the parts open() builds
        # what open() builds, from its plan
        self.plan: Plan | None = None
        self.io: IOBackend
        self.pool: SlotPool
        self.bridge: Bridge
        self.copier: HostCopier | CudaCopier
        self._driver: Driver | None = None

    # ----------------------------------------------------------------- lifecycle
    async def open(self) -> Engine:
        if self._state != "new":
            raise RuntimeError(f"engine is {self._state}; open() is called once")
        svc = current_services()
        self._svc = svc
        self._state = "opening"
        self._open_done = svc.create_future()  # an aclose() meanwhile waits for it, then closes
        try:
            prepare = staged_kernel_preparer(self.device, self.tuning.cuda_staged) if self.gpu else None
            self.file = await svc.to_thread(self._open_file, prepare, cleanup=_close_file)
        except BaseException:
            self._state = "closed"
            self._open_done.set_result(None)
            raise
        try:
            self._open_rest(svc)
        except BaseException:
            self._release()  # nothing was submitted yet
            raise
        else:
            self._state = "open"
        finally:
            self._open_done.set_result(None)
        return self

    def _open_file(self, prepare: Callable[[], None] | None) -> BlockFile:
        """On a worker thread: create the file and, in GPU mode, build the staged-copy kernel (the
        NVRTC compile would otherwise stall the loop the first time an engine opens on a device)."""
        file = BlockFile(self.path, self.block_bytes, self.num_disk_blocks, self._direct, self.keep_file,
                         reserve=self.tuning.reserve_space)
        if prepare is not None:
            with contextlib.suppress(Exception):  # tried again by the copier, which says what failed
                prepare()
        return file

    def _open_rest(self, svc: LoopServices) -> None:
        """The plan, and the parts built from it. io_uring is asked for first (the plan depends on
        whether it runs here), then the slots and, in GPU mode, the staged path's device side."""
        tuning, file = self.tuning, self.file
        ring, io_reason = ring_for(self._io_mode or tuning.io, svc, thread=tuning.wants_ring_thread())
        io: IOBackend | None = None
        try:
            self.pool = pool = SlotPool(self.num_slots, file.stride, svc, tuning.huge_pages)
            self._host_registered = False
            if self.gpu:
                host_register(pool.slab.addr, pool.slab.size)
                self._host_registered = True
            layout = self.layout
            blocks = BlockCopier([t.data_ptr() for t in layout.tensors], layout.tensor_block_bytes, layout.offsets)
            staging, staged_error = (
                staged_path(self.device, blocks, pool.slab.addr, file.stride, self.num_slots, self.block_bytes,
                            tuning.cuda_mapped)
                if self.gpu and tuning.cuda_staged else (None, ""))
            self.plan = plan = make_plan(tuning, self._geometry(file), ring is not None, io_reason,
                                         staging is not None, staged_error, ring is not None and ring.thread,
                                         staging is not None and staging.mapped)
            io, uring = backend_for(plan, svc, ring, tuning, self._trace, store_aging_s=STORE_AGING_S)
        except BaseException:
            if ring is not None and io is None:  # (not yet the backend's)
                ring.close()
            raise
        self.io = io
        self.io.register_buffers([(lease.addr, file.stride) for lease in pool.leases])
        self.io.register_file(file.fd)
        self.bridge = Bridge(svc, self._trace)
        collect = ring.collect if ring is not None and plan.pump_copies == "jobs" else None
        if self.gpu:
            self.copier = CudaCopier(blocks, self.bridge, self.device, staging=staging, staging_error=staged_error,
                                     lanes=plan.copy_lanes, native=plan.native_copier, batch=plan.copy_batch,
                                     copier_poll_us=plan.copier_poll_us,
                                     delay=self._copy_delay, collect=collect)
        else:
            self.copier = HostCopier(blocks, self.bridge, inline_blocks=plan.inline_copy_blocks,
                                     native=plan.native_copier, delay=self._copy_delay, collect=collect,
                                     poll_us=plan.copier_poll_us)
        native = self._native_pumps(plan, uring, blocks) if uring is not None and plan.pumps else None
        if native is not None and uring is not None and uring.ring_thread and plan.pump_copies == "jobs":
            link = self.copier.link
            assert link is not None
            uring.watch_copier(link.jobs)  # the ring thread collects the pumps' copy jobs
        self._driver = Driver(svc, plan, Parts(file, pool, self.io, self.copier, native), self._contents,
                              self._hazards, self._metrics, self._pressure, self._trace)

    def _geometry(self, file: BlockFile) -> Geometry:
        # a row's address needs the file's memory alignment, its length the file's alignment
        align, memory, layout = file.alignment, file.memory_alignment, self.layout
        rows_aligned = all(int(t.data_ptr()) % memory == 0 and nbytes % align == 0
                           for t, nbytes in zip(layout.tensors, layout.tensor_block_bytes, strict=True))
        return Geometry(gpu=self.gpu, direct=file.direct, stride=file.stride, num_slots=self.num_slots,
                        io_depth=self.io_depth, tensors=len(layout.tensors), block_bytes=self.block_bytes,
                        rows_aligned=rows_aligned, checksum=self.checksum, slowed=self._copy_delay > 0)

    def _native_pumps(self, plan: Plan, uring: UringBackend, blocks: BlockCopier) -> NativePumps:
        """The native pumps on the ring; their copies are jobs for the native copier where the plan
        says so (with the device staging slot of every slot, on the staged CUDA path)."""
        copies = None
        if plan.pump_copies == "jobs":
            link = self.copier.link
            assert link is not None  # (the plan runs pumps' copies as jobs only on the native copier)
            dev_slots = self.copier.pump_dev_slots([lease.addr for lease in self.pool.leases])
            copies = PumpCopies(link.jobs, plan.copy_call_blocks, dev_slots)
        return uring.pumps(self.file.fd, self.file.stride, blocks, self.pool.waiting, self.num_slots,
                           plan.pump_inline, (plan.into_rows, plan.from_rows), copies)

    def _release(self) -> None:
        """Free whatever open() set up, last part first, each part even if an earlier one failed
        (the first failure is raised after). Nothing may be in flight any more. On the loop's
        thread, or anywhere once the loop is closed."""
        self._state = "closed"
        steps: list[Callable[[], Any]] = []
        for name in ("copier", "bridge", "io"):
            part = getattr(self, name, None)
            if part is not None:
                steps.append(part.stop if name == "bridge" else part.close)
        if getattr(self, "_host_registered", False):
            self._host_registered = False
            steps.append(functools.partial(host_unregister, self.pool.slab.addr))
        if self._driver is not None:
            steps.append(self._driver.close)
        if getattr(self, "pool", None) is not None:
            steps.append(self.pool.close)
        if getattr(self, "file", None) is not None:
            steps.append(self.file.close)
        failure: BaseException | None = None
        for step in steps:
            try:
                step()
            except BaseException as exc:
                failure = failure or exc
        if failure is not None:
            raise failure

    async def aclose(self) -> None:
        """Stop accepting work, let in-flight batches finish, wait for every I/O and copy, free all.
        Every call returns only once the engine is closed (a second one waits for the first; one
        made while ``open()`` runs waits for it, then closes). Cancelling it does not stop it half
        way: it finishes closing, then raises the cancellation. Called on another thread or event
        loop than ``open()``'s, it raises RuntimeError, unless that loop has ended and nothing is
        in flight: then it frees everything at once."""
        if self._state == "new":
            self._state = "closed"
        if self._state == "closed":
            return
        svc = self._svc
        if not svc.is_current():
            if svc.is_closed() and not self._in_flight():
                self._release()
                return
            raise RuntimeError(self._foreign("aclose()"))
        if self._state == "opening":
            await svc.wait_through_cancellation(self._open_done)
            if self._state != "open":  # open() failed, or another aclose() already began
                await self.aclose()
                return
        if self._state == "closing":
            await svc.wait_through_cancellation(self._close_done)
            return
        self._state = "closing"
        self._close_done = svc.create_future()
        try:
            await svc.run_to_completion(self._close())
        finally:
            self._close_done.set_result(None)

    async def _close(self) -> None:
        try:
            for batch in list(self._driver.batches.active if self._driver is not None else ()):
                await self._svc.wait_through_cancellation(batch.done)
            await self.io.drain()
            while self.bridge.pending or self.copier.pending:
                await self._svc.sleep(0.001)
        finally:
            if not self._in_flight():
                self._release()

    def _in_flight(self) -> int:
        """I/O ops, copies and completions the kernel, the copiers or the bridge still owe."""
        io, bridge, copier = (getattr(self, name, None) for name in ("io", "bridge", "copier"))
        return ((io.inflight if io is not None else 0) + (bridge.pending if bridge is not None else 0)
                + (copier.pending if copier is not None else 0))

    def _foreign(self, what: str) -> str:
        return (f"uring_kv Engine for {self.path}: {what} called outside the event loop (and thread) that "
                "opened it; call it from there")

    def __del__(self) -> None:
        """An engine dropped open: free what can be freed without its loop (threads, ring, slab,
        file); with transfers still in flight, their memory and file must stay until they end."""
        if getattr(self, "_state", "closed") not in ("open", "closing"):
            return
        owed = self._in_flight()
        if owed:
            warnings.warn(f"uring_kv Engine for {self.path} was not closed, with {owed} transfers in flight: "
                          "its staging memory, ring, threads and file stay until the process exits",
                          ResourceWarning, stacklevel=1)
            return
        warnings.warn(f"uring_kv Engine for {self.path} was not closed; its threads, ring, staging memory and "
                      "file were released", ResourceWarning, stacklevel=1)
        svc = self._svc
        if svc.is_current() or svc.is_closed():
            self._release_quietly()
        else:  # another thread: the loop's watchers are removed on the loop's thread
            try:
                svc.call_soon_threadsafe(self._release_quietly)
            except RuntimeError:  # the loop has just ended
                self._release_quietly()

    def _release_quietly(self) -> None:
        try:
            self._release()
        except Exception as exc:
            warnings.warn(f"uring_kv Engine for {self.path}: releasing it failed: {exc}", ResourceWarning,
                          stacklevel=1)

    @property
    def closed(self) -> bool:
        return self._state == "closed"

    # ----------------------------------------------------------------- public API
    async def load_batch(self, disk_blocks: Sequence[int], gpu_blocks: Sequence[int], after: Any = None, *,
                         prefetch: Prefetch | None = None) -> None:
        """Read ``disk_blocks`` into ``gpu_blocks``; returns once the bytes are on the device.

        ``prefetch``: run it as a prefetch (behind every demand load for slots and I/O room, ahead
        of stores) until ``prefetch.upgrade()`` makes it a demand load, keeping the blocks read.

        GPU mode: the copies into ``gpu_blocks`` run after ``after`` (a ``torch.cuda.Event``, e.g.
        recorded after the blocks' last use), or by default after the work queued so far on the
        caller's current stream.

        If cancelled, no further block is started, and the call returns (raising CancelledError)
        only once the blocks already started have finished: after it, the engine no longer touches
        ``gpu_blocks``."""
        await self._transfer(Kind.LOAD, disk_blocks, gpu_blocks, after, native=True, wait=True, prefetch=prefetch)

    async def store_batch(self, gpu_blocks: Sequence[int], disk_blocks: Sequence[int], after: Any = None) -> None:
        """Write ``gpu_blocks`` to ``disk_blocks``; returns once the bytes are in the file.

        GPU mode: the copies out of ``gpu_blocks`` run after ``after`` (a ``torch.cuda.Event``
        recorded once the blocks are written), or by default after the work queued so far on the
        caller's current stream.

        Cancellation works as for :meth:`load_batch`: the blocks already started are written (their
        GPU bytes were already copied out) before the CancelledError propagates."""
        await self._transfer(Kind.STORE, disk_blocks, gpu_blocks, after, native=True, wait=True)

    async def load_batch_async(self, disk_blocks: Sequence[int], gpu_blocks: Sequence[int],
                               after: Any = None) -> TransferHandle:
        """Like :meth:`load_batch` but returns once every copy is enqueued (see :class:`TransferHandle`)."""
        # In GPU mode not in a native pump: its copies count as enqueued only once it is complete,
        # and this form exists to return as soon as the copies are on their stream.
        return await self._transfer(Kind.LOAD, disk_blocks, gpu_blocks, after, native=not self.gpu, wait=False)

    async def store_batch_async(self, gpu_blocks: Sequence[int], disk_blocks: Sequence[int],
                                after: Any = None) -> TransferHandle:
        """Like :meth:`store_batch` but returns once every D2H copy is enqueued; awaiting the handle
        waits for the writes."""
        return await self._transfer(Kind.STORE, disk_blocks, gpu_blocks, after, native=not self.gpu, wait=False)

    def adopt(self, sums: Mapping[int, int]) -> None:
        """Trust disk block ``d`` of a kept file (``keep_file=True``) to hold what an earlier engine
        stored there, whose crc32c was ``sums[d]``: loads of it then succeed, each verified
        (``checksum=True`` is required), a mismatch failing the block with ``EBADMSG``. Only before
        the first transfer."""
        if not self.keep_file or not self.checksum:
            raise ValueError("adopt() needs an engine with keep_file=True and checksum=True")
        transferring = self._hazards or (self._driver is not None and self._driver.batches.active)
        if self._state not in ("new", "open") or transferring:
            raise RuntimeError(f"adopt() is for an engine with no transfer yet (engine is {self._state})")
        for d in sums:
            if isinstance(d, bool) or not isinstance(d, int) or not 0 <= d < self.num_disk_blocks:
                raise ValueError(f"adopt(): disk block {d!r} is out of range [0, {self.num_disk_blocks})")
        self._contents.adopt(sums)

    def block_sums(self, disk_blocks: Sequence[int]) -> list[int | None]:
        """The crc32c of each block as last stored (``checksum=True``); None for a block that holds
        nothing to trust (never stored, its last store failed, or it could not be summed)."""
        contents = self._contents
        return [contents.sums.get(d) if contents.holds(d) else None for d in disk_blocks]

    # ----------------------------------------------------------------- admission
    async def _transfer(self, kind: Kind, disk_blocks: Any, gpu_blocks: Any, after: Any, native: bool,
                        wait: bool, prefetch: Prefetch | None = None) -> TransferHandle:
        """Admit the call (checked, its hazards registered in call order), then have the driver run
        it (``wait``: to its end, else until its copies are enqueued)."""
        if prefetch is not None and not isinstance(prefetch, Prefetch):
            raise TypeError(f"prefetch must be a uring_kv.Prefetch, got {type(prefetch).__name__}")
        try:
            count = len(disk_blocks)
        except TypeError:
            count = 0  # (the argument check refuses it)
        if kind is Kind.STORE:
            cls = IOClass.STORE
        else:
            cls = IOClass.PREFETCH if prefetch is not None and not prefetch.upgraded else IOClass.DEMAND
        ticket = self._pressure.enter(cls, count * self.block_bytes)  # EngineBusyError past the budget
        try:
            if cls is IOClass.PREFETCH and not prefetch.bind(functools.partial(self._upgrade, ticket)):  # type: ignore[union-attr]
                self._upgrade(ticket)  # upgraded just now
            run = await self._admit(kind, disk_blocks, gpu_blocks, after, native, ticket)  # ended with its batch
        except BaseException:
            self._pressure.end(ticket)  # (no batch: refused, or cancelled before admission)
            raise
        assert self._driver is not None
        if cls is not ticket.cls:  # upgraded while it was being admitted
            self._driver.upgrade(ticket)
        return await self._driver.run(run, wait)

    def _upgrade(self, ticket: Ticket) -> None:
        """A prefetch's ``upgrade()``, from any thread: its call is a demand load from now on."""
        svc = self._svc if self._state != "new" else None
        if svc is not None and not svc.is_current():
            with contextlib.suppress(RuntimeError):  # the loop has ended: so has the call
                svc.call_soon_threadsafe(self._upgrade, ticket)
            return
        if ticket.ended or ticket.cls is not IOClass.PREFETCH:
            return
        self._pressure.reclass(ticket, IOClass.DEMAND)
        if self._driver is not None:
            self._driver.upgrade(ticket)

    # A call's hazards are registered in call order, all of them before any later call's: a load
    # sees exactly the stores called before it. A batch of more than ADMIT_BLOCKS blocks is checked
    # and registered ADMIT_BLOCKS at a time, one piece per loop turn, so no single callback does
    # Python work for a whole huge batch; calls made meanwhile queue behind it (``_admitting``).
    async def _admit(self, kind: Kind, disk_blocks: Any, gpu_blocks: Any, after: Any, native: bool,
                     ticket: Ticket) -> Run:
        if self._state == "new":  # not opened: there is no loop to compare with yet
            raise EngineClosedError("engine is new")
        if not self._svc.is_current():  # before anything is taken: a slot, a hazard, a turn
            raise RuntimeError(self._foreign("load_batch()" if kind is Kind.LOAD else "store_batch()"))
        steps = self._admission(kind, disk_blocks, gpu_blocks, after, native, ticket)
        queue, turn = self._admitting, None
        if queue:  # earlier calls are still being admitted: wait for them, in order
            turn = self._svc.create_future()
            queue.append(turn)
            try:
                while queue[0] is not turn:
                    await self._svc.wait(queue[0])
            except BaseException:
                self._end_turn(turn)
                raise
        try:
            next(steps)  # the common case: a small batch is admitted in this one step
        except StopIteration as stop:
            self._end_turn(turn)
            return stop.value  # type: ignore[no-any-return]
        except BaseException:
            self._end_turn(turn)
            raise
        if turn is None:
            turn = self._svc.create_future()
            queue.appendleft(turn)
        try:
            return await self._svc.run_steps(steps)
        finally:
            self._end_turn(turn)

    def _end_turn(self, turn: Any) -> None:
        if turn is not None:
            self._admitting.remove(turn)
            turn.set_result(None)

    def _admission(self, kind: Kind, disk_blocks: Any, gpu_blocks: Any, after: Any, native: bool,
                   ticket: Ticket) -> Generator[None, None, Run]:
        """Check the call, then register its hazards (yielding between pieces of a large batch)."""
        if self._state != "open":
            raise EngineClosedError(f"engine is {self._state}")
        args = yield from check_call(disk_blocks, gpu_blocks, after, kind is Kind.STORE, self.num_disk_blocks,
                                     self.num_gpu_blocks, self._seen_disk, self._seen_gpu, self.gpu)
        if self._state != "open":  # closed while a large call was being checked
            raise EngineClosedError(f"engine is {self._state}")
        assert self._driver is not None
        return (yield from self._driver.admit(kind, args, native, ticket))

    # ----------------------------------------------------------------- what it shows of itself
    def _gauges(self) -> dict[str, Any]:
        """What is held or in flight right now (all zero before open() and once closed)."""
        if self._driver is None or self._state == "closed":
            return {"leases_held": 0, "io_inflight": 0, "copies_pending": 0, "oldest_lease_age_s": 0.0}
        return {"leases_held": self.pool.held, "io_inflight": self.io.inflight,
                "copies_pending": self.bridge.pending + self.copier.pending,
                "oldest_lease_age_s": self.pool.oldest_age()}

    def metrics(self) -> dict[str, Any]:
        """A snapshot: per direction (``load``, ``store``) bytes, blocks, failures, cancelled blocks,
        batches and histograms of batch latency and slot wait (prefetches count as loads there);
        per class (``load``: demand loads, ``prefetch``, ``store``) its back-pressure: calls and
        bytes queued (no block started yet) and in flight, the bytes per second served over the
        last second (``rate_bytes_s``), calls refused by its budget and the budget (0: none); gauges
        for leases held, copies pending, I/O in flight and the oldest lease's age."""
        pressure, metrics = self._pressure, self._metrics
        snapshot: dict[str, Any] = {
            "load": {**metrics[Kind.LOAD].snapshot(), **pressure.snapshot(IOClass.DEMAND)},
            "store": {**metrics[Kind.STORE].snapshot(), **pressure.snapshot(IOClass.STORE)},
            "prefetch": pressure.snapshot(IOClass.PREFETCH)}
        snapshot.update(self._gauges())
        return snapshot

    def stats(self) -> dict[str, Any]:
        """The gauges of :meth:`metrics`, the number of active batches, how many batches ran in
        native pumps, and what the engine chose here: I/O path, copy path, O_DIRECT, how the file is
        kept unnamed, fixed buffers, pinned bytes, whether the slots were advised onto huge pages
        (``huge_pages``), event loop, and whether pumped loads read straight
        into the caches and pumped stores write straight from them (``loads_into_caches``,
        ``stores_from_caches``: CPU mode, buffered or with every piece aligned), the
        :class:`Tuning` in force (``tuning``, a dict) and the plan made from it at ``open()``
        (``plan``, a dict: every choice of the data path, see ``docs/design.md``). ``direct_reason``:
        why the file is buffered ('' under O_DIRECT); ``stride``: bytes a block takes in the file
        (block ``d`` at ``d * stride``); ``reserved``: whether the whole file was allocated at open
        (``Tuning.reserve_space``), and ``reserve_reason`` why not ('' when it was). Once open."""
        driver, plan = self._driver, self.plan
        if driver is None or plan is None:
            raise RuntimeError(f"uring_kv Engine for {self.path}: stats() once open() has run")
        return {**self._gauges(), **driver.stats(), **self.io.stats(), **self.copier.stats(), **self.file.stats(),
                **self.pool.stats(), "io_depth": self.io_depth, "loop": self._svc.name,
                "loads_into_caches": plan.into_rows,
                "stores_from_caches": plan.from_rows, "tuning": self.tuning.as_dict(), "plan": plan.as_dict()}

    def fileno(self) -> int:
        """The block file's descriptor (block ``d`` at ``d * stats()["stride"]``), for tools that read
        it beside the engine, such as the bench's peers; valid while the engine is open."""
        return int(self.file.fd)

    def slot_phases(self, clear: bool = False) -> dict[str, Any]:
        """Diagnostics (for timing studies; may change): where the native pumps' slots and the
        native copier's jobs spent their time since ``open()`` or the last ``clear``:
        ``pump_io`` and ``pump_copy`` (a slot's I/O, submitted → completed, and its copy, due →
        the job collected: ``{"count", "mean_us"}``), and ``copy_jobs`` per direction (``load``,
        ``store``: ``jobs``, ``blocks``, mean µs per job ``queued_us`` → ``enqueue_us`` →
        ``run_us`` (the GPU and the bridge) → ``handover_us``). Keys are absent where the part
        does not run (no io_uring, no native copier)."""
        if self._driver is None:
            raise RuntimeError(f"uring_kv Engine for {self.path}: slot_phases() once open() has run")
        return {**self.io.phases(clear), **self.copier.phases(clear)}

    def delivery_times(self, clear: bool = False) -> list[int]:
        """Diagnostics (may change): ns from each finished copy (CUDA event or copier job) to the
        loop taking it, the last 100,000 (not the native pumps' jobs the ring thread takes);
        ``clear`` empties the record after reading it."""
        times = list(self.bridge.delivery_ns)
        if clear:
            self.bridge.delivery_ns.clear()
        return times

    def trace(self, tracer: Callable[[str, Kind | None, int], None] | None) -> None:
        """Diagnostics (for timing studies; may change): ``tracer(event, kind, count)`` runs on the
        loop's thread at these points (``None`` stops it; it may be set before or after ``open()``):

        ========================  ======  =====================================================
        event                     kind    count
        ========================  ======  =====================================================
        ``grow`` / ``grown``      batch   slots given to a batch's pump; before, and after its
                                          first I/O was submitted
        ``finished``              batch   blocks the batch's pump started
        ``submit``/``submitted``  None    io_uring: SQEs about to be submitted; after, the
                                          reads and writes in flight, not yet reaped
        ``reap`` / ``reaped``     None    io_uring wake-up: I/Os in flight before the reap;
                                          after, completions it found (pumps' included)
        ``collect``/``collected`` None    native copier: jobs pending; after, jobs taken
        ``copy``/``copy_queued``  batch   Python pump: blocks whose copies it queues, around
                                          the copier calls
        ``block_*``               batch   Python pump, a block's position in its batch:
                                          ``start``, ``read`` (handled), ``copy`` (queued),
                                          ``copied`` (done), ``write`` (submitted), ``written``
        ========================  ======  =====================================================

        Native pumps (the default) report only the first six; ``URING_KV_DEBUG_PUMP=0`` runs every
        batch in the Python pump. A tracer that raises breaks the batch it ran in."""
        self._trace.fn = tracer


def _close_file(file: BlockFile) -> None:
    file.close()
