"""The bench on a tiny configuration: its JSON has every method, and every method moved the right bytes."""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import rich.console
import torch
from tmpfs import mounted_tmpfs, ram_directory

from uring_kv import Engine
from uring_kv.bench.config import BenchConfig, staging_slots
from uring_kv.bench.report import render
from uring_kv.bench.run import filesystem_of
from uring_kv.bench.workload import Workload
from uring_kv.cli import main


def test_bench_json_has_every_method_and_all_verified(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "bench.json"
    plot = tmp_path / "bench.png"
    code = main(["bench", "--path", str(tmp_path), "--size", "4M", "--block-size", "64K", "--layers", "4",
                 "--batch", "16", "--batches", "2", "--io-depth", "4", "--slots", "6", "--threads", "2",
                 "--checksum", "--json", str(out), "--plot", str(plot)])
    assert code == 0
    result = json.loads(out.read_text())
    assert result["all_verified"] is True
    assert result["config"]["gc_freeze"] is True and result["config"]["warmup"] == 1
    rows = result["rows"]
    seen = {(r["op"], r["case"], r["method"]) for r in rows}
    fio = shutil.which("fio") is not None
    for case, ops in (("cold", ("load", "store")), ("hot", ("load",))):
        for op in ops:
            for method in ("uring_kv", "uring_kv+crc32c", "vllm-disk", "threads2", "ring ceiling", "copy ceiling"):
                assert (op, case, method) in seen
            assert ((op, case, "fio") in seen) == (fio and case == "cold")
    kinds = {r["method"]: r["kind"] for r in rows}
    assert kinds["vllm-disk"] == kinds["threads2"] == "peer"
    assert kinds["ring ceiling"] == kinds["copy ceiling"] == "ceiling"
    assert "copy ceiling" in result["extra"][str(64 << 10)]["notes"]  # what it times: the host memcpy here
    for row in rows:  # every method's share of the lower of the two ceilings of its group
        group = (row["op"], row["case"], row["block_bytes"])
        limit = min(r["gbps"] for r in rows if (r["op"], r["case"], r["block_bytes"]) == group
                    and r["method"] in ("ring ceiling", "copy ceiling"))
        if row["kind"] == "ceiling":
            assert row["of_limit"] is None
        else:
            assert row["of_limit"] == pytest.approx(row["gbps"] / limit)
    for row in rows:
        assert row["verified"] is True
        assert row["gbps"] > 0
        assert {"p50_ms", "p99_ms", "cpu_s", "lag_max_ms", "lag_p99_ms", "timer_lag_max_ms"} <= row.keys()
        if row["method"] not in ("pcie ceiling", "fio"):
            assert len(row["batch_ms"]) == 2  # --batches 2; the warm-up batch is not counted
    mine = next(r for r in rows if r["method"] == "uring_kv" and r["op"] == "load")
    # (+ "pcie ceiling" on a GPU)
    assert {"vllm-disk", "threads2", "ring ceiling", "copy ceiling", "uring_kv+crc32c"} <= set(mine["ratios"])
    for method, ratio in mine["ratios"].items():
        other = next(r for r in rows if r["method"] == method and r["op"] == "load" and
                     r["case"] in (mine["case"], "pcie"))
        assert ratio == pytest.approx(mine["gbps"] / other["gbps"])
    extra = result["extra"][str(64 << 10)]
    assert extra["cold"]["pinned_bytes"] == 6 * 64 * 1024  # --slots 6
    assert extra["cold"]["io_depth"] == 4 and extra["cold"]["slots"] == 6 and extra["batches"] == 2
    assert extra["cold"]["pumped_batches"] == 0  # checksums need Python per block: no pumps
    assert set(extra["depth_sweep"]) == {"4", "8", "16"}  # JSON keys; none deeper than the batch
    assert all(rate > 0 for rate in extra["depth_sweep"].values())
    assert "kvikio" in extra["notes"]  # CPU mode (or not installed): the reason, not a row
    assert all("lag_ms" not in row for row in rows)  # the samples are pooled, not in the JSON
    # every uring_kv row's samples together; the same probe while the ring ceiling ran on a worker thread
    for key, method in (("uring_kv_lag", "uring_kv"), ("idle_loop_lag", "ring ceiling")):
        pooled, own = result[key], [r for r in rows if r["method"] == method]
        assert pooled["samples"] == sum(r["lag_samples"] for r in own) > 0, key
        assert pooled["max_ms"] == pytest.approx(max(r["lag_max_ms"] for r in own), abs=1e-3), key
        assert pooled["p50_ms"] <= pooled["p99_ms"] <= pooled["max_ms"], key
    for row in rows:  # the process's CPU per GB moved, where it ran in this process
        assert (row["core_s_per_gb"] > 0) == (row["method"] not in ("fio", "pcie ceiling"))
        if row["core_s_per_gb"]:
            gigabytes = len(row["batch_ms"]) * 16 * (64 << 10) / 1e9  # --batch 16 of 64 KiB
            assert row["core_s_per_gb"] == pytest.approx(row["cpu_s"] / gigabytes)
    # the same run on a RAM-backed file, beside the disk's (where /dev/shm is a tmpfs with room)
    ram = result.get("ram")
    if ram is None:
        assert result["ram_skipped"].startswith("left out")
    else:
        assert ram["filesystem"] in ("tmpfs", "ramfs") and ram["path"] == os.path.realpath("/dev/shm")
        assert ram["all_verified"] is True
        assert {(r["op"], r["case"], r["method"]) for r in ram["rows"]} == seen
        assert "depth_sweep" not in ram["extra"][str(64 << 10)]  # the sizing advice is the disk's
        assert not list(Path("/dev/shm").glob(f"uring-kv-bench-{os.getpid()}-*"))
    assert plot.stat().st_size > 0
    assert not list(tmp_path.glob("uring-kv-bench-*")), "the bench left a block file behind"
    printed = capsys.readouterr().out
    if ram is not None:
        disk_part, ram_part = printed.split("RAM-backed file: the same run with the disk out of the way")
        # the verdict names the binding ceiling: on a RAM-backed file the ring's or the copies' own
        assert "of disk limit" in disk_part and "file in /dev/shm (tmpfs" in ram_part
        assert "of ring limit" in ram_part or "of copy limit" in ram_part
    assert "verified: all" in printed
    assert "sizing: I/O depth" in printed and "Engine(..., num_slots=" in printed
    for key, note in extra["notes"].items():
        assert f"{key}: {note}" in printed
    # notes are printed verbatim: "[peers]" in KvikIO's (on a GPU without it) is not console markup
    extra["notes"]["kvikio"] = "not installed (pip install uring-kv[peers])"
    text = io.StringIO()
    render(result, rich.console.Console(file=text, width=100))
    assert "kvikio: not installed (pip install uring-kv[peers])" in text.getvalue()


def test_bench_output_fits_100_columns_with_the_verdict_first(tmp_path: Path) -> None:
    """Run as a user would (a separate process, COLUMNS=100, not a terminal): the header and the
    verdict come first, every line fits 100 columns, no internals (dicts, counters) are printed."""
    env = {**os.environ, "COLUMNS": "100"}
    done = subprocess.run([sys.executable, "-P", "-m", "uring_kv", "bench", "--path", str(tmp_path), "--size", "4M",
                           "--block-size", "64K", "--block-size", "128K", "--layers", "4", "--batch", "8",
                           "--batches", "1", "--io-depth", "4", "--threads", "2"],
                          capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert all(len(line) <= 100 for line in lines), max(lines, key=len)
    assert lines[0].startswith("uring-kv bench · ") and lines[1].startswith(f"file in {tmp_path} (")
    verdict = next(line for line in lines if not line.startswith(("uring-kv bench", "file in", " ")) and
                   "layers" not in line)
    # (the lower of the disk's and the copy path's ceilings: on a loaded machine the copies' may be)
    assert verdict.startswith("load   64 KiB cold") and "× vLLM DiskBackend" in verdict
    assert "of disk limit" in verdict or "of copy limit" in verdict
    assert any(line.startswith("store 128 KiB cold") for line in lines)
    assert "{" not in done.stdout and "pumped_batches" not in done.stdout
    assert not list(tmp_path.glob("uring-kv-bench-*"))


@pytest.mark.parametrize("args, says", [
    (["--warmup", "-1"], "--warmup: must be >= 0, got -1"),
    (["--batches", "0"], "--batches: must be >= 1, got 0"),
    (["--layers", "0"], "--layers: must be >= 1, got 0"),
    (["--batch", "0"], "--batch: must be >= 1, got 0"),
    (["--threads", "0"], "--threads: must be >= 1, got 0"),
    (["--io-depth", "0"], "--io-depth: must be >= 1, got 0"),
    (["--block-size", "12Q"], "--block-size: expected a size such as 4096, 128K, 2M or 1G, got '12Q'"),
    (["--size", "0"], "--size: must be at least 1 byte, got '0'"),
    (["--peers", "serial"], "--peers: expected a comma-separated list of"),
    (["--block-size", "100000"], "--block-size 100000: does not split into 32 layers of a multiple of 64 bytes"),
    (["--block-size", "128K", "--layers", "3"], "--block-size 131072: does not split into 3 layers"),
    (["--device", "cuda"], "--device cuda: CUDA is not available here"),
    (["--device", "tpu"], "--device: expected cpu, cuda or cuda:N, got 'tpu'"),
    (["--path", "{missing}"], "--path: {missing} does not exist"),
    (["--path", "{file}"], "--path: {file} is not a directory"),
    (["--size", "1T"], "--path: {tmp} has "),
    (["--path", "{tmp}", "--path", "{tmp}"], "--path: a directory appears twice (give one directory per drive)"),
    (["--path", "{tmp}", "--path", "{missing}"], "--path: {missing} does not exist"),
])
def test_bench_bad_input_is_one_line_and_exit_2(tmp_path: Path, args: list[str], says: str) -> None:
    if "cuda" in args and torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    names = {"missing": str(tmp_path / "nowhere"), "file": str(tmp_path / "a-file"), "tmp": str(tmp_path)}
    (tmp_path / "a-file").write_text("")
    args = [a.format(**names) for a in args]
    path = [] if "--path" in args else ["--path", str(tmp_path)]
    done = subprocess.run([sys.executable, "-P", "-m", "uring_kv", "bench", *path, *args], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2
    said = done.stderr.strip().splitlines()
    assert len(said) == 1, done.stderr
    assert said[0].startswith("uring-kv bench: ") and says.format(**names) in said[0], said[0]
    if "1T" in args:
        assert "MiB free, the run needs" in said[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]  # nothing left behind


def test_bench_refuses_a_read_only_path(tmp_path: Path) -> None:
    with mounted_tmpfs(tmp_path / "ro", "size=1m,ro") as target:
        done = subprocess.run([sys.executable, "-P", "-m", "uring_kv", "bench", "--path", str(target)],
                              capture_output=True, text=True, timeout=120)
        said = done.stderr.strip().splitlines()
        assert done.returncode == 2 and len(said) == 1
        assert said[0] == f"uring-kv bench: --path: cannot create a file in {target}: Read-only file system"


@pytest.mark.parametrize("command, args, says", [
    ("demo", ["--path", "{missing}"], "--path: {missing} does not exist"),
    ("demo", ["--device", "cuda"], "--device cuda: CUDA is not available here"),
    ("soak", ["--blocks", "0"], "--blocks: must be >= 1, got 0"),
    ("soak", ["--slots", "0"], "--slots: must be >= 1, got 0"),
    ("soak", ["--cancel-rate", "2"], "--cancel-rate: must be between 0 and 1, got 2.0"),
    ("soak", ["--path", "{missing}"], "--path: {missing} does not exist"),
    ("soak", ["--device", "cuda"], "--device cuda: CUDA is not available here"),
])
def test_demo_and_soak_bad_input_is_one_line_and_exit_2(tmp_path: Path, command: str, args: list[str],
                                                        says: str) -> None:
    if "cuda" in args and torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    missing = str(tmp_path / "nowhere")
    args = [a.format(missing=missing) for a in args]
    done = subprocess.run([sys.executable, "-P", "-m", "uring_kv", command, *args], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2
    said = done.stderr.strip().splitlines()
    assert len(said) == 1 and said[0] == f"uring-kv {command}: {says.format(missing=missing)}", done.stderr
    assert list(tmp_path.iterdir()) == []


def test_ctrl_c_stops_the_bench_cleanly(tmp_path: Path) -> None:
    """SIGINT while the bench writes its file: 'interrupted' on stderr, exit 130, no traceback,
    nothing left in the directory."""
    proc = subprocess.Popen([sys.executable, "-P", "-m", "uring_kv", "bench", "--path", str(tmp_path), "--size", "2G",
                             "--block-size", "4K", "--layers", "4", "--direct"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            # as from a terminal: a shell's background job (this test's, maybe) ignores SIGINT
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert proc.stderr is not None
    for line in proc.stderr:  # progress lines (stderr is not a terminal)
        if "writing" in line:
            break
    time.sleep(0.5)  # writing its 2 GiB file (unnamed: nothing to see in the directory)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert err.strip().splitlines()[-1] == "interrupted" and "Traceback" not in err, err
    assert list(tmp_path.iterdir()) == []


def test_bench_help_shows_the_defaults() -> None:
    done = subprocess.run([sys.executable, "-P", "-m", "uring_kv", "soak", "--help"], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "COLUMNS": "100"})
    assert done.returncode == 0
    text = " ".join(done.stdout.split())
    for default in ("(default: 1000000)", "(default: 4)", "(default: 16)", "(default: 0.1)"):
        assert default in text


def test_soak_prints_a_plan_and_progress(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-P", "-m", "uring_kv", "soak", "--blocks", "20000", "--path",
                           str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    said = done.stderr.splitlines()
    assert said[0].startswith("soak on c") and ": 20000 blocks" in said[0] and "about" in said[0]
    steps = [line for line in said if line.startswith("soak: ") and "of 20000 blocks" in line]
    assert len(steps) >= 5  # every tenth (not a terminal: lines, not a bar)
    assert "corrupt=0" in done.stdout and list(tmp_path.iterdir()) == []


def test_peer_names_are_checked() -> None:
    from uring_kv.bench.config import PEERS
    from uring_kv.cli import _PEER_NAMES, _peers

    assert _PEER_NAMES == PEERS
    assert _peers("ceiling, vllm-disk") == ("vllm-disk", "ceiling")
    assert _peers("none") == ()
    for bad in ("threads8", "serial,pool", ""):
        with pytest.raises(argparse.ArgumentTypeError):
            _peers(bad)


def test_bench_runs_only_the_peers_asked_for(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "bench.json"
    code = main(["bench", "--path", str(tmp_path), "--size", "2M", "--block-size", "64K", "--layers", "4",
                 "--batch", "8", "--batches", "1", "--io-depth", "4", "--direct", "--peers", "ceiling",
                 "--no-sweep", "--json", str(out)])
    assert code == 0
    result = json.loads(out.read_text())
    assert {r["method"] for r in result["rows"] if r["case"] != "pcie"} == {"uring_kv", "ring ceiling", "copy ceiling"}
    mine = [r for r in result["rows"] if r["method"] == "uring_kv"]
    assert mine and all(set(r["ratios"]) <= {"ring ceiling", "copy ceiling", "pcie ceiling"} for r in mine)
    assert result["all_verified"] is True and result["idle_loop_lag"]["samples"] > 0
    assert "depth_sweep" not in result["extra"][str(64 << 10)]
    assert "sizing:" not in capsys.readouterr().out
    code = main(["bench", "--path", str(tmp_path), "--size", "2M", "--block-size", "64K", "--layers", "4",
                 "--batch", "8", "--batches", "1", "--io-depth", "4", "--direct", "--peers", "none",
                 "--json", str(out)])
    assert code == 0
    result = json.loads(out.read_text())
    assert {r["method"] for r in result["rows"] if r["case"] != "pcie"} == {"uring_kv"}
    assert result["idle_loop_lag"]["samples"] == 0


def test_where_the_engine_moves_the_cache_rows_itself_the_rows_ceiling_is_its_limit(
        capsys: pytest.CaptureFixture[str]) -> None:
    """On tmpfs (O_DIRECT there takes any buffer) the engine reads straight into torch's cache
    rows and writes straight from them: the copy ceiling, the engine's own copy path, is left out
    of those rows and of their limit, with a note saying why, and the rows ceiling (the ring's C
    loop doing those same I/Os) runs in its place, its bytes checked like any method's."""
    with ram_directory() as directory:
        out = directory / "bench.json"
        assert main(["bench", "--path", str(directory), "--size", "2M", "--block-size", "64K", "--layers", "4",
                     "--batch", "8", "--batches", "1", "--io-depth", "4", "--direct", "--peers", "ceiling",
                     "--no-sweep", "--json", str(out)]) == 0
        result = json.loads(out.read_text())
    rows, extra = result["rows"], result["extra"][str(64 << 10)]
    assert result["all_verified"] is True and all(r["verified"] for r in rows)
    assert extra["cold"]["direct"] is True
    assert {(r["op"], r["method"]) for r in rows} == {(op, m) for op in ("load", "store")
                                                      for m in ("uring_kv", "ring ceiling", "rows ceiling")}
    for row in rows:
        if row["method"] == "uring_kv":
            limit = min(r["gbps"] for r in rows if r["method"] in ("ring ceiling", "rows ceiling")
                        and r["op"] == row["op"])
            assert row["of_limit"] == pytest.approx(row["gbps"] / limit)
            assert "copy ceiling" not in row["ratios"] and "rows ceiling" in row["ratios"]
    assert extra["cold"]["rows_ceiling"].startswith("the ring's C loop")
    note = extra["notes"]["copy ceiling, cold"]
    assert note.startswith("left out for loads and stores")
    assert f"copy ceiling, cold: {note}" in " ".join(capsys.readouterr().out.split())  # (wrapped to the console)


def test_the_rows_ceiling_bounds_only_uring_kvs_own_row() -> None:
    """The rows ceiling is the limit of the engine's path straight into the rows; the peers (and
    uring_kv with checksums, in the Python pump) read into a buffer and copy, so their share is of
    the ring ceiling."""
    from uring_kv.bench.results import Row, kind_of, ratios

    def row(method: str, gbps: float) -> Row:
        return Row("load", "cold", 1 << 17, method, kind_of(method), gbps, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, True)

    rows = [row("uring_kv", 3.0), row("uring_kv+crc32c", 2.0), row("vllm-disk", 2.0), row("ring ceiling", 8.0),
            row("rows ceiling", 4.0)]
    ratios(rows)
    of = {r.method: r.of_limit for r in rows}
    assert of == {"uring_kv": 0.75, "uring_kv+crc32c": 0.25, "vllm-disk": 0.25, "ring ceiling": None,
                  "rows ceiling": None}


def test_the_rows_ceiling_moves_each_block_between_the_file_and_its_rows_in_either_mode(tmp_path: Path) -> None:
    """A load brings file block d into cache block c of every tensor (its rows in tensor order, as
    the engine lays a block out); a store writes cache block c's rows to file block d; in either
    submission mode, with cache blocks out of order."""
    from uring_kv.bench.ceilings import RowsCeiling

    row_bytes, tensors, blocks = [4096, 8192, 4096], 3, 6
    stride = sum(row_bytes)
    data = os.urandom(stride * blocks)
    path = tmp_path / "file"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDWR)
    caches = [torch.zeros(blocks, n, dtype=torch.uint8) for n in row_bytes]
    disk, cache = [4, 0, 5, 2], [1, 5, 0, 3]
    try:
        for async_io in (False, True):
            ceiling = RowsCeiling(caches, row_bytes, fd, stride, 2)
            ceiling.modes = {False: async_io, True: async_io}
            for t in caches:
                t.fill_(0xFF)
            ceiling.run_measured(False, disk, cache)
            for d, c in zip(disk, cache, strict=True):
                block = data[d * stride:(d + 1) * stride]
                got = b"".join(bytes(caches[t][c].numpy()) for t in range(tensors))
                assert got == block, f"async_io={async_io}: file block {d} in cache block {c}"
            for t in caches:
                t[cache[0]] = torch.randint(0, 255, t[cache[0]].shape, dtype=torch.uint8)
            want = b"".join(bytes(caches[t][cache[0]].numpy()) for t in range(tensors))
            ceiling.run_measured(True, disk[:1], cache[:1])
            assert os.pread(fd, stride, disk[0] * stride) == want, f"async_io={async_io}"
            data = data[:disk[0] * stride] + want + data[(disk[0] + 1) * stride:]
            ceiling.close()
    finally:
        os.close(fd)


def test_the_ram_backed_run_is_left_out_when_asked_or_when_the_file_is_in_ram_already(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "bench.json"
    small = ["--size", "2M", "--block-size", "64K", "--layers", "4", "--batch", "8", "--batches", "1",
             "--io-depth", "4", "--direct", "--peers", "none", "--json", str(out)]
    assert main(["bench", "--path", str(tmp_path), "--no-ram", *small]) == 0
    result = json.loads(out.read_text())
    assert "ram" not in result and result["ram_skipped"] == "left out (--no-ram)"
    assert "RAM-backed run: left out (--no-ram)" in capsys.readouterr().out
    if filesystem_of("/dev/shm") != "tmpfs":
        pytest.skip("/dev/shm is not a tmpfs here")
    assert main(["bench", "--path", "/dev/shm", *small]) == 0
    result = json.loads(out.read_text())
    assert "ram" not in result and result["ram_skipped"].startswith("left out: the file is already in RAM")


@pytest.mark.parametrize("store", [False, True])
@pytest.mark.parametrize("peer", ["vllm-disk", "threads"])
def test_each_peer_moves_the_right_bytes(tmp_path: Path, peer: str, store: bool) -> None:
    """A peer on its own, checked the bench's way: loads land each disk block's words in the
    right cache rows; stores put each cache row's words at the right place in the file."""
    from uring_kv.bench import peers
    from uring_kv.bench.workload import prefill, verify_file

    config = BenchConfig(size=1 << 20, layers=4, batch=8, batches=1)
    work = Workload(config, 16 << 10, torch.device("cpu"))

    async def run() -> bool:
        async with Engine(work.caches, tmp_path / "kv.bin", work.num_disk_blocks, 4) as engine:
            await prefill(engine, work)
            fd, stride = engine.file.fd, engine.file.stride
            method = (peers.VllmDisk(work.caches, work.per_layer, work.device, fd, stride) if peer == "vllm-disk"
                      else peers.ThreadPool(work.caches, work.per_layer, work.device, fd, stride, 3))
            try:
                disk, gpu = [9, 3, 40, 7, 12, 60, 1, 33], [5, 0, 7, 2, 6, 1, 3, 4]
                if store:
                    work.fill_gpu_as(disk[::-1], gpu)  # the file's blocks get other blocks' words...
                    method.run(True, disk, gpu)
                    assert not await verify_file(fd, stride, work, disk)
                    work.fill_gpu_as(disk, gpu)  # ...then their own back
                    method.run(True, disk, gpu)
                    return await verify_file(fd, stride, work, disk)
                work.scrub()
                method.run(False, disk, gpu)
                return work.verify(disk, gpu)
            finally:
                method.close()

    assert asyncio.run(run())


def test_kvikio_row_says_why_it_is_missing() -> None:
    from uring_kv.bench.peers import kvikio_problem

    assert kvikio_problem(torch.device("cpu")) == "needs CUDA (KvikIO reads into GPU memory)"
    if torch.cuda.is_available():
        try:
            import kvikio  # noqa: F401
        except ImportError:
            assert kvikio_problem(torch.device("cuda")) == "not installed (pip install uring-kv[peers])"


def test_staging_slots_default_to_half_the_depth_again_where_copies_are_copier_jobs() -> None:
    """GPU mode, and CPU mode once the slots hold over 1 MiB (its copies are then copier jobs),
    hide each slot's copy turnaround behind spare slots; smaller CPU set-ups keep their inline
    pumps, with spare slots for O_DIRECT up to the depth while all slots stay within 1 MiB (a reap
    refills through them before it copies), none for buffered files (read straight into the
    caches). An explicit count always wins."""
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert staging_slots(BenchConfig(io_depth=32), cuda, 4 << 10) == 48
    assert staging_slots(BenchConfig(io_depth=32), cpu, 128 << 10) == 48
    assert staging_slots(BenchConfig(io_depth=32), cpu, 32 << 10) == 32  # 1 MiB: still inline, no room
    assert staging_slots(BenchConfig(io_depth=32), cpu, 16 << 10) == 64
    assert staging_slots(BenchConfig(io_depth=32), cpu, 16 << 10, direct=False) == 32
    assert staging_slots(BenchConfig(io_depth=32), cpu, 24 << 10) == 42  # 42 × 24 KiB ≤ 1 MiB
    assert staging_slots(BenchConfig(io_depth=32, slots=32), cuda, 2 << 20) == 32
    assert staging_slots(BenchConfig(io_depth=8, slots=11), cpu, 4 << 10) == 11


def test_the_sizing_advice_takes_the_smallest_depth_near_the_best() -> None:
    from uring_kv.bench.ceilings import recommend_depth

    assert recommend_depth({4: 0.5, 8: 0.9, 16: 1.0, 32: 1.02, 64: 1.01}) == 16  # 1.0 ≥ 0.95 × 1.02
    assert recommend_depth({4: 0.5, 8: 0.9, 16: 0.95, 32: 1.2}) == 32
    assert recommend_depth({4: 3.0, 8: 2.0}) == 4


async def test_cpu_bench_set_up_with_spare_slots_runs_in_pumps(tmp_path: Path) -> None:
    """The bench's CPU set-up with spare slots (128 KiB blocks, depth 16 + 8 spare) is pumped: its
    copies are copier jobs, which run under a depth cap, unlike inline memcpy pumps."""
    config = BenchConfig(io_depth=16)
    slots = staging_slots(config, torch.device("cpu"), 128 << 10)
    assert slots == 24
    caches = {"k": torch.zeros(16, 32 << 10, dtype=torch.int32)}  # 128 KiB blocks
    source = torch.randint(-2**31, 2**31 - 1, (16, 32 << 10), dtype=torch.int32)
    async with Engine(caches, tmp_path / "kv.bin", 16, slots, io_depth=config.io_depth) as engine:
        caches["k"].copy_(source)
        await engine.store_batch(list(range(16)), list(range(16)))
        caches["k"].zero_()
        await engine.load_batch(list(range(16)), list(range(16)))
        assert torch.equal(caches["k"], source)
        assert engine.stats()["pumped_batches"] == 2


def test_the_heap_is_frozen_only_while_measuring() -> None:
    import gc

    from uring_kv.bench.measure import frozen_heap

    before = gc.get_freeze_count()
    keep = [[i] for i in range(1000)]  # tracked objects alive when the freeze starts
    with frozen_heap(True):
        assert gc.get_freeze_count() >= before + len(keep)
    assert gc.get_freeze_count() == 0
    with frozen_heap(False):
        assert gc.get_freeze_count() == 0


def test_lag_ticker_sees_a_stalled_loop() -> None:
    """Both of the ticker's measures catch a 20 ms blocking call on the loop, and the one ticked
    by the probe process stays small while the loop only sleeps."""
    import asyncio
    import time

    from uring_kv.bench.lagprobe import LagTicker

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
    from uring_kv.bench.config import batches_for

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

    monkeypatch.setattr("uring_kv._io.uring.NativeRing", refuse)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        facts, problem = info(str(tmp_path))
    assert "thread pool" in facts["io"] and "EPERM" in facts["io"] and "seccomp" in facts["io"]
    assert problem is None  # the fallback can run


async def test_bench_order_tool_replays_the_order_the_bench_ran() -> None:
    """lab/bench_order.py groups each batch time by the method that ran just before it, from the
    JSON alone: it must replay the rotation `measure` really used. Each stub method reports the
    call's position as its time, so every group can be checked against the recorded calls."""
    import importlib.util
    from types import SimpleNamespace

    from uring_kv.bench.measure import measure

    spec = importlib.util.spec_from_file_location("bench_order", Path(__file__).parents[1] / "lab" / "bench_order.py")
    assert spec is not None and spec.loader is not None
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    calls: list[tuple[str, list[int]]] = []

    def method(name: str) -> Any:
        async def run(store: bool, disk_blocks: list[int], gpu_blocks: list[int]) -> tuple[float, float]:
            calls.append((name, disk_blocks))
            return float(len(calls) - 1), 0.0  # "seconds": the call's position

        return run

    rounds, names = 7, ["uring_kv", "serial", "threads8", "ring ceiling"]
    work = SimpleNamespace(load_batches=[[r] for r in range(rounds)], gpu_order=[[0]] * rounds,
                           config=BenchConfig(warmup=2), device=torch.device("cpu"), scrub=lambda: None,
                           verify=lambda disk, gpu: True)
    tallies = await measure(work, {name: method(name) for name in names}, "load", -1, 0)  # type: ignore[arg-type]
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
    """lab/ring_idle.c, the C program behind deployment.md's figures on batches after idle time,
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
    subprocess.run([compiler, "-O2", "-Wall", "-Werror", "-o", str(exe), str(root / "lab" / "ring_idle.c"),
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


def test_a_store_method_that_writes_nothing_is_not_verified(tmp_path: Path) -> None:
    """The checked store round starts from zeroed blocks: a method that writes nothing (or only
    some blocks) fails the check, though every block already held its pattern from the prefill."""
    from uring_kv.bench.measure import measure
    from uring_kv.bench.workload import prefill

    config = BenchConfig(size=1 << 20, layers=4, batch=8, batches=1, warmup=0)
    work = Workload(config, 16 << 10, torch.device("cpu"))

    async def run() -> dict[str, bool]:
        async with Engine(work.caches, tmp_path / "kv.bin", work.num_disk_blocks, 4) as engine:
            await prefill(engine, work)

            async def honest(store: bool, disk: list[int], gpu: list[int]) -> None:
                await engine.store_batch(gpu, disk)

            async def idle(store: bool, disk: list[int], gpu: list[int]) -> None:
                return None

            async def half(store: bool, disk: list[int], gpu: list[int]) -> None:
                await engine.store_batch(gpu[:4], disk[:4])

            tallies = await measure(work, {"honest": honest, "idle": idle, "half": half}, "store",
                                     engine.file.fd, engine.file.stride)
            return {name: tally.verified for name, tally in tallies.items()}

    assert asyncio.run(run()) == {"honest": True, "idle": False, "half": False}


def test_striped_bench_has_every_row_and_checks_the_bytes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``bench --path A --path B``: per block size, each directory's ring ceiling, their sum, the
    ceilings at once, and the striped store's puts and gets, whose rows are checked; the gets'
    ratios to the ceilings are in the JSON, and nothing is left in the directories."""
    drives = [tmp_path / "a", tmp_path / "b"]
    for drive in drives:
        drive.mkdir()
    out = tmp_path / "striped.json"
    code = main(["bench", "--path", str(drives[0]), "--path", str(drives[1]), "--size", "2M", "--block-size", "64K",
                 "--block-size", "128K", "--layers", "4", "--batch", "8", "--json", str(out)])
    printed = capsys.readouterr().out
    assert code == 0, printed
    results = json.loads(out.read_text())["results"]
    for block in (64 << 10, 128 << 10):
        rows = {r["method"]: r for r in results if r["block_bytes"] == block}
        assert sorted(rows) == sorted([f"ring ceiling {drives[0]}", f"ring ceiling {drives[1]}", "sum of the ceilings",
                                       "ring ceilings at once", "uring_kv striped put", "uring_kv striped get, as put",
                                       "uring_kv striped get, random keys"])
        assert all(r["verified"] and r["gbps"] > 0 for r in rows.values())
        alone = rows[f"ring ceiling {drives[0]}"]["gbps"] + rows[f"ring ceiling {drives[1]}"]["gbps"]
        assert rows["sum of the ceilings"]["gbps"] == pytest.approx(alone)
        for get in (rows["uring_kv striped get, as put"], rows["uring_kv striped get, random keys"]):
            assert get["ratios"]["sum of the ceilings"] == pytest.approx(get["gbps"] / alone)
            assert set(get["ratios"]) == {"sum of the ceilings", "ring ceilings at once"}
    assert "÷ sum of the ceilings" in printed
    assert [list(drive.iterdir()) for drive in drives] == [[], []]


def test_striped_bench_reports_wrong_bytes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    """A get that puts two keys' bytes in each other's rows: the row says NO and the exit status is 1."""
    import uring_kv

    real_get = uring_kv.StripedBlockStore.get

    async def swapped(self: Any, keys: list[bytes], rows: list[int], after: Any = None) -> None:
        await real_get(self, keys, [rows[1], rows[0], *rows[2:]], after)

    monkeypatch.setattr(uring_kv.StripedBlockStore, "get", swapped)
    drives = [tmp_path / "a", tmp_path / "b"]
    for drive in drives:
        drive.mkdir()
    code = main(["bench", "--path", str(drives[0]), "--path", str(drives[1]), "--size", "1M", "--block-size", "64K",
                 "--layers", "4", "--batch", "8"])
    printed = capsys.readouterr().out
    assert code == 1
    gets = [line.split()[-1] for line in printed.splitlines() if line.startswith("uring_kv striped get")]
    assert gets == ["NO", "NO"]


def test_the_one_pass_identity_check_agrees_with_identity_words() -> None:
    """stamp_identity writes what identity_words builds; holds_identity catches a flipped bit and
    another key's row (what the framework benches check every moved row with)."""
    from uring_kv.bench.workload import holds_identity, identity_words, stamp_identity

    words = np.zeros((4, 512), dtype=np.int64)
    stamp_identity(words, [7, 8, 9, 10])
    assert torch.equal(torch.from_numpy(words), identity_words([7, 8, 9, 10], 0, 512, "cpu"))
    assert holds_identity(words, [7, 8, 9, 10])
    assert not holds_identity(words, [7, 8, 10, 9])
    words[2, 300] ^= 1 << 40
    assert not holds_identity(words, [7, 8, 9, 10])
    words[2, 300] ^= 1 << 40
    words[3, 511] ^= 1  # the last word of the last row
    assert not holds_identity(words, [7, 8, 9, 10])
    words[3, 511] ^= 1
    # bench-mix's form: checked and scrubbed in one pass, so a later load that leaves a row alone fails
    assert holds_identity(words, [7, 8, 9, 10], scrub=True)
    assert (words == -1).all()
    assert not holds_identity(words, [7, 8, 9, 10], scrub=True)
    stamp_identity(words, [7, 8, 9, 10])
    words[0, 0] = 0
    assert not holds_identity(words, [7, 8, 9, 10], scrub=True) and (words == -1).all()  # scrubbed even so
    with pytest.raises(ValueError, match=r"rows of shape \(4, 512\) for 3 keys"):
        holds_identity(words, [7, 8, 9])
    with pytest.raises(ValueError, match="rows of shape"):
        holds_identity(words[0], [7])  # one row, not a row of rows


def test_the_ring_ceiling_reads_the_blocks_in_either_submission_mode_and_keeps_the_faster(tmp_path: Path) -> None:
    """Inline and IOSQE_ASYNC submissions both bring each block's bytes into the buffer; left to
    choose, the ceiling times both on its first batch of an operation and keeps one for that operation."""
    from uring_kv.bench.ceilings import RingCeiling

    stride, blocks = 16384, 4
    data = os.urandom(stride * blocks)
    path = tmp_path / "file"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDWR)
    try:
        want = {data[i * stride:(i + 1) * stride] for i in range(blocks)}
        for async_io in (False, True):
            ceiling = RingCeiling(fd, stride, blocks, async_io=async_io)
            try:
                ceiling.buffer.view[:] = b"\xff" * (stride * blocks)
                assert ceiling.run(False, list(range(blocks)), []) > 0
                got = {bytes(ceiling.buffer.view[i * stride:(i + 1) * stride]) for i in range(blocks)}
                assert got == want, f"async_io={async_io}"
            finally:
                ceiling.close()
        chooser = RingCeiling(fd, stride, blocks)
        try:
            chooser.run(False, list(range(blocks)), [])
            assert list(chooser.modes) == [False] and chooser.description.startswith("loads ")
        finally:
            chooser.close()
    finally:
        os.close(fd)
