"""``uring-kv bench-vllm``: UringKVTier against vLLM's own file-system tier, on the same disk.

Each tier is built by vLLM itself (``TieringOffloadingSpec(config).get_manager()``: the shared
primary region, then the tier from its ``secondary_tiers`` entry) and driven as vLLM's tiering
manager drives it: jobs of ``--job`` chunks (one request's cascade, or its promotion), up to
``--jobs`` of them in flight, completions polled every millisecond (a scheduler step). Per row
size, both tiers store the same keys (cascade), then load them back in another order
(promotion); every promoted row is checked against the bytes stored. Reported per tier and
operation: GB/s, p50/p99 job latency (submit → seen finished), and uring_kv ÷ fs.

vLLM's fs tier writes one file per chunk under ``root_dir`` (its O_DIRECT probe decides direct
I/O); UringKVTier writes one file, O_DIRECT where the filesystem takes it. Both start empty and
cold: the page cache is dropped for the fs tier's files before the promotions
(``posix_fadvise(DONTNEED)`` on each), and UringKVTier's file is O_DIRECT.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
import uuid
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

TIERS = {
    "uring_kv": {"type": "UringKVTier", "module_path": "uring_kv.integrations.vllm"},
    "fs": {"type": "fs"},  # vLLM's FileSystemTierManager (16 read and 16 write threads by default)
}


@dataclass
class Result:
    tier: str
    row_bytes: int
    op: str  # "cascade" (store) or "promote" (load)
    gbps: float
    p50_ms: float
    p99_ms: float
    jobs: int
    verified: bool


def _manager(tier: str, root: str, rows: int, row_bytes: int, capacity: int) -> Any:
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )
    from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

    entry: dict[str, Any] = {**TIERS[tier], "root_dir": root}
    if tier == "uring_kv":
        entry.update(capacity_bytes=capacity, num_slots=32)
    config = OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=16, layer_names=("layers",), group_id=0),),
        worker_kv_bytes_per_block=row_bytes, enable_kv_cache_events=False,
        extra_config={"cpu_bytes_to_use": rows * row_bytes, "secondary_tiers": [entry]},
        engine_id=f"uring-kv-bench-{uuid.uuid4().hex[:8]}",
        model=OffloadingModelConfig(name="bench", dtype="bfloat16"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
                                          data_parallel_index=0, data_parallel_size=1,
                                          data_parallel_rank_local=None, is_parallelism_agnostic=False))
    return TieringOffloadingSpec(config).get_manager()


def _key(n: int) -> bytes:
    from vllm.v1.kv_offload.base import make_offload_key

    return bytes(make_offload_key(n.to_bytes(8, "big"), 0))


def _drive(tier: Any, rows: np.ndarray, order: list[int], job_keys: int, in_flight: int, promote: bool,
           ) -> tuple[float, list[float], bool]:
    """Run ``order``'s keys through ``tier`` in jobs of ``job_keys``: seconds, job latencies, and
    whether every job succeeded (and, for promotions, every row came back as stored)."""
    from vllm.v1.kv_offload.base import ReqContext
    from vllm.v1.kv_offload.tiering.base import TransferJob

    from uring_kv.bench.workload import holds_identity, stamp_identity  # (imports torch)

    free = list(range(rows.shape[0] // job_keys))  # row groups a job may use
    pending: dict[int, tuple[float, int, list[int]]] = {}  # job id → (submitted, row group, keys)
    latencies: list[float] = []
    ok = True
    jobs = [order[i:i + job_keys] for i in range(0, len(order), job_keys)]
    start = time.perf_counter()
    next_job = 0
    while next_job < len(jobs) or pending:
        while next_job < len(jobs) and len(pending) < in_flight and free:
            group, numbers = free.pop(), jobs[next_job]
            first = group * job_keys
            chunks = np.arange(first, first + len(numbers), dtype=np.int32)
            if not promote:
                stamp_identity(rows[first:first + len(numbers)].view(np.int64), numbers)
            else:
                rows[first:first + len(numbers)] = 0
            job = TransferJob(job_id=next_job, keys=[_key(n) for n in numbers], chunk_ids=chunks,
                              is_promotion=promote, req_context=ReqContext(req_id=f"r{next_job}"))
            pending[next_job] = (time.perf_counter(), group, numbers)
            (tier.submit_load if promote else tier.submit_store)(job)
            next_job += 1
        time.sleep(0.001)  # a scheduler step
        for result in tier.get_finished_jobs():
            submitted, group, numbers = pending.pop(result.job_id)
            latencies.append(time.perf_counter() - submitted)
            ok &= bool(result.success)
            if promote and result.success:
                first = group * job_keys
                ok &= holds_identity(rows[first:first + len(numbers)].view(np.int64), numbers)
            free.append(group)
    return time.perf_counter() - start, latencies, ok


def _drop_cache(root: str) -> None:
    for folder, _, files in os.walk(root):
        for name in files:
            path = os.path.join(folder, name)
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def run(directory: str, row_sizes: list[int], total: int, job_keys: int, in_flight: int,
        progress: Any = None) -> list[Result]:
    results = []
    for row_bytes in row_sizes:
        keys = max(job_keys, total // row_bytes)
        order = list(range(keys))
        shuffled = list(np.random.default_rng(row_bytes).permutation(keys))
        for tier in TIERS:
            root = tempfile.mkdtemp(prefix=f"uring-kv-vllm-{tier}-", dir=directory)
            manager = _manager(tier, root, job_keys * in_flight, row_bytes, (keys + job_keys) * row_bytes)
            try:
                rows = np.asarray(manager.primary_tier.get_kv_memoryview())
                secondary = manager.secondary_tiers[0]
                for op, sequence in (("cascade", order), ("promote", shuffled)):
                    if progress:
                        progress(f"{row_bytes >> 10} KiB rows, {tier}: {op} of {keys} keys")
                    if op == "promote":
                        _drop_cache(root)
                    seconds, latencies, ok = _drive(secondary, rows, [int(n) for n in sequence], job_keys,
                                                    in_flight, op == "promote")
                    results.append(Result(tier, row_bytes, op, keys * row_bytes / seconds / 1e9,
                                          percentile(latencies, 0.5) * 1e3, percentile(latencies, 0.99) * 1e3,
                                          len(latencies), ok))
                del rows
            finally:
                manager.shutdown()
                shutil.rmtree(root, ignore_errors=True)
    return results


def render(results: list[Result]) -> list[str]:
    lines = [f"{'rows':>8}  {'op':<8} {'tier':<9} {'GB/s':>7} {'p50 ms':>8} {'p99 ms':>8}  {'ok':<3} uring_kv ÷ fs"]
    for r in results:
        ratio = ""
        if r.tier == "uring_kv":
            fs = next(o for o in results if (o.tier, o.row_bytes, o.op) == ("fs", r.row_bytes, r.op))
            ratio = f"{r.gbps / fs.gbps:.2f}× the GB/s, {r.p99_ms / fs.p99_ms:.2f}× the p99"
        lines.append(f"{r.row_bytes >> 10:>4} KiB  {r.op:<8} {r.tier:<9} {r.gbps:7.2f} {r.p50_ms:8.2f} "
                     f"{r.p99_ms:8.2f}  {'yes' if r.verified else 'NO':<3} {ratio}")
    return lines


def main(args: argparse.Namespace) -> int:
    try:
        import vllm.v1.kv_offload.tiering.spec  # noqa: F401
    except ImportError as exc:
        print(f"uring-kv bench-vllm: vLLM's tiering is not importable here ({exc}); pip install vllm",
              file=sys.stderr)
        return 2

    progress = progress_printer("bench-vllm")
    results = run(args.path, args.row_size or [128 << 10, 2 << 20], args.bytes, args.job, args.jobs, progress)
    title = (f"uring-kv bench-vllm · UringKVTier vs vLLM's fs tier · {args.path} · jobs of {args.job} rows, "
             f"{args.jobs} in flight · {time.strftime('%Y-%m-%d')}")
    config = {"path": args.path, "bytes": args.bytes, "job": args.job, "jobs": args.jobs}
    return framework_report(title, render(results), args.json, config, results)


def add_command(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """The command's arguments, in ``uring-kv``'s parser (:func:`command` runs it)."""
    parser = commands.add_parser("bench-vllm", formatter_class=Defaults,
                                 help="UringKVTier against vLLM's own file-system tier (needs vLLM)")
    parser.add_argument("--path", help="directory for both tiers' files (default: the temp directory)")
    parser.add_argument("--row-size", type=byte_size, action="append",
                        help="bytes per primary row, vLLM's chunk (repeatable; default 128K and 2M)")
    parser.add_argument("--bytes", type=byte_size, default=1 << 30, help="bytes each tier stores per row size")
    parser.add_argument("--job", type=at_least(1), default=16, help="rows per job (a request's chunks)")
    parser.add_argument("--jobs", type=at_least(1), default=8, help="jobs in flight at most")
    parser.add_argument("--json", help="write the results as JSON to this file")
    parser.set_defaults(func=command)


def command(args: argparse.Namespace) -> int:
    """Checks what the parser cannot (sizes, the directory, its free space), then runs the bench."""
    check_multiples("--row-size", args.row_size, 4096, "vLLM's rows are whole pages")
    args.path = usable_directory(args.path)
    rows = max(args.row_size or [2 << 20])
    check_free_space(args.path, 2 * max(args.bytes, args.job * rows) + args.job * rows)  # both tiers' files at once
    return main(args)
