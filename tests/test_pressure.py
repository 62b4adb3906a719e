"""Back-pressure: each class's calls queued and in flight, its service rate, and a budget that
refuses a call at once (EBUSY) instead of letting it queue."""

from __future__ import annotations

import asyncio
import errno
from pathlib import Path

import pytest
from conftest import EngineFactory, until
from prometheus_client import CollectorRegistry, generate_latest

from uring_kv import BlockStore, EngineBusyError
from uring_kv._pressure import WINDOW_S, Pressure
from uring_kv._staging import IOClass
from uring_kv.metrics import PrometheusCollector
from uring_kv.testing import ELEMS, fill, id_caches, identify, store_identity

BLOCK = 4 * ELEMS * 4  # bytes of a block of id_caches' 4 int32 tensors
BUDGET = 3 * BLOCK  # two blocks fit, four do not


async def test_a_call_is_queued_until_its_first_block_starts_then_in_flight_until_it_ends(
        make_engine: EngineFactory) -> None:
    caches = id_caches("cpu", blocks=8)
    async with make_engine(caches, 8, num_slots=1, copy_delay=0.2) as engine:
        bb = engine.block_bytes
        for block in range(6):
            fill(caches, block, block, 1)
        first = asyncio.create_task(engine.store_batch([0, 1, 2, 3], [0, 1, 2, 3]))
        await until(lambda: engine.metrics()["store"]["inflight_calls"] == 1)
        second = asyncio.create_task(engine.store_batch([4, 5], [4, 5]))  # the one slot is the first's
        await until(lambda: engine.metrics()["store"]["queued_calls"] == 1)
        store = engine.metrics()["store"]
        assert (store["queued_bytes"], store["inflight_bytes"]) == (2 * bb, 4 * bb)
        assert engine.metrics()["load"]["queued_calls"] == engine.metrics()["load"]["inflight_calls"] == 0
        await asyncio.gather(first, second)
        store = engine.metrics()["store"]
        assert store["queued_calls"] == store["inflight_calls"] == store["queued_bytes"] == store["inflight_bytes"] == 0
        assert store["rate_bytes_s"] == 6 * bb / WINDOW_S  # both ended within the window
        assert store["refused_calls"] == 0 and store["budget_bytes"] == 0


async def test_past_its_budget_a_call_is_refused_at_once_having_taken_nothing(make_engine: EngineFactory) -> None:
    caches = id_caches("cpu", blocks=8)
    async with make_engine(caches, 8, num_slots=1, copy_delay=0.1, budgets={"store": BUDGET}) as engine:
        bb = engine.block_bytes
        assert bb == BLOCK
        for block in range(6):
            fill(caches, block, block, 1)
        first = asyncio.create_task(engine.store_batch([0, 1], [0, 1]))
        await until(lambda: engine.metrics()["store"]["inflight_calls"] == 1)
        with pytest.raises(EngineBusyError) as refused:
            await engine.store_batch([2, 3], [2, 3])
        assert refused.value.errno == errno.EBUSY
        assert refused.value.strerror == (f"store of {2 * bb} bytes refused: {2 * bb} bytes of stores are queued or in "
                                      f"flight, the budget is {BUDGET}")
        assert engine.metrics()["store"]["refused_calls"] == 1
        assert engine.metrics()["store"]["queued_calls"] == 0  # the refused call left nothing behind
        load = asyncio.create_task(engine.load_batch([0], [7]))  # loads have no budget: never refused
        await first
        await load
        assert identify(caches, 7) == (0, 1, True)
        # nothing pending: a call larger than the budget goes alone, and the refused blocks store now
        await engine.store_batch([2, 3, 4, 5], [2, 3, 4, 5])
        await engine.load_batch([2, 3, 4, 5], [2, 3, 4, 5])
        assert [identify(caches, block) for block in (2, 3, 4, 5)] == [(b, 1, True) for b in (2, 3, 4, 5)]
        assert engine.metrics()["store"]["budget_bytes"] == BUDGET


async def test_a_cancelled_queued_call_leaves_the_books(make_engine: EngineFactory) -> None:
    caches = id_caches("cpu", blocks=8)
    async with make_engine(caches, 8, num_slots=1, copy_delay=0.1) as engine:
        await store_identity(engine, caches, 4)
        first = asyncio.create_task(engine.load_batch([0, 1], [4, 5]))
        await until(lambda: engine.metrics()["load"]["inflight_calls"] == 1)
        queued = asyncio.create_task(engine.load_batch([2, 3], [6, 7]))
        await until(lambda: engine.metrics()["load"]["queued_calls"] == 1)
        queued.cancel()
        with pytest.raises(asyncio.CancelledError):
            await queued
        await first
        load = engine.metrics()["load"]
        assert load["queued_calls"] == load["inflight_calls"] == load["queued_bytes"] == load["inflight_bytes"] == 0
        assert load["rate_bytes_s"] == 2 * engine.block_bytes / WINDOW_S  # the cancelled one moved nothing


async def test_a_call_refused_by_its_arguments_leaves_the_books(make_engine: EngineFactory) -> None:
    caches = id_caches("cpu", blocks=8)
    async with make_engine(caches, 8, num_slots=2, budgets={"load": 1}) as engine:
        with pytest.raises(ValueError):
            await engine.load_batch([99], [0])
        assert engine.metrics()["load"]["queued_calls"] == engine.metrics()["load"]["queued_bytes"] == 0
        with pytest.raises(ValueError):  # the class has nothing pending: it was not refused as busy
            await engine.load_batch([99], [0])
        assert engine.metrics()["load"]["refused_calls"] == 0


@pytest.mark.parametrize(("budgets", "error", "message"), [
    ({"demand": 1}, ValueError, "budgets: unknown class 'demand' (classes: load, prefetch, store)"),
    ({"store": 0}, ValueError, "budgets['store'] must be a positive number of bytes, got 0"),
    ({"load": True}, ValueError, "budgets['load'] must be a positive number of bytes, got True"),
    ([("store", 1)], TypeError, "budgets must be a mapping of class name to bytes, got list"),
])
def test_a_wrong_budget_is_refused_in_one_line(tmp_path: Path, budgets: object, error: type, message: str) -> None:
    from uring_kv import Engine
    with pytest.raises(error) as refused:
        Engine(id_caches("cpu", blocks=2), tmp_path / "kv", 2, budgets=budgets)  # type: ignore[arg-type]
    assert str(refused.value) == message


def test_the_service_rate_counts_the_last_window_only() -> None:
    now = [100.0]
    pressure = Pressure({}, clock=lambda: now[0])
    for nbytes in (1000, 3000):
        ticket = pressure.enter(IOClass.DEMAND, nbytes)
        pressure.start(ticket)
        pressure.end(ticket, nbytes)
        now[0] += 0.4
    assert pressure.snapshot(IOClass.DEMAND)["rate_bytes_s"] == 4000 / WINDOW_S
    now[0] += WINDOW_S - 0.5  # the first call ended more than a window ago, the second not
    assert pressure.snapshot(IOClass.DEMAND)["rate_bytes_s"] == 3000 / WINDOW_S
    now[0] += 1.0
    assert pressure.snapshot(IOClass.DEMAND)["rate_bytes_s"] == 0


async def test_a_store_refused_as_busy_keeps_the_key_out_and_the_store_whole(tmp_path: Path) -> None:
    caches = id_caches("cpu", blocks=8)
    async with BlockStore(caches, tmp_path / "kv", 8, num_slots=1, copy_delay=0.1, budgets={"store": 1}) as store:
        for row in range(3):
            fill(caches, row, row, 1)
        first = asyncio.create_task(store.put([b"a", b"b"], [0, 1]))
        await until(lambda: store.engine.metrics()["store"]["inflight_calls"] == 1)
        with pytest.raises(EngineBusyError):
            await store.put([b"c"], [2])
        assert await first == 2
        assert not store.contains(b"c")
        assert await store.put([b"c"], [2]) == 1  # its block went back: it stores now
        await store.get([b"a", b"b", b"c"], [5, 6, 7])
        assert [identify(caches, row)[:2] for row in (5, 6, 7)] == [(0, 1), (1, 1), (2, 1)]


async def test_prometheus_sees_each_class_queued_in_flight_served_and_refused(make_engine: EngineFactory) -> None:
    caches = id_caches("cpu", blocks=8)
    async with make_engine(caches, 8, num_slots=2, budgets={"store": 1 << 20}) as engine:
        registry = CollectorRegistry()
        registry.register(PrometheusCollector(engine, labels={"engine": "test"}))
        await engine.store_batch([0, 1], [0, 1])
        text = generate_latest(registry).decode()
        assert 'uring_kv_queued_calls{class="store",engine="test"} 0.0' in text
        assert 'uring_kv_inflight_bytes{class="load",engine="test"} 0.0' in text
        assert 'uring_kv_queued_bytes{class="prefetch",engine="test"} 0.0' in text
        assert f'uring_kv_rate_bytes_per_second{{class="store",engine="test"}} {2.0 * engine.block_bytes}' in text
        assert 'uring_kv_budget_bytes{class="store",engine="test"} 1.048576e+06' in text
        assert 'uring_kv_refused_calls_total{class="load",engine="test"} 0.0' in text
