"""The hazard rules, pinned down on every driver: a load sees exactly the last store called before
it, and a store waits for every read of its block called before it, however many readers there
are, wherever the block sits in its batch, and whether each call runs in a native pump or the Python one.

One request is made slow in the fault filesystem (``FaultState.slow_next``: of several reads of
the same bytes only the first is slow), so the order of events is fixed, not left to timing:
each test fails on every run when the rule it holds is broken. Mutations each was run against
(every run failed): a store waiting only for the first reader to finish (all readers of a block
dropped when one finishes, per-block and pumped), the look-ahead starting blocks whose hazards
are not clear."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest
import torch
from aio import settle, task_group
from conftest import BOTH_BACKENDS, EngineFactory, use_python_pump
from faultfs import FaultState

from uring_kv import Engine
from uring_kv.testing import fill, id_caches, identify

SLOW = 0.3  # seconds the slowed request sleeps before it touches the bytes

# (io mode, environment): the ways a CPU-mode batch can be driven
DRIVERS = {
    "pump-scatter": ("uring", {}),  # native pump, loads read into (stores write from) the caches straight
    # pump, through the slots: loads read into them and memcpy'd, stores memcpy'd into them first
    "pump-slots": ("uring", {"URING_KV_DEBUG_PUMP_SCATTER": "0", "URING_KV_DEBUG_PUMP_GATHER": "0"}),
    "pump-copier": ("uring", {"URING_KV_HOST_INLINE_BYTES": "0"}),  # pump, copies on the copier thread
    "per-block": ("uring", {"URING_KV_DEBUG_PUMP": "0"}),  # io_uring, the Python pump: a handler per block
    "threads": ("threads", {}),
}


@pytest.fixture(params=BOTH_BACKENDS)
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(params=list(DRIVERS))
def driver(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    for name, value in DRIVERS[request.param][1].items():
        monkeypatch.setenv(name, value)
    return str(request.param)


@pytest.fixture
def io_mode(driver: str) -> str:
    return DRIVERS[driver][0]


def _per_block(engine: Engine, per_block: bool) -> None:
    """Make the engine's next calls go through the Python pump, a handler per block (True), or back
    to native pumps where it has them."""
    use_python_pump(engine, per_block)


def _batch(shape: str, d: int, gpu: list[int], others: list[int]) -> tuple[list[int], list[int]]:
    """A batch touching disk block ``d``: alone, or in the middle of two other blocks."""
    if shape == "alone":
        return [d], gpu[:1]
    return [others[0], d, others[1]], gpu


async def _stored(engine: Engine, caches: dict[str, torch.Tensor], blocks: list[int], version: int,
                  staging: int = 15) -> None:
    for d in blocks:
        fill(caches, staging, d, version)
        await engine.store_batch([staging], [d])


def _one_driver(engine: Engine, driver: str, pumped: bool) -> None:
    """Where the engine has pumps, send the next call to one (``pumped``) or block by block."""
    if driver.startswith("pump"):
        _per_block(engine, not pumped)


@pytest.mark.parametrize("shape", ["alone", "middle"])
@pytest.mark.parametrize("mix", ["same", "first-pumped", "first-per-block"])
async def test_a_store_waits_for_every_reader_of_its_block(fault_fs: tuple[Path, FaultState],
                                                           make_engine: EngineFactory, driver: str,
                                                           shape: str, mix: str) -> None:
    """Loads A (slow) and B of block 5 are in flight; B finishes; a store of version 2 to block 5
    is then called and awaited. It must wait for A's read: A returns version 1, a load called
    after the store returns 2. ``mix``: on pump drivers, A pumped and B block by block or the
    reverse (the store goes the other way from B)."""
    if mix != "same" and not driver.startswith("pump"):
        pytest.skip("only pump drivers run some calls in pumps and others block by block")
    mountpoint, state = fault_fs
    caches = id_caches("cpu", blocks=16)
    async with make_engine(caches, 12, num_slots=4, path=mountpoint / "kv.bin") as engine:
        await _stored(engine, caches, [1, 2, 3, 4, 5, 6, 7], 1)
        disk_a, gpu_a = _batch(shape, 5, [0, 1, 2], [1, 2])
        disk_b, gpu_b = _batch(shape, 5, [3, 4, 5], [3, 4])
        state.slow_next(engine.file.offset(5), engine.file.stride, SLOW)
        pumped = engine.stats()["pumped_batches"]
        with anyio.fail_after(10):
            async with task_group() as tasks:
                _one_driver(engine, driver, mix != "first-per-block")
                load_a = tasks.spawn(engine.load_batch, disk_a, gpu_a)
                await anyio.sleep(0.05)  # A's read of block 5 is in flight (sleeping in the filesystem)
                _one_driver(engine, driver, mix != "first-pumped")
                await engine.load_batch(disk_b, gpu_b)
                assert not load_a.done(), "the slow load finished before the store was called"
                fill(caches, 10, 5, 2)
                _one_driver(engine, driver, mix != "first-per-block")
                await engine.store_batch([10], [5])
                await load_a.join()
            _per_block(engine, False)
            calls_pumped = {"same": 3, "first-pumped": 2, "first-per-block": 1}[mix] if driver.startswith("pump") else 0
            assert engine.stats()["pumped_batches"] - pumped == calls_pumped
            a5 = gpu_a[disk_a.index(5)]
            b5 = gpu_b[disk_b.index(5)]
            assert identify(caches, b5) == (5, 1, True)
            assert identify(caches, a5) == (5, 1, True), "the store overtook a read called before it"
            assert [identify(caches, g) for g, d in zip(gpu_a, disk_a, strict=True) if d != 5] == \
                [(d, 1, True) for d in disk_a if d != 5]
            await engine.load_batch([5], [11])
            assert identify(caches, 11) == (5, 2, True)


@pytest.mark.parametrize("readers", [2, 3])
async def test_a_store_waits_for_the_slowest_of_several_readers(fault_fs: tuple[Path, FaultState],
                                                                make_engine: EngineFactory, driver: str,
                                                                readers: int) -> None:
    """Several loads of block 5, the first slow and the others done; a store called then waits
    for the slow one (the readers are multi-block batches, block 5 in the middle)."""
    mountpoint, state = fault_fs
    caches = id_caches("cpu", blocks=16)
    async with make_engine(caches, 12, num_slots=4, path=mountpoint / "kv.bin") as engine:
        await _stored(engine, caches, list(range(12)), 1)
        state.slow_next(engine.file.offset(5), engine.file.stride, SLOW)
        with anyio.fail_after(10):
            async with task_group() as tasks:
                slow = tasks.spawn(engine.load_batch, [0, 5, 1], [0, 1, 2])
                await anyio.sleep(0.05)
                for reader in range(1, readers):
                    await engine.load_batch([5 + 2 * reader, 5, 6 + 2 * reader],
                                            [3 * reader, 3 * reader + 1, 3 * reader + 2])
                fill(caches, 12, 5, 2)
                await engine.store_batch([12], [5])
                await slow.join()
        assert identify(caches, 1) == (5, 1, True), "the store overtook the slowest reader"
        await engine.load_batch([5], [13])
        assert identify(caches, 13) == (5, 2, True)


async def test_a_store_waits_for_a_reader_registered_after_another(fault_fs: tuple[Path, FaultState],
                                                                  make_engine: EngineFactory, driver: str) -> None:
    """Every read of block 5 is slow: load A of it starts, then load C, then a store of version 2 is
    called while both read. The store must wait for C too, not only for the first reader it finds
    (A finishes first; C then still sleeps before it reads the bytes). Mutation: a store waiting
    only for the first load found reading its block (C then delivered version 2)."""
    mountpoint, state = fault_fs
    caches = id_caches("cpu", blocks=16)
    async with make_engine(caches, 12, num_slots=4, path=mountpoint / "kv.bin") as engine:
        await _stored(engine, caches, list(range(12)), 1)
        state.slow_down(engine.file.offset(5), engine.file.stride, SLOW, writes=False)
        with anyio.fail_after(10):
            async with task_group() as tasks:
                load_a = tasks.spawn(engine.load_batch, [5], [0])
                await anyio.sleep(SLOW / 3)
                load_c = tasks.spawn(engine.load_batch, [4, 5], [1, 2])
                await anyio.sleep(SLOW / 3)
                fill(caches, 12, 5, 2)
                await engine.store_batch([12], [5])
                await load_a.join()
                await load_c.join()
        state.clear()
        assert identify(caches, 0) == (5, 1, True) and identify(caches, 2) == (5, 1, True), \
            "the store overtook a reader"
        await engine.load_batch([5], [13])
        assert identify(caches, 13) == (5, 2, True)


@pytest.mark.parametrize("shared", ["first", "middle", "last"])
async def test_a_load_waits_for_a_store_in_flight_wherever_the_block_sits(fault_fs: tuple[Path, FaultState],
                                                                          make_engine: EngineFactory,
                                                                          shared: str) -> None:
    """A store of version 2 to block 5 is slow; a load of [a, 5, b] called meanwhile (free slots
    for all three) returns version 2 for block 5: the blocks around it may start, block 5 may not
    until the store is done."""
    mountpoint, state = fault_fs
    caches = id_caches("cpu", blocks=16)
    async with make_engine(caches, 12, num_slots=4, path=mountpoint / "kv.bin") as engine:
        await _stored(engine, caches, list(range(12)), 1)
        disk = {"first": [5, 1, 2], "middle": [1, 5, 2], "last": [1, 2, 5]}[shared]
        fill(caches, 10, 5, 2)
        state.slow_next(engine.file.offset(5), engine.file.stride, SLOW, reads=False)
        with anyio.fail_after(10):
            async with task_group() as tasks:
                store = tasks.spawn(engine.store_batch, [10], [5])
                await settle()  # the store is called, its write sleeping in the filesystem
                await engine.load_batch(disk, [0, 1, 2])
                await store.join()
        assert [identify(caches, g) for g in range(3)] == [(d, 2 if d == 5 else 1, True) for d in disk]


@pytest.mark.parametrize("shared", ["first", "middle", "last"])
async def test_a_store_waits_for_a_read_in_flight_wherever_the_block_sits(fault_fs: tuple[Path, FaultState],
                                                                          make_engine: EngineFactory,
                                                                          shared: str) -> None:
    """The reverse: a load of block 5 is slow; a store of [a, 5, b] (version 2) called meanwhile
    must not write block 5 until that read is done; the load returns version 1."""
    mountpoint, state = fault_fs
    caches = id_caches("cpu", blocks=16)
    async with make_engine(caches, 12, num_slots=4, path=mountpoint / "kv.bin") as engine:
        await _stored(engine, caches, list(range(12)), 1)
        disk = {"first": [5, 1, 2], "middle": [1, 5, 2], "last": [1, 2, 5]}[shared]
        for g, d in enumerate(disk):
            fill(caches, 10 + g, d, 2)
        state.slow_next(engine.file.offset(5), engine.file.stride, SLOW)
        with anyio.fail_after(10):
            async with task_group() as tasks:
                load = tasks.spawn(engine.load_batch, [5], [0])
                await anyio.sleep(0.05)
                await engine.store_batch([10, 11, 12], disk)
                await load.join()
        assert identify(caches, 0) == (5, 1, True), "the store wrote block 5 under a read called before it"
        await engine.load_batch(disk, [1, 2, 3])
        assert [identify(caches, g) for g in (1, 2, 3)] == [(d, 2, True) for d in disk]
