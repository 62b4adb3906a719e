"""The bench on a tiny configuration: its JSON has every method, and every method moved the right bytes."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from uring_kv import Engine
from uring_kv._bench import BenchConfig, Workload, spare_slots
from uring_kv.cli import main


def test_bench_json_has_every_method_and_all_verified(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "bench.json"
    plot = tmp_path / "bench.png"
    code = main(["bench", "--path", str(tmp_path), "--size", "4M", "--block-size", "64K", "--layers", "4",
                 "--batch", "16", "--batches", "2", "--slots", "4", "--spare-slots", "2", "--threads", "2",
                 "--checksum", "--json", str(out),
                 "--plot", str(plot)])
    assert code == 0
    result = json.loads(out.read_text())
    assert result["all_verified"] is True
    assert result["config"]["gc_freeze"] is True and result["config"]["warmup"] == 1
    rows = result["rows"]
    seen = {(r["op"], r["case"], r["method"]) for r in rows}
    for case, ops in (("cold", ("load", "store")), ("hot", ("load",))):
        for op in ops:
            for method in ("uring_kv", "uring_kv+crc32c", "serial", "threads2", "ring ceiling"):
                assert (op, case, method) in seen
    for row in rows:
        assert row["verified"] is True
        assert row["gbps"] > 0
        assert row["blocks_per_s"] > 0 or row["method"] == "pcie ceiling"
        assert {"p50_ms", "p99_ms", "cpu_s", "lag_max_ms", "lag_p99_ms", "timer_lag_max_ms"} <= row.keys()
        if row["method"] != "pcie ceiling":
            assert len(row["batch_ms"]) == 2  # --batches 2; the warm-up batch is not counted
    mine = next(r for r in rows if r["method"] == "uring_kv" and r["op"] == "load")
    # (+ "pcie ceiling" on a GPU)
    assert {"serial", "threads2", "ring ceiling", "uring_kv+crc32c"} <= set(mine["ratios"])
    extra = result["extra"][str(64 << 10)]
    assert extra["pinned_bytes"] == 6 * 64 * 1024  # 4 slots of depth and 2 spare
    assert extra["io_depth"] == 4 and extra["slots"] == 6 and extra["batches"] == 2
    assert extra["pumped_batches_cold"] == 0  # checksums need Python per block: no pumps
    assert all("lag_ms" not in row for row in rows)  # the samples are pooled, not in the JSON
    # every uring_kv row's samples together; the same probe while the ring ceiling ran on a worker thread
    for key, method in (("uring_kv_lag", "uring_kv"), ("idle_loop_lag", "ring ceiling")):
        pooled, own = result[key], [r for r in rows if r["method"] == method]
        assert pooled["samples"] == sum(r["lag_samples"] for r in own) > 0, key
        assert pooled["max_ms"] == pytest.approx(max(r["lag_max_ms"] for r in own), abs=1e-3), key
        assert pooled["p50_ms"] <= pooled["p99_ms"] <= pooled["max_ms"], key
    assert plot.stat().st_size > 0
    assert not list(tmp_path.glob("uring-kv-bench-*")), "the bench left a block file behind"
    assert "verified: all" in capsys.readouterr().out


@pytest.mark.parametrize("flag", [["--warmup", "-1"], ["--batches", "0"]])
def test_bench_refuses_bad_counts(flag: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["bench", *flag])
    assert info.value.code == 2
    assert "must be >=" in capsys.readouterr().err


def test_bench_runs_only_the_baselines_asked_for(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "bench.json"
    code = main(["bench", "--path", str(tmp_path), "--size", "2M", "--block-size", "64K", "--layers", "4",
                 "--batch", "8", "--batches", "1", "--slots", "4", "--direct", "--baselines", "ceiling",
                 "--json", str(out)])
    assert code == 0
    result = json.loads(out.read_text())
    assert {r["method"] for r in result["rows"] if r["case"] != "pcie"} == {"uring_kv", "ring ceiling"}
    mine = [r for r in result["rows"] if r["method"] == "uring_kv"]
    assert mine and all(set(r["ratios"]) <= {"ring ceiling", "pcie ceiling"} for r in mine)
    assert result["all_verified"] is True and result["idle_loop_lag"]["samples"] > 0
    assert "while idle" in capsys.readouterr().out
    code = main(["bench", "--path", str(tmp_path), "--size", "2M", "--block-size", "64K", "--layers", "4",
                 "--batch", "8", "--batches", "1", "--slots", "4", "--direct", "--baselines", "none",
                 "--json", str(out)])
    assert code == 0
    result = json.loads(out.read_text())
    assert {r["method"] for r in result["rows"] if r["case"] != "pcie"} == {"uring_kv"}
    assert result["idle_loop_lag"]["samples"] == 0
    assert "while idle" not in capsys.readouterr().out  # no ceiling rows, no idle-loop line


def test_baseline_names_are_checked() -> None:
    from uring_kv._bench import BASELINES
    from uring_kv.cli import _BASELINE_NAMES, _baselines

    assert _BASELINE_NAMES == BASELINES
    assert _baselines("ceiling, serial") == ("serial", "ceiling")
    assert _baselines("none") == ()
    for bad in ("threads8", "serial,pool", ""):
        with pytest.raises(argparse.ArgumentTypeError):
            _baselines(bad)


def test_spare_slots_default_to_half_the_depth_where_copies_are_copier_jobs() -> None:
    """GPU mode, and CPU mode once the slots hold over 1 MiB (its copies are then copier jobs),
    hide each slot's copy turnaround behind spare slots; smaller CPU set-ups keep their inline
    pumps, with spare slots for O_DIRECT up to the depth while all slots stay within 1 MiB (a reap
    refills through them before it copies), none for buffered files (read straight into the
    caches). An explicit count always wins."""
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert spare_slots(BenchConfig(slots=32), cuda, 4 << 10) == 16
    assert spare_slots(BenchConfig(slots=32), cpu, 128 << 10) == 16
    assert spare_slots(BenchConfig(slots=32), cpu, 32 << 10) == 0  # 1 MiB: still inline, no room
    assert spare_slots(BenchConfig(slots=32), cpu, 16 << 10) == 32
    assert spare_slots(BenchConfig(slots=32), cpu, 16 << 10, direct=False) == 0
    assert spare_slots(BenchConfig(slots=32), cpu, 24 << 10) == 10  # 42 × 24 KiB ≤ 1 MiB
    assert spare_slots(BenchConfig(slots=32, spare_slots=0), cuda, 2 << 20) == 0
    assert spare_slots(BenchConfig(slots=8, spare_slots=3), cpu, 4 << 10) == 3


async def test_cpu_bench_set_up_with_spare_slots_runs_in_pumps(tmp_path: Path) -> None:
    """The bench's CPU set-up with spare slots (128 KiB blocks, depth 16 + 8 spare) is pumped: its
    copies are copier jobs, which run under a depth cap, unlike inline memcpy pumps."""
    config = BenchConfig(slots=16)
    spare = spare_slots(config, torch.device("cpu"), 128 << 10)
    assert spare == 8
    caches = {"k": torch.zeros(16, 32 << 10, dtype=torch.int32)}  # 128 KiB blocks
    source = torch.randint(-2**31, 2**31 - 1, (16, 32 << 10), dtype=torch.int32)
    async with Engine(caches, tmp_path / "kv.bin", 16, config.slots + spare, io_depth=config.slots) as engine:
        caches["k"].copy_(source)
        await engine.store_batch(list(range(16)), list(range(16)))
        caches["k"].zero_()
        await engine.load_batch(list(range(16)), list(range(16)))
        assert torch.equal(caches["k"], source)
        assert engine.stats()["pumped_batches"] == 2


def test_the_heap_is_frozen_only_while_measuring() -> None:
    import gc

    from uring_kv._bench import _frozen_heap

    before = gc.get_freeze_count()
    keep = [[i] for i in range(1000)]  # tracked objects alive when the freeze starts
    with _frozen_heap(True):
        assert gc.get_freeze_count() >= before + len(keep)
    assert gc.get_freeze_count() == 0
    with _frozen_heap(False):
        assert gc.get_freeze_count() == 0


def test_lag_ticker_sees_a_stalled_loop() -> None:
    """Both of the ticker's measures catch a 20 ms blocking call on the loop, and the one ticked
    by the probe process stays small while the loop only sleeps."""
    import asyncio
    import time

    from uring_kv._bench import LagTicker

    async def run() -> tuple[LagTicker, LagTicker]:
        with LagTicker() as idle:
            await asyncio.sleep(0.05)
        with LagTicker() as stalled:
            await asyncio.sleep(0.01)
            time.sleep(0.02)  # the stall
            await asyncio.sleep(0.01)
        return idle, stalled

    idle, stalled = asyncio.run(run())
    assert len(idle.samples) >= 10 and len(idle.timer_samples) >= 10
    assert max(stalled.samples) >= 0.015
    assert max(stalled.timer_samples) >= 0.015
    assert sorted(idle.samples)[len(idle.samples) // 2] < 0.005  # a loop at rest answers at once


def test_default_batches_move_about_the_same_bytes_per_block_size() -> None:
    from uring_kv._bench import batches_for

    config = BenchConfig()  # batches of 256 blocks
    assert batches_for(config, 2 << 20) == 4  # 512 MiB a batch: the floor
    assert batches_for(config, 1 << 20) == 4
    assert batches_for(config, 256 << 10) == 8
    assert batches_for(config, 128 << 10) == 16
    assert batches_for(config, 4 << 10) == 16  # the cap
    assert Workload(BenchConfig(size=1 << 20, layers=2, batch=4), 8192, torch.device("cpu")).batches == 16
    config.batches = 3  # --batches wins
    assert batches_for(config, 128 << 10) == batches_for(config, 2 << 20) == 3


def test_bench_detects_wrong_bytes() -> None:
    work = Workload(BenchConfig(size=1 << 20, layers=2, batch=4, batches=1), 8192, torch.device("cpu"))
    work.fill_gpu_as([5, 6, 7, 8], [0, 1, 2, 3])
    assert work.verify([5, 6, 7, 8], [0, 1, 2, 3])
    assert not work.verify([5, 6, 8, 7], [0, 1, 2, 3])


def test_module_entry_point_runs_info() -> None:
    # -P: the installed package, not the source tree in the working directory
    done = subprocess.run([sys.executable, "-P", "-m", "uring_kv", "info"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "io_uring" in done.stdout or "thread pool" in done.stdout


@pytest.mark.parametrize("loop", ["asyncio", "trio"])
def test_quickstart_example_runs(loop: str) -> None:
    example = Path(__file__).resolve().parent.parent / "examples" / "quickstart.py"
    flags = ["--trio"] if loop == "trio" else []
    done = subprocess.run([sys.executable, str(example), *flags], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "reloaded blocks identical: True" in done.stdout
    assert "enqueued-form load done: True" in done.stdout
    assert f"event loop: {loop}" in done.stdout
    assert "block file removed on close: True" in done.stdout


def test_transformer_example_generates_identically_after_reload() -> None:
    pytest.importorskip("transformers")
    example = Path(__file__).resolve().parent.parent / "examples" / "transformer_offload.py"
    done = subprocess.run([sys.executable, str(example)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "identical generation: True" in done.stdout
    assert "control (one wrong block) differs: True" in done.stdout


def test_overlap_example_runs() -> None:
    example = Path(__file__).resolve().parent.parent / "examples" / "overlap.py"
    done = subprocess.run([sys.executable, str(example)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "results match: True" in done.stdout


def test_server_example_answers_while_offloading() -> None:
    pytest.importorskip("aiohttp")
    example = Path(__file__).resolve().parent.parent / "examples" / "server.py"
    done = subprocess.run([sys.executable, str(example), "--self-test", "100"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "100 requests while" in done.stdout and "wrong blocks: 0" in done.stdout


def test_info_exits_nonzero_with_one_line_reason(tmp_path: Path) -> None:
    unwritable = tmp_path / "missing" / "dir"
    done = subprocess.run([sys.executable, "-P", "-m", "uring_kv", "info", "--path", str(unwritable)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    reason = done.stderr.strip().splitlines()
    assert len(reason) == 1 and reason[0].startswith("uring_kv cannot run here:") and "missing" in reason[0]


def test_info_names_the_fallback_cause(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import errno
    import warnings

    from uring_kv.cli import info

    def refuse(*args: object, **kwargs: object) -> None:
        raise OSError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr("uring_kv._io.NativeRing", refuse)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        facts, problem = info(str(tmp_path))
    assert "thread pool" in facts["io"] and "EPERM" in facts["io"] and "seccomp" in facts["io"]
    assert problem is None  # the fallback can run


async def test_bench_order_tool_replays_the_order_the_bench_ran() -> None:
    """tools/bench_order.py groups each batch time by the method that ran just before it, from the
    JSON alone: it must replay the rotation `_measure` really used. Each stub method reports the
    call's position as its time, so every group can be checked against the recorded calls."""
    import importlib.util
    from types import SimpleNamespace

    from uring_kv._bench import _measure

    spec = importlib.util.spec_from_file_location("bench_order", Path(__file__).parents[1] / "tools" / "bench_order.py")
    assert spec is not None and spec.loader is not None
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    calls: list[tuple[str, list[int]]] = []

    def method(name: str) -> Any:
        async def run(store: bool, disk_blocks: list[int], gpu_blocks: list[int]) -> float:
            calls.append((name, disk_blocks))
            return float(len(calls) - 1)  # "seconds": the call's position

        return run

    rounds, names = 7, ["uring_kv", "serial", "threads8", "ring ceiling"]
    work = SimpleNamespace(load_batches=[[r] for r in range(rounds)], gpu_order=[[0]] * rounds,
                           config=SimpleNamespace(warmup=2), device=torch.device("cpu"), scrub=lambda: None,
                           verify=lambda disk, gpu: True)
    tallies = await _measure(work, {name: method(name) for name in names}, "load", -1, 0)  # type: ignore[arg-type]
    result = {"config": {"warmup": 2}, "rows": [
        {"op": "load", "case": "cold", "block_bytes": 4096, "method": name,
         "batch_ms": [x * 1e3 for x in tallies[name].latencies]} for name in names]}
    groups = tool.by_predecessor(result, "load", "cold")
    checked = 0
    for name in names:
        for (prev, same), times in groups[f"{name} (4 KiB)"].items():
            for ms in times:
                position = round(ms / 1e3)
                assert calls[position][0] == name and calls[position - 1][0] == prev
                assert (calls[position][1] == calls[position - 1][1]) == same
                checked += 1
    assert checked == (rounds - 2) * len(names)


def test_ring_idle_tool_reads_through_every_ring_set_up(tmp_path: Path) -> None:
    """tools/ring_idle.c, the C program behind benchmarks.md's figures on batches after idle time,
    builds against the liburing the extension links, times batches right after another and after a
    gap through all six ring set-ups (every read checked for its full length), and removes its file."""
    import importlib.util
    import os
    import shutil

    root = Path(__file__).parents[1]
    spec = importlib.util.spec_from_file_location("build_ffi_for_tools", root / "build_ffi.py")
    assert spec is not None and spec.loader is not None
    build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build)
    include, archive = build.find_liburing(os.environ, build._pkg_config, os.path.exists)
    compiler = shutil.which("cc") or shutil.which("gcc")
    assert compiler, "a C compiler builds the extension; it must be here"
    exe, data = tmp_path / "ring_idle", tmp_path / "data.bin"
    subprocess.run([compiler, "-O2", "-Wall", "-Werror", "-o", str(exe), str(root / "tools" / "ring_idle.c"),
                    f"-I{include}", archive], check=True)
    out = subprocess.run([str(exe), str(data), "8", "2", "1", "4", "8", "32"], check=True, capture_output=True,
                         text=True, timeout=120).stdout
    result = json.loads(out.strip().splitlines()[-1])
    assert (result["block_bytes"], result["depth"], result["batch"], result["rounds"]) == (4096, 8, 32, 2)
    assert [mode["name"] for mode in result["modes"]] == [
        "fresh ring, wait (ceiling)", "one ring, wait", "one ring, DEFER, wait", "one ring, DEFER, epoll",
        "one ring, DEFER, epoll, ASYNC", "one ring, epoll"]
    for mode in result["modes"]:
        assert 0 < mode["first_ms"] <= mode["batch_ms"] and 0 < mode["first_after_gap_ms"] <= mode["batch_after_gap_ms"]
    assert not data.exists()
    bad = subprocess.run([str(exe), str(data), "8", "0"], capture_output=True, text=True)
    assert bad.returncode == 2 and "bad arguments" in bad.stderr
