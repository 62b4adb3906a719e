"""A persistent store's journal (``BlockStore(persistent=True)``): what changes in the store's
keys, recorded in its SQLite index (``_index.py``), and read back when the store reopens.

The store owns its keys and blocks and decides everything about them; the journal records what it
is told and hands back futures, so the store can keep the two orders that keep the index true
(``docs/persistence.md``): a key's row is committed only after its block was written (and, with
``fsync``, after an fdatasync of the block file), and a block's old row is deleted, and the
deletion committed, before anything is written to the block again. What it records:

- :meth:`commit`: new rows (key, disk block, crc32c), each with a use number;
- :meth:`forget`: a key left the store (evicted, or its load failed); its row's deletion goes out
  with the next :meth:`deletions`, whose future the store waits for before it reuses the block;
- :meth:`use`: a key was used (the LRU order), saved with the next commit or deletion;
- :meth:`restore`: at open, the rows the index holds, least recently used first.

It never imports the store (which sits above it), and keeps no state of the store's.
"""

from __future__ import annotations

import errno
import os
import sqlite3
from typing import Any

from uring_kv._index import FORMAT, Index
from uring_kv._loop import LoopServices

Row = tuple[bytes, int, int]  # (key, disk block, crc32c of its padded bytes)


def failure_errno(exc: BaseException) -> int:
    """The errno a key gets when the journal could not record it (a commit or deletion refused)."""
    if isinstance(exc, OSError) and exc.errno:
        return exc.errno
    if getattr(exc, "sqlite_errorcode", None) == sqlite3.SQLITE_FULL:
        return errno.ENOSPC
    return errno.EIO


class Journal:
    """The journal of one persistent store: its index at ``path`` beside the block file at
    ``block_path``, made for ``geometry`` (each tensor's name, dtype, block shape and bytes in
    ``tensors``, the block's bytes, the store's ``fingerprint``); ``fsync``: commits wait for an
    fdatasync of the block file, and are synced themselves."""

    def __init__(self, path: str, block_path: str, fsync: bool, fingerprint: str, tensors: list[Any],
                 block_bytes: int) -> None:
        self.path, self.block_path, self.fsync = path, block_path, fsync
        self.geometry = {"format": FORMAT, "fingerprint": fingerprint, "tensors": tensors, "block_bytes": block_bytes}
        self.db: Index | None = None
        self._doomed: list[tuple[bytes, int]] = []  # (key, disk block) rows to delete with the next deletions
        self._touched: dict[bytes, int] = {}  # key → its last use, not yet in the index
        self._clock = 0  # the next use number

    async def open(self, services: LoopServices) -> None:
        """Open the index and check the geometry its files were made for (``GeometryMismatchError``,
        the files left as they are): before the store touches the block file."""
        self.db = Index(self.path, self.block_path, self.fsync, services)
        await self.db.open(self.geometry)

    async def restore(self, block_fd: int, stride: int, capacity: int, fresh_file: bool) -> list[Row]:
        """Once the block file is open (``block_fd``): the rows the index holds, least recently used
        first (none if the file was just made, none beyond ``capacity``). The index reads the block
        file through its own copy of the descriptor, made here, where nobody can close it first."""
        assert self.db is not None
        fd = os.dup(block_fd)
        try:
            restored = await self.db.restore(fd, stride, capacity, fresh_file)
        finally:
            os.close(fd)
        self._clock = restored.clock
        return restored.rows

    def use(self, key: bytes) -> None:
        """``key`` was used now (put again, or read): saved with the next commit or deletion."""
        self._touched[key] = self._tick()

    def forget(self, key: bytes, disk_block: int) -> None:
        """``key`` left the store (evicted, or its load failed): its row goes with the next deletions."""
        self._doomed.append((key, disk_block))
        self._touched.pop(key, None)

    def retract(self, rows: list[Row]) -> None:
        """Rows whose commit may or may not have landed (it was cancelled, or refused): deleted with
        the next deletions, before their blocks are reused."""
        self._doomed += [(key, disk_block) for key, disk_block, _ in rows]

    def deletions(self) -> tuple[list[int], Any] | None:
        """Send the rows forgotten so far for deletion (with the uses not yet saved): their disk
        blocks, and a future done once the deletion is committed (or failed with why); None when
        nothing was forgotten."""
        if not self._doomed:
            return None
        assert self.db is not None
        doomed, self._doomed = self._doomed, []
        return [disk_block for _, disk_block in doomed], self.db.write(deletes=doomed, touches=self._take_touches())

    def commit(self, rows: list[Row]) -> Any:
        """Insert ``rows``, each with a use number, and the uses not yet saved, in one transaction
        (after an fdatasync of the block file with ``fsync``): a future, done once committed or
        failed with why."""
        assert self.db is not None
        inserts = [(key, disk_block, crc, self._tick()) for key, disk_block, crc in rows]
        return self.db.write(inserts=inserts, touches=self._take_touches(), sync=self.fsync)

    async def close(self, save: bool = True) -> None:
        """Save the last deletions and uses (unless ``save`` is False: an open that failed), then
        close the index; its first failure is raised once that is done."""
        if self.db is None:
            return
        doomed, self._doomed = (self._doomed, []) if save else ([], [])
        await self.db.close(doomed, self._take_touches() if save else [])

    def _tick(self) -> int:
        self._clock += 1
        return self._clock - 1

    def _take_touches(self) -> list[tuple[int, bytes]]:
        touched, self._touched = self._touched, {}
        return [(used, key) for key, used in touched.items()]
