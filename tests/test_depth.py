"""``io_depth``: fewer reads and writes in flight than there are slots; the spare slots carry blocks
between their I/O and the end of their copy."""

from __future__ import annotations

import random
from pathlib import Path

import anyio
import pytest
from aio import task_group
from backlog import overtakes
from conftest import BOTH_BACKENDS, EngineFactory
from faultfs import FaultState

from uring_kv._io import UringBackend
from uring_kv.testing import fill, id_caches, identify, store_identity


@pytest.fixture(params=BOTH_BACKENDS)
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def io_mode() -> str:
    return "uring"  # the ring's own count of ops in flight is what is checked


@pytest.mark.parametrize("path", ["pumped", "per-block"])
async def test_io_depth_caps_ops_in_flight_while_spare_slots_hold_copies(make_engine: EngineFactory,
                                                                          monkeypatch: pytest.MonkeyPatch,
                                                                          path: str) -> None:
    """8 slots, depth 2, copies slowed: the ring never has more than 2 reads or writes in flight,
    while more than 2 slots are held at once (blocks waiting for or in their copy), and every byte
    arrives; in native pumps (the C count of their I/Os, its high-water mark) and block by block.
    Mutations tried: the ring's capacity ignoring the depth (8 ops were in flight); pumps ignoring
    the cap (peak 8)."""
    if path == "per-block":
        monkeypatch.setenv("URING_KV_DEBUG_PUMP", "0")
    in_flight: list[int] = []
    flush = UringBackend._flush

    def counting_flush(self: UringBackend) -> None:
        flush(self)
        in_flight.append(len(self._pending))

    monkeypatch.setattr(UringBackend, "_flush", counting_flush)
    caches = id_caches("cpu", blocks=64)
    async with make_engine(caches, 32, num_slots=8, io_depth=2, copy_delay=0.002) as engine:
        assert engine.stats()["io_depth"] == 2
        held: list[int] = []
        release = engine.pool.release

        def counting_release(lease: object) -> None:
            held.append(engine.pool.held)
            release(lease)  # type: ignore[arg-type]

        monkeypatch.setattr(engine.pool, "release", counting_release)
        await store_identity(engine, caches, 32)
        for tensor in caches.values():
            tensor.fill_(-1)
        order = random.Random(3).sample(range(32), 32)
        await engine.load_batch(order, list(range(32, 64)))
        assert [identify(caches, 32 + i) for i in range(32)] == [(d, 1, True) for d in order]
        assert engine.stats()["pumped_batches"] == (2 if path == "pumped" else 0)
        assert isinstance(engine.io, UringBackend)
        pump_io, pump_peak = engine.io._ring.pump_io()
    if path == "pumped":
        assert pump_io == 0 and pump_peak == 2, f"pump I/Os in flight at once: up to {pump_peak}"
    else:
        assert max(in_flight) == 2, f"ops in flight after a submission: up to {max(in_flight)}"
    assert max(held) > 2, "no slot was ever spare: the depth cap did not let copies overlap the I/O"


def test_io_depth_is_checked() -> None:
    from uring_kv import Engine

    caches = id_caches("cpu", blocks=4)
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ValueError, match="io_depth"):
            Engine(caches, "/nonexistent/kv.bin", 4, 4, io_depth=bad)  # type: ignore[arg-type]
    assert Engine(caches, "/nonexistent/kv.bin", 4, 4, io_depth=16).io_depth == 4  # at most the slots
    assert Engine(caches, "/nonexistent/kv.bin", 4, 4).io_depth == 4


async def test_under_a_depth_cap_reads_go_ahead_of_queued_writes(fault_fs: tuple[Path, FaultState],
                                                                 make_engine: EngineFactory,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Depth 1, slow writes: a store's writes queue up behind the one in flight; a load called
    meanwhile has its read submitted before writes that were queued ahead of it (loads are the
    latency-critical side). Mutation tried: one FIFO backlog for both (the read waited for every
    write queued before it)."""
    mountpoint, state = fault_fs
    # The backlog orders per-block batches' ops (pumps under a cap park their slots in C instead,
    # loads' pumps first): batch by block here.
    monkeypatch.setenv("URING_KV_DEBUG_PUMP", "0")
    # a read went in: were writes queued before it still waiting?
    jumped = overtakes(monkeypatch, goes_first=lambda op: not op.write, waits=lambda op: op.write)
    caches = id_caches("cpu", blocks=24)
    async with make_engine(caches, 16, num_slots=4, io_depth=1, path=mountpoint / "kv.bin") as engine:
        await store_identity(engine, caches, 16)
        for block in range(8):
            fill(caches, block, block, 2)
        state.slow_down(0, 8 * engine.file.stride, 0.01, reads=False)
        async with task_group() as tasks:
            store = tasks.spawn(engine.store_batch, list(range(8)), list(range(8)))
            for _ in range(1000):  # until its writes queue up behind the one in flight
                if engine.io._backlog[1]:  # type: ignore[attr-defined]
                    break
                await anyio.sleep(0.001)
            assert engine.io._backlog[1], "the store's writes never queued"  # type: ignore[attr-defined]
            await engine.load_batch([12], [12])  # stored, and not behind the slowed writes
            await store.join()
        state.clear()
        await engine.load_batch(list(range(8)), list(range(16, 24)))
        assert [identify(caches, 16 + b) for b in range(8)] == [(b, 2, True) for b in range(8)]
    assert any(jumped), "no read was ever submitted ahead of a write queued before it"
