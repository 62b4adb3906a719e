"""The striped store: keys spread over several files, one engine each, bytes identical whichever
file holds them, a failing file failing only its own keys, persistence per file.

Blocks identify themselves (``uring_kv.testing``): key ``key(i)`` always holds block ``i`` at
version 1."""

from __future__ import annotations

import asyncio
import errno
import hashlib
from pathlib import Path
from typing import Any

import pytest
import torch
from aio import settle, task_group
from conftest import BOTH_BACKENDS, random_caches
from faultfs import FaultState

from uring_kv import (
    EngineClosedError,
    GeometryMismatchError,
    KeyIOError,
    KeyMissingError,
    StripedBlockStore,
    SyncBlockStore,
)
from uring_kv.testing import fill, id_caches, identify


def key(i: int) -> bytes:
    return hashlib.sha256(b"block %d" % i).digest()


def spread(store: StripedBlockStore, ids: range) -> dict[int, list[int]]:
    """The ids each stripe holds."""
    by_stripe: dict[int, list[int]] = {}
    for i in ids:
        position = store.stripe_of(key(i))
        assert position is not None, f"no stripe holds key {i}"
        by_stripe.setdefault(position, []).append(i)
    return by_stripe


@pytest.mark.parametrize("anyio_backend", BOTH_BACKENDS)
async def test_bytes_come_back_identical_from_every_file(tmp_path: Path) -> None:
    caches = random_caches("cpu", layers=3, blocks=48, shape=(7, 9))  # odd sizes: padded blocks
    originals = {name: t[:24].clone() for name, t in caches.items()}
    paths = [tmp_path / f"drive{n}" / "kv.bin" for n in range(3)]
    for path in paths:
        path.parent.mkdir()
    async with StripedBlockStore(caches, paths, 30, 4) as store:
        assert [stripe.capacity for stripe in store.stripes] == [10, 10, 10]
        assert await store.put([key(i) for i in range(24)], range(24)) == 24  # the keys written
        assert await store.put([key(0), key(1)], [0, 1]) == 0  # held already: refreshed, not written
        held = [stripe.stats()["keys"] for stripe in store.stripes]
        assert sum(held) == 24 and all(held), f"a file got no key: {held}"
        for position, ids in spread(store, range(24)).items():
            assert all(store.stripes[position].contains(key(i)) for i in ids)
        assert store.lookup([key(i) for i in range(24)]) == 24 and not store.contains(key(99))
        await store.get([key(i) for i in reversed(range(24))], range(24, 48))
        for name, t in caches.items():
            assert torch.equal(t[24:48].flip(0), originals[name]), f"cache {name!r} came back different"
        stats = store.stats()
        assert stats["keys"] == 24 and stats["capacity_blocks"] == 30 and stats["stripes"] == 3
        with pytest.raises(KeyMissingError) as info:
            await store.get([key(0), key(99)], [40, 41])
        assert info.value.keys == [key(99)]
        assert await store.get_present([key(99), key(3), key(5)], [40, 41, 42]) == [key(3), key(5)]


async def test_capacity_is_split_and_checked(tmp_path: Path) -> None:
    caches = id_caches("cpu")
    store = StripedBlockStore(caches, [tmp_path / "a", tmp_path / "b", tmp_path / "c"], 10)
    assert [stripe.capacity for stripe in store.stripes] == [4, 3, 3] and store.capacity == 10
    with pytest.raises(ValueError, match="cannot give each of the 3 files a block"):
        StripedBlockStore(caches, [tmp_path / "a", tmp_path / "b", tmp_path / "c"], 2)
    with pytest.raises(ValueError, match="appears twice"):
        StripedBlockStore(caches, [tmp_path / "a", tmp_path / "a"], 4)
    with pytest.raises(TypeError, match="not one path"):
        StripedBlockStore(caches, str(tmp_path / "a"), 4)


async def test_a_failing_file_fails_only_its_own_keys(tmp_path: Path, fault_fs: tuple[Path, FaultState]) -> None:
    """Stripe 1's file is on the fault filesystem. Every write there failing (EIO): a put fails
    for exactly that stripe's keys and lands the others. Then, once stored, every read there
    failing: a get fails for exactly those keys, which become misses, and the others load."""
    mountpoint, state = fault_fs
    caches = id_caches("cpu", blocks=48)
    paths = [tmp_path / "kv0.bin", mountpoint / "kv1.bin", tmp_path / "kv2.bin"]
    async with StripedBlockStore(caches, paths, 48, 4) as store:
        by_stripe = {n: [i for i in range(24) if i % 3 == n] for n in range(3)}  # a put's keys go round
        for i in range(24):
            fill(caches, i, i, 1)
        state.fail_writes(0, 1 << 40)
        with pytest.raises(KeyIOError) as info:
            await store.put([key(i) for i in range(24)], range(24))
        assert info.value.failures == {key(i): errno.EIO for i in by_stripe[1]}
        assert [i for i in range(24) if store.contains(key(i))] == sorted(by_stripe[0] + by_stripe[2])
        state.clear()
        await store.put([key(i) for i in by_stripe[1]], by_stripe[1])  # placed anew: over every file
        assert store.lookup([key(i) for i in range(24)]) == 24
        by_stripe = spread(store, range(24))
        assert all(by_stripe.get(position) for position in range(3))
        state.fail_reads(0, 1 << 40)
        with pytest.raises(KeyIOError) as info:
            await store.get([key(i) for i in range(24)], range(24, 48))
        assert info.value.failures == {key(i): errno.EIO for i in by_stripe[1]}
        for row, i in enumerate(range(24), start=24):
            if i not in by_stripe[1]:
                assert identify(caches, row) == (i, 1, True)
        assert [i for i in range(24) if store.contains(key(i))] == sorted(by_stripe[0] + by_stripe[2])


async def test_persistent_stripes_reopen_and_refuse_reordered_paths(tmp_path: Path) -> None:
    paths = [tmp_path / "a.bin", tmp_path / "b.bin"]
    caches = id_caches("cpu", blocks=16)
    options: dict[str, Any] = {"persistent": True, "fingerprint": "m", "fsync": False}
    async with StripedBlockStore(caches, paths, 16, 4, **options) as store:
        for i in range(8):
            fill(caches, i, i, 1)
        await store.put([key(i) for i in range(8)], range(8))
    caches = id_caches("cpu", blocks=16)
    async with StripedBlockStore(caches, paths, 16, 4, **options) as store:
        assert store.stats()["restored"] == 8
        await store.get([key(i) for i in range(8)], range(8, 16))
        assert [identify(caches, row) for row in range(8, 16)] == [(i, 1, True) for i in range(8)]
    with pytest.raises(GeometryMismatchError, match=r"'m \(stripe 1 of 2\)' here, the files were written with "
                                                    r"'m \(stripe 2 of 2\)'"):
        await StripedBlockStore(caches, paths[::-1], 16, 4, **options).open()


def test_a_sync_store_over_a_list_of_paths_stripes(tmp_path: Path) -> None:
    caches = id_caches("cpu", blocks=16)
    for i in range(6):
        fill(caches, i, i, 1)
    with SyncBlockStore(caches, [tmp_path / "a.bin", tmp_path / "b.bin"], 8, 4) as store:
        assert isinstance(store.store, StripedBlockStore)
        store.put([key(i) for i in range(6)], range(6))
        assert store.lookup([key(i) for i in range(6)]) == 6 and store.stats()["stripes"] == 2
        store.get([key(5), key(0)], [10, 11])
    assert identify(caches, 10) == (5, 1, True) and identify(caches, 11) == (0, 1, True)


@pytest.mark.parametrize("anyio_backend", BOTH_BACKENDS)
async def test_a_put_fans_out_to_every_file_at_once(tmp_path: Path) -> None:
    """While one put of keys of every stripe runs (its copies slowed), every stripe is writing its
    part. Mutation tried: the parts run one after the other (only one stripe was writing)."""
    caches = id_caches("cpu", blocks=24)
    async with StripedBlockStore(caches, [tmp_path / f"kv{n}.bin" for n in range(3)], 48, 4,
                                 copy_delay=0.05) as store:
        async with task_group() as tasks:
            put = tasks.spawn(store.put, [key(i) for i in range(24)], range(24))
            await settle()
            assert [stripe.stats()["writing"] > 0 for stripe in store.stripes] == [True, True, True]
            await put.join()
        assert store.lookup([key(i) for i in range(24)]) == 24


@pytest.mark.parametrize("anyio_backend", BOTH_BACKENDS)
async def test_a_cancelled_striped_put_returns_once_every_stripe_let_go(tmp_path: Path) -> None:
    """Cancelling a put cancels every stripe's part and returns only once all have ended: no key
    visible, none being written, every block free."""
    caches = id_caches("cpu", blocks=24)
    async with StripedBlockStore(caches, [tmp_path / f"kv{n}.bin" for n in range(3)], 48, 4,
                                 copy_delay=0.05) as store:
        async with task_group() as tasks:
            put = tasks.spawn(store.put, [key(i) for i in range(24)], range(24))
            await settle()
            put.cancel()
        assert put.cancelled
        stats = store.stats()
        assert stats["keys"] == 0 and stats["writing"] == 0 and stats["free_blocks"] == 48
        assert all(stripe.engine.stats()["active_batches"] == 0 for stripe in store.stripes)


async def test_a_put_spreads_its_keys_evenly_and_a_held_key_stays_put(tmp_path: Path) -> None:
    """A put's new keys split evenly over the stripes (each batch waits for its fullest stripe);
    one-key puts go round the stripes; a key put again stays in the stripe that holds it; two puts
    placing the same key at once send it to one stripe. Mutations tried: placement by hash (the 40 keys
    split 11/12/8/9); each put placing its keys without looking at the others in flight (the key
    landed in two stripes)."""
    caches = id_caches("cpu", blocks=64)
    for i in range(64):
        fill(caches, i, i, 1)
    paths = [tmp_path / f"kv{n}.bin" for n in range(4)]
    async with StripedBlockStore(caches, paths, 80, 4) as store:
        await store.put([key(i) for i in range(40)], range(40))
        assert [stripe.stats()["keys"] for stripe in store.stripes] == [10, 10, 10, 10]
        for i in range(40, 43):
            await store.put([key(i)], [i])
        assert sorted(store.stripe_of(key(i)) for i in range(40, 43)) == [0, 1, 2]  # type: ignore[type-var]
        where = {i: store.stripe_of(key(i)) for i in range(43)}
        await store.put([key(i) for i in range(30, 43)], range(30, 43))  # held already: refreshed in place
        assert {i: store.stripe_of(key(i)) for i in range(43)} == where
        assert sum(stripe.stats()["keys"] for stripe in store.stripes) == 43
        async with task_group() as tasks:
            tasks.spawn(store.put, [key(50)], [50])
            tasks.spawn(store.put, [key(50), key(51)], [50, 51])
        assert [stripe.contains(key(50)) for stripe in store.stripes].count(True) == 1
        assert sum(stripe.stats()["keys"] for stripe in store.stripes) == 45
        await store.get([key(i) for i in (50, 51, 0, 42)], [60, 61, 62, 63])
        assert [identify(caches, row) for row in (60, 61, 62, 63)] == [(i, 1, True) for i in (50, 51, 0, 42)]


async def test_a_pinned_key_is_not_evicted_from_its_stripe(tmp_path: Path) -> None:
    """``pin`` holds each key in the stripe that has it, against eviction, until ``unpin``; a key
    no stripe holds gets None. Mutation tried: pin doing nothing (key 0 was evicted)."""
    caches = id_caches("cpu", blocks=32)
    for i in range(32):
        fill(caches, i, i, 1)
    async with StripedBlockStore(caches, [tmp_path / "a.bin", tmp_path / "b.bin"], 4, 4) as store:
        await store.put([key(i) for i in range(4)], range(4))
        handles = store.pin([key(0), key(99)])
        assert handles[1] is None and handles[0] is not None
        for i in range(4, 12):
            await store.put([key(i)], [i])
        assert store.contains(key(0)) and not store.contains(key(1))
        store.unpin(handles)
        for i in range(12, 20):
            await store.put([key(i)], [i])
        assert not store.contains(key(0))
        with pytest.raises(TypeError, match="not one key"):
            store.pin(key(1))  # type: ignore[arg-type]


async def test_a_get_racing_an_eviction_loads_every_key_it_does_not_report(tmp_path: Path) -> None:
    """A get's parts start a loop turn after it checked its keys; a put evicting one of them
    meanwhile fails that key alone (ENOENT) and every other key of its stripe is loaded. (Once, the
    stripe's whole part was skipped while only the evicted key was reported: rows left stale.)"""
    caches = id_caches("cpu", blocks=16)
    for i in range(6):
        fill(caches, i, i, 1)
    async with StripedBlockStore(caches, [tmp_path / "a.bin", tmp_path / "b.bin"], 4, 2) as store:
        await store.put([key(i) for i in range(4)], range(4))
        older, younger = spread(store, range(4))[0]  # stripe 0's keys, least recently used first
        fill(caches, 10, 99, 9)
        fill(caches, 11, 99, 9)
        async with task_group() as tasks:
            put = tasks.spawn(store.put, [key(4), key(5)], [4, 5])  # one new key a stripe: each evicts
            get = tasks.spawn(store.get, [key(older), key(younger)], [10, 11])
            await put.join()
            with pytest.raises(KeyIOError) as info:
                await get.join()
        assert info.value.failures == {key(older): errno.ENOENT}
        assert identify(caches, 11) == (younger, 1, True)
        assert identify(caches, 10) == (99, 9, True)  # the evicted key's row untouched


def test_a_striped_put_under_way_when_close_begins_finishes_in_every_stripe(tmp_path: Path) -> None:
    """aclose() called the loop turn after a put began (its stripes' parts scheduled, not started:
    what SyncBlockStore.close() right after a submit_put does) lets the put finish in every stripe.
    (Once, the first stripe was already closing when its part started: the put failed with
    EngineClosedError while the second stripe's keys landed.)"""
    caches = id_caches("cpu", blocks=16)
    for i in range(4):
        fill(caches, i, i, 1)

    async def main() -> list[int]:
        store = await StripedBlockStore(caches, [tmp_path / "a.bin", tmp_path / "b.bin"], 8, 2).open()
        put = asyncio.ensure_future(store.put([key(i) for i in range(4)], range(4)))
        await asyncio.sleep(0)  # the put's first step: keys placed, the parts scheduled
        await store.aclose()
        assert put.done() and put.exception() is None
        with pytest.raises(EngineClosedError):
            await store.put([key(5)], [5])
        return [stripe.engine.metrics()["store"]["blocks"] for stripe in store.stripes]

    assert asyncio.run(main()) == [2, 2]
