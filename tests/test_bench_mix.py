"""``uring-kv bench-mix`` on a tiny configuration (a few seconds): every method and class in the table
and the JSON, every load's bytes checked, the demand schedule kept, bad arguments refused in one line;
and the vLLM fs tier port's queueing and per-file behaviour."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from uring_kv._memory import HostBuffer, view_of
from uring_kv.bench import mix
from uring_kv.bench.fs_tier import DualQueueThreadPool, FsTier
from uring_kv.cli import main

TINY = ["--size", "4M", "--block-size", "16K", "--rate", "200", "--duration", "0.2", "--warmup", "0.05",
        "--store-tasks", "2", "--store-batch", "8", "--prefetch-tasks", "1", "--prefetch-batch", "16",
        "--slots", "8", "--io-depth", "4"]


def _tiny_config(path: Path) -> mix.MixConfig:
    return mix.MixConfig(path=str(path), size=4 << 20, block_bytes=16 << 10, rate=200, duration=0.2, warmup=0.05,
                         store_tasks=2, store_batch=8, prefetch_tasks=1, prefetch_batch=16, slots=8, io_depth=4)


def test_table_and_json_have_every_method_and_class_all_checked(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    out.mkdir()
    result_path = tmp_path / "mix.json"
    assert main(["bench-mix", "--path", str(out), *TINY, "--json", str(result_path)]) == 0
    printed = capsys.readouterr().out
    result = json.loads(result_path.read_text())
    assert result["all_verified"] and printed.strip().endswith("verified: all")
    assert set(result["methods"]) == set(mix.METHODS)
    assert result["methods"]["uring_kv"]["rule"] == "demand > prefetch > store"
    assert result["methods"]["uring_kv-1class"]["rule"] == "loads first"
    assert result["methods"]["vllm-fs"]["read_threads"] == 16 == result["methods"]["vllm-fs"]["write_threads"]
    seen = {(row["method"], row["phase"], row["cls"]) for row in result["rows"]}
    assert seen == {(method, phase, cls) for method in mix.METHODS
                    for phase, cls in [("idle", "demand"), *[("flood", c) for c in mix.CLASSES]]}
    for row in result["rows"]:
        assert row["verified"] and row["calls"] > 0 and row["gbps"] > 0, row
        assert row["p50_ms"] <= row["p99_ms"] <= row["max_ms"], row
        assert (row["p99_vs_idle"] is not None) == ((row["phase"], row["cls"]) == ("flood", "demand"))
        assert f"{row['method']} · {row['rule']}" in printed
    for cls in mix.CLASSES:
        assert cls in printed
    assert list(out.iterdir()) == []  # every method's files removed


def test_the_demand_schedule_is_fixed_and_kept(tmp_path: Path) -> None:
    config = _tiny_config(tmp_path)
    schedule = mix.demand_schedule(config, "idle")
    assert len(schedule) == round(config.rate * config.duration) == 40
    assert [offset for offset, _ in schedule] == [i / config.rate for i in range(40)]
    for _, blocks in schedule:
        assert len(set(blocks)) == len(blocks) == config.demand_blocks
        assert all(block in config.demand_region for block in blocks)
    assert mix.demand_schedule(config, "idle") == schedule  # fixed before the phase starts
    flood = mix.demand_schedule(config, "flood")
    assert [offset for offset, _ in flood] == [offset for offset, _ in schedule]
    assert [blocks for _, blocks in flood] != [blocks for _, blocks in schedule]  # other blocks, same shape
    assert not set(config.demand_region) & (set(config.prefetch_region) | set(config.store_region))
    result = asyncio.run(mix.run_mix(config))
    for row in result["rows"]:
        if row["cls"] == "demand":
            assert row["calls"] == len(schedule)
            assert row["start_lag_ms"]["min"] >= 0  # no call starts before its scheduled arrival


def test_a_load_that_brings_the_wrong_bytes_is_caught(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    async def crossed(self: mix.EngineMethod, disk_blocks: list[int], rows: list[int]) -> float:
        return await mix_load(self, disk_blocks[::-1], rows)  # each row gets another block's bytes

    mix_load = mix.EngineMethod.load
    monkeypatch.setattr(mix.EngineMethod, "load", crossed)
    assert main(["bench-mix", "--path", str(tmp_path), *TINY, "--methods", "uring_kv"]) == 1
    assert "verified: NOT ALL" in capsys.readouterr().out


def test_closing_the_rows_waits_for_a_check_still_running(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A call that failed or was cancelled leaves its check (a worker thread scrubbing the rows)
    running; the rows are unmapped only once it has finished. Without the wait, close returns while
    the check still runs (mutation tried: shutdown(wait=False) fails the last assertion)."""
    started, finished = threading.Event(), threading.Event()

    def slow_check(words: np.ndarray, disk_blocks: list[int]) -> bool:
        started.set()
        threading.Event().wait(0.3)
        finished.set()
        return True

    monkeypatch.setattr(mix, "_check_and_scrub", slow_check)
    rows = mix._Rows(_tiny_config(tmp_path))

    async def abandon_a_check() -> None:
        check = asyncio.ensure_future(rows.check(rows.demand_first, [0, 1]))
        while not started.is_set():
            await asyncio.sleep(0.001)
        check.cancel()  # as a cancelled demand call leaves it

    asyncio.run(abandon_a_check())
    assert not finished.is_set()
    rows.close()
    assert finished.is_set(), "the rows were closed while a check still ran"


@pytest.mark.parametrize(("args", "says"), [
    (["--rate", "0"], "--rate: must be > 0, got '0'"),
    (["--duration", "soon"], "--duration: expected a number, got 'soon'"),
    (["--methods", "uring_kv,lmcache"],
     "--methods: expected a comma-separated list of uring_kv, uring_kv-1class, vllm-fs"),
    (["--block-size", "5000"], "--block-size 5000: blocks are whole pages (a multiple of 4096 bytes)"),
    (["--size", "256K"], "--size 262144: too small for the store region, a prefetch and a demand load"),
    (["--path", "{missing}"], "--path: {missing} does not exist"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path: Path, args: list[str], says: str) -> None:
    names = {"missing": str(tmp_path / "nowhere")}
    args = [a.format(**names) for a in args]
    path = [] if "--path" in args else ["--path", str(tmp_path)]
    done = subprocess.run([sys.executable, "-P", "-m", "uring_kv", "bench-mix", *path, *args],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    said = done.stderr.strip().splitlines()
    assert len(said) == 1, done.stderr
    assert said[0].startswith("uring-kv bench-mix: ") and says.format(**names) in said[0], said[0]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("load_priority", [True, False])
def test_the_fs_pool_serves_its_own_queue_first(load_priority: bool) -> None:
    """vLLM's discipline: a load-priority thread takes a queued load before an older queued store,
    a store-priority thread the reverse."""
    order: list[str] = []
    release = threading.Event()
    finished = threading.Semaphore(0)
    pool = DualQueueThreadPool(int(load_priority), int(not load_priority), finished.release)
    try:
        enqueue_own = pool.enqueue_load if load_priority else pool.enqueue_store
        enqueue_other = pool.enqueue_store if load_priority else pool.enqueue_load
        def busy() -> None:  # holds the only thread until both other jobs are queued
            release.wait(10)
            order.append("busy")

        enqueue_own(0, 1, [busy])
        enqueue_other(1, 1, [lambda: order.append("other")])
        enqueue_own(2, 1, [lambda: order.append("own")])
        release.set()
        for _ in range(3):
            assert finished.acquire(timeout=10)
        assert order == ["busy", "own", "other"]
        assert sorted(job for job, success, _ in pool.get_finished() if success) == [0, 1, 2]
    finally:
        pool.shutdown()


def test_the_fs_tier_writes_a_file_per_block_and_never_rewrites_one(tmp_path: Path) -> None:
    block = 8192
    buffer = HostBuffer(4 * block)
    words = np.frombuffer(view_of(buffer.addr, buffer.size), dtype=np.int64).reshape(4, -1)

    async def run() -> dict[str, Any]:
        tier = FsTier(str(tmp_path), block, buffer.addr)
        try:
            words[0], words[1] = 11, 22
            await tier.store([0, 1], [100, 101])
            files = {key: tier.path(key) for key in (100, 101)}
            words[0] = 33
            await tier.store([0], [100])  # the file exists: vLLM writes nothing
            await tier.load([100, 101], [2, 3])
            return {"files": files, "o_direct": tier.o_direct, "exist": all(map(os.path.isfile, files.values()))}
        finally:
            tier.close()

    try:
        seen = asyncio.run(run())
        assert seen["exist"]
        for path in seen["files"].values():
            relative = Path(path).relative_to(tmp_path).parts
            name = relative[-1].removesuffix(".bin")
            assert len(name) == 64 and relative[-3] == name[:3] and relative[-2] == f"{name[3:5]}_g0"
        assert (words[2] == 11).all() and (words[3] == 22).all()
        assert list(tmp_path.iterdir()) == []
    finally:
        buffer.close()
