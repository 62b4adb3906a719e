"""The Python pump: a batch carried through its slots by a Python handler per block, for what a
native pump does not do.

The engine has one batch driver (``_driver.py``) and two kinds of pump it can hand slots to. A
native pump (``_native.c``) moves blocks with no Python per block; this one runs where that is not
possible:

- the thread-pool backend (no ring to pump on);
- ``checksum=True`` (a crc32c per block, summed on worker threads);
- copies that are not the native copier's (``URING_KV_DEBUG_NATIVE_COPIER=0``; CUDA without the
  staged path);
- ``load_batch_async``/``store_batch_async`` in GPU mode: they return once every copy is enqueued,
  and a native pump reports its copies only when it finishes;
- a batch beyond the native pumps a ring holds at once (``PumpsBusy``).

It keeps a native pump's interface and rules. The driver hands it slots (PUMPING leases); it
carries one block after another through each (load: read into the slot, then copy to the caches;
store: copy from the caches, then write) and hands a slot back only once the last I/O completion and
the copy event of the block in it have come: the rule of ``_staging.py``, applied per slot. Freed
slots start the next block, unless the batch is stopped, has none left, or another batch waits for a
slot (then the slot goes back, so batches share the pool in call order). Completions of one loop
iteration are handled together: one ``submit`` for the reads they start, one copy call per
``copy_call_blocks`` blocks ready.
"""

from __future__ import annotations

import errno
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from uring_kv._batch import Batch, Batches, bind
from uring_kv._blocks import Contents
from uring_kv._copy import Copier
from uring_kv._file import BlockFile
from uring_kv._io import IOBackend, Op
from uring_kv._loop import LoopServices
from uring_kv._memory import view_of
from uring_kv._staging import IOClass, Kind
from uring_kv._trace import Tracer

_Slot = tuple[int, int]  # (pool index, address)
_Ready = tuple[int, int, int]  # (pool index, address, block position)


class Summer:
    """crc32c of staged blocks (``checksum=True``) on worker threads; results come back on the loop."""

    def __init__(self, services: LoopServices, stride: int) -> None:
        # (Engine(checksum=True) has refused to be made without the crc32c package)
        self._svc = services
        self._stride = stride
        self._pool: ThreadPoolExecutor | None = None

    def sum_then(self, addr: int, then: Callable[[int | None], None]) -> None:
        """crc32c of the slot at ``addr``; ``then(crc)`` runs on the loop afterwards (None: summing
        raised, which is reported)."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(2, thread_name_prefix="uring-kv-crc")
        summing = self._pool.submit(crc32c_of, addr, self._stride)
        summing.add_done_callback(lambda done: self._svc.call_soon_threadsafe(self._summed, done, then))

    def _summed(self, done: Future[int], then: Callable[[int | None], None]) -> None:
        exc = done.exception()
        if exc is not None:
            self._svc.report("uring_kv: summing a slot (checksum=True) failed", exc)
        then(None if exc is not None else done.result())

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()


def crc32c_of(addr: int, length: int) -> int:
    import crc32c

    view = view_of(addr, length)
    try:
        return int(crc32c.crc32c(view))
    finally:
        view.release()


class PyPumps:
    """What every Python pump of an open engine shares: its loop, I/O backend, copier, file,
    contents, batches' books, the slot pool's waiter counts, the blocks per copy call and, with
    ``checksum``, the crc32c summer; :meth:`pump` makes one for a batch."""

    def __init__(self, services: LoopServices, io: IOBackend, copier: Copier, file: BlockFile, contents: Contents,
                 batches: Batches, waiting: Any, copy_call_blocks: int, checksum: bool) -> None:
        self.services, self.io, self.copier, self.file, self.contents = services, io, copier, file, contents
        self.batches, self.waiting, self.copy_call_blocks = batches, waiting, copy_call_blocks
        self.summer = Summer(services, file.stride) if checksum else None

    def pump(self, kind: Kind, batch: Batch, disk: list[int], cache_blocks: list[int],
             on_progress: Callable[[], None], tracer: Tracer | None) -> PyPump:
        """A pump for ``batch`` (blocks ``disk[i]`` ↔ ``cache_blocks[i]``); ``on_progress()`` runs on the
        loop when it handed slots back or finished; ``tracer``: Engine.trace's, or None."""
        return PyPump(self, kind, batch, disk, cache_blocks, on_progress, tracer)

    def close(self) -> None:
        if self.summer is not None:
            self.summer.close()


class PyPump:
    """One batch's blocks through the slots it is given; see the module docstring."""

    copies_marked = True  # its copies count down ``batch.to_enqueue``; the copier marks the last one

    def __init__(self, kit: PyPumps, kind: Kind, batch: Batch, disk: list[int], cache_blocks: list[int],
                 on_progress: Callable[[], None], tracer: Tracer | None) -> None:
        self._kind = kind
        self._write = kind is Kind.STORE
        self._cls = IOClass.STORE if self._write else IOClass.DEMAND  # set_class() may change it
        self._batch, self._batches, self._svc = batch, kit.batches, kit.services
        self._io, self._copier = kit.io, kit.copier
        self._file, self._contents, self._summer = kit.file, kit.contents, kit.summer
        self._disk, self._cache = disk, cache_blocks
        self._waiting, self._step, self._on_progress = kit.waiting, kit.copy_call_blocks, on_progress
        # Engine.trace's tracer when the batch was admitted: block events (count: the block's
        # position in its batch) and copy calls
        self.tracer = tracer
        self.nblocks = len(disk)
        self._next = 0  # blocks started
        self._held = 0  # slots held
        self._stop = False
        self._closed = False
        self._scheduled = False
        self._idle: list[_Slot] = []  # held slots free for the next block
        self._ready: list[_Ready] = []  # blocks whose copy is to be enqueued
        self._released: list[int] = []
        self._failed: list[tuple[int, int]] = []

    # ---- the pump interface (see NativePump)
    def set_class(self, cls: IOClass) -> None:
        self._cls = cls

    @property
    def started(self) -> int:
        return self._next

    @property
    def slots(self) -> int:
        return self._held

    unstarted_slots = 0  # the backend queues I/O beyond its depth: a slot never waits to start

    @property
    def finished(self) -> bool:
        return not self._held and (self._stop or self._next >= self.nblocks)

    @property
    def stopped(self) -> bool:
        return self._stop

    def stop(self) -> None:
        self._stop = True
        if self._idle:
            self._schedule()

    def keep_only(self, positions: list[int]) -> None:
        if self._next:
            raise RuntimeError("keep_only() after a block started")
        self._disk = [self._disk[p] for p in positions]
        self._cache = [self._cache[p] for p in positions]
        self.nblocks = len(positions)

    def give(self, indices: list[int], addrs: list[int]) -> None:
        self._held += len(indices)
        self._idle.extend(zip(indices, addrs, strict=True))
        self._start()

    def take_released(self) -> list[int]:
        got, self._released = self._released, []
        return got

    def failures(self) -> list[tuple[int, int]]:
        return list(self._failed)

    def close(self) -> None:
        self._closed = True

    # ---- moving blocks
    def _start(self) -> None:
        """A block into every idle slot (or the slot back), the reads in one submit."""
        idle, self._idle = self._idle, []
        ops = []
        file, disk = self._file, self._disk
        for index, addr in idle:
            if self._stop or self._next >= self.nblocks:
                self._held -= 1
                self._released.append(index)
                continue
            position = self._next
            self._next += 1
            if self.tracer is not None:
                self.tracer("block_start", self._kind, position)
            if self._write:
                self._ready.append((index, addr, position))
            else:
                ops.append(Op(False, file.fd, addr, file.stride, file.offset(disk[position]),
                              bind(self._on_read, index, addr, position), index,
                              later=self._cls is IOClass.PREFETCH))
        if ops:
            self._io.submit(ops)
        if self._ready:
            self._enqueue_copies()

    def _enqueue_copies(self) -> None:
        group, self._ready = self._ready, []
        step, cache, tracer = self._step, self._cache, self.tracer
        if tracer is not None:
            for _, _, position in group:
                tracer("block_copy", self._kind, position)
            tracer("copy", self._kind, len(group))
        for first in range(0, len(group), step):
            chunk = group[first:first + step]
            self._copier.copy(self._write, [addr for _, addr, _ in chunk], [cache[p] for _, _, p in chunk],
                              bind(self._on_copied, chunk))
        if tracer is not None:
            tracer("copy_queued", self._kind, len(group))
        self._batches.enqueued_some(self._batch, len(group), True)

    def _schedule(self) -> None:
        if not self._scheduled:
            self._scheduled = True
            self._svc.call_soon(self._flush)

    def _flush(self) -> None:
        """Once per loop iteration with completions: start blocks in the freed slots, enqueue the
        copies of the blocks read, tell the driver when slots went back or the pump finished."""
        self._scheduled = False
        if self._idle:
            self._start()
        if self._ready:
            self._enqueue_copies()
        if (self._released or self.finished) and not self._closed:
            self._on_progress()

    def _slot_free(self, index: int, addr: int) -> None:
        """The block in this slot is done (its last I/O and copy have completed)."""
        waiting, cls = self._waiting, self._cls
        # a batch of its class or a more urgent one waits: let it have the slot
        if waiting[0] or (cls and waiting[1]) or (cls is IOClass.STORE and waiting[2]):
            self._held -= 1
            self._released.append(index)
        else:
            self._idle.append((index, addr))
        self._schedule()

    def _fail(self, index: int, addr: int, position: int, code: int) -> None:
        self._failed.append((position, code))
        self._slot_free(index, addr)

    # Completion handlers
    def _on_read(self, index: int, addr: int, position: int, res: int) -> None:
        if res != self._file.stride:
            self._batches.enqueued_some(self._batch, 1, False)
            self._fail(index, addr, position, -res if res < 0 else errno.EIO)
            return
        if self.tracer is not None:
            self.tracer("block_read", self._kind, position)
        if self._summer is not None and (expected := self._contents.sums.get(self._disk[position])) is not None:
            self._summer.sum_then(addr, bind(self._verified, index, addr, position, expected))
            return
        self._ready.append((index, addr, position))
        self._schedule()

    def _verified(self, index: int, addr: int, position: int, expected: int, crc: int | None) -> None:
        if crc is None or crc != expected:  # None: could not be summed, unverified rather than known bad
            self._batches.enqueued_some(self._batch, 1, False)
            self._fail(index, addr, position, errno.EIO if crc is None else errno.EBADMSG)
            return
        self._ready.append((index, addr, position))
        self._schedule()

    def _on_copied(self, chunk: list[_Ready], error: BaseException | None = None) -> None:
        if error is not None:  # the copier could not enqueue them (it waited for what it did enqueue)
            self._svc.report("uring_kv copy failed", error)
            for index, addr, position in chunk:
                self._fail(index, addr, position, errno.EIO)
            return
        if self.tracer is not None:
            for _, _, position in chunk:
                self.tracer("block_copied", self._kind, position)
        if not self._write:
            for index, addr, _ in chunk:
                self._slot_free(index, addr)
            return
        if self._summer is None:
            self._write_out(chunk, None)
            return
        # Sum the staged bytes off the loop first; the slots stay this pump's meanwhile.
        sums: dict[int, int | None] = {}

        def summed(position: int, crc: int | None) -> None:
            sums[position] = crc  # None (summing failed, reported): written unsummed, never verified
            if len(sums) == len(chunk):
                self._write_out(chunk, sums)

        for _, addr, position in chunk:
            self._summer.sum_then(addr, bind(summed, position))

    def _write_out(self, chunk: list[_Ready], sums: dict[int, int | None] | None) -> None:
        file, disk = self._file, self._disk
        if self.tracer is not None:
            for _, _, position in chunk:
                self.tracer("block_write", self._kind, position)
        self._io.submit([Op(True, file.fd, addr, file.stride, file.offset(disk[position]),
                            bind(self._on_written, index, addr, position, sums), index)
                         for index, addr, position in chunk])

    def _on_written(self, index: int, addr: int, position: int, sums: dict[int, int | None] | None,
                    res: int) -> None:
        if res != self._file.stride:
            self._fail(index, addr, position, -res if res < 0 else errno.EIO)
            return
        if self.tracer is not None:
            self.tracer("block_written", self._kind, position)
        if sums is not None:
            d, crc = self._disk[position], sums[position]
            if crc is None:
                self._contents.sums.pop(d, None)  # written unsummed: nothing to verify against
            else:
                self._contents.sums[d] = crc
        self._slot_free(index, addr)
