"""A persistent block store's side (``BlockStore(persistent=True)``): the SQLite index (``_index.py``)
the in-memory index follows, and the order of its writes.

A persistent store (``persistent=True``) keeps the file at ``path`` and an SQLite index beside it
(``_index.py``), which the in-memory index follows: a key becomes visible once its row is
committed, after its write (and, with ``fsync``, after an fdatasync). A block that leaves a key
(evicted, or its load failed) is *doomed*: its row's deletion goes to the index with the next
put, and no write may touch the block before that deletion is committed (``_clearing``). Should
the deletion fail, the block is never used again in this run (``_lost``): the row may still
name it. Every block carries a crc32c (the engine's ``checksum=True``), kept in its row and
checked on every load, the first after a reopen included.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os
from typing import TYPE_CHECKING, Any

from uring_kv._index import FORMAT, Index, failure_errno
from uring_kv._loop import LoopServices
from uring_kv.errors import BlockIOError, EngineClosedError

if TYPE_CHECKING:
    from uring_kv.store import BlockStore


class Kept:
    """The persistence of one :class:`BlockStore`: its index database, the rows to delete before
    their blocks are reused, and the uses (LRU order) not yet saved."""

    def __init__(self, store: BlockStore, fsync: bool, fingerprint: str, layout: list[Any]) -> None:
        self._store = store
        self.fsync = fsync
        self.fingerprint = fingerprint
        self.layout = layout  # each tensor's name, dtype, block shape and bytes
        self.db: Index | None = None
        self.doomed: list[tuple[bytes, int]] = []  # (key, disk block) rows to delete before the block is reused
        self.clearing: dict[int, Any] = {}  # disk block → the future of its old row's deletion
        self.touched: dict[bytes, int] = {}  # key → its last use, not yet in the index
        self.clock = 0  # the next use number

    async def open(self, svc: LoopServices) -> None:
        """Open the index (its geometry checked before the block file is touched), then the engine
        on the kept file, then take the index's keys in, LRU order and all."""
        store = self._store
        engine = store.engine
        db = self.db = Index(engine.path + ".index", engine.path, self.fsync, svc)

        def still_opening() -> None:  # after each wait: aclose() may have begun meanwhile
            if store._state != "opening":
                raise EngineClosedError(f"block store {engine.path} was closed while it opened")

        try:
            await db.open(self.geometry())
            still_opening()
            await engine.open()
            still_opening()
            # The index thread reads the blocks through its own copy of the fd, made from this one
            # here, where aclose() cannot close it first (a number closed and reused meanwhile
            # would be another file).
            fd = os.dup(engine.file.fd)
            try:
                restored = await db.restore(fd, engine.file.stride, store.capacity, engine.file.created)
            finally:
                os.close(fd)
            still_opening()
            engine.adopt({disk_block: crc for _, disk_block, crc in restored.rows})
        except BaseException:
            await svc.run_to_completion(self._abandon(db))
            raise
        self.clock = restored.clock
        store._restore([(key, disk_block) for key, disk_block, _ in restored.rows])

    async def _abandon(self, db: Index) -> None:
        try:
            await self._store.engine.aclose()
        finally:
            await db.close([], [])

    def geometry(self) -> dict[str, Any]:
        """What decides how a block's bytes are read: checked against a persistent store's files."""
        return {"format": FORMAT, "fingerprint": self.fingerprint, "tensors": self.layout,
                "block_bytes": self._store.engine.block_bytes}

    async def write(self, writes: list[tuple[Any, int]], after: Any) -> dict[bytes, int]:
        """The store's write for a persistent store: the blocks' old rows deleted first, the new
        rows committed (after a sync) before the keys become visible."""
        store, db = self._store, self.db
        svc = store._svc
        assert svc is not None and db is not None
        self._flush_doomed()
        clearing = {entry.disk_block: fut for entry, _ in writes
                    if (fut := self.clearing.get(entry.disk_block)) is not None}
        failed: dict[int, int] = {}
        try:
            for disk_block, fut in clearing.items():
                await _quietly(svc, fut)
                if fut.exception() is not None:
                    self.lose(disk_block)
                    failed[disk_block] = failure_errno(fut.exception())
            todo = [(entry, row) for entry, row in writes if entry.disk_block not in failed]
            if todo:
                try:
                    await store.engine.store_batch([row for _, row in todo], [entry.disk_block for entry, _ in todo],
                                                   after)
                except BlockIOError as exc:
                    failed.update(exc.failures)
        except BaseException:  # cancelled, or refused (closing): no block of it is vouched for
            store._settle(writes, {entry.disk_block: errno.ECANCELED for entry, _ in writes})
            raise
        written = [entry for entry, _ in writes if entry.disk_block not in failed]
        rows = []
        for entry, crc in zip(written, store.engine.block_sums([entry.disk_block for entry in written]), strict=True):
            if crc is None:  # could not be summed (reported by the engine): nothing to check it by later
                failed[entry.disk_block] = errno.EIO
            else:
                rows.append((entry.key, entry.disk_block, crc, self._tick()))
        if rows:
            committed = db.write(inserts=rows, touches=self.take_touches(), sync=self.fsync)
            try:
                await _quietly(svc, committed)
            except BaseException:  # cancelled: the rows may still land, so they go again before reuse
                self.doomed += [(key, disk_block) for key, disk_block, _, _ in rows]
                store._settle(writes, {entry.disk_block: errno.ECANCELED for entry, _ in writes})
                raise
            if (refusal := committed.exception()) is not None:
                self._store._counts["index_failures"] += 1
                self.doomed += [(key, disk_block) for key, disk_block, _, _ in rows]
                failed.update({disk_block: failure_errno(refusal) for _, disk_block, _, _ in rows})
        return store._settle(writes, failed)

    def _flush_doomed(self) -> None:
        """Send the doomed rows' deletion to the index; their blocks wait for it before reuse."""
        if not self.doomed:
            return
        assert self.db is not None
        doomed, self.doomed = self.doomed, []
        fut = self.db.write(deletes=doomed, touches=self.take_touches())
        blocks = [disk_block for _, disk_block in doomed]
        for disk_block in blocks:
            self.clearing[disk_block] = fut
        fut.add_done_callback(functools.partial(self._cleared, blocks))

    def _cleared(self, blocks: list[int], fut: Any) -> None:
        failed = fut.exception() is not None
        if failed:
            self._store._counts["index_failures"] += 1
        for disk_block in blocks:
            if self.clearing.get(disk_block) is fut:
                del self.clearing[disk_block]
            if failed:
                self.lose(disk_block)

    def lose(self, disk_block: int) -> None:
        """A block whose old row may still be in the index: never used again in this run."""
        if disk_block not in self._store._lost:
            self._store._lost.add(disk_block)
            if disk_block in self._store._free:
                self._store._free.remove(disk_block)

    def use(self, key: bytes) -> None:
        self.touched[key] = self._tick()

    def _tick(self) -> int:
        self.clock += 1
        return self.clock - 1

    def take_touches(self) -> list[tuple[int, bytes]]:
        touched, self.touched = self.touched, {}
        return [(used, key) for key, used in touched.items()]

    def forget(self, key: bytes, disk_block: int) -> None:
        """``key`` left the index (evicted, or its load failed): its row goes with the next write."""
        self.doomed.append((key, disk_block))
        self.touched.pop(key, None)

    async def close(self, svc: LoopServices) -> None:
        """Save the last deletions and uses, then close the database; a failure is reported (the
        files stay sound: a row kept names a block never reused)."""
        if self.db is None:
            return
        try:
            await self.db.close(self.doomed, self.take_touches())
        except Exception as exc:
            svc.report(f"uring_kv BlockStore {self._store.engine.path}: saving its index at close failed", exc)
        self.doomed = []


async def _quietly(svc: LoopServices, fut: Any) -> None:
    """Wait for ``fut`` without raising its error (the caller reads it); a cancellation still raises."""
    if not fut.done():
        with contextlib.suppress(Exception):  # (cancellations are BaseExceptions, under asyncio and trio)
            await svc.wait(fut)
