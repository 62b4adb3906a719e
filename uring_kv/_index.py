"""A persistent store's index: which key's bytes each disk block holds, in SQLite, and the one
thread that reads and writes it.

The index must never say that a block holds a key's bytes when it might not, whenever the process
dies. Two orders make that so; the store keeps them, and this module gives it the means:

* a key's row is committed only after its block's write completed, and with ``fsync`` after an
  ``fdatasync`` of the block file: the sync and the commit run here, in that order, in one step;
* a block's old row is deleted, and the deletion committed, before any new write to the block is
  submitted (the store waits for :meth:`Index.write`'s future before it writes).

So at any instant every row names a block that holds exactly its key's bytes, whose crc32c the row
keeps (checked again on every load: a torn or rotten block the orders could not prevent, as after
a power loss without ``fsync``, fails its check and becomes a miss).

Some facts about SQLite, and what follows here:

* It is an embedded database with crash-safe transactions: no journal of our own. WAL mode makes a
  commit one append to the ``-wal`` file (and, with ``synchronous=FULL``, one fsync of it).
  ``synchronous=NORMAL`` (without ``fsync``) skips that fsync: a commit survives the process being
  killed (it is in the OS), not a power loss.
* ``locking_mode=EXCLUSIVE`` set before WAL mode is entered keeps the WAL index in the process's
  heap: no ``-shm`` file to map (filesystems without shared mmap work), and no second process can
  open the database while this one has it. An ``flock`` on the index file comes first, so that a
  second store gets a one-line error instead of "database is locked".
* A connection must be used by one thread at a time, and a commit blocks (for an fsync, ms):
  every statement runs on this module's thread, never on the event loop. Requests are applied in
  the order the store made them; those that arrive while a commit runs are applied together in
  the next transaction, sharing its ``fdatasync`` and its commit (group commit), so concurrent
  puts pay one sync between them.
* SQLite makes the ``-wal`` file with the database file's permissions, so creating the database
  file 0600 first keeps every file of the store 0600.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import sqlite3
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from uring_kv._file import check_private, lock
from uring_kv._loop import LoopServices
from uring_kv.errors import EngineClosedError, GeometryMismatchError

FORMAT = 1  # of the files; a store that finds another refuses them
# SQLite copies the WAL back into the database (a checkpoint: two fsyncs, which on ext4 also commit
# the journal with the block file's metadata) once the WAL holds this many pages. Its default, 1000,
# stalled a put for 50-200 ms every few hundred puts on the 2-core test VM (p99 of 16-block puts
# 190 ms, 150 MB/s at 128 KiB blocks without fsync); 10000 pages (a WAL of up to ~40 MB) made it
# 29 ms and 270 MB/s (lab/persist_cost.py, 2000 puts).
CHECKPOINT_PAGES = 10_000

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS blocks (
    key BLOB PRIMARY KEY,
    disk_block INTEGER NOT NULL UNIQUE,
    crc INTEGER NOT NULL,  -- crc32c of the block's padded bytes, as written
    used INTEGER NOT NULL  -- when it was last put or got: the LRU order, oldest first
);
"""

# what the geometry's fields are called in a refusal
_FIELDS = {"format": "the file format", "fingerprint": "the fingerprint", "block_bytes": "the block size (bytes)",
           "tensors": "the caches", "stride": "the block stride in the file (the I/O alignment)"}


@dataclass(frozen=True)
class Restored:
    """What a reopened index holds: ``(key, disk block, crc32c)`` rows, least recently used first,
    and the next use number."""

    rows: list[tuple[bytes, int, int]]
    clock: int


@dataclass(eq=False)
class _Request:
    fn: Callable[[], Any] | None  # run alone (outside any transaction); None: a write
    fut: Any
    deletes: list[tuple[bytes, int]] = field(default_factory=list)
    inserts: list[tuple[bytes, int, int, int]] = field(default_factory=list)
    touches: list[tuple[int, bytes]] = field(default_factory=list)
    sync: bool = False


def describe_difference(found: dict[str, Any], wanted: dict[str, Any]) -> str | None:
    """The first field in which a store's geometry (``wanted``) differs from its files'
    (``found``), in words; None if they agree."""
    for name, value in wanted.items():
        there = found.get(name)
        if there == value:
            continue
        if name == "tensors" and isinstance(there, list):
            if len(there) != len(value):
                return f"the caches have {len(value)} tensors here, the files were written for {len(there)}"
            for position, (mine, theirs) in enumerate(zip(value, there, strict=True)):
                if mine != theirs:
                    return (f"cache tensor {position} is {_tensor(mine)} here, the files were written for "
                            f"{_tensor(theirs)}")
        return f"{_FIELDS.get(name, name)} is {value!r} here, the files were written with {there!r}"
    return None


def _tensor(entry: Any) -> str:
    name, dtype, shape, nbytes = entry
    return f"{name!r} {dtype}{list(shape)} ({nbytes} bytes a block)"


class Index:
    """The SQLite index at ``path`` of a persistent store, on a thread of its own (see the module
    docstring). Made on the loop; every method but :meth:`write` is a coroutine of that loop."""

    def __init__(self, path: str, block_path: str, fsync: bool, services: LoopServices) -> None:
        self.path, self.block_path, self.fsync = path, block_path, fsync
        self._svc = services
        self._conn: sqlite3.Connection | None = None
        self._lock_fd = -1
        self._data_fd = -1  # a dup of the block file's fd, for fdatasync
        self._pending: deque[_Request | None] = deque()  # None: the thread ends
        self._wake = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False

    # ----------------------------------------------------------------- the loop's side
    async def open(self, geometry: dict[str, Any]) -> None:
        """Open (or create) the database, check the geometry it was made for against ``geometry``
        (GeometryMismatchError, the files untouched), or record it on a new one."""
        self._thread = threading.Thread(target=self._serve, name="uring-kv-index", daemon=True)
        self._thread.start()
        await self._svc.wait(self._call(self._open, geometry))

    async def restore(self, data_fd: int, stride: int, capacity: int, fresh_file: bool) -> Restored:
        """Once the block file is open: check (or record) its stride, forget every row if the file
        was just made (``fresh_file``) and those beyond ``capacity``, and return the rows."""
        result: Restored = await self._svc.wait(self._call(self._restore, data_fd, stride, capacity, fresh_file))
        return result

    def write(self, deletes: list[tuple[bytes, int]] | None = None,
              inserts: list[tuple[bytes, int, int, int]] | None = None,
              touches: list[tuple[int, bytes]] | None = None, sync: bool = False) -> Any:
        """Delete rows ``(key, disk block)`` (only where both match), insert (or replace) rows
        ``(key, disk block, crc32c, use)``, set the use number of keys ``(use, key)``, in one
        transaction, after an ``fdatasync`` of the block file if ``sync``. Returns a future of the
        loop: done once committed, or failed with the error."""
        fut = self._svc.create_future()
        if self._closed:
            fut.set_exception(EngineClosedError("the store's index is closed"))
            return fut
        self._put(_Request(None, fut, deletes or [], inserts or [], touches or [], sync))
        return fut

    async def close(self, deletes: list[tuple[bytes, int]], touches: list[tuple[int, bytes]]) -> None:
        """Commit the last ``deletes`` and ``touches``, close the database, end the thread. The
        first failure is raised once all that is done."""
        if self._closed or self._thread is None:
            self._closed = True
            return
        failure: BaseException | None = None
        if deletes or touches:
            last = self.write(deletes=deletes, touches=touches)
            await self._svc.wait_through_cancellation(last)
            failure = last.exception()
        self._closed = True
        done = self._call(self._close)
        self._put(None)
        await self._svc.wait_through_cancellation(done)
        self._thread.join()
        if failure is None and done.exception() is not None:
            failure = done.exception()
        if failure is not None:
            raise failure

    def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        fut = self._svc.create_future()
        self._put(_Request(lambda: fn(*args), fut))
        return fut

    def _put(self, request: _Request | None) -> None:
        with self._wake:
            self._pending.append(request)
            self._wake.notify()

    # ----------------------------------------------------------------- the index thread
    def _serve(self) -> None:
        while True:
            with self._wake:
                while not self._pending:
                    self._wake.wait()
                first = self._pending.popleft()
                if first is None:
                    return
                group = [first]
                if first.fn is None:  # the writes waiting behind it join its transaction
                    while self._pending and (following := self._pending[0]) is not None and following.fn is None:
                        group.append(following)
                        self._pending.popleft()
            if first.fn is not None:
                try:
                    self._deliver(first.fut, first.fn(), None)
                except BaseException as exc:
                    self._deliver(first.fut, None, exc)
                continue
            self._commit(group)

    def _commit(self, group: list[_Request]) -> None:
        conn = self._conn
        failures: dict[int, BaseException] = {}
        if any(request.sync for request in group):
            try:
                os.fdatasync(self._data_fd)
            except OSError as exc:  # the writes it was to make durable may be lost: their rows must not land
                for request in group:
                    if request.sync:
                        failures[id(request)] = exc
        applied = [request for request in group if id(request) not in failures]
        try:
            if conn is None:
                raise EngineClosedError("the store's index is closed")
            if applied:
                conn.execute("BEGIN IMMEDIATE")
                try:
                    for request in applied:
                        if request.touches:
                            conn.executemany("UPDATE blocks SET used = ? WHERE key = ?", request.touches)
                        if request.deletes:
                            conn.executemany("DELETE FROM blocks WHERE key = ? AND disk_block = ?", request.deletes)
                        if request.inserts:
                            conn.executemany("INSERT OR REPLACE INTO blocks (key, disk_block, crc, used) "
                                             "VALUES (?, ?, ?, ?)", request.inserts)
                    conn.execute("COMMIT")
                except BaseException:
                    with contextlib.suppress(sqlite3.Error):
                        conn.execute("ROLLBACK")
                    raise
        except BaseException as exc:
            for request in applied:
                failures[id(request)] = exc
        for request in group:
            self._deliver(request.fut, None, failures.get(id(request)))

    def _deliver(self, fut: Any, result: Any, exc: BaseException | None) -> None:
        with contextlib.suppress(RuntimeError):  # the loop has ended: nobody waits any more
            self._svc.call_soon_threadsafe(_settle, fut, result, exc)

    def _open(self, geometry: dict[str, Any]) -> None:
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            fd = os.open(self.path, flags, 0o600)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise OSError(errno.ELOOP, f"{self.path} is a symbolic link; a store's index must not be one") from None
            raise
        self._lock_fd = fd
        check_private(fd, self.path)
        lock(fd, self.path)
        try:
            conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        except sqlite3.Error as exc:
            raise OSError(errno.EIO, f"{self.path}: SQLite could not open it ({exc})") from None
        self._conn = conn
        try:
            conn.execute("PRAGMA locking_mode = EXCLUSIVE")
            mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
            if str(mode).lower() != "wal":
                raise OSError(errno.EINVAL, f"{self.path}: SQLite cannot use WAL mode there (got {mode})")
            conn.execute(f"PRAGMA synchronous = {'FULL' if self.fsync else 'NORMAL'}")
            conn.execute(f"PRAGMA wal_autocheckpoint = {CHECKPOINT_PAGES}")
            conn.executescript(SCHEMA)
            meta = dict(conn.execute("SELECT name, value FROM meta").fetchall())
        except sqlite3.DatabaseError as exc:
            raise OSError(errno.EIO, f"{self.path} is not a store index SQLite can read ({exc})") from None
        if "geometry" not in meta:
            conn.execute("BEGIN IMMEDIATE")
            conn.execute("DELETE FROM blocks")  # (rows without a geometry cannot be trusted)
            conn.execute("INSERT INTO meta (name, value) VALUES ('geometry', ?)", (json.dumps(geometry),))
            conn.execute("COMMIT")
            return
        difference = describe_difference(json.loads(meta["geometry"]), geometry)
        if difference is not None:
            raise GeometryMismatchError(self._refusal(difference))

    def _refusal(self, difference: str) -> str:
        return (f"persistent store {self.block_path}: {difference}; refusing to read its blocks (its files are "
                f"left as they are: open it as it was made, or remove {self.block_path} and {self.path})")

    def _restore(self, data_fd: int, stride: int, capacity: int, fresh_file: bool) -> Restored:
        conn = self._conn
        assert conn is not None
        self._data_fd = os.dup(data_fd)
        conn.execute("BEGIN IMMEDIATE")
        try:
            row = conn.execute("SELECT value FROM meta WHERE name = 'stride'").fetchone()
            if row is None:
                conn.execute("INSERT INTO meta (name, value) VALUES ('stride', ?)", (str(stride),))
            elif int(row[0]) != stride:
                raise GeometryMismatchError(self._refusal(describe_difference({"stride": int(row[0])},
                                                                              {"stride": stride}) or ""))
            if fresh_file:  # a new, empty file: no row can be true
                conn.execute("DELETE FROM blocks")
            conn.execute("DELETE FROM blocks WHERE disk_block >= ? OR disk_block < 0", (capacity,))
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        rows = conn.execute("SELECT key, disk_block, crc, used FROM blocks ORDER BY used").fetchall()
        clock = rows[-1][3] + 1 if rows else 0
        return Restored([(bytes(key), disk_block, crc) for key, disk_block, crc, _ in rows], clock)

    def _close(self) -> None:
        conn, self._conn = self._conn, None
        try:
            if conn is not None:
                conn.close()  # (the last connection: SQLite checkpoints the WAL into the database)
        finally:
            for name in ("_data_fd", "_lock_fd"):
                fd = getattr(self, name)
                if fd >= 0:
                    setattr(self, name, -1)
                    os.close(fd)


def _settle(fut: Any, result: Any, exc: BaseException | None) -> None:
    if fut.done():
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(result)
