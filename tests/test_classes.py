"""I/O classes: demand loads before prefetches before stores, for slots and I/O room; a prefetch
upgraded to a demand load keeps what it read; a cancelled prefetch keeps the lease rule; stores
age past a stream of loads."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import EngineFactory, until

from uring_kv import BlockStore, Prefetch, SyncBlockStore
from uring_kv.testing import fill, id_caches, identify, store_identity


async def test_a_demand_load_overtakes_the_prefetches_and_stores_waiting_before_it(
        make_engine: EngineFactory) -> None:
    """One slot, held by a store; then, in this order, a store, a prefetch and a demand load wait
    for it: the demand load is served first, then the prefetch, then the stores. Under the rule
    without classes (loads before stores, FIFO among loads) the prefetch came before the demand."""
    caches = id_caches("cpu", blocks=16)
    async with make_engine(caches, 16, num_slots=1, copy_delay=0.03) as engine:
        await store_identity(engine, caches, 4)
        for block in range(8, 12):
            fill(caches, block, block, 2)
        finished: list[str] = []

        async def call(name: str, coroutine: Any) -> None:
            await coroutine
            finished.append(name)

        holder = asyncio.create_task(call("store 1", engine.store_batch([8, 9], [8, 9])))
        await until(lambda: engine.metrics()["store"]["inflight_calls"] == 1)
        waiting = [asyncio.create_task(call("store 2", engine.store_batch([10, 11], [10, 11])))]
        await until(lambda: engine.metrics()["store"]["queued_calls"] == 1)
        waiting.append(asyncio.create_task(call("prefetch", engine.load_batch([0, 1], [12, 13],
                                                                              prefetch=Prefetch()))))
        await until(lambda: engine.metrics()["prefetch"]["queued_calls"] == 1)
        waiting.append(asyncio.create_task(call("demand", engine.load_batch([2, 3], [14, 15]))))
        await until(lambda: engine.metrics()["load"]["queued_calls"] == 1)
        await asyncio.gather(holder, *waiting)
        assert finished.index("demand") < finished.index("prefetch") < finished.index("store 2")
        assert [identify(caches, row) for row in (12, 13, 14, 15)] == [(0, 1, True), (1, 1, True),
                                                                       (2, 1, True), (3, 1, True)]


async def test_an_upgraded_prefetch_goes_ahead_of_the_prefetches_before_it(make_engine: EngineFactory) -> None:
    caches = id_caches("cpu", blocks=16)
    async with make_engine(caches, 16, num_slots=1, copy_delay=0.03) as engine:
        await store_identity(engine, caches, 6)
        fill(caches, 8, 8, 2)
        finished: list[str] = []

        async def call(name: str, coroutine: Any) -> None:
            await coroutine
            finished.append(name)

        holder = asyncio.create_task(call("store", engine.store_batch([8], [8])))
        await until(lambda: engine.metrics()["store"]["inflight_calls"] == 1)
        first = asyncio.create_task(call("first", engine.load_batch([0, 1], [10, 11], prefetch=Prefetch())))
        await until(lambda: engine.metrics()["prefetch"]["queued_calls"] == 1)
        needed = Prefetch()
        second = asyncio.create_task(call("second", engine.load_batch([2, 3], [12, 13], prefetch=needed)))
        await until(lambda: engine.metrics()["prefetch"]["queued_calls"] == 2)
        needed.upgrade()  # its request was scheduled
        assert engine.metrics()["prefetch"]["queued_calls"] == 1 and engine.metrics()["load"]["queued_calls"] == 1
        await asyncio.gather(holder, first, second)
        assert finished == ["store", "second", "first"]


async def test_an_upgrade_mid_flight_keeps_the_blocks_read_and_reads_none_twice(make_engine: EngineFactory) -> None:
    caches = id_caches("cpu", blocks=16)
    async with make_engine(caches, 16, num_slots=2, copy_delay=0.02) as engine:
        await store_identity(engine, caches, 8)
        before = engine.metrics()["load"]
        prefetch = Prefetch()
        task = asyncio.create_task(engine.load_batch(list(range(8)), list(range(8, 16)), prefetch=prefetch))
        await until(lambda: engine.metrics()["prefetch"]["inflight_calls"] == 1)
        await asyncio.sleep(0.05)  # some blocks read and copied
        prefetch.upgrade()
        classes = engine.metrics()
        assert classes["prefetch"]["inflight_calls"] == 0 and classes["load"]["inflight_calls"] == 1
        await task
        after = engine.metrics()["load"]
        assert after["blocks"] - before["blocks"] == 8  # every block read once
        assert after["bytes"] - before["bytes"] == 8 * engine.block_bytes
        assert [identify(caches, row) for row in range(8, 16)] == [(b, 1, True) for b in range(8)]
        assert after["rate_bytes_s"] > 0 and engine.metrics()["prefetch"]["rate_bytes_s"] == 0  # served as demand


async def test_a_cancelled_prefetch_returns_only_after_its_blocks_and_frees_its_slots(
        make_engine: EngineFactory) -> None:
    """The lease rule for prefetches: cancelled with copies in flight, the call returns once they
    have landed; the caller then reuses its rows, and no late copy overwrites them."""
    caches = id_caches("cpu", blocks=8)
    async with make_engine(caches, 8, num_slots=2, copy_delay=0.03) as engine:
        await store_identity(engine, caches, 4)
        task = asyncio.create_task(engine.load_batch([0, 1, 2, 3], [4, 5, 6, 7], prefetch=Prefetch()))
        await until(lambda: engine.stats()["leases_held"] == 2)
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert engine.stats()["leases_held"] == 0 and engine.stats()["active_batches"] == 0
        for row in range(4, 8):
            fill(caches, row, 7, 9)  # the caller reuses its rows at once
        await asyncio.sleep(0.1)  # time for any late copy to land
        assert [identify(caches, row) for row in range(4, 8)] == [(7, 9, True)] * 4
        prefetch = engine.metrics()["prefetch"]
        assert prefetch["queued_calls"] == prefetch["inflight_calls"] == 0


async def test_a_store_ages_past_a_stream_of_demand_loads(make_engine: EngineFactory) -> None:
    """Two tasks keep a demand load always waiting for the one slot; a store called meanwhile
    still goes within about the aging bound (without aging it waited for the loads to stop)."""
    caches = id_caches("cpu", blocks=8)
    async with make_engine(caches, 8, num_slots=1, copy_delay=0.005) as engine:
        await store_identity(engine, caches, 2)
        fill(caches, 6, 6, 3)
        stop = asyncio.Event()
        loaded: list[float] = []  # when each load ended

        async def loads(block: int) -> None:
            while not stop.is_set():
                await engine.load_batch([block], [block + 2])
                loaded.append(time.monotonic())

        streams = [asyncio.create_task(loads(block)) for block in (0, 1)]
        await until(lambda: engine.metrics()["load"]["queued_calls"] >= 1)
        started = time.monotonic()
        store = asyncio.create_task(engine.store_batch([6], [6]))
        done, _ = await asyncio.wait([store], timeout=2.0)
        stored = time.monotonic()
        await asyncio.sleep(0.05)  # the loads go on after it
        stop.set()
        await asyncio.gather(*streams)
        await store
        assert store in done, "the store waited for the loads to stop"
        assert stored - started < 1.0
        assert any(when > stored for when in loaded), "the loads had stopped before the store went"
        await engine.load_batch([6], [7])
        assert identify(caches, 7) == (6, 3, True)


async def test_a_store_get_runs_as_a_prefetch_until_upgraded_from_another_thread(tmp_path: Path) -> None:
    caches = id_caches("cpu", blocks=16)
    async with BlockStore(caches, tmp_path / "kv", 8, num_slots=1, copy_delay=0.03) as store:
        for row in range(3):
            fill(caches, row, row, 1)
        await store.put([b"a", b"b"], [0, 1])
        metrics = store.engine.metrics
        holder = asyncio.create_task(store.put([b"c"], [2]))
        await until(lambda: metrics()["store"]["inflight_calls"] == 1)
        prefetch = Prefetch()
        get = asyncio.create_task(store.get_present([b"a", b"b", b"gone"], [8, 9, 10], prefetch=prefetch))
        await until(lambda: metrics()["prefetch"]["queued_calls"] == 1)
        await asyncio.to_thread(prefetch.upgrade)  # the framework's scheduler thread
        await until(lambda: metrics()["load"]["queued_calls"] == 1)
        assert metrics()["prefetch"]["queued_calls"] == 0
        assert await get == [b"a", b"b"]
        await holder
        assert [identify(caches, row)[:2] for row in (8, 9)] == [(0, 1), (1, 1)]


def test_the_sync_store_passes_a_prefetch_on(tmp_path: Path) -> None:
    caches = id_caches("cpu", blocks=16)
    with SyncBlockStore(caches, tmp_path / "kv", 8, num_slots=2) as store:
        fill(caches, 0, 0, 1)
        store.put([b"a"], [0])
        prefetch = Prefetch()
        future = store.submit_get([b"a"], [5], prefetch=prefetch)
        prefetch.upgrade()  # this thread; the call may be anywhere in its run
        future.result(5)
        assert identify(caches, 5) == (0, 1, True)
        prefetch.upgrade()  # idempotent


def test_one_prefetch_covers_every_call_made_with_it() -> None:
    prefetch, upgraded = Prefetch(), []
    assert prefetch.bind(lambda: upgraded.append(1)) and prefetch.bind(lambda: upgraded.append(2))
    prefetch.upgrade()
    prefetch.upgrade()
    assert upgraded == [1, 2]
    assert not prefetch.bind(lambda: upgraded.append(3))  # upgraded already: a demand load


async def test_a_prefetch_upgraded_before_its_call_runs_as_a_demand_load(make_engine: EngineFactory) -> None:
    caches = id_caches("cpu", blocks=8)
    async with make_engine(caches, 8, num_slots=1, copy_delay=0.03) as engine:
        await store_identity(engine, caches, 2)
        fill(caches, 5, 5, 2)
        holder = asyncio.create_task(engine.store_batch([5], [5]))
        await until(lambda: engine.metrics()["store"]["inflight_calls"] == 1)
        prefetch = Prefetch()
        prefetch.upgrade()
        task = asyncio.create_task(engine.load_batch([0, 1], [6, 7], prefetch=prefetch))
        await until(lambda: engine.metrics()["load"]["queued_calls"] == 1)
        assert engine.metrics()["prefetch"]["queued_calls"] == 0
        await asyncio.gather(holder, task)
        with pytest.raises(TypeError, match=r"prefetch must be a uring_kv\.Prefetch, got bool"):
            await engine.load_batch([0], [6], prefetch=True)  # type: ignore[arg-type]
