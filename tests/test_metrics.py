"""Metrics: the snapshot counts what moved, failed and was cancelled; prometheus sees the same."""

from __future__ import annotations

import asyncio
import os

import pytest
from conftest import EngineFactory
from prometheus_client import CollectorRegistry, generate_latest

from uring_kv import BlockIOError
from uring_kv.metrics import PrometheusCollector
from uring_kv.testing import id_caches, store_identity


async def test_snapshot_counts_blocks_bytes_failures_and_batches(make_engine: EngineFactory) -> None:
    caches = id_caches("cpu", blocks=8)
    async with make_engine(caches, 8, num_slots=2) as engine:
        await store_identity(engine, caches, 4)
        await engine.load_batch([0, 1], [4, 5])
        os.ftruncate(engine.file.fd, 3 * engine.file.stride)
        with pytest.raises(BlockIOError):
            await engine.load_batch([2, 3], [6, 7])
        snap = engine.metrics()
        assert snap["store"]["blocks"] == 4 and snap["store"]["batches"] == 1
        assert snap["store"]["bytes"] == 4 * engine.block_bytes
        assert snap["load"]["blocks"] == 3 and snap["load"]["failed_blocks"] == 1 and snap["load"]["batches"] == 2
        assert snap["load"]["batch_latency_s"]["count"] == 2
        assert snap["load"]["slot_wait_s"]["count"] == 4
        assert snap["load"]["batch_latency_s"]["cumulative"][-1] == 2
        assert snap["leases_held"] == 0 and snap["io_inflight"] == 0


async def test_cancelled_blocks_are_counted_and_age_gauge_grows_while_held(make_engine: EngineFactory) -> None:
    caches = id_caches("cpu", blocks=8)
    async with make_engine(caches, 8, num_slots=1, copy_delay=0.05) as engine:
        task = asyncio.create_task(engine.store_batch(list(range(6)), list(range(6))))
        await asyncio.sleep(0.02)
        assert engine.metrics()["leases_held"] == 1
        assert engine.metrics()["oldest_lease_age_s"] >= 0.01
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        snap = engine.metrics()
        assert snap["store"]["cancelled_blocks"] == 5 and snap["store"]["blocks"] == 1


async def test_prometheus_collector_exposes_the_snapshot(make_engine: EngineFactory) -> None:
    caches = id_caches("cpu", blocks=8)
    async with make_engine(caches, 8, num_slots=2) as engine:
        registry = CollectorRegistry()
        registry.register(PrometheusCollector(engine, labels={"engine": "test"}))
        await engine.store_batch([0, 1], [0, 1])
        text = generate_latest(registry).decode()
        assert 'uring_kv_blocks_total{direction="store",engine="test"} 2.0' in text
        assert 'uring_kv_batch_latency_seconds_count{direction="store",engine="test"} 1.0' in text
        assert 'uring_kv_leases_held{engine="test"} 0.0' in text
