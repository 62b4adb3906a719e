"""``io_depth``: fewer reads and writes in flight than there are slots; the spare slots carry blocks
between their I/O and the end of their copy."""

from __future__ import annotations

import random

import pytest
from conftest import BOTH_BACKENDS, EngineFactory

from uring_kv._io import UringBackend
from uring_kv.testing import id_caches, identify, store_identity


@pytest.fixture(params=BOTH_BACKENDS)
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def io_mode() -> str:
    return "uring"  # the ring's own count of ops in flight is what is checked


async def test_io_depth_caps_ops_in_flight_while_spare_slots_hold_copies(make_engine: EngineFactory,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """8 slots, depth 2, copies slowed: the ring never has more than 2 reads or writes in flight,
    while more than 2 slots are held at once (blocks waiting for or in their copy), and every byte
    arrives. Mutation tried: the ring's capacity ignoring the depth (8 ops were in flight)."""
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
        assert engine.stats()["pumped_batches"] == 0  # pumps keep an op per slot: not with a depth cap
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
