"""The engine: its public methods, argument checks and lifecycle. Orchestration only.

It never calls the kernel or CUDA itself: reads and writes go through an ``IOBackend``, copies through a
copier, both driven by the batch driver (``_driver.py``) through pumps; leases move only in the
pumps' completions (see ``_staging``). A call is checked, then admitted (its hazards registered, in
call order), then driven. Everything after a block's submission is driven by completions, so
cancelling a call stops *new* submissions but never frees a slot that the kernel or the DMA engine
still uses.
"""

from __future__ import annotations

import contextlib
import functools
import os
import warnings
from collections import deque
from collections.abc import Callable, Generator, Mapping, Sequence
from typing import Any

from uring_kv._args import check_call, check_disk_size, index_bytes, normalise_caches
from uring_kv._batch import Batches, TransferHandle
from uring_kv._blocks import Contents, HazardTable
from uring_kv._bridge import Bridge
from uring_kv._copy import CudaCopier, HostCopier, staged_kernel_preparer
from uring_kv._cuda import host_register, host_unregister
from uring_kv._driver import Driver, Run
from uring_kv._file import BlockFile
from uring_kv._io import IOBackend, open_backend
from uring_kv._loop import OpenClose, current_services
from uring_kv._native import BlockCopier, bitmap
from uring_kv._observe import Observed
from uring_kv._staging import Kind, SlotPool
from uring_kv._tuning import Tuning
from uring_kv.errors import EngineClosedError

__all__ = ["Engine", "TransferHandle"]


class Engine(Observed, OpenClose):
    """Loads and stores KV-cache blocks between ``caches`` and a private file beside ``path``.

    ``path``: where the block file lives. The file never takes this name (or any): it is made
    unnamed in ``path``'s directory (resolved once, at construction), mode 0600, so no other
    process can open it and none of its bytes outlive the process, even under SIGKILL. Whatever
    exists at ``path`` is left alone.
    ``caches``: mapping name → tensor (or a sequence of tensors), all on one device, dim 0 the block
    index, each block one contiguous run of its tensor's own bytes. A disk block holds one block
    of every tensor, padded to the I/O alignment.
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
    """

    def __init__(self, caches: Any, path: str | os.PathLike[str], num_disk_blocks: int, num_slots: int = 16,
                 *, direct: bool | None = None, io: str | None = None, copy_delay: float = 0.0,
                 checksum: bool = False, io_depth: int | None = None, tuning: Tuning | None = None,
                 keep_file: bool = False) -> None:
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
        self.names, self._tensors = normalise_caches(caches)
        self.device = self._tensors[0].device
        self.gpu = self.device.type == "cuda"
        self.num_gpu_blocks = int(self._tensors[0].shape[0])
        self._seen_gpu = bitmap(self.num_gpu_blocks)  # scratch for the repeat checks of a call
        # Bytes of one block of each tensor, from its shape: stride(0) overstates it for a tensor of
        # one block that is a slice (its stride still spans the whole parent's block).
        self._tensor_block_bytes = [t.numel() // t.shape[0] * t.element_size() for t in self._tensors]
        offsets, total = [], 0
        for nbytes in self._tensor_block_bytes:
            offsets.append(total)
            total += nbytes
        self._slot_offsets = offsets
        self.block_bytes = total
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
        self._open_done: Any = None  # futures: open() finished (however), the closing finished
        self._close_done: Any = None
        self._hazards = HazardTable()
        self._admitting: deque[Any] = deque()  # futures: the calls being admitted, in call order
        self._batches = Batches(self.block_bytes)  # the active batches and their metrics
        self._driver: Driver | None = None
        self._tracer: Callable[[str, Kind | None, int], None] | None = None

    # ----------------------------------------------------------------- lifecycle
    async def open(self) -> Engine:
        if self._state != "new":
            raise RuntimeError(f"engine is {self._state}; open() is called once")
        svc = current_services()
        self._svc = svc
        self._batches.services = svc
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
            self._open_rest()
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

    def _open_rest(self) -> None:
        tuning, stride = self.tuning, self.file.stride
        async_io, async_writes = tuning.sqe_flags(self.gpu, self.file.direct, self.num_slots, stride)
        capped = self.io_depth < self.num_slots
        self.io: IOBackend = open_backend(self._io_mode or tuning.io, services=self._svc, async_io=async_io,
                                          async_writes=async_writes, depth=self.io_depth if capped else None,
                                          tuning=tuning)
        self.pool = SlotPool(self.num_slots, stride, self._svc, tuning.huge_pages)
        self._host_registered = False
        if self.gpu:
            host_register(self.pool.slab.addr, self.pool.slab.size)
            self._host_registered = True
        self.io.register_buffers([(lease.addr, stride) for lease in self.pool.leases])
        self.io.register_file(self.file.fd)
        self.bridge = Bridge(self._svc)
        blocks = BlockCopier([t.data_ptr() for t in self._tensors], self._tensor_block_bytes, self._slot_offsets)
        self.copier: HostCopier | CudaCopier
        if self.gpu:
            self.copier = CudaCopier(blocks, self.bridge, self.device, self._copy_delay,
                                     lanes=tuning.copy_lanes or None,
                                     staging=(self.pool.slab.addr, stride, self.num_slots, self.block_bytes),
                                     native=tuning.native_copier, staged=tuning.cuda_staged, batch=tuning.cuda_batch)
        else:
            self.copier = HostCopier(blocks, self.bridge, self._copy_delay, inline_bytes=tuning.host_inline_bytes,
                                     native=tuning.native_copier)
        self._batches.copier = self.copier
        self._driver = Driver(self._svc, tuning, self.file, self.pool, self.io, self.copier, blocks, self._contents,
                              self._hazards, self._batches, self.gpu, self.checksum, self._tensors,
                              self._tensor_block_bytes)
        self._apply_tracer()

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
            for batch in list(self._batches.active):
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
    async def load_batch(self, disk_blocks: Sequence[int], gpu_blocks: Sequence[int], after: Any = None) -> None:
        """Read ``disk_blocks`` into ``gpu_blocks``; returns once the bytes are on the device.

        GPU mode: the copies into ``gpu_blocks`` run after ``after`` (a ``torch.cuda.Event``, e.g.
        recorded after the blocks' last use), or by default after the work queued so far on the
        caller's current stream.

        If cancelled, no further block is started, and the call returns (raising CancelledError)
        only once the blocks already started have finished: after it, the engine no longer touches
        ``gpu_blocks``."""
        await self._drive(await self._admit(Kind.LOAD, disk_blocks, gpu_blocks, after, True), wait=True)

    async def store_batch(self, gpu_blocks: Sequence[int], disk_blocks: Sequence[int], after: Any = None) -> None:
        """Write ``gpu_blocks`` to ``disk_blocks``; returns once the bytes are in the file.

        GPU mode: the copies out of ``gpu_blocks`` run after ``after`` (a ``torch.cuda.Event``
        recorded once the blocks are written), or by default after the work queued so far on the
        caller's current stream.

        Cancellation works as for :meth:`load_batch`: the blocks already started are written (their
        GPU bytes were already copied out) before the CancelledError propagates."""
        await self._drive(await self._admit(Kind.STORE, disk_blocks, gpu_blocks, after, True), wait=True)

    async def load_batch_async(self, disk_blocks: Sequence[int], gpu_blocks: Sequence[int],
                               after: Any = None) -> TransferHandle:
        """Like :meth:`load_batch` but returns once every copy is enqueued (see :class:`TransferHandle`)."""
        # In GPU mode not in a native pump: its copies count as enqueued only once it is complete,
        # and this form exists to return as soon as the copies are on their stream.
        return await self._drive(await self._admit(Kind.LOAD, disk_blocks, gpu_blocks, after, not self.gpu),
                                 wait=False)

    async def store_batch_async(self, gpu_blocks: Sequence[int], disk_blocks: Sequence[int],
                                after: Any = None) -> TransferHandle:
        """Like :meth:`store_batch` but returns once every D2H copy is enqueued; awaiting the handle
        waits for the writes."""
        return await self._drive(await self._admit(Kind.STORE, disk_blocks, gpu_blocks, after, not self.gpu),
                                 wait=False)

    def adopt(self, sums: Mapping[int, int]) -> None:
        """Trust disk block ``d`` of a kept file (``keep_file=True``) to hold what an earlier engine
        stored there, whose crc32c was ``sums[d]``: loads of it then succeed, each verified
        (``checksum=True`` is required), a mismatch failing the block with ``EBADMSG``. Only before
        the first transfer."""
        if not self.keep_file or not self.checksum:
            raise ValueError("adopt() needs an engine with keep_file=True and checksum=True")
        if self._state not in ("new", "open") or self._batches.active or self._hazards:
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
    # A call's hazards are registered in call order, all of them before any later call's: a load
    # sees exactly the stores called before it. A batch of more than ADMIT_BLOCKS blocks is checked
    # and registered ADMIT_BLOCKS at a time, one piece per loop turn, so no single callback does
    # Python work for a whole huge batch; calls made meanwhile queue behind it (``_admitting``).
    async def _admit(self, kind: Kind, disk_blocks: Any, gpu_blocks: Any, after: Any, native: bool) -> Run:
        if self._state == "new":  # not opened: there is no loop to compare with yet
            raise EngineClosedError("engine is new")
        if not self._svc.is_current():  # before anything is taken: a slot, a hazard, a turn
            raise RuntimeError(self._foreign("load_batch()" if kind is Kind.LOAD else "store_batch()"))
        steps = self._admission(kind, disk_blocks, gpu_blocks, after, native)
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

    def _admission(self, kind: Kind, disk_blocks: Any, gpu_blocks: Any, after: Any,
                   native: bool) -> Generator[None, None, Run]:
        """Check the call, then register its hazards (yielding between pieces of a large batch)."""
        if self._state != "open":
            raise EngineClosedError(f"engine is {self._state}")
        args = yield from check_call(disk_blocks, gpu_blocks, after, kind is Kind.STORE, self.num_disk_blocks,
                                     self.num_gpu_blocks, self._seen_disk, self._seen_gpu, self.gpu)
        if self._state != "open":  # closed while a large call was being checked
            raise EngineClosedError(f"engine is {self._state}")
        assert self._driver is not None
        return (yield from self._driver.admit(kind, args, native))

    async def _drive(self, run: Run, wait: bool) -> TransferHandle:
        assert self._driver is not None
        return await self._driver.run(run, wait)

    # ----------------------------------------------------------------- internals


def _close_file(file: BlockFile) -> None:
    file.close()
