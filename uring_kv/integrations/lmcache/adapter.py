"""uring_kv as an L2 adapter of LMCache's multiprocess server (``lmcache server``).

LMCache's server keeps KV chunks in an L1 memory arena and writes them through to its L2 adapters,
prefetching them back into L1 on a later hit. This adapter keeps those chunks in one file through
a :class:`uring_kv.BlockStore` (io_uring, O_DIRECT where the filesystem takes it), with a hard
capacity and LRU eviction, and answers LMCache's non-blocking ``L2AdapterInterface``. Load it as a
plugin adapter::

    lmcache server --l2-adapter '{"type": "plugin", "module_path": "uring_kv.integrations.lmcache",
        "class_name": "UringKVL2Adapter",
        "adapter_params": {"root_dir": "/nvme/kv", "capacity_bytes": 500000000000}}'

How it answers LMCache's contract (every ``submit_*`` returns at once; the work runs on the store's
own event-loop thread, and each finished task is posted to its result table before its eventfd is
signalled):

* Blocks are chunks, moved without a copy where LMCache's memory allows: with the L1 arena LMCache
  hands plugin adapters (``l1_memory_desc``), the arena is the store's cache tensor, one row per
  chunk-sized slot from its start, and io_uring reads and writes straight between the file and
  each chunk. LMCache's first-fit L1 allocator keeps chunks of one size in those slots (the
  server drops partial chunks); a chunk outside them (a second chunk size in one server) is not
  stored (a failed store, a miss; ``stats()["unplaced"]`` counts them), so such servers set
  ``"rows": "staging"``: chunks are then copied through the adapter's own page-aligned rows. The
  block size is the first chunk's (``block_bytes`` sets it); a larger chunk is a miss.
* ``submit_store_task``: keys already held are not written again; the task fails if any key could
  not be stored (an I/O error, no room: every block pinned or in flight), and those keys stay
  misses. ``L2StoreResult`` carries the bytes of the keys it wrote.
* ``submit_lookup_and_lock_task``: a bitmap of the keys held, each hit pinned against eviction
  until ``submit_unlock`` releases it (pins count, like LMCache's own lock counts).
* ``submit_load_task``: a bitmap of the keys whose bytes are now in their buffers. A key that is
  not held, or whose read failed (dropped from the index: the next lookup misses), is a 0; a
  failure is never stale bytes or a hang.
* ``close``: refuses new tasks (they complete at once as failures), lets every task under way
  finish and post its result, closes the store (its file has no name: nothing is left on disk)
  and joins its thread.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import gc
import logging
import threading
from collections.abc import Callable, Coroutine
from typing import Any

import numpy as np
import torch
from lmcache.lmcache_native import Bitmap
from lmcache.v1.distributed.internal_api import L2StoreResult
from lmcache.v1.distributed.l2_adapters.base import AdapterUsage, L2AdapterInterface
from lmcache.v1.platform import create_event_notifier

from uring_kv._file import refuse_beyond_free_space, size_text
from uring_kv._memory import view_of
from uring_kv.errors import KeyIOError
from uring_kv.integrations.config import open_store
from uring_kv.integrations.lmcache.config import UringKVL2AdapterConfig
from uring_kv.store import BlockStore
from uring_kv.striped import StripedBlockStore
from uring_kv.sync import LoopThread

logger = logging.getLogger(__name__)

# Staging copies of at most this many bytes a call run on the loop; larger ones on a worker thread
# (numpy releases the GIL for them), so that the loop keeps reaping I/O meanwhile.
_INLINE_COPY_BYTES = 1 << 20


def _key(key: Any) -> bytes:
    """An ObjectKey as the store's key: its fields, then its chunk hash (``@`` is in neither the
    model name nor the salt)."""
    return (f"{key.model_name}@{key.kv_rank:x}@{key.object_group_id:x}@{key.cache_salt}@".encode()
            + bytes(key.chunk_hash))


class UringKVL2Adapter(L2AdapterInterface):  # type: ignore[misc]
    """An LMCache L2 adapter on a uring_kv block store (see the module docstring and
    :class:`UringKVL2AdapterConfig`). Thread-safe: LMCache's store and prefetch controllers call
    it from their own threads."""

    config_class_name = "UringKVL2AdapterConfig"

    def __init__(self, config: UringKVL2AdapterConfig | dict[str, Any], l1_memory_desc: Any = None) -> None:
        super().__init__()
        if isinstance(config, dict):
            config = UringKVL2AdapterConfig.from_dict(config)
        if config.persistent and not config.block_bytes:
            raise ValueError("UringKVL2Adapter: a persistent adapter needs block_bytes (the chunk size)")
        config.store.check_directories("UringKVL2Adapter")
        self._config = config
        self._arena = l1_memory_desc if config.rows != "staging" else None
        if config.rows == "l1" and self._arena is None:
            raise ValueError('UringKVL2Adapter: rows="l1" needs the L1 arena, which LMCache did not give')
        self._store: BlockStore | StripedBlockStore | None = None
        self._open_failed: BaseException | None = None
        self._opening: asyncio.Future[None] | None = None
        self._block = 0  # bytes a block (known once the store opens)
        self._base = 0  # the arena's address (rows mode "l1"/"auto" with an arena)
        self._arena_rows = 0  # the arena's slots (the store's rows), when it is over the arena
        self._rows: np.ndarray | None = None  # the staging rows (mode "staging"), as numpy
        self._free_rows: list[int] = []
        self._staging_rows = 0
        self._row_waiters: collections.deque[tuple[int, asyncio.Future[list[int]]]] = collections.deque()
        self._locks: dict[bytes, list[Any]] = {}  # key → pins held for it by lookups, until unlocked
        self._counts = {"in_place": 0, "staged": 0, "unplaced": 0}
        self._warned = False

        self._store_efd = create_event_notifier()
        self._lookup_efd = create_event_notifier()
        self._load_efd = create_event_notifier()
        # task ids, result tables, tasks in flight, closing (re-entrant: a task that ends before
        # add_done_callback runs its callback, which takes it, in the submitting thread)
        self._lock = threading.RLock()
        self._next_task_id = 0
        self._stores_done: dict[int, L2StoreResult] = {}
        self._lookups_done: dict[int, Any] = {}
        self._loads_done: dict[int, Any] = {}
        self._in_flight: set[concurrent.futures.Future[None]] = set()
        self._closing = False
        self._closed = False
        if not (config.persistent or config.block_bytes):
            # opened at the first chunk, whose size sets the block's: the room is checked now
            share = config.capacity_bytes // len(config.root_dirs)
            for directory in config.root_dirs:
                refuse_beyond_free_space(f"UringKVL2Adapter: capacity_bytes={config.capacity_bytes} "
                                         f"({size_text(share)} in {directory})", share, directory)
        self._loop = LoopThread(name="uring-kv-lmcache")
        # Open now where the block size is known (a persistent adapter's kept keys are hits from
        # the start; a store the disk has no room for is refused here, not at the first chunk).
        if config.persistent or config.block_bytes:
            try:
                self._loop.run(self._open(None))
            except BaseException:
                self._loop.close()
                raise

    # ---------------------------------------------------------------- event fds
    def get_store_event_fd(self) -> int:
        return int(self._store_efd.fileno())

    def get_lookup_and_lock_event_fd(self) -> int:
        return int(self._lookup_efd.fileno())

    def get_load_event_fd(self) -> int:
        return int(self._load_efd.fileno())

    # ---------------------------------------------------------------- submits (any thread)
    def submit_store_task(self, keys: list[Any], objects: list[Any]) -> int:
        return self._submit(lambda tid: self._store_task(tid, list(keys), list(objects)),
                            lambda tid: self._post("_stores_done", tid, L2StoreResult(False, 0), self._store_efd))

    def submit_lookup_and_lock_task(self, keys: list[Any], group_layout_descs: Any = None) -> int:
        return self._submit(lambda tid: self._lookup_task(tid, list(keys)),
                            lambda tid: self._post("_lookups_done", tid, Bitmap(len(keys)), self._lookup_efd))

    def submit_load_task(self, keys: list[Any], objects: list[Any]) -> int:
        return self._submit(lambda tid: self._load_task(tid, list(keys), list(objects)),
                            lambda tid: self._post("_loads_done", tid, Bitmap(len(keys)), self._load_efd))

    def submit_unlock(self, keys: list[Any]) -> None:
        encoded = [_key(key) for key in keys]
        with self._lock:
            if self._closing:  # closing releases every pin
                return
            self._loop.submit(self._unlock(encoded))

    def pop_completed_store_tasks(self) -> dict[int, L2StoreResult]:
        with self._lock:
            done, self._stores_done = self._stores_done, {}
        return done

    def query_lookup_and_lock_result(self, task_id: int) -> Any:
        with self._lock:
            return self._lookups_done.pop(task_id, None)

    def query_load_result(self, task_id: int) -> Any:
        with self._lock:
            return self._loads_done.pop(task_id, None)

    def _submit(self, task: Callable[[int], Coroutine[Any, Any, None]], refuse: Callable[[int], None]) -> int:
        with self._lock:
            task_id = self._next_task_id
            self._next_task_id += 1
            if not self._closing:
                future = self._loop.submit(task(task_id))
                self._in_flight.add(future)
                future.add_done_callback(self._task_ended)
                return task_id
        refuse(task_id)  # closed: the task fails at once
        return task_id

    def _task_ended(self, future: concurrent.futures.Future[None]) -> None:
        with self._lock:
            self._in_flight.discard(future)

    def _post(self, table: str, task_id: int, result: Any, efd: Any) -> None:
        """Put a task's result in its table (named: pop_completed_store_tasks swaps the store
        table, so it is looked up under the lock), then signal the task's eventfd."""
        with self._lock:
            getattr(self, table)[task_id] = result
            if self._closed:
                return
            efd.notify()

    # ---------------------------------------------------------------- the tasks (the store's loop)
    async def _store_task(self, task_id: int, keys: list[Any], objects: list[Any]) -> None:
        result = L2StoreResult(False, 0)
        try:
            result = await self._store_objects(keys, objects)
        except Exception:
            logger.exception("UringKVL2Adapter: store task %d (%d keys) failed", task_id, len(keys))
        finally:
            self._post("_stores_done", task_id, result, self._store_efd)

    async def _store_objects(self, keys: list[Any], objects: list[Any]) -> L2StoreResult:
        if len(keys) != len(objects):
            raise ValueError(f"{len(keys)} keys but {len(objects)} objects")
        if not keys:
            return L2StoreResult(True, 0)
        store = await self._open(objects[0])
        fresh: dict[bytes, tuple[Any, Any]] = {}  # the keys to write (a key twice is written once)
        for key, obj in zip(keys, objects, strict=True):
            encoded = _key(key)
            if not store.contains(encoded):  # one held already is not written again
                fresh.setdefault(encoded, (key, obj))
        in_place, staged = self._place({k: obj for k, (_, obj) in fresh.items()})
        written: list[bytes] = []
        failed = len(fresh) - len(in_place) - len(staged)  # no row for them: misses
        if in_place:
            done, failures = await self._put(store, in_place)
            written += done
            failed += failures
        for piece in self._pieces(staged):
            rows = await self._take_rows(len(piece))
            try:
                await self._copy([(fresh[k][1], row) for k, row in zip(piece, rows, strict=True)], into_rows=True)
                done, failures = await self._put(store, list(zip(piece, rows, strict=True)))
            finally:
                self._give_rows(rows)
            written += done
            failed += failures
        if written:
            self._notify_keys_stored([fresh[k][0] for k in written], [fresh[k][1].get_size() for k in written])
        return L2StoreResult(failed == 0, sum(fresh[k][1].get_size() for k in written))

    async def _put(self, store: BlockStore | StripedBlockStore,
                   pairs: list[tuple[bytes, int]]) -> tuple[list[bytes], int]:
        """Put (key, row) pairs: the keys stored, and how many were not."""
        keys = [k for k, _ in pairs]
        try:
            await store.put(keys, [row for _, row in pairs])
        except KeyIOError as error:
            return [k for k in keys if k not in error.failures], len(error.failures)
        return keys, 0

    async def _lookup_task(self, task_id: int, keys: list[Any]) -> None:
        bitmap = Bitmap(len(keys))
        try:
            store = self._store
            if store is not None and not store.closed:
                encoded = [_key(key) for key in keys]
                for i, (key, handle) in enumerate(zip(encoded, store.pin(encoded), strict=True)):
                    if handle is not None:
                        bitmap.set(i)
                        self._locks.setdefault(key, []).append(handle)
        except Exception:
            logger.exception("UringKVL2Adapter: lookup task %d (%d keys) failed", task_id, len(keys))
            bitmap = Bitmap(len(keys))
        finally:
            self._post("_lookups_done", task_id, bitmap, self._lookup_efd)

    async def _unlock(self, keys: list[bytes]) -> None:
        store = self._store
        for key in keys:
            handles = self._locks.get(key)
            if not handles:
                continue  # not locked (a lookup miss): nothing to release
            handle = handles.pop()
            if not handles:
                del self._locks[key]
            if store is not None:
                store.unpin([handle])

    async def _load_task(self, task_id: int, keys: list[Any], objects: list[Any]) -> None:
        bitmap = Bitmap(len(keys))
        try:
            loaded = await self._load_objects(keys, objects)
            for i in loaded:
                bitmap.set(i)
            if loaded:
                self._notify_keys_accessed([keys[i] for i in loaded])
        except Exception:
            logger.exception("UringKVL2Adapter: load task %d (%d keys) failed", task_id, len(keys))
            bitmap = Bitmap(len(keys))  # nothing vouched for
        finally:
            self._post("_loads_done", task_id, bitmap, self._load_efd)

    async def _load_objects(self, keys: list[Any], objects: list[Any]) -> list[int]:
        """The positions of the keys whose bytes are now in their objects."""
        if len(keys) != len(objects):
            raise ValueError(f"{len(keys)} keys but {len(objects)} objects")
        store = self._store
        if store is None or store.closed or not keys:
            return []
        encoded = [_key(key) for key in keys]
        # (a key missing now is left out; one evicted before its read is left out by get_present)
        in_place, staged = self._place({i: objects[i] for i, k in enumerate(encoded) if store.contains(k)})
        loaded: list[int] = []
        if in_place:
            present = set(await store.get_present([encoded[i] for i, _ in in_place], [row for _, row in in_place]))
            loaded += [i for i, _ in in_place if encoded[i] in present]
        for piece in self._pieces(staged):
            rows = await self._take_rows(len(piece))
            try:
                present = set(await store.get_present([encoded[i] for i in piece], rows))
                back = [(i, row) for i, row in zip(piece, rows, strict=True) if encoded[i] in present]
                await self._copy([(objects[i], row) for i, row in back], into_rows=False)
            finally:
                self._give_rows(rows)
            loaded += [i for i, _ in back]
        return sorted(loaded)

    # ---------------------------------------------------------------- rows
    def _place(self, objects: dict[Any, Any]) -> tuple[list[tuple[Any, int]], list[Any]]:
        """Where each object's bytes go: (id, row) for those that are a row of the L1 arena, the ids
        of those copied through staging rows; any other (outside the arena's slots in mode "l1",
        larger than a block) is in neither list."""
        in_place: list[tuple[Any, int]] = []
        staged: list[Any] = []
        block = self._block
        for ident, obj in objects.items():
            if self._arena_rows:
                offset = int(obj.data_ptr) - self._base
                row, rest = divmod(offset, block)
                if rest == 0 and 0 <= row < self._arena_rows and int(obj.get_physical_size()) == block:
                    in_place.append((ident, row))
                else:
                    self._counts["unplaced"] += 1
                    if not self._warned:
                        self._warned = True
                        logger.warning("UringKVL2Adapter: a chunk of %d bytes lies outside the L1 arena's %d-byte "
                                       "slots: it is not stored (a miss); rows=\"staging\" copies such chunks",
                                       obj.get_physical_size(), block)
            elif int(obj.get_size()) <= block:
                staged.append(ident)
            else:
                self._counts["unplaced"] += 1
        self._counts["in_place"] += len(in_place)
        self._counts["staged"] += len(staged)
        return in_place, staged

    def _pieces(self, ids: list[Any]) -> list[list[Any]]:
        """``ids`` in pieces of at most the staging rows."""
        n = self._staging_rows
        return [ids[i:i + n] for i in range(0, len(ids), n)] if ids else []

    async def _take_rows(self, count: int) -> list[int]:
        """``count`` staging rows (at most all of them), first come first served."""
        if not self._row_waiters and len(self._free_rows) >= count:
            rows, self._free_rows = self._free_rows[:count], self._free_rows[count:]
            return rows
        waiter: asyncio.Future[list[int]] = asyncio.get_running_loop().create_future()
        self._row_waiters.append((count, waiter))
        return await waiter

    def _give_rows(self, rows: list[int]) -> None:
        self._free_rows += rows
        while self._row_waiters and len(self._free_rows) >= self._row_waiters[0][0]:
            count, waiter = self._row_waiters.popleft()
            if waiter.done():  # (cancelled)
                continue
            taken, self._free_rows = self._free_rows[:count], self._free_rows[count:]
            waiter.set_result(taken)

    async def _copy(self, pairs: list[tuple[Any, int]], into_rows: bool) -> None:
        """Copy each object's bytes into its staging row, or back; on a worker thread when large."""
        rows = self._rows
        assert rows is not None

        def run() -> None:
            for obj, row in pairs:
                data = np.frombuffer(obj.byte_array, dtype=np.uint8)
                if into_rows:
                    rows[row, :data.size] = data
                else:
                    data[:] = rows[row, :data.size]

        if sum(int(obj.get_size()) for obj, _ in pairs) <= _INLINE_COPY_BYTES:
            run()
        else:
            await asyncio.to_thread(run)

    async def _open(self, first: Any) -> BlockStore | StripedBlockStore:
        """The store, opened on first use with the block size of the first chunk (``first``; None
        when ``block_bytes`` is configured)."""
        if self._store is not None:
            return self._store
        if self._open_failed is not None:
            raise RuntimeError("UringKVL2Adapter: the block store could not be opened") from self._open_failed
        if self._opening is not None:
            await asyncio.shield(self._opening)
            assert self._store is not None
            return self._store
        self._opening = asyncio.get_running_loop().create_future()
        try:
            store = self._make_store(int(self._config.block_bytes or first.get_physical_size()))
            await store.open()
        except BaseException as exc:
            self._open_failed = exc
            self._opening.set_exception(exc)
            self._opening.exception()  # (marked retrieved: each waiter raises its own error)
            raise
        self._store = store
        self._opening.set_result(None)
        return store

    def _make_store(self, block: int) -> BlockStore | StripedBlockStore:
        """The block store over the arena's slots of ``block`` bytes, or over staging rows."""
        cfg, arena = self._config, self._arena
        self._block = block
        if arena is not None and int(arena.size) // block:
            self._base = int(arena.ptr)
            self._arena_rows = int(arena.size) // block
            caches = torch.frombuffer(view_of(self._base, self._arena_rows * block),
                                      dtype=torch.uint8).view(self._arena_rows, block)
        else:
            if cfg.rows == "l1":
                raise ValueError(f"UringKVL2Adapter: the L1 arena holds no {block}-byte block")
            count = max(1, cfg.staging_bytes // block)
            # page-aligned rows: O_DIRECT reads go straight into them
            raw = torch.empty(count * block + 4096, dtype=torch.uint8)
            start = -raw.data_ptr() % 4096
            caches = raw[start:start + count * block].view(count, block)
            self._rows = caches.numpy()
            self._free_rows = list(range(count))
            self._staging_rows = count
        # a file per block size when persistent; the keys carry the model and rank
        name = f"uring-kv-lmcache-{block}.bin" if cfg.persistent else "uring-kv-lmcache.bin"
        return open_store({"chunks": caches}, cfg.store, name, fingerprint="uring_kv LMCache L2 adapter",
                          threaded=False)

    # ---------------------------------------------------------------- the rest of the interface
    def get_usage(self) -> AdapterUsage:
        """Bytes held (keys × block size) and the capacity (LMCache's own eviction is not needed:
        the store evicts to stay within it)."""
        store = self._store
        if store is None:
            return AdapterUsage(total_bytes_used=0, total_capacity_bytes=0)
        stats = store.stats()
        return AdapterUsage(total_bytes_used=stats["keys"] * self._block,
                            total_capacity_bytes=stats["capacity_blocks"] * self._block)

    def stats(self) -> dict[str, int]:
        """The block store's counters (keys held, capacity, evictions, failures, pins) and the
        adapter's: chunks moved in place (``in_place``), through staging rows (``staged``), or not
        at all (``unplaced``: outside the arena's slots, or larger than a block)."""
        store = self._store
        return {**(store.stats() if store is not None else {}), **self._counts, "block_bytes": self._block}

    def report_status(self) -> dict[str, Any]:
        return {"is_healthy": self._loop.thread.is_alive() and self._open_failed is None,
                "type": "UringKVL2Adapter", "root_dir": self._config.root_dir,
                "mode": "l1" if self._arena_rows else "staging" if self._block else "not opened",
                **self.stats()}

    def close(self) -> None:
        """Refuse new tasks, let those under way finish (each posts its result), close the store
        (nothing is left on disk), join the loop's thread, close the event fds. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closing = True
            pending = list(self._in_flight)
        concurrent.futures.wait(pending)
        try:
            self._loop.run(self._shutdown())
        finally:
            self._loop.close()
            with self._lock:
                self._closed = True
            for efd in (self._store_efd, self._lookup_efd, self._load_efd):
                efd.close()
            self._rows = None
            gc.collect()  # the engine's last references to the arena

    async def _shutdown(self) -> None:
        self._locks.clear()
        store, self._store = self._store, None
        if store is not None:
            await store.aclose()


__all__ = ["UringKVL2Adapter", "UringKVL2AdapterConfig"]
