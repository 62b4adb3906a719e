"""Large calls: checked and registered a piece at a time, so no loop callback does Python work for a
whole batch, while the hazard rules hold exactly as for small calls (call order decides which
stores a load sees, whatever the sizes), and cancellation during admission leaves nothing behind."""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

import anyio
import pytest
import torch
from aio import settle, task_group
from conftest import BOTH_BACKENDS, EngineFactory

from uring_kv import Engine, _args
from uring_kv.testing import fill, id_caches, identify

PIECE = _args.ADMIT_BLOCKS
BLOCKS = 8 * PIECE


@pytest.fixture(params=BOTH_BACKENDS)
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def _registered(engine: Engine) -> int:
    """Hazard entries the engine holds: stores' blocks and in-flight reads."""
    return len(engine._hazards)


async def _ticks(engine: Engine, checked: list[int], seen: list[tuple[int, int]]) -> None:
    """Once per loop turn until the call is admitted: how many indices were checked and how many
    hazards registered so far."""
    while not engine._admitting:
        await anyio.lowlevel.checkpoint()
    while engine._admitting:
        seen.append((checked[0], _registered(engine)))
        await anyio.lowlevel.checkpoint()
    seen.append((checked[0], _registered(engine)))


@pytest.mark.parametrize("kind", ["store", "load"])
async def test_a_large_call_is_checked_and_registered_a_piece_per_loop_turn(
    make_engine: EngineFactory, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    """Between two turns of another task, a call of BLOCKS blocks checks and registers at most a
    piece or two (the scheduler may run two of its steps back to back), never the whole batch."""
    checked = [0]
    original = _args.checked_indices

    def counting(items: list[Any], what: str, limit: int, start: int) -> Any:
        checked[0] += len(items)
        return original(items, what, limit, start)

    monkeypatch.setattr(_args, "checked_indices", counting)
    caches = id_caches("cpu", layers=1, blocks=BLOCKS)
    async with make_engine(caches, BLOCKS, num_slots=4) as engine:
        blocks = list(range(BLOCKS))
        if kind == "load":
            await engine.store_batch(blocks, blocks)
            await settle()  # a pumped store's entries are dropped over a few callbacks
        checked[0] = 0
        call = engine.store_batch if kind == "store" else engine.load_batch
        seen: list[tuple[int, int]] = [(0, _registered(engine))]
        async with task_group() as tasks:
            tasks.spawn(_ticks, engine, checked, seen)
            await anyio.lowlevel.checkpoint()
            await call(blocks, blocks)
        assert checked[0] == 2 * BLOCKS  # both index lists were checked, through the counter
        steps = [(b[0] - a[0], b[1] - a[1]) for a, b in itertools.pairwise(seen)]
        assert max(c for c, _ in steps) <= 2 * PIECE, "indices checked in one turn"
        assert max(r for _, r in steps) <= 2 * PIECE, "hazards registered in one turn"
        assert sum(1 for c, r in steps if c or r > 0) >= BLOCKS // PIECE  # spread over many turns


async def test_a_load_called_during_a_large_stores_admission_sees_that_store(make_engine: EngineFactory) -> None:
    """Call order decides: a one-block load called while a large store is still being admitted
    (its last block not yet registered) returns that store's bytes, not the older version."""
    caches = id_caches("cpu", layers=2, blocks=BLOCKS + 1)
    async with make_engine(caches, BLOCKS, num_slots=4) as engine:
        blocks = list(range(BLOCKS))
        for b in blocks:
            fill(caches, b, b, 1)
        await engine.store_batch(blocks, blocks)
        await settle()  # a pumped store's entries are dropped over a few callbacks
        for b in blocks:
            fill(caches, b, b, 2)
        async with task_group() as tasks:
            tasks.spawn(engine.store_batch, blocks, blocks)
            while not engine._admitting:
                await anyio.lowlevel.checkpoint()
            assert engine._hazards.writer(BLOCKS - 1) is None  # not registered yet
            await engine.load_batch([BLOCKS - 1], [BLOCKS])
        assert identify(caches, BLOCKS) == (BLOCKS - 1, 2, True)


async def test_a_store_called_during_a_large_loads_admission_waits_for_that_load(make_engine: EngineFactory) -> None:
    """The converse: a one-block store called while a large load is being admitted does not
    overtake the load's read of that block; the load returns the version stored before it."""
    caches = id_caches("cpu", layers=2, blocks=2 * BLOCKS + 1)
    async with make_engine(caches, BLOCKS, num_slots=4) as engine:
        blocks = list(range(BLOCKS))
        for b in blocks:
            fill(caches, b, b, 1)
        await engine.store_batch(blocks, blocks)
        fill(caches, 2 * BLOCKS, BLOCKS - 1, 2)
        async with task_group() as tasks:
            tasks.spawn(engine.load_batch, blocks, [BLOCKS + b for b in blocks])
            while not engine._admitting:
                await anyio.lowlevel.checkpoint()
            await engine.store_batch([2 * BLOCKS], [BLOCKS - 1])
        assert identify(caches, 2 * BLOCKS - 1) == (BLOCKS - 1, 1, True)
        await engine.load_batch([BLOCKS - 1], [0])
        assert identify(caches, 0) == (BLOCKS - 1, 2, True)


async def test_cancelled_during_admission_leaves_no_hazard_behind(make_engine: EngineFactory) -> None:
    """A large store cancelled while it is being admitted finishes its admission, then stops:
    it raises the cancellation, and every hazard it registered is gone, so later calls on its
    blocks run (and a waiting small call that was cancelled in the queue is dropped from it)."""
    caches = id_caches("cpu", layers=1, blocks=BLOCKS)
    async with make_engine(caches, BLOCKS, num_slots=2, copy_delay=0.001) as engine:
        blocks = list(range(BLOCKS))
        for b in blocks:
            fill(caches, b, b, 1)
        async with task_group() as tasks:
            big = tasks.spawn(engine.store_batch, blocks, blocks)
            while not engine._admitting:
                await anyio.lowlevel.checkpoint()
            small = tasks.spawn(engine.store_batch, [0], [0])
            await anyio.lowlevel.checkpoint()
            small.cancel()
            big.cancel()
            await big.join()
            await small.join()
        assert big.cancelled and small.cancelled
        await settle()
        assert not engine._admitting
        assert _registered(engine) == 0
        await engine.store_batch([1, 2], [1, 2])
        await engine.load_batch([1, 2], [5, 6])
        assert identify(caches, 6) == (2, 1, True)


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_asyncio_timeout_expiring_during_admission_raises_timeout_error(make_engine: EngineFactory) -> None:
    """asyncio.timeout expiring while a large call is admitted raises TimeoutError: the held
    cancellation is delivered as the timeout's own, the task's cancel count left as it was."""
    caches = id_caches("cpu", layers=1, blocks=BLOCKS)
    async with make_engine(caches, BLOCKS, num_slots=2) as engine:
        blocks = list(range(BLOCKS))
        task = asyncio.current_task()
        assert task is not None
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(None) as deadline:
                asyncio.get_running_loop().call_soon(deadline.reschedule, 0)  # expires mid-admission
                await engine.store_batch(blocks, blocks)
        assert task.cancelling() == 0
        await settle()
        assert _registered(engine) == 0


def test_large_index_arrays_match_small_ones() -> None:
    """The pieces of a large list make the same C array, and a bad entry is named by its position
    in the whole list."""
    values = list(range(3 * PIECE + 7))

    def run(values: Any) -> Any:
        steps = _args.block_indices(values, "disk_blocks", len(values) + 1)
        while True:
            try:
                next(steps)
            except StopIteration as stop:
                return stop.value

    out, array = run(values)
    assert out == values and list(array) == values
    values[2 * PIECE + 3] = -1
    with pytest.raises(ValueError, match=rf"disk_blocks\[{2 * PIECE + 3}\] = -1 is out of range"):
        run(values)
    assert run(torch.arange(2 * PIECE + 1))[0] == list(range(2 * PIECE + 1))
