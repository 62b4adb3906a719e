"""``uring-kv bench-lmcache``: UringKVL2Adapter against LMCache's own disk L2 adapters, same disk.

Each adapter is built by LMCache itself from its ``--l2-adapter`` JSON (``parse_args_to_l2_adapters_config``
then ``create_l2_adapter`` with an ``L1MemoryDesc``), and fed chunks made by LMCache's own L2 bench
helpers (``lmcache bench l2``: ``TensorMemoryObj`` views of one aligned L1 buffer, filled per key).
It is driven as LMCache's controllers drive L2 adapters: tasks of ``--job`` keys, up to ``--jobs``
in flight, completions waited for on the eventfds (a blocking poll, as the controllers wait).
Per chunk size, every adapter stores the same keys, then loads them back in another order; every
chunk loaded is compared with the bytes stored.
Reported per adapter and operation: GB/s, p50/p99 task latency (submit → result seen), and
uring_kv ÷ each of LMCache's adapters.

The peers: ``fs`` (``FSL2Adapter``: a file per chunk through aiofiles, buffered, its default) and
``fs_native`` (LMCache's C++ file connector, 4 worker threads, buffered, its default). Both start
empty; before the loads their files are synced and dropped from the page cache
(``posix_fadvise(DONTNEED)``), so every adapter reads from the disk (uring_kv's file is O_DIRECT
where the filesystem takes it).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import select
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from uring_kv.bench.args import (
    Defaults,
    at_least,
    byte_size,
    check_free_space,
    check_multiples,
    usable_directory,
)
from uring_kv.bench.results import framework_report, percentile, progress_printer

ADAPTERS = {
    "uring_kv": {"type": "plugin", "module_path": "uring_kv.integrations.lmcache", "class_name": "UringKVL2Adapter"},
    "fs": {"type": "fs"},
    "fs_native": {"type": "fs_native"},
}
PEERS = ("fs", "fs_native")


@dataclass
class Result:
    adapter: str
    chunk_bytes: int
    op: str  # "store" or "load"
    gbps: float
    p50_ms: float
    p99_ms: float
    tasks: int
    verified: bool


def _adapter(name: str, root: str, capacity: int, l1_desc: Any) -> Any:
    from lmcache.v1.distributed.l2_adapters import create_l2_adapter
    from lmcache.v1.distributed.l2_adapters.config import parse_args_to_l2_adapters_config

    entry: dict[str, Any] = dict(ADAPTERS[name])
    if name == "uring_kv":
        entry["adapter_params"] = {"root_dir": root, "capacity_bytes": capacity, "num_slots": 32}
    else:
        entry["base_path"] = root
    config = parse_args_to_l2_adapters_config(argparse.Namespace(l2_adapter=[json.dumps(entry)])).adapters[0]
    return create_l2_adapter(config, l1_memory_desc=l1_desc)


def _drain(adapter: Any, load: bool, pending: dict[int, tuple[float, int, list[int]]]) -> list[tuple[int, Any]]:
    """Wait for completions on the eventfd, as LMCache's controllers do (a blocking poll, here of at
    most 100 ms); the finished (task id, result)."""
    fd = adapter.get_load_event_fd() if load else adapter.get_store_event_fd()
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    if poller.poll(100):
        with contextlib.suppress(BlockingIOError):
            os.eventfd_read(fd)
    if not load:
        return list(adapter.pop_completed_store_tasks().items())
    done = []
    for task_id in list(pending):
        if (bitmap := adapter.query_load_result(task_id)) is not None:
            done.append((task_id, bitmap))
    return done


def _drive(adapter: Any, buffer: Any, chunk: int, order: list[int], job_keys: int, in_flight: int, load: bool,
           expected: dict[int, int]) -> tuple[float, list[float], bool]:
    """Run ``order``'s keys through ``adapter`` in tasks of ``job_keys``: seconds, task latencies,
    and whether every task succeeded (and, for loads, every chunk came back as stored)."""
    from lmcache.cli.commands.bench.l2_adapter_bench.data import make_memory_objects, make_object_keys

    groups = list(range(in_flight))  # buffer regions a task may use, job_keys chunks each
    pending: dict[int, tuple[float, int, list[int]]] = {}  # task id → (submitted, region, key numbers)
    latencies: list[float] = []
    ok = True
    jobs = [order[i:i + job_keys] for i in range(0, len(order), job_keys)]
    start = time.perf_counter()
    next_job = 0
    while next_job < len(jobs) or pending:
        while next_job < len(jobs) and groups:
            group, numbers = groups.pop(), jobs[next_job]
            objs = make_memory_objects(buffer, len(numbers), chunk, group * job_keys * chunk)
            keys = [make_object_keys(1, key_offset=n)[0] for n in numbers]
            if not load:
                for obj, n in zip(objs, numbers, strict=True):
                    obj.raw_data.fill_(expected[n])
                task_id = adapter.submit_store_task(keys, objs)
            else:
                for obj in objs:
                    obj.raw_data.fill_(0xFF)
                task_id = adapter.submit_load_task(keys, objs)
            pending[task_id] = (time.perf_counter(), group, numbers)
            next_job += 1
        for task_id, result in _drain(adapter, load, pending):
            submitted, group, numbers = pending.pop(task_id)
            latencies.append(time.perf_counter() - submitted)
            if not load:
                ok &= bool(result.is_successful())
            else:
                ok &= result.popcount() == len(numbers)
                view = buffer[group * job_keys * chunk:(group * job_keys + len(numbers)) * chunk].view(len(numbers), -1)
                for row, n in enumerate(numbers):
                    ok &= bool((view[row] == expected[n]).all())
            groups.append(group)
    return time.perf_counter() - start, latencies, ok


def _drop_cache(root: str) -> None:
    os.sync()
    for folder, _, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(folder, name), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def run(directory: str, chunk_sizes: list[int], total: int, job_keys: int, in_flight: int,
        adapters: list[str] | None = None, progress: Any = None) -> list[Result]:
    from lmcache.cli.commands.bench.l2_adapter_bench.data import create_l1_memory_desc, make_aligned_tensor

    results = []
    for chunk in chunk_sizes:
        keys = max(job_keys, total // chunk)
        order = list(range(keys))
        shuffled = [int(n) for n in np.random.default_rng(chunk).permutation(keys)]
        expected = {n: (n * 7 + 1) % 255 for n in order}  # a chunk's fill byte (never 0xFF, the loads' fill)
        for name in adapters or list(ADAPTERS):
            root = tempfile.mkdtemp(prefix=f"uring-kv-lmcache-{name}-", dir=directory)
            buffer = make_aligned_tensor(in_flight * job_keys * chunk, 4096)
            adapter = _adapter(name, root, (keys + job_keys) * chunk, create_l1_memory_desc(buffer, 4096))
            try:
                for op, sequence in (("store", order), ("load", shuffled)):
                    if progress:
                        progress(f"{chunk >> 10} KiB chunks, {name}: {op} of {keys} keys")
                    if op == "load":
                        _drop_cache(root)
                    seconds, latencies, ok = _drive(adapter, buffer, chunk, sequence, job_keys, in_flight,
                                                    op == "load", expected)
                    results.append(Result(name, chunk, op, keys * chunk / seconds / 1e9,
                                          percentile(latencies, 0.5) * 1e3, percentile(latencies, 0.99) * 1e3,
                                          len(latencies), ok))
            finally:
                adapter.close()
                del buffer
                shutil.rmtree(root, ignore_errors=True)
    return results


def render(results: list[Result]) -> list[str]:
    lines = [f"{'chunks':>8}  {'op':<6} {'adapter':<10} {'GB/s':>7} {'p50 ms':>8} {'p99 ms':>8}  {'ok':<3} "
             "uring_kv ÷ peer (GB/s)"]
    for r in results:
        ratio = ""
        if r.adapter == "uring_kv":
            parts = [f"{r.gbps / peer.gbps:.2f}× {peer.adapter}" for peer in results
                     if peer.adapter in PEERS and (peer.chunk_bytes, peer.op) == (r.chunk_bytes, r.op)]
            ratio = ", ".join(parts)
        lines.append(f"{r.chunk_bytes >> 10:>4} KiB  {r.op:<6} {r.adapter:<10} {r.gbps:7.2f} {r.p50_ms:8.2f} "
                     f"{r.p99_ms:8.2f}  {'yes' if r.verified else 'NO':<3} {ratio}")
    return lines


def main(args: argparse.Namespace) -> int:
    os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")  # LMCache's usage telemetry posts to the network
    try:
        import lmcache.cli.commands.bench.l2_adapter_bench.data
        import lmcache.v1.distributed.l2_adapters  # noqa: F401
    except ImportError as exc:
        print(f"uring-kv bench-lmcache: LMCache is not importable here ({exc}); pip install 'uring-kv[lmcache]'",
              file=sys.stderr)
        return 2

    progress = progress_printer("bench-lmcache")
    results = run(args.path, args.chunk_size or [128 << 10, 2 << 20], args.bytes, args.job, args.jobs,
                  args.adapter, progress)
    title = (f"uring-kv bench-lmcache · UringKVL2Adapter vs LMCache's fs and fs_native L2 adapters · {args.path} · "
             f"tasks of {args.job} chunks, {args.jobs} in flight · {time.strftime('%Y-%m-%d')}")
    config = {"path": args.path, "bytes": args.bytes, "job": args.job, "jobs": args.jobs}
    return framework_report(title, render(results), args.json, config, results)


def add_command(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """The command's arguments, in ``uring-kv``'s parser (:func:`command` runs it)."""
    parser = commands.add_parser("bench-lmcache", formatter_class=Defaults,
                                 help="UringKVL2Adapter against LMCache's own fs and fs_native L2 adapters "
                                      "(needs LMCache)")
    parser.add_argument("--path", help="directory for every adapter's files (default: the temp directory)")
    parser.add_argument("--chunk-size", type=byte_size, action="append",
                        help="bytes per chunk, LMCache's KV chunk (repeatable; default 128K and 2M)")
    parser.add_argument("--bytes", type=byte_size, default=512 << 20, help="bytes each adapter stores per size")
    parser.add_argument("--job", type=at_least(1), default=16, help="chunks per task")
    parser.add_argument("--jobs", type=at_least(1), default=4, help="tasks in flight at most")
    parser.add_argument("--adapter", action="append", choices=("uring_kv", "fs", "fs_native"),
                        help="adapters to run (repeatable; default all)")
    parser.add_argument("--json", help="write the results as JSON to this file")
    parser.set_defaults(func=command)


def command(args: argparse.Namespace) -> int:
    """Checks what the parser cannot (sizes, the directory, its free space), then runs the bench."""
    check_multiples("--chunk-size", args.chunk_size, 4096, "LMCache's L1 chunks are whole pages")
    args.path = usable_directory(args.path)
    chunks = max(args.chunk_size or [2 << 20])
    check_free_space(args.path, max(args.bytes, args.job * chunks) + args.job * chunks)  # one adapter's files at a time
    return main(args)
