"""The ring thread (csrc/ringthread.c): a C thread reaps the ring and moves the native pumps, the
loop hears only of what it must act on (slots handed back, its own ops' completions).

The rest of the suite's pump, class and engine tests run a second time with the thread on (``./dev
test``); these check what only the thread does: the loop's wake-ups no longer grow with the blocks,
the copier's pump jobs are collected off the loop, and a slot the loop acquires while the thread
runs the pump's last blocks comes back to the pool.
"""

from __future__ import annotations

import random

import anyio
import pytest
import torch
from conftest import BOTH_BACKENDS, EngineFactory

from uring_kv import Tuning
from uring_kv._staging import LeaseState
from uring_kv.testing import id_caches, identify, store_identity

ON = Tuning(ring_thread="on")


@pytest.fixture(params=BOTH_BACKENDS)
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def io_mode() -> str:
    return "uring"  # the thread runs io_uring's pumps


@pytest.mark.parametrize("direct", [None, False], ids=["direct", "buffered"])
@pytest.mark.parametrize("copies", ["memcpy", "jobs"])
async def test_the_thread_carries_the_blocks_and_the_loop_hears_of_batch_ends(
        make_engine: EngineFactory, direct: bool | None, copies: str) -> None:
    """256 blocks stored, then loaded in a shuffled order, through 8 slots: exact bytes, and the
    loop woken a few times per batch (slots handed back at its end), not per few blocks as when it
    reaps. Memcpy pumps, and copy jobs for the native copier (every copy off the loop, as in GPU
    mode), collected by the thread. Mutation tried: the thread waking the loop
    on every pass (loop wake-ups then grew with the blocks)."""
    caches = id_caches("cpu", blocks=256)
    tuning = ON if copies == "memcpy" else Tuning(ring_thread="on", host_inline_bytes=0)
    async with make_engine(caches, 256, num_slots=8, direct=direct, tuning=tuning) as engine:
        plan = engine.stats()["plan"]
        assert plan["ring_thread"] and plan["pumps"]
        assert plan["pump_copies"] == ("reap" if copies == "memcpy" else "jobs")
        await store_identity(engine, caches, 256)
        for tensor in caches.values():
            tensor.fill_(-1)
        order = random.Random(3).sample(range(256), 256)
        await engine.load_batch(order, list(range(256)))
        assert [identify(caches, g) for g in range(256)] == [(d, 1, True) for d in order]
        stats = engine.stats()
        assert stats["pumped_batches"] == 2
        assert stats["ring_thread_wakeups"] > 0
        assert stats["loop_wakeups"] <= 2 * 8 * 2, "the loop was woken per block, not per batch end"
        assert all(lease.state is LeaseState.FREE for lease in engine.pool.leases)


@pytest.mark.parametrize("direct", [None, False], ids=["direct", "buffered"])
async def test_a_slot_acquired_while_the_thread_ends_the_pump_goes_back(make_engine: EngineFactory,
                                                                         direct: bool | None) -> None:
    """More slots than the I/O depth, small batches: the loop may read the pump holding no slot
    and start waiting for one just as the thread runs its last blocks and the batch ends. The slot
    it then gets must go back to the pool, not to the finished pump (which would hold it for ever:
    the next close() waited for it). Many rounds, each bounded in time, every slot free after each.
    Without the check in Driver._drive, a round hung within 40 rounds (of 6 x 40 tried)."""
    caches = id_caches("cpu", blocks=64)
    async with make_engine(caches, 64, num_slots=8, io_depth=4, direct=direct, tuning=ON) as engine:
        await store_identity(engine, caches, 64)
        for round_ in range(150):
            order = random.Random(round_).sample(range(64), 16)
            with anyio.fail_after(10):
                await engine.load_batch(order, list(range(16)))
            assert [identify(caches, g) for g in range(16)] == [(d, 1, True) for d in order]
            assert all(lease.state is LeaseState.FREE for lease in engine.pool.leases), f"round {round_}"


async def test_concurrent_loads_and_stores_on_the_thread_land_exact(make_engine: EngineFactory) -> None:
    """Loads and stores of disjoint blocks at once, several batches each, while the thread moves
    all their pumps and the loop hands slots between them: every block exact."""
    caches = {"k": torch.zeros(128, 4096, dtype=torch.int32)}
    source = torch.randint(-2**31, 2**31 - 1, (128, 4096), dtype=torch.int32)
    async with make_engine(caches, 256, num_slots=6, io_depth=4, tuning=ON) as engine:
        caches["k"][:64].copy_(source[:64])
        await engine.store_batch(list(range(64)), list(range(64)))  # disk 0..63 <- rows 0..63
        caches["k"][64:].copy_(source[64:])
        caches["k"][:64].zero_()

        async def load(part: int) -> None:
            rows = list(range(part * 16, part * 16 + 16))
            await engine.load_batch(rows, rows)

        async def store(part: int) -> None:
            rows = list(range(64 + part * 16, 64 + part * 16 + 16))
            await engine.store_batch(rows, [128 + r - 64 for r in rows])

        async with anyio.create_task_group() as tg:
            for part in range(4):
                tg.start_soon(load, part)
                tg.start_soon(store, part)
        assert torch.equal(caches["k"][:64], source[:64])
        caches["k"].zero_()
        await engine.load_batch(list(range(128, 192)), list(range(64, 128)))
        assert torch.equal(caches["k"][64:], source[64:])
