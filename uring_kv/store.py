"""Keys → disk blocks of one engine's file: a bounded block store with LRU eviction.

It owns the index (key → disk block), the free blocks, and the pins of blocks in flight. It must never
let a lookup see a key whose bytes are not complete and trusted, and never give a block to another
key while a transfer still uses it. The I/O itself is the engine's.

Some facts about frameworks' KV caches, and what follows for the store:

* Frameworks poll: a lookup answers "is it there?" now, and a load is scheduled later. A key whose
  last store failed must therefore turn into a *miss*, not into a hit whose every load fails (vLLM
  #49176 livelocked so, retrying the load forever). So a key is *visible* (``contains``,
  ``lookup``, ``get``) only from the end of a successful store until it is evicted or a load of it
  fails. A key being written waits outside the index, in ``_writing``: invisible, and out of the
  eviction's reach; if its store fails it never appears, and its block goes back to the free list.
* Keys are content hashes (vLLM's block hash names the block's tokens and everything before them),
  so a key's bytes never change. A put of a visible key only refreshes it in the LRU order; a put of
  a key another put is still writing waits for that write and shares its outcome. Nothing ever
  rewrites a visible key's block, which is why a get running beside a put of the same key reads the
  old, complete bytes (or misses, if the key was not visible when the get was called).
* A get pins its blocks (``readers``) for as long as the engine may read them; eviction skips pinned
  blocks, and a block dropped while pinned (its load failed) is freed by its last reader. When every
  block is in flight, a put fails at once for the keys that found no room (``NO_ROOM``) instead of
  waiting: one put may take every block, and waiting for its own blocks would never end; a cache
  that cannot take a block now is better off without it than stalled.
* Everything but ``contains``/``lookup``/``stats`` runs on the engine's loop, and no decision is
  separated from its bookkeeping by an ``await``. The index is an OrderedDict: lookup, touch and
  eviction of the oldest are O(1). A lookup from another thread is one dict membership test per
  key, atomic under the GIL, so those three may be called from any thread (see ``uring_kv.sync``).
* A persistent store (``persistent=True``) records its changes in a journal (``_journal.py``, an
  SQLite index beside the file) in two orders that keep the index true whenever the process dies:
  a key's row is committed only after its block was written (and, with ``fsync``, synced), so a
  key becomes visible only once its row is committed; and a block that leaves a key (evicted, or
  its load failed) is *doomed*: its row's deletion goes out with the next put, and no write may
  touch the block before that deletion is committed (``_clearing``). Should the deletion fail, the
  block is never used again in this run (``_lost``): the row may still name it. Every block carries
  a crc32c (the engine's ``checksum=True``), kept in its row and checked on every load, the first
  after a reopen included.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from uring_kv._args import capacity_in_blocks, check_keys_and_rows
from uring_kv._engine import Engine
from uring_kv._journal import Journal, Row, failure_errno
from uring_kv._layout import CacheLayout
from uring_kv._loop import CallsUnderWay, LoopServices, OpenClose, current_services
from uring_kv._prefetch import Prefetch
from uring_kv.errors import NO_ROOM, BlockIOError, EngineClosedError, KeyIOError, KeyMissingError


@dataclass(eq=False, slots=True)
class _Entry:
    key: bytes
    disk_block: int
    readers: int = 0  # gets in flight that read the block: it must not be evicted or reused
    gone: bool = False  # out of the index for good (evicted, or its load failed)
    error: int = 0  # the errno of its store, which failed
    written: Any = None  # a future other puts of the key wait on (made when one does)


class BlockStore(OpenClose):
    """Keys (bytes) → blocks of cache rows, kept in a private file of ``capacity`` blocks.

    ``caches``, ``path``, ``num_slots`` and ``engine_options`` (``direct``, ``io``, ``copy_delay``,
    ``checksum``, ``io_depth``) go to the :class:`Engine` underneath (``store.engine``). Give the
    size as ``capacity_blocks``, or as ``capacity_bytes`` (each block counted padded to 4 KiB). The
    file is sized for the capacity at ``open()`` and no more blocks are ever used; the index takes
    memory per key held, so memory is bounded by the capacity too. By default nothing outlives the
    store: the file has no name, and closing forgets every key.

    ``persistent=True`` keeps the keys across restarts: the file is ``path`` itself and its index
    an SQLite database at ``path + ".index"`` (both 0600, locked against a second process, kept at
    close). Reopened with the same geometry (the caches' names, dtypes and block shapes, and
    ``fingerprint``, a string naming whatever else decides a block's bytes: the model and its
    revision, the KV dtype, the tensor-parallel rank), the store serves the keys it held; with
    another, ``open()`` raises :class:`GeometryMismatchError` and leaves the files alone. A key
    becomes visible once its bytes are written and its row committed; with ``fsync=True`` (the
    default) the block file is fdatasync'ed before the commit, and every commit is synced, so a
    key a put returned survives a power loss; with ``fsync=False`` it survives the process being
    killed, not a power loss. Every block is checked against its crc32c on load (``checksum`` is
    on): a block that fails is a miss. See ``docs/persistence.md``.

    Use as ``async with BlockStore(...) as store`` (or ``open()`` … ``aclose()``) on one event loop
    (asyncio, or trio); :class:`uring_kv.SyncBlockStore` runs one for threads.

    Guarantees:

    * A key is visible to ``contains``/``lookup``/``get`` only once a store of its bytes completed,
      and stops being visible when it is evicted or a load of it fails: a failure is a miss, never
      a hang or stale bytes.
    * Eviction takes the least recently used key (``put`` and ``get`` use a key; lookups do not)
      among those no transfer is using: a block being read or written is never evicted.
    * A key's bytes are written once: a put of a visible key only refreshes it. A get therefore
      returns a key's complete bytes, or raises.
    """

    def __init__(self, caches: Any, path: str | os.PathLike[str], capacity_blocks: int | None = None,
                 num_slots: int = 16, *, capacity_bytes: int | None = None, persistent: bool = False,
                 fingerprint: str = "", fsync: bool | None = None, **engine_options: Any) -> None:
        if "keep_file" in engine_options:
            raise TypeError("BlockStore keeps its file with persistent=True (keep_file is the engine's)")
        if not isinstance(fingerprint, str):
            raise TypeError(f"fingerprint must be a str, got {type(fingerprint).__name__}")
        if not persistent and (fingerprint or fsync is not None):
            raise ValueError("fingerprint= and fsync= apply to a persistent store (persistent=True)")
        if persistent:
            if engine_options.get("checksum") is False:
                raise ValueError("a persistent store checks every block's crc32c: checksum=False is refused")
            engine_options.update(checksum=True, keep_file=True)
        layout = CacheLayout.of(caches)  # (checked once: the engine takes it as it is)
        capacity_blocks = capacity_in_blocks(layout, capacity_blocks, capacity_bytes)
        self.engine = Engine(layout, path, capacity_blocks, num_slots, **engine_options)  # checks the rest
        self.capacity = capacity_blocks
        self._index: OrderedDict[bytes, _Entry] = OrderedDict()  # visible keys, least recently used first
        self._writing: dict[bytes, _Entry] = {}  # keys being written: invisible, not evictable
        self._free: list[int] = []  # blocks given back
        self._fresh = 0  # blocks [_fresh, capacity) were never given out
        self._pinned = 0  # entries of the index with readers
        self._calls = CallsUnderWay()  # puts and gets: aclose() waits for the last of them
        self._closed: Any = None  # a future: closing finished
        self._svc: LoopServices | None = None
        self._state = "new"
        self._counts = {"evictions": 0, "store_failures": 0, "load_failures": 0, "no_room": 0}
        # persistence (see the module docstring)
        self.persistent = persistent
        self.fsync = persistent and fsync is not False
        self.fingerprint = fingerprint
        self._clearing: dict[int, Any] = {}  # disk block → the future of its old row's deletion
        self._lost: set[int] = set()  # blocks whose old row could not be deleted: never reused
        self._journal: Journal | None = None
        if persistent:
            self._counts.update(restored=0, index_failures=0)
            self._journal = Journal(self.engine.path + ".index", self.engine.path, self.fsync, fingerprint,
                                    layout.geometry(), layout.block_bytes)

    # ----------------------------------------------------------------- lifecycle
    async def open(self) -> BlockStore:
        """Open the engine (create the file) on the running loop."""
        if self._state != "new":
            raise RuntimeError(f"block store is {self._state}; open() is called once")
        self._state = "opening"
        self._svc = current_services()
        try:
            if self._journal is not None:
                await self._open_kept(self._journal, self._svc)
            else:
                await self.engine.open()
        except BaseException:
            self._state = "closed"
            raise
        if self._state == "opening":  # (not if aclose() began meanwhile)
            self._state = "open"
        return self

    async def _open_kept(self, journal: Journal, svc: LoopServices) -> None:
        """A persistent store's open: the journal (its geometry checked before the block file is
        touched), then the engine on the kept file, then the journal's keys, LRU order and all."""
        engine = self.engine
        try:
            await journal.open(svc)
            self._still_opening()
            await engine.open()
            self._still_opening()
            rows = await journal.restore(engine.file.fd, engine.file.stride, self.capacity, engine.file.created)
            self._still_opening()
            engine.adopt({disk_block: crc for _, disk_block, crc in rows})
        except BaseException:
            await svc.run_to_completion(self._abandon(journal))
            raise
        self._restore(rows)

    def _still_opening(self) -> None:
        """After each wait of an open: aclose() may have begun meanwhile."""
        if self._state != "opening":
            raise EngineClosedError(f"block store {self.engine.path} was closed while it opened")

    async def _abandon(self, journal: Journal) -> None:
        try:
            await self.engine.aclose()
        finally:
            await journal.close(save=False)

    async def aclose(self) -> None:
        """Refuse new calls, let those under way finish (their keys land or fail as usual), close
        the engine (which frees the file), and forget every key. Returns once closed, however many
        times it is called; a cancelled aclose() still closes, then raises the cancellation."""
        if self._state == "closed":
            return
        svc = self._svc or current_services()
        if self._closed is not None:
            await svc.wait_through_cancellation(self._closed)
            return
        self._closed = svc.create_future()
        self._state = "closing"
        try:
            await svc.run_to_completion(self._close(svc))
        finally:
            self._state = "closed"
            self._closed.set_result(None)

    async def _close(self, svc: LoopServices) -> None:
        try:
            await self.engine.aclose()  # waits for every batch in flight (and for open() if it runs)
        finally:
            await self._calls.none_left(svc)  # their last step (index updates, pins) runs after their batches
            if self._journal is not None:  # the last deletions and uses; the index is then closed
                await self._close_journal(self._journal, svc)
            for entry in self._index.values():
                entry.readers = 0  # pins still held (see pin) end with the store
            self._index.clear()
            self._writing.clear()
            self._free.clear()
            self._fresh = self._pinned = 0

    async def _close_journal(self, journal: Journal, svc: LoopServices) -> None:
        """A failure is reported, not raised: the files stay sound (a row kept names a block never reused)."""
        try:
            await journal.close()
        except Exception as exc:
            svc.report(f"uring_kv BlockStore {self.engine.path}: saving its index at close failed", exc)

    @property
    def closed(self) -> bool:
        """Whether the store has finished closing (or failed to open)."""
        return self._state == "closed"

    # ----------------------------------------------------------------- lookups (any thread)
    def contains(self, key: bytes) -> bool:
        """Whether ``key`` is visible now. O(1), no I/O, does not touch the LRU order; safe from any
        thread. A hint: the key may be evicted before a later ``get``."""
        return key in self._index

    def lookup(self, keys: Iterable[bytes]) -> int:
        """How many of ``keys``, from the first, are visible now (a prefix hit). O(1) per key, no
        I/O, does not touch the LRU order; safe from any thread."""
        index, count = self._index, 0
        for key in keys:
            if key not in index:
                break
            count += 1
        return count

    def stats(self) -> dict[str, int]:
        """Keys held, capacity and free blocks (in blocks), keys being written, keys pinned by gets,
        and counts since open: evictions, keys whose store failed, keys dropped by a failed load,
        keys a put found no room for; a persistent store adds the keys it found at open
        (``restored``), the index writes that failed (``index_failures``) and the blocks kept out
        of use until a restart because their old row could not be deleted (``lost_blocks``). Safe
        from any thread (the numbers may be mid-update)."""
        stats = {"keys": len(self._index), "capacity_blocks": self.capacity,
                 "free_blocks": len(self._free) + self.capacity - self._fresh, "writing": len(self._writing),
                 "pinned": self._pinned, **self._counts}
        if self.persistent:
            stats["lost_blocks"] = len(self._lost)
        return stats

    # ----------------------------------------------------------------- transfers (the loop)
    async def put(self, keys: Iterable[bytes], rows: Iterable[int], after: Any = None) -> int:
        """Store cache row ``rows[i]`` under ``keys[i]``; returns once every key is visible, with
        the number of keys this put wrote (what it moved to disk: a framework's backpressure weighs
        it).

        A visible key is not written again (its bytes cannot have changed), only refreshed in the
        LRU order; a key another put is writing is left to that put, and this one waits for it. A
        new key takes a free block, else the least recently used key's block among those no
        transfer is using. It becomes visible once its bytes are in the file.

        Raises :class:`KeyIOError` naming the keys that were not stored (an I/O error, or
        ``NO_ROOM`` when every block was in flight; its ``written``: the keys this put wrote);
        the others were. Bad arguments raise
        ValueError or TypeError before anything changes. If cancelled, none of the keys it was
        writing becomes visible. ``after``: see :meth:`Engine.store_batch` (GPU mode)."""
        key_list, row_list = self._arguments(keys, rows, after, unique_keys=True)
        svc = self._check_open()
        writes: list[tuple[_Entry, int]] = []
        others: list[_Entry] = []  # keys another put is writing
        failures: dict[bytes, int] = {}
        index = self._index
        for key, row in zip(key_list, row_list, strict=True):
            if key in index:
                index.move_to_end(key)
                if self._journal is not None:
                    self._journal.use(key)
            elif (entry := self._writing.get(key)) is not None:
                if entry.written is None:
                    entry.written = svc.create_future()
                others.append(entry)
            elif (disk_block := self._allocate()) is None:
                failures[key] = NO_ROOM
            else:
                entry = _Entry(key, disk_block)
                self._writing[key] = entry
                writes.append((entry, row))
        self._counts["no_room"] += len(failures)
        self._calls.enter()
        written = 0
        try:
            if writes:
                failed = await self._write(writes, after)
                written = len(writes) - len(failed)
                failures.update(failed)
            for entry in others:
                await svc.wait(entry.written)
                if entry.error:
                    failures[entry.key] = entry.error
        finally:
            self._calls.leave()
        if failures:
            raise KeyIOError("put", failures, written)
        return written

    async def get(self, keys: Iterable[bytes], rows: Iterable[int], after: Any = None, *,
                  prefetch: Prefetch | None = None) -> None:
        """Load the bytes of ``keys[i]`` into cache row ``rows[i]``; returns once they are there.

        Every key must be visible, or :class:`KeyMissingError` names the missing ones before any
        I/O. The keys' blocks are pinned until the load ends, so they are neither evicted nor
        reused meanwhile. A key whose load fails is dropped (later lookups miss) and
        :class:`KeyIOError` names it; the other rows hold their keys' bytes. If cancelled, the rows
        of blocks not yet loaded are left as they were. ``after``: see :meth:`Engine.load_batch`."""
        key_list, row_list = self._arguments(keys, rows, after, unique_keys=False)
        self._check_open()
        index = self._index
        if missing := [key for key in key_list if key not in index]:
            raise KeyMissingError(missing)
        entries = [index[key] for key in key_list]
        for entry in entries:
            index.move_to_end(entry.key)
            if self._journal is not None:
                self._journal.use(entry.key)
            if not entry.readers:
                self._pinned += 1
            entry.readers += 1
        self._calls.enter()
        try:
            await self.engine.load_batch([entry.disk_block for entry in entries], row_list, after, prefetch=prefetch)
        except BlockIOError as exc:
            failures = {entry.key: exc.failures[entry.disk_block] for entry in entries
                        if entry.disk_block in exc.failures}
            for entry in entries:
                if entry.key in failures:
                    self._drop(entry)
            self._counts["load_failures"] += len(failures)
            raise KeyIOError("get", failures) from exc
        finally:
            for entry in entries:
                self._unpin(entry)
            self._calls.leave()

    async def get_present(self, keys: Iterable[bytes], rows: Iterable[int], after: Any = None, *,
                          prefetch: Prefetch | None = None) -> list[bytes]:
        """Like :meth:`get`, for the keys of ``keys`` held when it runs (checked on the loop, so none
        can be evicted between the check and the load): returns the keys whose bytes are now in
        their rows. A key missing, or whose load failed (dropped from the index, as with
        :meth:`get`), is left out; nothing raises for them."""
        key_list, row_list = self._arguments(keys, rows, after, unique_keys=False)
        self._check_open()
        present = [(key, row) for key, row in zip(key_list, row_list, strict=True) if key in self._index]
        if not present:
            return []
        try:
            await self.get([key for key, _ in present], [row for _, row in present], after, prefetch=prefetch)
        except KeyIOError as exc:
            return [key for key, _ in present if key not in exc.failures]
        return [key for key, _ in present]

    # ----------------------------------------------------------------- pins (the loop)
    def pin(self, keys: Iterable[bytes]) -> list[Any]:
        """Pin each visible key of ``keys`` against eviction until :meth:`unpin`, as a get in flight
        pins it: a handle per key, None for a key not visible (nothing is pinned for it). A pinned
        key stays visible unless a load of it fails (its block is then freed by the last unpin).
        Does not touch the LRU order. On the store's loop; the caller must unpin every handle."""
        if isinstance(keys, (bytes, bytearray, str)):
            raise TypeError("keys must be a sequence of keys (bytes), not one key")
        self._check_open()
        handles: list[Any] = []
        for key in keys:
            entry = self._index.get(key)
            if entry is not None:
                if not entry.readers:
                    self._pinned += 1
                entry.readers += 1
            handles.append(entry)
        return handles

    def unpin(self, handles: Iterable[Any]) -> None:
        """Release pins taken by :meth:`pin` (None handles are skipped). On the store's loop; after
        the store closed it does nothing (closing forgot every key and pin)."""
        if self._state == "closed":
            return
        for entry in handles:
            if entry is not None and entry.readers > 0:
                self._unpin(entry)

    # ----------------------------------------------------------------- internals
    async def _write(self, writes: list[tuple[_Entry, int]], after: Any) -> dict[bytes, int]:
        """Store the entries' rows to their blocks; make the written ones visible, free the
        others' blocks. The keys that failed, with their errno. A persistent store first waits for
        the deletion of the blocks' old rows, and commits the new rows before the keys become
        visible."""
        journal = self._journal
        failed: dict[int, int] = {}
        try:
            if journal is not None:
                await self._cleared_for(journal, writes, failed)
            todo = [(entry, row) for entry, row in writes if entry.disk_block not in failed] if failed else writes
            if todo:
                try:
                    await self.engine.store_batch([row for _, row in todo], [entry.disk_block for entry, _ in todo],
                                                  after)
                except BlockIOError as exc:
                    failed.update(exc.failures)
        except BaseException:  # cancelled, or refused (closing): no block of it is vouched for
            self._settle(writes, {entry.disk_block: errno.ECANCELED for entry, _ in writes})
            raise
        if journal is not None:
            await self._commit(journal, writes, failed)
        return self._settle(writes, failed)

    async def _cleared_for(self, journal: Journal, writes: list[tuple[_Entry, int]], failed: dict[int, int]) -> None:
        """Before the writes: send the doomed rows' deletion, and wait for that of each block's old
        row; a block whose deletion failed is lost (never used again) and its key fails."""
        self._send_deletions(journal)
        clearing = {entry.disk_block: fut for entry, _ in writes
                    if (fut := self._clearing.get(entry.disk_block)) is not None}
        for disk_block, fut in clearing.items():
            await _quietly(self._svc, fut)
            if (refusal := fut.exception()) is not None:
                self._lose(disk_block)
                failed[disk_block] = failure_errno(refusal)

    def _send_deletions(self, journal: Journal) -> None:
        """Send the doomed rows' deletion; their blocks wait for it before they are reused."""
        sent = journal.deletions()
        if sent is None:
            return
        blocks, fut = sent
        for disk_block in blocks:
            self._clearing[disk_block] = fut
        fut.add_done_callback(functools.partial(self._cleared, blocks))

    def _cleared(self, blocks: list[int], fut: Any) -> None:
        failed = fut.exception() is not None
        if failed:
            self._counts["index_failures"] += 1
        for disk_block in blocks:
            if self._clearing.get(disk_block) is fut:
                del self._clearing[disk_block]
            if failed:
                self._lose(disk_block)

    async def _commit(self, journal: Journal, writes: list[tuple[_Entry, int]], failed: dict[int, int]) -> None:
        """Commit the rows of the keys written (after a sync, with ``fsync``); a key whose row could
        not be committed, or whose block could not be summed, joins ``failed``."""
        written = [entry for entry, _ in writes if entry.disk_block not in failed]
        rows: list[Row] = []
        for entry, crc in zip(written, self.engine.block_sums([entry.disk_block for entry in written]), strict=True):
            if crc is None:  # could not be summed (reported by the engine): nothing to check it by later
                failed[entry.disk_block] = errno.EIO
            else:
                rows.append((entry.key, entry.disk_block, crc))
        if not rows:
            return
        committed = journal.commit(rows)
        try:
            await _quietly(self._svc, committed)
        except BaseException:  # cancelled: the rows may still land, so they go again before reuse
            journal.retract(rows)
            self._settle(writes, {entry.disk_block: errno.ECANCELED for entry, _ in writes})
            raise
        if (refusal := committed.exception()) is not None:
            self._counts["index_failures"] += 1
            journal.retract(rows)
            failed.update({disk_block: failure_errno(refusal) for _, disk_block, _ in rows})

    def _lose(self, disk_block: int) -> None:
        """A block whose old row may still be in the index: never used again in this run."""
        if disk_block not in self._lost:
            self._lost.add(disk_block)
            if disk_block in self._free:
                self._free.remove(disk_block)

    def _restore(self, rows: list[Row]) -> None:
        """At open, a persistent store's keys (least recently used first) and their blocks."""
        used = set()
        for key, disk_block, _ in rows:
            self._index[key] = _Entry(key, disk_block)
            used.add(disk_block)
        self._fresh = max(used) + 1 if used else 0
        self._free = [disk_block for disk_block in range(self._fresh - 1, -1, -1) if disk_block not in used]
        self._counts["restored"] = len(rows)

    def _settle(self, writes: list[tuple[_Entry, int]], failed: Mapping[int, int]) -> dict[bytes, int]:
        failures: dict[bytes, int] = {}
        for entry, _ in writes:
            del self._writing[entry.key]
            if code := failed.get(entry.disk_block, 0):
                entry.error = failures[entry.key] = code
                if entry.disk_block not in self._lost:
                    self._free.append(entry.disk_block)
            else:
                self._index[entry.key] = entry
            if entry.written is not None:
                entry.written.set_result(None)
        self._counts["store_failures"] += len(failures)
        return failures

    def _allocate(self) -> int | None:
        """A disk block for a new key: a free one, else the least recently used unpinned key's
        (evicted); None when every block is in flight."""
        if self._free:
            return self._free.pop()  # (never a lost block: _lose takes them out)
        if self._fresh < self.capacity:
            self._fresh += 1
            return self._fresh - 1
        index = self._index
        if len(index) == self._pinned:
            return None
        while True:
            key, entry = next(iter(index.items()))
            if not entry.readers:
                break
            index.move_to_end(key)  # being read: in use right now, so not the least recently used
        del index[key]
        entry.gone = True
        self._counts["evictions"] += 1
        if self._journal is not None:
            self._journal.forget(key, entry.disk_block)
        return entry.disk_block

    def _drop(self, entry: _Entry) -> None:
        """Take a visible key out of the index for good; its block is freed once no get reads it."""
        if entry.gone:
            return
        entry.gone = True
        del self._index[entry.key]
        if self._journal is not None:
            self._journal.forget(entry.key, entry.disk_block)
        if entry.readers:
            self._pinned -= 1  # (counts the index's entries only)
        else:
            self._free.append(entry.disk_block)

    def _unpin(self, entry: _Entry) -> None:
        entry.readers -= 1
        if entry.readers:
            return
        if entry.gone:
            if entry.disk_block not in self._lost:
                self._free.append(entry.disk_block)  # the last reader of a dropped key gives its block back
        else:
            self._pinned -= 1

    def _check_open(self) -> LoopServices:
        if self._state != "open":
            raise EngineClosedError(f"block store is {self._state}")
        assert self._svc is not None
        if not self._svc.is_current():  # before anything changes: the index belongs to the loop's thread
            raise RuntimeError("uring_kv BlockStore called outside the event loop (and thread) that opened it")
        return self._svc

    def _arguments(self, keys: Iterable[bytes], rows: Iterable[int], after: Any,
                   unique_keys: bool) -> tuple[list[bytes], list[int]]:
        return check_keys_and_rows(keys, rows, after, self.engine.gpu, self.engine.num_gpu_blocks, unique_keys)


async def _quietly(svc: LoopServices | None, fut: Any) -> None:
    """Wait for ``fut`` without raising its error (the caller reads it); a cancellation still raises."""
    assert svc is not None
    if not fut.done():
        with contextlib.suppress(Exception):  # (cancellations are BaseExceptions, under asyncio and trio)
            await svc.wait(fut)
