"""The I/O classes where I/Os wait for room under the depth: a demand load's read goes ahead of the
prefetches' reads waiting before it, at the ring's backlog (ops of Python pumps), among the
native pumps' parked slots (in C), and in the thread-pool backend's queue; a write that has
waited there STORE_AGING_S goes ahead of every read."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import anyio
import pytest
from aio import task_group
from backlog import overtakes
from conftest import EngineFactory, until
from faultfs import FaultState

from uring_kv import Prefetch, Tuning
from uring_kv._staging import IOClass
from uring_kv.testing import fill, id_caches, identify, store_identity


@pytest.fixture
def io_mode() -> str:
    return "uring"  # the ring's backlog is what is checked


async def test_under_a_depth_cap_a_demand_read_goes_ahead_of_queued_prefetch_reads(
        fault_fs: tuple[Path, FaultState], make_engine: EngineFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Depth 1, the prefetched blocks' reads held: the prefetch's reads queue behind the one in
    flight; a demand load called meanwhile gets the slot of the first read let through and has its
    read submitted before the prefetch reads still queued. Mutation tried: the prefetches' reads in
    the demand loads' queue (the demand read waited for every prefetch read queued before it)."""
    mountpoint, state = fault_fs
    monkeypatch.setenv("URING_KV_DEBUG_PUMP", "0")  # per-block batches: their ops go through the backlog
    # a demand read went in: were prefetch reads queued before it still waiting?
    jumped = overtakes(monkeypatch, goes_first=lambda op: not op.write and not op.later, waits=lambda op: op.later)
    caches = id_caches("cpu", blocks=24)
    async with make_engine(caches, 16, num_slots=4, io_depth=1, path=mountpoint / "kv.bin") as engine:
        await store_identity(engine, caches, 16)
        state.hold_reads(0, 8 * engine.file.stride)
        backlog = engine.io._backlog  # type: ignore[attr-defined]
        async with task_group() as tasks:
            prefetching = functools.partial(engine.load_batch, prefetch=Prefetch())
            prefetch = tasks.spawn(prefetching, list(range(8)), list(range(16, 24)))
            # its reads queue up behind the one in flight, every slot taken
            await until(lambda: state.holding == 1 and any(op.later for queue in backlog for op in queue))
            load = tasks.spawn(engine.load_batch, [12], [12])
            await until(lambda: engine.pool.waiting[IOClass.DEMAND] == 1)  # for a slot
            state.let_through(1)  # the first read ends: its slot goes to the demand load, whose read
            # takes that room at once or waits in the backlog
            await until(lambda: load.done() or any(not op.later and not op.write for queue in backlog for op in queue))
            state.clear()
            await load.join()
            await prefetch.join()
        assert [identify(caches, 16 + b) for b in range(8)] == [(b, 1, True) for b in range(8)]
        assert identify(caches, 12) == (12, 1, True)
    assert any(jumped), "no demand read was ever submitted ahead of a prefetch read queued before it"


async def read_order(engine: Any, state: FaultState, prefetched: int, first_row: int, started: int, block: int,
                     row: int, demand: bool) -> list[int]:
    """Prefetch blocks 0..``prefetched`` into rows from ``first_row``, their reads held at the
    filesystem's gate; once ``started`` of them wait there, load ``block`` into ``row`` (a demand
    load, else a second prefetch) and, once that load's read is queued (``queued``), let one held
    read through: the read its I/O worker takes next comes in before any other. The blocks in the
    order their reads reached the filesystem."""
    stride = engine.file.stride
    state.hold_reads(0, prefetched * stride)
    state.reads.clear()
    async with task_group() as tasks:
        prefetching = functools.partial(engine.load_batch, prefetch=Prefetch())
        prefetch = tasks.spawn(prefetching, list(range(prefetched)), list(range(first_row, first_row + prefetched)))
        await until(lambda: state.holding == started)
        await until(lambda: engine.metrics()["prefetch"]["inflight_calls"] == 1)
        inflight = engine.stats()["io_inflight"]
        kwargs = {} if demand else {"prefetch": Prefetch()}
        load = tasks.spawn(functools.partial(engine.load_batch, **kwargs), [block], [row])
        # the load took its slot and its read went to the I/O (in flight or waiting for room)
        cls, calls = ("load", 1) if demand else ("prefetch", 2)
        await until(lambda: engine.metrics()[cls]["inflight_calls"] == calls)
        await until(lambda: engine.stats()["io_inflight"] > inflight or state.holding < started)
        await anyio.sleep(0.01)
        assert state.holding == started and len(state.reads) == started, "a held read went on before its turn"
        state.let_through(1)
        await until(lambda: len(state.reads) > started)
        state.clear()
        await load.join()
        await prefetch.join()
    return list(dict.fromkeys(offset // stride for offset in state.reads))


@pytest.mark.parametrize("demand", [True, pytest.param(False, marks=pytest.mark.xfail(
    strict=True, reason="the control: a second prefetch waits its turn behind the parked slots"))])
async def test_a_demand_pumps_parked_slot_takes_the_room_before_prefetch_slots_parked_first(
        fault_fs: tuple[Path, FaultState], make_engine: EngineFactory, demand: bool) -> None:
    """Depth 1, native pumps, the prefetched blocks' reads held: the prefetch's pump holds four
    slots, one reading and three parked for room. A demand load called meanwhile parks its slot
    after them; when the read in flight is let go, the room goes to the demand pump's slot (class
    first, then the order they parked), so its block is read second. Called as a prefetch, the
    same load waits behind the three (the control: the read order itself tells the classes apart)."""
    mountpoint, state = fault_fs
    caches = id_caches("cpu", blocks=24)
    async with make_engine(caches, 16, num_slots=8, io_depth=1, path=mountpoint / "kv.bin") as engine:
        await store_identity(engine, caches, 16)
        order = await read_order(engine, state, 4, 16, 1, 12, 12, demand)  # the first read in flight, 3 parked
        assert engine.stats()["pumped_batches"] >= 3, "the batches did not run in native pumps"
        assert sorted(order) == [0, 1, 2, 3, 12]
        assert [identify(caches, 16 + b) for b in range(4)] == [(b, 1, True) for b in range(4)]
        assert identify(caches, 12) == (12, 1, True)
    assert order.index(12) == 1, f"read order by block: {order}"


@pytest.mark.parametrize("demand", [True, pytest.param(False, marks=pytest.mark.xfail(
    strict=True, reason="the control: a second prefetch waits its turn behind the queued reads"))])
async def test_on_the_thread_pool_a_demand_read_goes_before_queued_prefetch_reads(
        fault_fs: tuple[Path, FaultState], make_engine: EngineFactory, demand: bool) -> None:
    """The thread-pool backend (8 workers), the prefetched blocks' reads held: a prefetch of 16
    blocks keeps every worker busy and 8 reads waiting for one. A demand load called meanwhile has
    its read taken by the first worker let go, ahead of those 8; called as a prefetch, it
    waits behind them (the control)."""
    mountpoint, state = fault_fs
    caches = id_caches("cpu", blocks=48)
    async with make_engine(caches, 24, num_slots=24, io="threads", path=mountpoint / "kv.bin") as engine:
        assert engine.stats()["io"].startswith("thread pool (8 threads")
        await store_identity(engine, caches, 24)
        order = await read_order(engine, state, 16, 24, 8, 20, 40, demand)  # every worker on a slowed read
        assert sorted(order) == [*range(16), 20]
        assert [identify(caches, 24 + b) for b in range(16)] == [(b, 1, True) for b in range(16)]
        assert identify(caches, 40) == (20, 1, True)
    assert order.index(20) == 8, f"read order by block: {order}"


@pytest.mark.parametrize("path", ["native pumps", "python pumps", "thread pool"])
async def test_a_store_waiting_for_room_behind_a_stream_of_loads_ages_ahead_of_them(
        fault_fs: tuple[Path, FaultState], make_engine: EngineFactory, monkeypatch: pytest.MonkeyPatch,
        path: str) -> None:
    """Reads slowed, tasks loading back to back, so that some load's read always waits for room
    (depth 1 on the ring, two tasks; on the thread pool, four tasks of 8 blocks for its 8
    workers). A store called meanwhile gets a slot (once it has waited STORE_AGING_S for one: the
    pool's rule), then its write waits behind the loads' reads; once the store has waited
    STORE_AGING_S there too, its write goes next. So it ends while the loads still stream: most
    of their reads come after it (without aging where I/Os wait for room, every load's read went
    ahead of the write, and the stream never left it a turn)."""
    mountpoint, state = fault_fs
    if path == "python pumps":
        monkeypatch.setenv("URING_KV_DEBUG_PUMP", "0")  # per-block batches: their ops go through the backlog
    threads = path == "thread pool"
    settings: dict[str, Any] = {"io": "threads", "num_slots": 40} if threads else {"io_depth": 1, "num_slots": 4}
    tasks_, calls = (4, 10) if threads else (2, 10)  # 8 blocks a call: 0.4 s of reads on 8 workers, 1.6 s at depth 1
    caches = id_caches("cpu", blocks=56)  # rows 16-47 the loads', 48-49 the store's
    async with make_engine(caches, 32, path=mountpoint / "kv.bin", **settings) as engine:
        await store_identity(engine, caches, 16)
        stride = engine.file.stride
        state.slow_down(0, 16 * stride, 0.01, writes=False)
        state.reads.clear()
        stored_after: list[int] = []

        async def stream(task: int) -> None:
            first = 8 * (task % 2)
            for _ in range(calls):
                await engine.load_batch(list(range(first, first + 8)), list(range(16 + 8 * task, 24 + 8 * task)))

        async def store() -> None:
            fill(caches, 48, 30, 2)
            await engine.store_batch([48], [30])
            stored_after.append(len(state.reads))

        async with task_group() as tasks:
            loads = [tasks.spawn(stream, task) for task in range(tasks_)]
            await until(lambda: len(state.reads) >= 4)
            stored = tasks.spawn(store)
            for task in (*loads, stored):
                await task.join()
        state.clear()
        assert [identify(caches, 16 + b) for b in range(8 * tasks_)] == [(b % 16, 1, True) for b in range(8 * tasks_)]
        await engine.load_batch([30], [49])
        assert identify(caches, 49) == (30, 2, True)
    total = len(state.reads)
    assert total >= tasks_ * calls * 8 and stored_after, (total, stored_after)
    assert stored_after[0] < total // 2, f"the store ended after {stored_after[0]} of the {total} load reads"


@pytest.mark.parametrize("prefetch_depth", [2, pytest.param(0, marks=pytest.mark.xfail(
    strict=True, reason="the control: with no cap the prefetch fills the depth beside the demand load"))])
async def test_while_a_demand_load_runs_a_prefetch_keeps_to_the_prefetch_depth(
        fault_fs: tuple[Path, FaultState], make_engine: EngineFactory, prefetch_depth: int) -> None:
    """Depth 8, native pumps, every read held: a demand load's read is in flight when a prefetch
    of 8 blocks is called. While the demand load runs, the prefetch starts I/O only below the
    prefetch depth (2 in flight, the demand's read counted); once the demand load ends it takes
    the whole depth again, and every block lands."""
    mountpoint, state = fault_fs
    caches = id_caches("cpu", blocks=48)
    async with make_engine(caches, 32, num_slots=24, io_depth=8, path=mountpoint / "kv.bin",
                           tuning=Tuning(prefetch_depth=prefetch_depth)) as engine:
        assert engine.stats()["prefetch_depth"] == prefetch_depth
        await store_identity(engine, caches, 24)
        state.hold_reads(0, 16 * engine.file.stride)
        async with task_group() as tasks:
            demand = tasks.spawn(engine.load_batch, [0], [40])
            await until(lambda: state.holding == 1)
            prefetch = tasks.spawn(functools.partial(engine.load_batch, prefetch=Prefetch()),
                                   list(range(1, 9)), list(range(24, 32)))
            await until(lambda: engine.metrics()["prefetch"]["inflight_calls"] == 1 and state.holding >= 2)
            if prefetch_depth:
                await anyio.sleep(0.05)  # room for reads the cap should hold back
            else:  # the control: the reads it would hold back come
                await until(lambda: state.holding > 2)
            held = state.holding
            assert not demand.done() and not prefetch.done()
            state.clear()
            for task in (demand, prefetch):
                await task.join()
        assert held == 2, f"{held} reads in flight beside the demand load's (the prefetch depth is {prefetch_depth})"
        assert identify(caches, 40) == (0, 1, True)
        assert [identify(caches, 24 + b) for b in range(8)] == [(1 + b, 1, True) for b in range(8)]
