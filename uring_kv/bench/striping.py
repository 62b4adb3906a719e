"""``uring-kv bench --path A --path B ...``: a :class:`~uring_kv.StripedBlockStore` over one file
per path, against each path's own ceiling.

Per block size, the same bytes in every row (``--size`` in all, split evenly over the paths):

* ``ring ceiling <path>``: the C loop on io_uring (registered buffers, ``--io-depth`` in flight,
  O_DIRECT, random block order, no Python) on a file in that path, the others idle: the drive's
  ceiling at that depth;
* ``sum of the ceilings``: their sum, the target the issue set: striping at or above 0.9 of it;
* ``ring ceilings at once``: the same loops on every file at the same time, one thread each: what
  the drives give together on this machine (a shared bus, CPU or page cache shows up here);
* ``uring_kv striped put``: ``put`` of ``--batch`` new keys at a time, back to back (the cache has a
  row per key), each stripe's engine at ``--io-depth``;
* ``uring_kv striped get, as put``: ``get`` of the same batches (a request's blocks are read as
  they were stored), in random order, the keys shuffled in each;
* ``uring_kv striped get, random keys``: ``get`` of batches of keys drawn at random from all of
  them: each batch splits over the stripes unevenly, and waits for its fullest.

Every row a get fills is compared with its key's bytes after the row's last batch; the first batch
of each row is not counted. The ratios are each get row's GB/s over the sum of the ceilings and
over the ceilings at once.
"""

from __future__ import annotations

import asyncio
import datetime
import os
import platform
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from uring_kv._file import round_up
from uring_kv._native import ring_loop
from uring_kv.bench.ceilings import RingCeiling
from uring_kv.bench.results import BatchRow, framework_report, percentile


@dataclass
class Result(BatchRow):
    ratios: dict[str, float] = field(default_factory=dict)  # a get row's GB/s ÷ each ceiling row's


def _row(method: str, block_bytes: int, times: list[float], blocks: int, verified: bool = True) -> Result:
    return Result.of(method, block_bytes, times, blocks, verified)


class _CeilingFile:
    """A file of ``blocks`` blocks in ``directory`` (O_DIRECT), written once by the C loop; its
    reads (:class:`RingCeiling`) are the ceiling. Removed on close."""

    def __init__(self, directory: str, stride: int, blocks: int, depth: int) -> None:
        self.path = os.path.join(directory, f"uring-kv-ceiling-{os.getpid()}-{stride}.bin")
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_DIRECT, 0o600)
        self.ceiling = RingCeiling(self.fd, stride, depth)
        os.posix_fallocate(self.fd, 0, stride * blocks)
        ring_loop(self.fd, True, depth, stride, [b * stride for b in range(blocks)], self.ceiling.buffer.addr, True)

    def read(self, batches: list[list[int]]) -> list[float]:
        """Seconds per batch of block numbers."""
        return [self.ceiling.run(False, batch, []) for batch in batches]

    def close(self) -> None:
        os.close(self.fd)
        os.unlink(self.path)
        self.ceiling.close()


def _batches(blocks: int, batch: int, seed: int) -> list[list[int]]:
    order = list(range(blocks))
    random.Random(seed).shuffle(order)
    return [order[i:i + batch] for i in range(0, blocks - batch + 1, batch)]


def _ceilings(paths: list[str], block_bytes: int, share: int, batch: int, depth: int) -> list[Result]:
    stride = round_up(block_bytes, 4096)
    files = []
    try:
        for path in paths:
            files.append(_CeilingFile(path, stride, share, depth))
        plans = [_batches(share, batch, seed) for seed in range(len(files))]
        results = []
        for path, file, plan in zip(paths, files, plans, strict=True):
            file.read(plan[:1])  # warm-up
            results.append(_row(f"ring ceiling {path}", block_bytes, file.read(plan), len(plan) * batch))
        alone = sum(r.gbps for r in results)
        results.append(Result("sum of the ceilings", block_bytes, alone, 0.0, 0.0, 0, True))
        times: list[list[float]] = [[] for _ in files]

        def run(position: int) -> None:
            times[position] = files[position].read(plans[position])

        threads = [threading.Thread(target=run, args=(position,)) for position in range(len(files))]
        started = time.perf_counter()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        wall = time.perf_counter() - started
        moved = sum(len(plan) for plan in plans) * batch * block_bytes
        slowest = max(times, key=sum)
        results.append(Result("ring ceilings at once", block_bytes, moved / wall / 1e9,
                              percentile(slowest, 0.5) * 1e3, percentile(slowest, 0.99) * 1e3, len(slowest),
                              True))
        return results
    finally:
        for file in files:
            file.close()


def _rows(layers: int, blocks: int, block_bytes: int, device: str) -> Any:
    """Cache rows for every block at once (row i: key i's bytes, every word = i), so that the
    batches run back to back: a pause between them would let a throttled device bank its budget."""
    import torch

    ids = torch.arange(blocks, dtype=torch.int64, device=device).unsqueeze(1)
    return {f"layer{i}": ids.expand(blocks, block_bytes // layers // 8).contiguous() for i in range(layers)}


def _check(rows: Any) -> bool:
    import torch

    first = next(iter(rows.values()))
    want = torch.arange(first.shape[0], dtype=torch.int64, device=first.device).unsqueeze(1)
    return all(bool(torch.all(tensor == want)) for tensor in rows.values())


async def _striped(paths: list[str], block_bytes: int, blocks: int, batch: int, layers: int, depth: int,
                   device: str) -> list[Result]:
    from uring_kv import StripedBlockStore

    rows = _rows(layers, blocks, block_bytes, device)
    keys = [f"stripe-bench/{block_bytes}/{index}".encode() for index in range(blocks)]
    slots = max(depth, 16)
    put_times: list[float] = []
    files = [os.path.join(path, "uring-kv-striped.bin") for path in paths]  # unnamed files in those directories
    shuffle = random.Random(7)
    as_put = [list(range(first, first + batch)) for first in range(0, blocks, batch)]
    shuffle.shuffle(as_put)
    for plan in as_put:
        shuffle.shuffle(plan)
    plans = {"as put": as_put, "random keys": _batches(blocks, batch, 7)}
    results = []
    # room for a quarter more than the keys: the stripes' capacities are not all used evenly
    async with StripedBlockStore(rows, files, blocks + blocks // 4, slots, io_depth=depth) as store:
        for first in range(0, blocks, batch):
            started = time.perf_counter()
            await store.put(keys[first:first + batch], range(first, first + batch))
            put_times.append(time.perf_counter() - started)
        # the first batch of each row is a warm-up (slots faulted in, the rings' first submissions)
        results.append(_row("uring_kv striped put", block_bytes, put_times[1:], batch * (len(put_times) - 1)))
        for name, order in plans.items():
            for tensor in rows.values():
                tensor.zero_()
            get_times = []
            for plan in order:  # each key into its own row
                started = time.perf_counter()
                await store.get([keys[i] for i in plan], plan)
                get_times.append(time.perf_counter() - started)
            results.append(_row(f"uring_kv striped get, {name}", block_bytes, get_times[1:],
                                batch * (len(get_times) - 1), _check(rows)))
    return results


def bench_striped(paths: list[str], block_sizes: list[int], total_bytes: int, batch: int, layers: int,
                  depth: int, device: str, json_path: str | None,
                  progress: Any = lambda message: None) -> int:
    """Run the bench (see the module docstring) on one file per path; print the table; the exit
    status (1 when a get's bytes did not check)."""
    results: list[Result] = []
    for block_bytes in block_sizes:
        blocks = max(2 * batch, total_bytes // block_bytes)
        blocks -= blocks % batch
        share = blocks // len(paths)
        progress(f"{block_bytes >> 10} KiB: ring ceilings on {len(paths)} files of {share} blocks")
        ceilings = _ceilings(paths, block_bytes, share, min(batch, share), depth)
        progress(f"{block_bytes >> 10} KiB: uring_kv striped over {len(paths)} files")
        striped = asyncio.run(_striped(paths, block_bytes, blocks, batch, layers, depth, device))
        for get in striped[1:]:
            for ceiling in ceilings[-2:]:
                get.ratios[ceiling.method] = get.gbps / ceiling.gbps if ceiling.gbps else float("inf")
        results += ceilings + striped
    width = max(28, *(len(r.method) + 2 for r in results))
    lines = [f"{'method':<{width}}{'block':>8}{'GB/s':>8}{'p50 ms':>9}{'p99 ms':>9}{'batches':>9}  checked"]
    for r in results:
        numbers = f"{r.p50_ms:>9.2f}{r.p99_ms:>9.2f}{r.batches:>9}" if r.batches else f"{'':>27}"
        lines.append(f"{r.method:<{width}}{r.block_bytes >> 10:>6}Ki{r.gbps:>8.2f}{numbers}"
                     f"  {'yes' if r.verified else 'NO'}")
        lines += [f"{'':<{width}}  ÷ {name}: {ratio:.2f}" for name, ratio in r.ratios.items()]
    title = (f"uring-kv bench (striped over {len(paths)} files): {batch} blocks a batch, depth {depth} per file, "
             f"{device}, {os.cpu_count()} CPUs, {platform.node()}, {datetime.date.today().isoformat()}")
    config = {"paths": paths, "block_sizes": block_sizes, "bytes": total_bytes, "batch": batch, "layers": layers,
              "io_depth": depth, "device": device, "host": platform.node(), "cpus": os.cpu_count(),
              "kernel": platform.release(), "date": datetime.date.today().isoformat()}
    return framework_report(title, lines, json_path, config, results)
