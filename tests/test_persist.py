"""The persistent block store: restarts serve the keys, a different geometry is refused, files stay
private, the LRU order and the capacity survive, a block is checked on load, the index's orders
(sync before commit, old row deleted before reuse) hold, and index failures never serve bad bytes.

Blocks identify themselves (``uring_kv.testing``): key ``key(i)`` always holds block ``i`` at
version 1. Crash safety under real kills is ``test_crash.py``."""

from __future__ import annotations

import errno
import hashlib
import os
import stat
import threading
import time
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
from aio import settle, task_group
from conftest import BOTH_BACKENDS

import uring_kv._index as index_module
from uring_kv import BlockStore, EngineClosedError, GeometryMismatchError, KeyIOError, SyncBlockStore
from uring_kv._index import Index
from uring_kv.testing import fill, id_caches, identify


def key(i: int) -> bytes:
    return hashlib.sha256(b"block %d" % i).digest()


def store_at(path: Path, caches: Any, capacity: int = 8, **kwargs: Any) -> BlockStore:
    kwargs.setdefault("fingerprint", "model-a")
    return BlockStore(caches, path, capacity, 4, persistent=True, **kwargs)


async def put_ids(store: BlockStore, caches: dict[str, torch.Tensor], ids: list[int]) -> None:
    rows = list(range(len(ids)))
    for i, row in zip(ids, rows, strict=True):
        fill(caches, row, i, 1)
    await store.put([key(i) for i in ids], rows)


async def check_ids(store: BlockStore, caches: dict[str, torch.Tensor], ids: list[int]) -> None:
    """Every id in ``ids`` loads back as itself, intact."""
    rows = list(range(len(caches["layer0"]) - len(ids), len(caches["layer0"])))
    await store.get([key(i) for i in ids], rows)
    assert [identify(caches, row) for row in rows] == [(i, 1, True) for i in ids]


def files_of(path: Path) -> dict[str, int]:
    """The store's files beside ``path``, with their modes."""
    return {p.name: stat.S_IMODE(p.stat().st_mode) for p in path.parent.iterdir() if p.name.startswith(path.name)}


@pytest.mark.parametrize("anyio_backend", BOTH_BACKENDS)
@pytest.mark.parametrize("io", ["uring", "threads"])
async def test_a_reopened_store_serves_its_keys_byte_exact(tmp_path: Path, io: str) -> None:
    """Keys put before a clean close load back after a reopen, in a fresh process's caches."""
    path = tmp_path / "kv.bin"
    caches = id_caches("cpu", blocks=16)
    async with store_at(path, caches, io=io) as store:
        await put_ids(store, caches, [0, 1, 2, 3, 4])
        assert store.stats()["restored"] == 0
    assert files_of(path) == {"kv.bin": 0o600, "kv.bin.index": 0o600}  # the WAL was checkpointed away
    caches = id_caches("cpu", blocks=16)  # all -1: nothing left over from the first run
    async with store_at(path, caches, io=io) as store:
        assert store.lookup([key(i) for i in range(5)]) == 5 and not store.contains(key(5))
        stats = store.stats()
        assert stats["restored"] == 5 and stats["keys"] == 5 and stats["free_blocks"] == 3
        await check_ids(store, caches, [4, 0, 3, 1, 2])
        await put_ids(store, caches, [5])
    async with store_at(path, id_caches("cpu", blocks=16), io=io) as store:
        assert store.stats()["restored"] == 6


async def test_every_file_is_0600_even_under_a_permissive_umask(tmp_path: Path) -> None:
    path = tmp_path / "kv.bin"
    old = os.umask(0)
    try:
        async with store_at(path, id_caches("cpu")) as store:
            await put_ids(store, id_caches("cpu"), [0])
            modes = files_of(path)
    finally:
        os.umask(old)
    assert modes == {"kv.bin": 0o600, "kv.bin.index": 0o600, "kv.bin.index-wal": 0o600}, modes


@pytest.mark.parametrize("which", ["kv.bin", "kv.bin.index"])
async def test_a_file_others_can_read_is_refused(tmp_path: Path, which: str) -> None:
    path = tmp_path / "kv.bin"
    async with store_at(path, id_caches("cpu")):
        pass
    os.chmod(tmp_path / which, 0o644)
    with pytest.raises(PermissionError, match="mode 0644: other users may read it"):
        await store_at(path, id_caches("cpu")).open()


@pytest.mark.parametrize("which", ["kv.bin", "kv.bin.index"])
async def test_a_symlink_is_refused(tmp_path: Path, which: str) -> None:
    target = tmp_path / "elsewhere"
    target.write_bytes(b"")
    target.chmod(0o600)
    (tmp_path / which).symlink_to(target)
    with pytest.raises(OSError, match="is a symbolic link"):
        await store_at(tmp_path / "kv.bin", id_caches("cpu")).open()
    assert target.read_bytes() == b""


async def test_a_second_store_on_the_same_files_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "kv.bin"
    async with store_at(path, id_caches("cpu")):
        with pytest.raises(OSError, match="in use by another process"):
            await store_at(path, id_caches("cpu")).open()
    async with store_at(path, id_caches("cpu")):  # free again once the first closed
        pass


@pytest.mark.parametrize("change", ["fingerprint", "dtype", "block shape", "tensor count", "tensor name"])
async def test_a_different_geometry_is_refused_and_the_files_are_left_alone(tmp_path: Path, change: str) -> None:
    path = tmp_path / "kv.bin"
    caches = id_caches("cpu")
    async with store_at(path, caches) as store:
        await put_ids(store, caches, [0, 1])
    before = {name: (tmp_path / name).read_bytes() for name in files_of(path)}
    fingerprint, other = "model-a", id_caches("cpu")
    if change == "fingerprint":
        fingerprint = "model-b"
    elif change == "dtype":  # same bytes per block, other meaning
        other = {name: t.view(torch.float32) for name, t in other.items()}
    elif change == "block shape":
        other = {name: t.view(len(t), 1, -1) for name, t in other.items()}  # same bytes per block
    elif change == "tensor count":
        other["layer4"] = other["layer0"].clone()
    else:
        other = {f"k{name}": t for name, t in other.items()}
    store = store_at(path, other, fingerprint=fingerprint)
    with pytest.raises(GeometryMismatchError) as info:
        await store.open()
    message = str(info.value)
    assert "\n" not in message and f"persistent store {path}" in message and "refusing" in message
    assert {"fingerprint": "'model-b' here", "dtype": "float32", "block shape": "int32[1, 61]",
            "tensor count": "have 5 tensors here", "tensor name": "'klayer0'"}[change] in message
    assert store.closed
    assert {name: (tmp_path / name).read_bytes() for name in files_of(path)} == before
    async with store_at(path, id_caches("cpu")) as store:  # the right geometry still serves them
        assert store.stats()["restored"] == 2


async def test_a_different_stride_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same caches on a file whose I/O alignment differs would place blocks elsewhere."""
    path = tmp_path / "kv.bin"
    async with store_at(path, id_caches("cpu")) as store:
        stride = store.engine.file.stride
    real = index_module.Index.restore

    async def other_stride(self: Index, data_fd: int, stride: int, capacity: int, fresh: bool) -> Any:
        return await real(self, data_fd, stride * 2, capacity, fresh)

    monkeypatch.setattr(index_module.Index, "restore", other_stride)
    with pytest.raises(GeometryMismatchError, match=f"stride .* is {stride * 2} here, the files were written "
                                                    f"with {stride}"):
        await store_at(path, id_caches("cpu")).open()


@pytest.mark.parametrize("anyio_backend", BOTH_BACKENDS)
async def test_a_store_closed_while_it_opens_fails_its_open_cleanly(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """aclose() while open() restores the index (a slow disk): open() raises EngineClosedError,
    the store serves nothing, and the restore never read through an fd that aclose() closed
    (once it did: EBADF, or a number reused by another file). The files stay sound."""
    path = tmp_path / "kv.bin"
    caches = id_caches("cpu")
    async with store_at(path, caches) as store:
        await put_ids(store, caches, [0, 1])
    real = Index._restore
    restoring = threading.Event()

    def slow_restore(self: Index, data_fd: int, *args: Any) -> Any:  # on the index's thread
        restoring.set()
        time.sleep(0.2)  # a slow disk: aclose() runs meanwhile
        return real(self, data_fd, *args)

    monkeypatch.setattr(Index, "_restore", slow_restore)
    store = store_at(path, caches)
    async with task_group() as tasks:
        opening = tasks.spawn(store.open)
        while not restoring.is_set():
            await anyio.sleep(0.005)
        await store.aclose()
        with pytest.raises(EngineClosedError, match="closed while it opened"):
            await opening.join()
    assert store.closed and not store.contains(key(0)) and store.stats()["keys"] == 0
    monkeypatch.undo()
    async with store_at(path, caches) as again:
        await check_ids(again, caches, [0, 1])


async def test_the_lru_order_and_the_capacity_survive_a_restart(tmp_path: Path) -> None:
    """Uses made before the close (a get of key 0, a re-put of key 1) count after it: the next two
    new keys evict keys 2 and 3, the least recently used. Mutation tried: uses not saved at close
    (keys 0 and 1 evicted)."""
    path = tmp_path / "kv.bin"
    caches = id_caches("cpu", blocks=16)
    async with store_at(path, caches, capacity=4) as store:
        await put_ids(store, caches, [0, 1, 2, 3])
        await check_ids(store, caches, [0])
        await put_ids(store, caches, [1])
    async with store_at(path, caches, capacity=4) as store:
        assert store.stats()["free_blocks"] == 0
        await put_ids(store, caches, [4, 5])
        assert [store.contains(key(i)) for i in range(6)] == [True, True, False, False, True, True]
        stats = store.stats()
        assert stats["keys"] == 4 and stats["free_blocks"] == 0 and stats["evictions"] == 2
        await check_ids(store, caches, [0, 1, 4, 5])


async def test_a_smaller_capacity_drops_the_keys_beyond_it_and_a_larger_one_adds_blocks(tmp_path: Path) -> None:
    path = tmp_path / "kv.bin"
    caches = id_caches("cpu", blocks=16)
    async with store_at(path, caches, capacity=6) as store:
        await put_ids(store, caches, [0, 1, 2, 3, 4, 5])
        blocks = {k: e.disk_block for k, e in store._index.items()}
    async with store_at(path, caches, capacity=3) as store:
        kept = sorted(i for i in range(6) if blocks[key(i)] < 3)
        assert [i for i in range(6) if store.contains(key(i))] == kept and len(kept) == 3
        assert store.stats()["free_blocks"] == 0
        await check_ids(store, caches, kept)
    async with store_at(path, caches, capacity=8) as store:
        assert store.stats()["keys"] == 3 and store.stats()["free_blocks"] == 5
        await put_ids(store, caches, [6, 7, 8, 9, 10])
        assert store.stats()["evictions"] == 0
        await check_ids(store, caches, [*kept, 6, 7, 8, 9, 10])


async def test_a_block_changed_on_disk_fails_its_check_and_is_forgotten(tmp_path: Path) -> None:
    """A block overwritten behind the store's back between runs: its first load after the reopen
    fails the crc32c check (EBADMSG), the key is dropped, and it stays dropped after the next
    reopen. Mutation tried: adopting the blocks without their sums (the load returned the bad
    bytes)."""
    path = tmp_path / "kv.bin"
    caches = id_caches("cpu", blocks=16)
    async with store_at(path, caches) as store:
        await put_ids(store, caches, [0, 1, 2])
        block_of_1, stride = store._index[key(1)].disk_block, store.engine.file.stride
    with open(path, "r+b") as f:
        f.seek(block_of_1 * stride + 100)
        f.write(b"\x01\x02\x03")
    async with store_at(path, caches) as store:
        with pytest.raises(KeyIOError) as info:
            await store.get([key(0), key(1), key(2)], [5, 6, 7])
        assert info.value.failures == {key(1): errno.EBADMSG}
        assert identify(caches, 5) == (0, 1, True) and identify(caches, 7) == (2, 1, True)
        assert not store.contains(key(1)) and store.stats()["load_failures"] == 1
    async with store_at(path, caches) as store:
        assert [store.contains(key(i)) for i in range(3)] == [True, False, True]
        assert store.stats()["free_blocks"] == 6


async def test_a_block_file_made_anew_forgets_the_index(tmp_path: Path) -> None:
    """The block file removed between runs: the index's rows name bytes that are gone."""
    path = tmp_path / "kv.bin"
    caches = id_caches("cpu")
    async with store_at(path, caches) as store:
        await put_ids(store, caches, [0, 1])
    path.unlink()
    async with store_at(path, caches) as store:
        assert store.stats()["keys"] == 0 and store.stats()["restored"] == 0


async def test_without_persistence_nothing_is_left_and_the_options_are_checked(tmp_path: Path) -> None:
    path = tmp_path / "kv.bin"
    caches = id_caches("cpu")
    async with BlockStore(caches, path, 8, 4) as store:
        await put_ids(store, caches, [0])
        assert os.listdir(tmp_path) == []
    assert os.listdir(tmp_path) == []
    with pytest.raises(ValueError, match="apply to a persistent store"):
        BlockStore(caches, path, 8, fingerprint="m")
    with pytest.raises(ValueError, match="apply to a persistent store"):
        BlockStore(caches, path, 8, fsync=False)
    with pytest.raises(ValueError, match="checksum=False is refused"):
        BlockStore(caches, path, 8, persistent=True, checksum=False)
    with pytest.raises(TypeError, match="keep_file"):
        BlockStore(caches, path, 8, keep_file=True)


@pytest.mark.parametrize("fsync", [True, False], ids=["fsync", "no-fsync"])
async def test_rows_are_committed_after_the_data_sync_and_keys_visible_after_the_commit(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fsync: bool) -> None:
    """With fsync, the block file is fdatasync'ed, in the transaction's group, while the index
    holds none of the put's rows yet; the keys become visible only once the rows are committed.
    Without fsync, no fdatasync at all. Mutations tried: committing before the sync (the rows
    were there at the sync), keys visible before the commit (contains() was True at it)."""
    path = tmp_path / "kv.bin"
    caches = id_caches("cpu", blocks=16)
    events: list[tuple[str, Any]] = []
    store = store_at(path, caches, fsync=fsync)
    real_sync, real_commit = os.fdatasync, Index._commit

    def rows_in_index() -> int:  # (on the index thread, which owns the connection)
        assert store._journal is not None and store._journal.db is not None and store._journal.db._conn is not None
        return int(store._journal.db._conn.execute("SELECT count(*) FROM blocks").fetchone()[0])

    def fdatasync(fd: int) -> None:
        events.append(("fdatasync", rows_in_index()))
        real_sync(fd)

    def commit(self: Index, group: list[Any]) -> None:
        keys = [row[0] for request in group for row in request.inserts]
        events.append(("group", keys))
        events.append(("visible", [store.contains(k) for k in keys]))
        real_commit(self, group)
        events.append(("committed", rows_in_index()))

    monkeypatch.setattr(os, "fdatasync", fdatasync)
    monkeypatch.setattr(Index, "_commit", commit)
    async with store:
        await put_ids(store, caches, [0, 1])
        assert store.contains(key(0)) and store.contains(key(1))
    start = events.index(("group", [key(0), key(1)]))
    expected = [("visible", [False, False]), *([("fdatasync", 0)] if fsync else []), ("committed", 2)]
    assert events[start + 1:start + 1 + len(expected)] == expected
    assert sum(what == "fdatasync" for what, _ in events) == (1 if fsync else 0)


async def test_a_reused_blocks_old_row_is_deleted_before_the_block_is_written(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An eviction gives key 0's block to key 2: the deletion of key 0's row commits before the
    engine writes that block. Mutation tried: writing without waiting for the deletion (the
    write began while it was pending)."""
    path = tmp_path / "kv.bin"
    caches = id_caches("cpu", blocks=16)
    store = store_at(path, caches, capacity=2)
    deleted: list[int] = []
    written: list[tuple[list[int], list[int]]] = []  # (blocks written, blocks whose deletion committed then)
    real_commit = Index._commit

    def commit(self: Index, group: list[Any]) -> None:
        real_commit(self, group)
        deleted.extend(disk_block for request in group for _, disk_block in request.deletes)

    monkeypatch.setattr(Index, "_commit", commit)
    async with store:
        real_store = store.engine.store_batch

        async def store_batch(gpu_blocks: Any, disk_blocks: Any, after: Any = None) -> None:
            written.append((list(disk_blocks), list(deleted)))
            await real_store(gpu_blocks, disk_blocks, after)

        store.engine.store_batch = store_batch  # type: ignore[method-assign]
        await put_ids(store, caches, [0, 1])
        await put_ids(store, caches, [2])
        assert not store.contains(key(0)) and store.contains(key(2))
    (first, none_deleted), (second, deleted_then) = written
    assert none_deleted == [] and len(second) == 1 and second[0] in first
    assert deleted_then == second


async def test_a_failed_deletion_keeps_the_block_out_of_use_and_its_key_safe(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The index refuses the deletion of an evicted key's row: the put that needed its block fails
    (EIO), the block is never written in this run, and after a restart the evicted key (whose
    row survived) still loads its own bytes. Mutation tried: freeing the block anyway (it was
    counted free again, for the next put to write)."""
    path = tmp_path / "kv.bin"
    caches = id_caches("cpu", blocks=16)
    real_commit = Index._commit

    def commit(self: Index, group: list[Any]) -> None:
        if any(request.deletes for request in group):
            for request in group:
                self._deliver(request.fut, None, OSError(errno.EIO, "injected"))
            return
        real_commit(self, group)

    async with store_at(path, caches, capacity=2) as store:
        await put_ids(store, caches, [0, 1])
        monkeypatch.setattr(Index, "_commit", commit)
        with pytest.raises(KeyIOError) as info:
            await put_ids(store, caches, [2])
        assert info.value.failures == {key(2): errno.EIO}
        stats = store.stats()
        assert stats["keys"] == 1 and stats["free_blocks"] == 0 and stats["lost_blocks"] == 1
        assert stats["index_failures"] >= 1
        with pytest.raises(KeyIOError):  # key 1's block: its deletion fails too
            await put_ids(store, caches, [3])
        assert store.stats()["keys"] == 0 and store.stats()["lost_blocks"] == 2
        assert store.stats()["free_blocks"] == 0
        monkeypatch.undo()
    async with store_at(path, caches, capacity=2) as store:
        assert store.stats()["restored"] == 2
        await check_ids(store, caches, [0, 1])


@pytest.mark.parametrize("anyio_backend", BOTH_BACKENDS)
@pytest.mark.parametrize("when", ["writing", "committing"])
async def test_a_cancelled_put_leaves_no_key_now_or_after_a_restart(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, when: str) -> None:
    """A put cancelled while its blocks are written, or while its rows are being committed (the
    commit cannot be called back, so the rows may land): its keys are invisible, its blocks free,
    and after a restart none of its keys is served. Mutation tried: not deleting the rows of a put
    cancelled while committing (its keys came back after the restart)."""
    path = tmp_path / "kv.bin"
    caches = id_caches("cpu", blocks=16)
    committing = threading.Event()
    real_commit = Index._commit

    def slow_commit(self: Index, group: list[Any]) -> None:
        if any(request.inserts for request in group):
            committing.set()
            time.sleep(0.3)
        real_commit(self, group)

    options: dict[str, Any] = {"copy_delay": 0.2} if when == "writing" else {}
    if when == "committing":
        monkeypatch.setattr(Index, "_commit", slow_commit)
    async with store_at(path, caches, **options) as store:
        async with task_group() as tasks:
            put = tasks.spawn(put_ids, store, caches, [0, 1, 2])
            if when == "writing":
                await settle()
                assert store.stats()["writing"] == 3
            else:
                while not committing.is_set():
                    await anyio.sleep(0.005)
            put.cancel()
        assert put.cancelled
        stats = store.stats()
        assert stats["keys"] == 0 and stats["writing"] == 0 and stats["free_blocks"] == 8
        monkeypatch.undo()
        await put_ids(store, caches, [3])
    async with store_at(path, caches) as store:
        assert [i for i in range(4) if store.contains(key(i))] == [3]
        assert store.stats()["free_blocks"] == 7
        await check_ids(store, caches, [3])


def test_a_persistent_sync_store_round_trips(tmp_path: Path) -> None:
    path = tmp_path / "kv.bin"
    caches = id_caches("cpu", blocks=16)
    for i in range(3):
        fill(caches, i, i, 1)
    with SyncBlockStore(caches, path, 8, 4, persistent=True, fingerprint="m", fsync=False) as store:
        store.put([key(i) for i in range(3)], range(3))
    caches = id_caches("cpu", blocks=16)
    with SyncBlockStore(caches, path, 8, 4, persistent=True, fingerprint="m", fsync=False) as store:
        assert store.lookup([key(i) for i in range(3)]) == 3
        store.get([key(2), key(0)], [5, 6])
    assert identify(caches, 5) == (2, 1, True) and identify(caches, 6) == (0, 1, True)
