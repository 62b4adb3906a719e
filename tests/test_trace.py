"""Engine.trace: the diagnostic hook the lab scripts time the engine with, instead of wrapping its
internals. The events must be where the docstring says and their counts must add up: a tracer
that missed completions or named the wrong blocks would mislead every study built on it."""

from __future__ import annotations

import collections
import random

import pytest
from conftest import EngineFactory, use_python_pump

from uring_kv import Engine
from uring_kv.testing import id_caches, identify, store_identity

Event = tuple[str, object, int]
RING = {"submit", "submitted", "reap", "reaped", "collect", "collected"}  # not a batch's own events


@pytest.fixture
def io_mode() -> str:
    return "uring"


def recording(engine: Engine) -> list[Event]:
    events: list[Event] = []
    engine.trace(lambda event, kind, count: events.append((event, kind, count)))
    return events


def totals(events: list[Event]) -> collections.Counter[str]:
    counted: collections.Counter[str] = collections.Counter()
    for event, _, count in events:
        counted[event] += count
    return counted


@pytest.mark.parametrize("copies", ["memcpy", "copier"])
async def test_native_pump_batches_report_every_completion(make_engine: EngineFactory, copies: str,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A pumped batch's reaps count each of its reads once (they are handled in C, not in the
    list the ring returns to Python); with the native copier, its collections count its jobs."""
    if copies == "copier":
        monkeypatch.setenv("URING_KV_HOST_INLINE_BYTES", "0")
    caches = id_caches("cpu", blocks=64)
    async with make_engine(caches, 64, num_slots=8) as engine:
        await store_identity(engine, caches, 64)
        events = recording(engine)
        order = random.Random(2).sample(range(64), 64)
        await engine.load_batch(order, list(range(64)))
        assert [identify(caches, g) for g in range(64)] == [(d, 1, True) for d in order]
        assert engine.stats()["pumped_batches"] == 2
        names = [event for event, _, _ in events]
        assert names[:2] == ["grow", "grown"] and names.count("finished") == 1
        assert all(event in RING for event in names[names.index("finished") + 1:])
        counted = totals(events)
        assert counted["reaped"] == 64, "each read's completion is counted once, pumps' included"
        assert counted["finished"] == 64
        assert counted["grow"] <= 8
        reaps = [count for event, _, count in events if event == "reap"]
        assert reaps and max(reaps) <= 8, "no more I/O in flight than slots"
        if copies == "copier":
            assert counted["collected"] >= 1
            assert all(kind is None for event, kind, _ in events if event in ("collect", "collected"))
        else:
            assert "collected" not in counted
        engine.trace(None)
        seen = len(events)
        await engine.load_batch(order[:8], list(range(8)))
        assert len(events) == seen, "trace(None) stops the events"


async def test_python_pump_reports_each_block_in_order(make_engine: EngineFactory) -> None:
    """In the Python pump every block goes start → read → copy → copied on a load and start →
    copy → copied → write → written on a store, each once; the ring's submissions count each I/O."""
    caches = id_caches("cpu", blocks=32)
    async with make_engine(caches, 32, num_slots=4) as engine:
        events = recording(engine)
        use_python_pump(engine)
        await store_identity(engine, caches, 32)
        stored = list(events)
        events.clear()
        order = random.Random(4).sample(range(32), 32)
        await engine.load_batch(order, list(range(32)))
        assert [identify(caches, g) for g in range(32)] == [(d, 1, True) for d in order]
        for trace, steps in ((stored, ["block_start", "block_copy", "block_copied", "block_write", "block_written"]),
                             (events, ["block_start", "block_read", "block_copy", "block_copied"])):
            per_block: dict[int, list[str]] = collections.defaultdict(list)
            for event, _, count in trace:
                if event.startswith("block_"):
                    per_block[count].append(event)
            assert sorted(per_block) == list(range(32))
            assert all(seen == steps for seen in per_block.values()), per_block
            counted = totals(trace)
            assert counted["submit"] == 32 and counted["reaped"] == 32
            assert counted["copy"] == counted["copy_queued"] == 32
        assert engine.stats()["pumped_batches"] == 0
