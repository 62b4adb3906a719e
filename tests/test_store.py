"""The key-addressed block store: bytes round trip, a hard capacity, LRU order, no eviction of a block
in flight, keys visible only once written, failures turned into misses, and calls of one key racing.

Blocks identify themselves (``uring_kv.testing``): key ``key(i)`` always holds block ``i`` at
version 1, so a check tells another key's bytes, a torn block or a stale version apart."""

from __future__ import annotations

import errno
import hashlib
import os
import random
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
from aio import settle, task_group
from conftest import BOTH_BACKENDS, random_caches, reported_errors
from faultfs import FaultState
from tmpfs import take_space

from uring_kv import BlockStore, EngineClosedError, KeyIOError, KeyMissingError
from uring_kv.errors import NO_ROOM
from uring_kv.testing import fill, id_caches, identify

StoreFactory = Callable[..., BlockStore]


def key(i: int) -> bytes:
    return hashlib.sha256(b"block %d" % i).digest()


def fill_keys(caches: dict[str, torch.Tensor], ids: list[int], rows: list[int], version: int = 1) -> None:
    for block_id, row in zip(ids, rows, strict=True):
        fill(caches, row, block_id, version)


def used_blocks(store: BlockStore) -> list[int]:
    """The disk blocks the index and the writes in flight hold (each must be distinct, in range)."""
    return sorted([e.disk_block for e in store._index.values()] + [e.disk_block for e in store._writing.values()])


@pytest.fixture
async def make_store(tmp_path: Path) -> AsyncIterator[StoreFactory]:
    """Stores over tmp_path; after the test each is closed, and must leave nothing held or on disk."""
    stores: list[BlockStore] = []

    def make(caches: Any, capacity_blocks: int | None = None, num_slots: int = 4, path: Path | None = None,
             **kwargs: Any) -> BlockStore:
        store = BlockStore(caches, path or tmp_path / f"kv{len(stores)}.bin", capacity_blocks, num_slots, **kwargs)
        stores.append(store)
        return store

    with reported_errors() as loop_errors:
        yield make
        for store in stores:
            await store.aclose()
            engine = store.engine
            assert store.closed and engine.closed
            assert store.stats()["keys"] == 0 and store.stats()["pinned"] == 0
            if hasattr(engine, "pool"):
                assert engine.pool.held == 0, "a lease is still held after close"
                assert engine.io.inflight == 0, "an SQE is still in flight after close"
                assert not engine.bridge.alive, "the bridge thread is still running"
                assert engine.file.closed, "the block file is still open"
            assert not os.path.exists(engine.path), "a file was left at the store's path"
    assert not loop_errors, f"a completion handler failed: {loop_errors}"


@pytest.mark.parametrize("anyio_backend", BOTH_BACKENDS)
@pytest.mark.parametrize("io", ["uring", "threads"])
async def test_round_trip_is_byte_exact(make_store: StoreFactory, io: str) -> None:
    caches = random_caches("cpu", layers=3, blocks=16, shape=(7, 9))  # odd sizes: padded blocks
    originals = {name: t[:6].clone() for name, t in caches.items()}
    async with make_store(caches, 8, io=io) as store:
        keys = [key(i) for i in range(6)]
        await store.put(keys, range(6))
        assert store.lookup(keys) == 6 and all(store.contains(k) for k in keys)
        await store.get(keys[::-1], range(15, 9, -1))
        for name, t in caches.items():
            assert torch.equal(t[10:16], originals[name]), f"cache {name!r} came back different"
        assert store.stats() == {"keys": 6, "capacity_blocks": 8, "free_blocks": 2, "writing": 0, "pinned": 0,
                                 "evictions": 0, "store_failures": 0, "load_failures": 0, "no_room": 0}


async def test_capacity_is_never_exceeded_under_many_puts(make_store: StoreFactory) -> None:
    """Concurrent puts and gets of 40 keys over 8 blocks: the index never holds more than 8 keys,
    no two keys share a block, the file keeps its size, and every visible key reads back right.
    Mutation tried: allocating past the capacity (the engine refuses the block: ValueError)."""
    capacity = 8
    caches = id_caches("cpu", blocks=64)
    rng = random.Random(3)
    async with make_store(caches, capacity, copy_delay=0.0005) as store:
        size = os.fstat(store.engine.file.fd).st_size
        assert size == capacity * store.engine.file.stride

        async def worker(index: int) -> None:
            rows = list(range(index * 8, index * 8 + 8))
            for _ in range(25):
                ids = rng.sample(range(40), rng.randint(1, 5))
                if rng.random() < 0.6:
                    fill_keys(caches, ids, rows[:len(ids)])
                    try:
                        await store.put([key(i) for i in ids], rows[:len(ids)])
                    except KeyIOError as exc:  # every block in flight
                        assert set(exc.failures.values()) == {NO_ROOM}
                else:
                    present = [i for i in ids if store.contains(key(i))]
                    await store.get([key(i) for i in present], rows[:len(present)])
                    assert [identify(caches, r) for r in rows[:len(present)]] == [(i, 1, True) for i in present]
                blocks = used_blocks(store)
                assert len(store._index) <= capacity and len(blocks) == len(set(blocks)) <= capacity
                assert all(0 <= b < capacity for b in blocks)

        async with task_group() as tasks:
            for index in range(4):
                tasks.spawn(worker, index)
        stats = store.stats()
        assert stats["keys"] + stats["free_blocks"] == capacity and stats["evictions"] > 0
        assert os.fstat(store.engine.file.fd).st_size == size


async def test_eviction_takes_the_least_recently_used_key(make_store: StoreFactory) -> None:
    """get and put of a present key use it; lookups do not. Mutations tried: get not touching
    (key 0 evicted), a re-put not touching (key 1 evicted), a lookup touching (key 2 kept)."""
    caches = id_caches("cpu", blocks=8)
    async with make_store(caches, 4) as store:
        for i in range(4):
            fill(caches, i, i, 1)
            await store.put([key(i)], [i])  # LRU order: 0 1 2 3
        await store.get([key(0)], [4])  # 1 2 3 0
        await store.put([key(1)], [1])  # 2 3 0 1, and not written again
        assert store.contains(key(2)) and store.lookup([key(2), key(3)]) == 2  # no change
        for i in (4, 5):
            fill(caches, i, i, 1)
            await store.put([key(i)], [i])
        assert [store.contains(key(i)) for i in range(6)] == [True, True, False, False, True, True]
        assert store.stats()["evictions"] == 2
        assert store.engine.metrics()["store"]["blocks"] == 6  # key 1 was written once
        await store.get([key(i) for i in (0, 1, 4, 5)], [4, 5, 6, 7])
        assert [identify(caches, r) for r in (4, 5, 6, 7)] == [(i, 1, True) for i in (0, 1, 4, 5)]


async def test_a_block_being_read_is_never_evicted(make_store: StoreFactory) -> None:
    """Capacity 2, keys 0 and 1. A slow get of key 0 is in flight; a put of keys 2 and 3 needs two
    blocks: key 1 is evicted for key 2, and key 3 finds no room, since key 0's block is being read.
    Mutation tried: eviction ignoring pins (key 3 took key 0's block; key 0 was gone after its get)."""
    caches = id_caches("cpu", blocks=8)
    async with make_store(caches, 2, copy_delay=0.1) as store:
        fill_keys(caches, [0, 1], [0, 1])
        await store.put([key(0), key(1)], [0, 1])
        fill_keys(caches, [2, 3], [2, 3])
        async with task_group() as tasks:
            get = tasks.spawn(store.get, [key(0)], [4])
            await settle()
            assert store.stats()["pinned"] == 1
            with pytest.raises(KeyIOError) as info:
                await store.put([key(2), key(3)], [2, 3])
            assert info.value.failures == {key(3): NO_ROOM} and info.value.written == 1
            await get.join()
        assert identify(caches, 4) == (0, 1, True)
        assert [store.contains(key(i)) for i in range(4)] == [True, False, True, False]
        assert store.stats()["no_room"] == 1 and store.stats()["pinned"] == 0


async def test_a_pinned_key_is_never_evicted_until_unpinned(make_store: StoreFactory) -> None:
    """Capacity 2, keys 0 and 1, key 0 pinned (a framework's lookup-and-lock): a put of keys 2 and 3
    evicts key 1 for key 2 and finds no room for key 3; once unpinned, key 0 is evicted in its LRU
    turn. A pin of a missing key is None; a failed load of a pinned key drops it, and its block is
    freed by the unpin. Unpins after close do nothing. Mutation tried: a pin that takes no reader
    count (caught by the first check)."""
    caches = id_caches("cpu", blocks=8)
    async with make_store(caches, 2) as store:
        fill_keys(caches, [0, 1, 2, 3, 5], [0, 1, 2, 3, 5])
        await store.put([key(0), key(1)], [0, 1])
        handles = store.pin([key(0), key(9)])
        assert handles[1] is None and store.stats()["pinned"] == 1
        with pytest.raises(KeyIOError) as info:
            await store.put([key(2), key(3)], [2, 3])
        assert info.value.failures == {key(3): NO_ROOM}
        assert [store.contains(key(i)) for i in range(4)] == [True, False, True, False]
        await store.get([key(0)], [4])  # a get beside the pin: still pinned afterwards
        assert identify(caches, 4) == (0, 1, True) and store.stats()["pinned"] == 1
        store.unpin(handles)
        assert store.stats()["pinned"] == 0
        await store.put([key(3)], [3])  # LRU order was 2, 0: key 2 goes
        await store.put([key(5)], [5])  # then key 0
        assert [store.contains(key(i)) for i in (0, 2, 3, 5)] == [False, False, True, True]
        pinned = store.pin([key(3)])
        os.ftruncate(store.engine.file.fd, 0)  # every load fails now
        with pytest.raises(KeyIOError):
            await store.get([key(3)], [6])
        assert not store.contains(key(3)) and store.stats()["free_blocks"] == 0
        store.unpin(pinned)
        assert store.stats()["free_blocks"] == 1 and store.stats()["pinned"] == 0
        late = store.pin([key(5)])
        assert store.stats()["pinned"] == 1
    assert store.stats()["pinned"] == 0
    store.unpin(late)
    assert store.stats()["pinned"] == 0 and store.stats()["keys"] == 0


async def test_a_block_being_written_is_never_evicted_nor_visible(make_store: StoreFactory) -> None:
    """While a slow put of keys 0..3 is in flight, none of them is visible (a get misses at once,
    touching nothing) and their blocks are not evictable (a put of key 4 finds no room); once
    written, all four are. Mutation tried: a key visible from its allocation (lookups saw it
    during the write, and key 4 evicted it)."""
    caches = id_caches("cpu", blocks=8)
    async with make_store(caches, 4, copy_delay=0.05) as store:
        fill_keys(caches, [0, 1, 2, 3, 4], [0, 1, 2, 3, 4])
        keys = [key(i) for i in range(4)]
        async with task_group() as tasks:
            put = tasks.spawn(store.put, keys, [0, 1, 2, 3])
            await settle()
            assert store.lookup(keys) == 0 and not any(store.contains(k) for k in keys)
            assert store.stats()["writing"] == 4
            with pytest.raises(KeyMissingError) as missing:
                await store.get([key(0)], [5])
            assert missing.value.keys == [key(0)]
            assert identify(caches, 5) == (-1, -1, False)
            with pytest.raises(KeyIOError) as info:
                await store.put([key(4)], [4])
            assert info.value.failures == {key(4): NO_ROOM}
            await put.join()
        assert store.lookup(keys) == 4 and not store.contains(key(4))
        await store.get(keys, [4, 5, 6, 7])
        assert [identify(caches, r) for r in (4, 5, 6, 7)] == [(i, 1, True) for i in range(4)]


async def test_a_key_being_written_by_another_put_is_written_once(make_store: StoreFactory) -> None:
    """A second put of a key still being written waits for that write and returns with the key
    visible, holding the first put's bytes (one store, not two)."""
    caches = id_caches("cpu", blocks=8)
    async with make_store(caches, 4, copy_delay=0.05) as store:
        fill(caches, 0, 0, 1)
        fill(caches, 1, 0, 2)  # the same key's row in the second call, as another version
        async with task_group() as tasks:
            first = tasks.spawn(store.put, [key(0)], [0])
            await settle()
            assert await store.put([key(0)], [1]) == 0  # it wrote nothing: the first put did
            assert store.contains(key(0))
            assert await first.join() == 1
        await store.get([key(0)], [2])
        assert identify(caches, 2) == (0, 1, True)
        assert store.engine.metrics()["store"]["blocks"] == 1
        fill(caches, 3, 1, 1)
        assert await store.put([key(0), key(1)], [1, 3]) == 1  # key 0 held: only key 1 is written


async def test_a_get_beside_a_put_of_the_same_key_reads_the_old_complete_bytes(make_store: StoreFactory) -> None:
    """Key 0 holds version 1. A slow get of it runs beside a put of it whose row holds version 2:
    the get returns version 1, intact, and so does every later get (a present key is not rewritten)."""
    caches = id_caches("cpu", blocks=8)
    async with make_store(caches, 4, copy_delay=0.05) as store:
        fill(caches, 0, 0, 1)
        await store.put([key(0)], [0])
        fill(caches, 1, 0, 2)
        async with task_group() as tasks:
            get = tasks.spawn(store.get, [key(0)], [2])
            put = tasks.spawn(store.put, [key(0)], [1])
            await get.join()
            await put.join()
        await store.get([key(0)], [3])
        assert identify(caches, 2) == (0, 1, True) and identify(caches, 3) == (0, 1, True)


async def test_racing_calls_on_few_keys_never_deliver_wrong_bytes(make_store: StoreFactory) -> None:
    """Workers put, get and cancel calls on 12 keys over 5 blocks: a get delivers every row's own
    key, intact, or misses; a cancelled put leaves its keys invisible or complete. The index and
    the free blocks add up to the capacity."""
    capacity = 5
    caches = id_caches("cpu", blocks=32)
    async with make_store(caches, capacity, num_slots=2, copy_delay=0.001) as store:
        async def worker(index: int) -> None:
            rng = random.Random(index)
            rows = list(range(index * 8, index * 8 + 8))
            for _ in range(30):
                ids = rng.sample(range(12), rng.randint(1, 3))
                keys = [key(i) for i in ids]
                if rng.random() < 0.5:
                    fill_keys(caches, ids, rows[:len(ids)])
                    with anyio.move_on_after(rng.choice([0.0005, 1.0])):
                        try:
                            await store.put(keys, rows[:len(ids)])
                        except KeyIOError as exc:
                            assert set(exc.failures.values()) <= {NO_ROOM, errno.ECANCELED}
                    continue
                for r in rows[:len(ids)]:
                    for t in caches.values():
                        t[r].fill_(-1)
                try:
                    await store.get(keys, rows[:len(ids)])
                except KeyMissingError:
                    continue
                assert [identify(caches, r) for r in rows[:len(ids)]] == [(i, 1, True) for i in ids]

        async with task_group() as tasks:
            for index in range(4):
                tasks.spawn(worker, index)
        stats = store.stats()
        assert stats["keys"] + stats["free_blocks"] == capacity and stats["writing"] == stats["pinned"] == 0
        visible = [i for i in range(12) if store.contains(key(i))]
        await store.get([key(i) for i in visible], range(len(visible)))
        assert [identify(caches, r) for r in range(len(visible))] == [(i, 1, True) for i in visible]


async def test_a_missing_key_is_named_before_any_io(make_store: StoreFactory) -> None:
    caches = id_caches("cpu", blocks=8)
    async with make_store(caches, 4) as store:
        fill(caches, 0, 0, 1)
        await store.put([key(0)], [0])
        with pytest.raises(KeyMissingError, match=key(7).hex()) as info:
            await store.get([key(0), key(7)], [4, 5])
        assert isinstance(info.value, KeyError) and info.value.keys == [key(7)]
        assert identify(caches, 4) == (-1, -1, False)
        assert store.engine.metrics()["load"]["batches"] == 0
        assert store.stats()["pinned"] == 0


@pytest.mark.parametrize(("keys", "rows", "error", "match"), [
    ([b"a", b"b"], [0], ValueError, "keys has 2 entries but rows has 1"),
    (["a"], [0], TypeError, r"keys\[0\] is a str"),
    (b"ab", [0, 1], TypeError, "not one key"),
    ([b"a", b"a"], [0, 1], ValueError, "a key appears twice"),
    ([b"a", b"b"], [1, 1], ValueError, "a row appears twice"),
    ([b"a"], [8], ValueError, r"rows\[0\] = 8 is out of range \[0, 8\)"),
    ([b"a"], [True], TypeError, "bool"),
    ([b"a"], [1.0], TypeError, "must be an integer"),
    ([b"a"], [1], TypeError, "only applies to CUDA caches"),  # (with after=)
])
async def test_bad_arguments_change_nothing(make_store: StoreFactory, keys: Any, rows: Any,
                                            error: type[Exception], match: str) -> None:
    caches = id_caches("cpu", blocks=8)
    async with make_store(caches, 1) as store:
        fill(caches, 0, 0, 1)
        await store.put([key(0)], [0])
        before = store.stats()
        after = object() if "CUDA" in match else None
        with pytest.raises(error, match=match):
            await store.put(keys, rows, after)
        assert store.stats() == before and store.contains(key(0))


def test_capacity_is_given_once_in_blocks_or_bytes(tmp_path: Path) -> None:
    caches = id_caches("cpu", blocks=4)  # 4 × 244 bytes a block: one 4 KiB page padded
    assert BlockStore(caches, tmp_path / "kv.bin", capacity_bytes=10 * 4096 + 4000).capacity == 10
    with pytest.raises(ValueError, match="one of them"):
        BlockStore(caches, tmp_path / "kv.bin")
    with pytest.raises(ValueError, match="one of them"):
        BlockStore(caches, tmp_path / "kv.bin", 4, capacity_bytes=4096)
    with pytest.raises(ValueError, match="holds no block"):
        BlockStore(caches, tmp_path / "kv.bin", capacity_bytes=4000)
    with pytest.raises(ValueError, match="num_disk_blocks must be a positive integer"):
        BlockStore(caches, tmp_path / "kv.bin", 0)


async def test_capacity_bytes_bounds_the_file(make_store: StoreFactory) -> None:
    caches = id_caches("cpu", blocks=4)
    async with make_store(caches, capacity_bytes=5 * 4096) as store:
        assert store.capacity == 5
        assert os.fstat(store.engine.file.fd).st_size <= 5 * 4096


async def test_a_failed_load_drops_the_key(make_store: StoreFactory) -> None:
    """The file is cut short under the store: a get of keys 0 and 2 loads key 0 and fails key 2,
    which is then a miss (not a hit that fails again, not stale bytes), its block free for reuse.
    Mutation tried: leaving the key in the index (lookups kept reporting it)."""
    caches = id_caches("cpu", blocks=8)
    async with make_store(caches, 4) as store:
        fill_keys(caches, [0, 1, 2, 3], [0, 1, 2, 3])
        await store.put([key(i) for i in range(4)], [0, 1, 2, 3])
        os.ftruncate(store.engine.file.fd, 2 * store.engine.file.stride)  # blocks 2 and 3 now read short
        with pytest.raises(KeyIOError, match="EIO") as info:
            await store.get([key(0), key(2)], [4, 5])
        assert info.value.failures == {key(2): errno.EIO} and info.value.keys == [key(2)]
        assert identify(caches, 4) == (0, 1, True)
        assert store.lookup([key(0), key(1), key(2)]) == 2 and store.contains(key(3))
        with pytest.raises(KeyMissingError):
            await store.get([key(2)], [6])
        stats = store.stats()
        assert stats["load_failures"] == 1 and stats["keys"] == 3 and stats["free_blocks"] == 1
        fill(caches, 2, 2, 1)
        await store.put([key(2)], [2])  # into the freed block, which the write makes whole again
        await store.get([key(2)], [6])
        assert identify(caches, 6) == (2, 1, True)


async def test_a_failed_store_is_a_miss(make_store: StoreFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """The copy out of key 1's row fails (as a CUDA error would): the put names key 1, which stays
    invisible while the others land; put again, it lands. Mutation tried: making a failed key
    visible anyway (lookups hit, and every get of it failed)."""
    from uring_kv._native import BlockCopier

    monkeypatch.setenv("URING_KV_HOST_INLINE_BYTES", "0")  # copies on the copier's Python thread
    monkeypatch.setenv("URING_KV_DEBUG_NATIVE_COPIER", "0")
    monkeypatch.setenv("URING_KV_DEBUG_PUMP", "0")
    real_host = BlockCopier.host
    failing = {"left": 1}

    def flaky_host(self: BlockCopier, to_slot: bool, slot_addrs: Any, gpu_blocks: Any) -> None:
        if to_slot and failing["left"] and 1 in list(gpu_blocks):
            failing["left"] -= 1
            raise RuntimeError("injected copy failure")
        real_host(self, to_slot, slot_addrs, gpu_blocks)

    monkeypatch.setattr(BlockCopier, "host", flaky_host)
    caches = id_caches("cpu", blocks=8)
    async with make_store(caches, 4, num_slots=1) as store:
        fill_keys(caches, [0, 1, 2], [0, 1, 2])
        with reported_errors() as errors, pytest.raises(KeyIOError) as info:
            await store.put([key(0), key(1), key(2)], [0, 1, 2])
        assert len(errors) == 1 and "copy failed" in str(errors[0])
        assert info.value.failures == {key(1): errno.EIO}
        assert [store.contains(key(i)) for i in range(3)] == [True, False, True]
        with pytest.raises(KeyMissingError):
            await store.get([key(1)], [4])
        assert store.stats()["store_failures"] == 1 and store.stats()["free_blocks"] == 2
        await store.put([key(1)], [1])
        await store.get([key(0), key(1), key(2)], [4, 5, 6])
        assert [identify(caches, r) for r in (4, 5, 6)] == [(i, 1, True) for i in range(3)]


async def test_eio_on_write_makes_the_key_a_miss(fault_fs: tuple[Path, FaultState],
                                                 make_store: StoreFactory) -> None:
    """Real EIO from the filesystem for key 2's block (the put's third key takes block 2)."""
    mountpoint, state = fault_fs
    caches = id_caches("cpu", blocks=8)
    async with make_store(caches, 8, num_slots=2, path=mountpoint / "kv.bin") as store:
        state.fail_writes(store.engine.file.offset(2), store.engine.file.stride)
        fill_keys(caches, [0, 1, 2, 3], [0, 1, 2, 3])
        keys = [key(i) for i in range(4)]
        with pytest.raises(KeyIOError, match="EIO") as info:
            await store.put(keys, [0, 1, 2, 3])
        assert info.value.failures == {key(2): errno.EIO}
        assert store.lookup(keys) == 2 and store.contains(key(3))
        with pytest.raises(KeyMissingError):
            await store.get([key(2)], [4])
        await store.get([key(0), key(1), key(3)], [4, 5, 6])
        assert [identify(caches, r) for r in (4, 5, 6)] == [(0, 1, True), (1, 1, True), (3, 1, True)]
        state.clear()
        await store.put([key(2)], [2])
        await store.get([key(2)], [7])
        assert identify(caches, 7) == (2, 1, True)


async def test_eio_on_read_drops_the_key(fault_fs: tuple[Path, FaultState], make_store: StoreFactory) -> None:
    """Real EIO on key 1's block: the get names it, later lookups miss even once reads work again."""
    mountpoint, state = fault_fs
    caches = id_caches("cpu", blocks=8)
    async with make_store(caches, 8, num_slots=2, path=mountpoint / "kv.bin") as store:
        fill_keys(caches, [0, 1, 2], [0, 1, 2])
        await store.put([key(i) for i in range(3)], [0, 1, 2])
        state.fail_reads(store.engine.file.offset(1), store.engine.file.stride)
        with pytest.raises(KeyIOError) as info:
            await store.get([key(0), key(1), key(2)], [4, 5, 6])
        assert info.value.failures == {key(1): errno.EIO}
        assert identify(caches, 4) == (0, 1, True) and identify(caches, 6) == (2, 1, True)
        state.clear()
        assert not store.contains(key(1))
        with pytest.raises(KeyMissingError):
            await store.get([key(1)], [5])


async def test_enospc_makes_the_keys_that_did_not_fit_misses(tiny_tmpfs: Path, make_store: StoreFactory) -> None:
    """A 4 MiB store on a tmpfs left with 1 MiB: the puts that run out of space name their keys
    with ENOSPC, those keys are misses, and every key that did land reads back intact."""
    caches = id_caches("cpu", layers=64, blocks=16)  # 64 layers × 244 bytes: 16 KiB blocks after padding
    async with make_store(caches, 256, path=tiny_tmpfs / "kv.bin") as store:
        take_space(tiny_tmpfs, leave=1 << 20)
        failed: dict[bytes, int] = {}
        for first in range(0, 256, 8):
            ids = list(range(first, first + 8))
            fill_keys(caches, ids, list(range(8)))
            try:
                await store.put([key(i) for i in ids], range(8))
            except KeyIOError as exc:
                failed.update(exc.failures)
        assert failed and set(failed.values()) == {errno.ENOSPC}
        stored = [i for i in range(256) if key(i) not in failed]
        assert all(store.contains(key(i)) for i in stored) and not any(store.contains(k) for k in failed)
        assert store.stats()["keys"] == len(stored) and store.stats()["store_failures"] == len(failed)
        for first in range(0, len(stored), 8):
            chunk = stored[first:first + 8]
            await store.get([key(i) for i in chunk], range(8, 8 + len(chunk)))
            assert [identify(caches, r) for r in range(8, 8 + len(chunk))] == [(i, 1, True) for i in chunk]


async def test_a_cancelled_put_leaves_its_keys_invisible_and_blocks_free(make_store: StoreFactory) -> None:
    caches = id_caches("cpu", blocks=8)
    async with make_store(caches, 4, num_slots=1, copy_delay=0.05) as store:
        fill_keys(caches, [0, 1, 2, 3], [0, 1, 2, 3])
        with anyio.move_on_after(0.02):
            await store.put([key(i) for i in range(4)], [0, 1, 2, 3])
        assert store.lookup([key(i) for i in range(4)]) == 0
        assert store.stats()["free_blocks"] == 4 and store.stats()["writing"] == 0
        await store.put([key(i) for i in range(4)], [0, 1, 2, 3])  # and the store goes on
        assert store.lookup([key(i) for i in range(4)]) == 4


async def test_aclose_lets_calls_under_way_finish_then_refuses(make_store: StoreFactory) -> None:
    caches = id_caches("cpu", blocks=8)
    store = make_store(caches, 4, copy_delay=0.05)
    await store.open()
    fill_keys(caches, [0, 1], [0, 1])
    async with task_group() as tasks:
        put = tasks.spawn(store.put, [key(0), key(1)], [0, 1])
        await settle()
        await store.aclose()
        await put.join()  # it finished: its keys landed before the engine closed
    assert store.closed and not store.contains(key(0)) and store.stats()["keys"] == 0
    assert store.engine.metrics()["store"]["blocks"] == 2
    with pytest.raises(EngineClosedError):
        await store.put([key(2)], [2])
    with pytest.raises(EngineClosedError):
        await store.get([key(0)], [2])
