"""One ``uring-kv bench`` run: per block size and case, an engine on a fresh file, the peers and
ceilings asked for on the same file, every operation measured in rotation (``measure``), the depth
sweep, and the result as a JSON-ready dict (``report`` renders it)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import torch

from uring_kv import Engine
from uring_kv.bench import ceilings, peers
from uring_kv.bench.config import BenchConfig, largest_file, staging_slots
from uring_kv.bench.measure import Method, frozen_heap, measure, to_row
from uring_kv.bench.results import Row, percentile, pooled_lag, ratios
from uring_kv.bench.workload import Workload, prefill


class _Closing:
    """The peers of one case, closed together whatever happens."""

    def __init__(self) -> None:
        self.items: list[Any] = []

    def add(self, item: Any) -> Any:
        self.items.append(item)
        return item

    def close(self) -> None:
        for item in reversed(self.items):
            item.close()
        self.items.clear()


async def bench_block_size(config: BenchConfig, block_bytes: int, device: torch.device, directory: str,
                           progress: Callable[[str], None]) -> tuple[list[Row], dict[str, Any]]:
    work = Workload(config, block_bytes, device)
    rows: list[Row] = []
    extra: dict[str, Any] = {"batches": work.batches, "notes": {}}
    cases = [("cold", True), ("hot", False)] if config.direct is None else [
        ("cold" if config.direct else "hot", config.direct)]
    for case, direct in cases:
        slots = staging_slots(config, device, block_bytes, direct)
        path = os.path.join(directory, f"uring-kv-bench-{os.getpid()}-{block_bytes}-{case}.bin")
        async with Engine(work.caches, path, work.num_disk_blocks, slots,
                          direct=None if direct else False, checksum=config.checksum,
                          io_depth=config.io_depth) as engine:
            engine.trace(config.tracer)
            o_direct = engine.stats()["direct"]  # O_DIRECT in force (asked for, and the file system has it)
            if direct and not o_direct:
                extra["notes"][case] = f"O_DIRECT unavailable: {engine.stats()['direct_reason']}; 'cold' is buffered"
            progress(f"{block_bytes >> 10} KiB {case}: writing {work.num_disk_blocks} blocks")
            await prefill(engine, work)
            fd, stride = engine.fileno(), engine.stats()["stride"]
            if not direct:
                await asyncio.to_thread(_warm, fd, stride * work.num_disk_blocks)
            stats = engine.stats()
            extra[case] = {"slots": slots, "io_depth": stats["io_depth"], "pinned_bytes": stats["pinned_bytes"],
                           "direct": o_direct, "file_bytes": stride * work.num_disk_blocks,
                           "stride": stride, "io": stats["io"], "copy": stats["copy"]}
            if case == "cold" and config.sweep:
                depths = ", ".join(map(str, ceilings.DEPTHS))
                progress(f"{block_bytes >> 10} KiB cold: the ring ceiling at depths {depths}")
                # two batches at each depth
                extra["depth_sweep"] = await asyncio.to_thread(ceilings.depth_sweep, fd, stride, work.load_batches[:2])

            async def uring_kv(store: bool, disk_blocks: list[int], gpu_blocks: list[int],
                               checksum: bool = False) -> None:
                engine.checksum = checksum  # the prefill stored sums for every block when asked to
                if store:
                    await engine.store_batch(gpu_blocks, disk_blocks)
                else:
                    await engine.load_batch(disk_blocks, gpu_blocks)

            methods: dict[str, Method] = {"uring_kv": uring_kv}
            closing = _Closing()
            try:
                ops = ["load", "store"] if case == "cold" or config.direct is not None else ["load"]
                # where the engine reads straight into the cache rows (writes straight from them) it
                # makes no copy of its own: the copy ceiling is no limit of it there, and is left out;
                # the rows ceiling (the ring's loop doing those I/Os) is its limit, and runs only there
                uncopied = [op for op in ops if stats["loads_into_caches" if op == "load" else "stores_from_caches"]]
                ring, rows_ceiling = _add_peers(config, work, engine, methods, closing, extra, bool(uncopied))
                if config.checksum:
                    methods["uring_kv+crc32c"] = functools.partial(uring_kv, checksum=True)
                if uncopied and "copy ceiling" in methods:
                    extra["notes"][f"copy ceiling, {case}"] = (
                        f"left out for {' and '.join(op + 's' for op in uncopied)}: the engine moves those bytes "
                        "between the file and the cache rows itself, with no copy of its own (see the rows ceiling)")
                for op in ops:
                    run = {name: method for name, method in methods.items()
                           if not (name == "copy ceiling" and op in uncopied)
                           and not (name == "rows ceiling" and op not in uncopied)}
                    progress(f"{block_bytes >> 10} KiB {case} {op}: {', '.join(run)} (rotating)")
                    engine.delivery_times(clear=True)
                    engine.slot_phases(clear=True)
                    with frozen_heap(config.gc_freeze):
                        tallies = await measure(work, run, op, fd, stride)
                    # uring_kv's runs of this op: where its slots' time went (diagnostics, may change)
                    extra[case][f"slot_phases_{op}"] = engine.slot_phases()
                    rows.extend(to_row(work, op, case, name, tally) for name, tally in tallies.items())
                    delivery = [x / 1e3 for x in engine.delivery_times()]
                    extra[case][f"bridge_us_{op}"] = {  # None: no copy went through the bridge (CPU inline)
                        "p50": round(percentile(delivery, 0.5), 1), "p99": round(percentile(delivery, 0.99), 1),
                    } if delivery else None
                    if "fio" in config.peers and direct and o_direct and ceilings.fio_path():
                        progress(f"{block_bytes >> 10} KiB {case} {op}: fio")
                        moved = work.batches * config.batch * stride
                        gbps = await asyncio.to_thread(ceilings.run_fio, _reopenable(fd), op == "store", stride,
                                                       config.io_depth, stride * work.num_disk_blocks, moved)
                        rows.append(Row(op, case, block_bytes, "fio", "ceiling", gbps, gbps * 1e9 / stride, 0.0, 0.0,
                                        0.0, 0.0, 0.0, True))
                # batches run in native pumps (else in the Python pump), the prefill's included
                extra[case]["pumped_batches"] = engine.stats()["pumped_batches"]
                if ring is not None:
                    extra[case]["ring_ceiling"] = ring.description  # the faster submission mode per operation
                if rows_ceiling is not None and rows_ceiling.modes:
                    extra[case]["rows_ceiling"] = rows_ceiling.description
            finally:
                closing.close()
    if "fio" in config.peers and not ceilings.fio_path():
        extra["notes"]["fio"] = "not on PATH (apt-get install fio)"
    if device.type == "cuda":
        rows.extend(ceilings.pcie_ceiling(device))
    ratios(rows)
    return rows, extra


def _add_peers(config: BenchConfig, work: Workload, engine: Engine, methods: dict[str, Method], closing: _Closing,
               extra: dict[str, Any], moves_rows: bool) -> tuple[ceilings.RingCeiling | None,
                                                                ceilings.RowsCeiling | None]:
    """The peers asked for, on the engine's file and the bench's caches; the ring ceiling and (where
    the engine moves the cache rows itself in an operation measured: ``moves_rows``) the rows
    ceiling among them."""
    fd, stride = engine.fileno(), engine.stats()["stride"]
    if "vllm-disk" in config.peers:
        vllm = closing.add(peers.VllmDisk(work.caches, work.per_layer, work.device, fd, stride))
        methods[vllm.name] = functools.partial(_in_thread, vllm.run)
    if "threads" in config.peers:
        pool = closing.add(peers.ThreadPool(work.caches, work.per_layer, work.device, fd, stride, config.threads))
        methods[pool.name] = functools.partial(_in_thread, pool.run)
    if "kvikio" in config.peers:
        problem = peers.kvikio_problem(work.device)
        if problem:
            extra["notes"]["kvikio"] = problem
        else:
            kvikio = closing.add(peers.Kvikio(work.caches, work.per_layer, work.device, _reopenable(fd), stride,
                                              config.threads, config.batch, engine.stats()["direct"]))
            extra["notes"]["kvikio"] = f"{config.threads} threads, {kvikio.mode} mode"
            methods[kvikio.name] = functools.partial(_in_thread, kvikio.run)
    if "ceiling" in config.peers:
        ceiling: ceilings.RingCeiling = closing.add(ceilings.RingCeiling(fd, stride, engine.io_depth))
        methods["ring ceiling"] = functools.partial(_in_thread_timed, ceiling.run_measured)
        try:
            copies = closing.add(ceilings.CopyCeiling(work.caches, *work.slot_layout(), fd, stride, config.batch,
                                                      mapped=engine.stats()["plan"]["copier"] == "mapped"))
        except Exception as exc:  # a GPU where the staged kernel cannot be built (no NVRTC): said, not fatal
            extra["notes"]["copy ceiling"] = f"left out: {type(exc).__name__}: {exc}"
        else:
            extra["notes"]["copy ceiling"] = copies.description
            methods["copy ceiling"] = functools.partial(_in_thread_timed, copies.run_measured)
        rows = None
        if moves_rows:
            rows = closing.add(ceilings.RowsCeiling(work.caches, work.slot_layout()[0], fd, stride, engine.io_depth))
            methods["rows ceiling"] = functools.partial(_in_thread_timed, rows.run_measured)
        return ceiling, rows
    return None, None


def _reopenable(fd: int) -> str:
    """A path other processes and libraries can open the engine's file by: it has no name (it is
    made unnamed, or unlinked at once), but /proc/PID/fd/N reopens the same file."""
    return f"/proc/{os.getpid()}/fd/{fd}"


async def _in_thread(run: Callable[[bool, list[int], list[int]], None], store: bool, disk_blocks: list[int],
                     gpu_blocks: list[int]) -> None:
    await asyncio.to_thread(run, store, disk_blocks, gpu_blocks)


async def _in_thread_timed(run: Callable[[bool, list[int], list[int]], tuple[float, float]], store: bool,
                           disk_blocks: list[int], gpu_blocks: list[int]) -> tuple[float, float]:
    return await asyncio.to_thread(run, store, disk_blocks, gpu_blocks)


def _warm(fd: int, length: int) -> None:
    chunk = bytearray(8 << 20)
    offset = 0
    while offset < length:
        got = os.preadv(fd, [chunk], offset)
        if got <= 0:
            break
        offset += got


def filesystem_of(directory: str) -> str:
    """The type of the filesystem holding ``directory`` (from /proc/self/mountinfo), or "?"."""
    target, best, kind = os.path.realpath(directory), "", "?"
    with contextlib.suppress(OSError), open("/proc/self/mountinfo") as mounts:
        for line in mounts:
            fields = line.split()
            point = fields[4].encode().decode("unicode_escape")
            fstype = fields[fields.index("-") + 1]
            inside = target == point or target.startswith(point.rstrip("/") + "/")
            if inside and len(point) >= len(best):
                best, kind = point, fstype
    return kind


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


RAM_FILESYSTEMS = ("tmpfs", "ramfs")


def ram_directory(config: BenchConfig, disk_directory: str) -> tuple[str | None, str]:
    """Where the RAM-backed run goes (``config.ram_path``), or None and why it is left out: not
    asked for, not a RAM filesystem, the disk run already on one, or too little room there."""
    if not config.ram:
        return None, "left out (--no-ram)"
    if filesystem_of(disk_directory) in RAM_FILESYSTEMS:
        return None, f"left out: the file is already in RAM ({disk_directory}, {filesystem_of(disk_directory)})"
    kind = filesystem_of(config.ram_path)
    if not os.path.isdir(config.ram_path) or kind not in RAM_FILESYSTEMS:
        return None, f"left out: {config.ram_path} is not a RAM filesystem here ({kind})"
    stats = os.statvfs(config.ram_path)
    free, needed = stats.f_bavail * stats.f_frsize, largest_file(config)
    if free < needed:
        return None, (f"left out: {config.ram_path} has {free >> 20} MiB free, the run needs {needed >> 20} MiB "
                      "(make --size smaller)")
    return config.ram_path, ""


async def _run_in(config: BenchConfig, device: torch.device, directory: str,
                  progress: Callable[[str], None]) -> dict[str, Any]:
    """Every block size on a file in ``directory``: the rows, the set-up and the loop's lag."""
    rows: list[Row] = []
    extras: dict[str, Any] = {}
    for block_bytes in config.block_sizes:
        got, extra = await bench_block_size(config, block_bytes, device, directory, progress)
        rows.extend(got)
        extras[str(block_bytes)] = extra
    return {
        "path": os.path.realpath(directory),
        "filesystem": filesystem_of(directory),
        "rows": [{k: v for k, v in asdict(row).items() if k != "lag_ms"} for row in rows],
        "extra": extras,
        "all_verified": all(row.verified for row in rows),
        "uring_kv_lag": pooled_lag(rows),
        # The same probe while the loop had nothing to do (the ceiling's C loop runs on a worker
        # thread): the host's own wake-up latency, the floor under every lag figure of the run.
        "idle_loop_lag": pooled_lag(rows, "ring ceiling"),
    }


async def run_bench(config: BenchConfig, progress: Callable[[str], None]) -> dict[str, Any]:
    """The run on ``config.path`` (the disk), then, where :func:`ram_directory` finds one, the same
    on a RAM-backed file under ``"ram"`` (no depth sweep there: the sizing advice is the disk's).
    ``all_verified`` covers both."""
    device = resolve_device(config.device)
    directory = config.path or tempfile.gettempdir()
    result: dict[str, Any] = {
        "machine": {"kernel": os.uname().release, "cpus": os.cpu_count(), "python": sys.version.split()[0],
                    "torch": torch.__version__,
                    "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
                    "date": time.strftime("%Y-%m-%d")},
        "config": {k: v for k, v in asdict(config).items() if k not in ("tracer", "lag_watch")},
        "device": str(device),
        **await _run_in(config, device, directory, progress),
    }
    ram, why = ram_directory(config, directory)
    if ram is None:
        result["ram_skipped"] = why
        return result
    result["ram"] = await _run_in(dataclasses.replace(config, sweep=False), device, ram,
                                  lambda message: progress(f"RAM-backed file: {message}"))
    result["all_verified"] = result["all_verified"] and result["ram"]["all_verified"]
    return result


def to_json(result: dict[str, Any]) -> str:
    return json.dumps(result, indent=2)
