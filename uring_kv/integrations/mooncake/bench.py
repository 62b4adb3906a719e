"""``uring-kv bench-mooncake``: the Mooncake tier's remote hits and its writes, on this machine's loopback.

The topology is one machine playing three: a ``mooncake_master`` (``LocalMaster``), a store node
(``StoreNode``: a process that lends the cluster its memory and does nothing else) and this
process, whose stores lend none, so every value lives in the node and every remote hit crosses a
process boundary over TCP on 127.0.0.1, as it would cross the network between machines. That is
all it is: a loopback figure, bounded by this machine's memory bandwidth and cores, not a network.

Per block size, in batches of ``--batch`` blocks, every row on its own keys or stores:

* ``put local only``: the local tier alone (``TieredStore.local.put``), the baseline of the puts;
* ``put write-through``: ``TieredStore.put`` with ``write="through"`` (returns once Mooncake has the
  values too);
* ``put write-back``: ``write="back"`` (returns once the rows are copied into staging rows; the
  time until Mooncake has them all is reported beside it);
* ``get remote hit``: ``get_present`` in a store whose local tier is empty, ``promote=False``:
  Mooncake → staging row → checksum → cache row;
* ``get remote hit + promote``: the same, writing each hit into the local tier before returning;
* ``get local hit``: those keys again, now local;
* ``mooncake batch_get_into``: the client alone into the registered staging rows, with no checksum
  and no copy: what the tier adds is the difference.

Every row a get fills is compared with its key's bytes (outside the timed part). The first batch
of every row is not counted: it opens the TCP connections and faults the staging rows in.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import platform
import tempfile
import time
from dataclasses import dataclass
from typing import Any

from uring_kv.bench.args import (
    Defaults,
    UsageError,
    at_least,
    byte_size,
    check_free_space,
    check_multiples,
    usable_directory,
)
from uring_kv.bench.results import BatchRow, framework_report, progress_printer


@dataclass
class Result(BatchRow):
    extra_s: float = 0.0  # put write-back: seconds after the last put until Mooncake had every value


def _caches(batch: int, block_bytes: int) -> Any:
    import torch

    return {"kv": torch.zeros(batch, block_bytes // 8, dtype=torch.int64)}


def _fill(caches: Any, first_index: int, count: int) -> None:
    for row in range(count):
        caches["kv"][row].fill_(first_index + row)


def _check(caches: Any, first_index: int, count: int) -> bool:
    import torch

    return all(bool(torch.all(caches["kv"][row] == first_index + row)) for row in range(count))


def _keys(tag: str, block_bytes: int, first: int, count: int) -> list[bytes]:
    return [f"{tag}/{block_bytes}/{index}".encode().ljust(32, b".") for index in range(first, first + count)]


def _row(method: str, block_bytes: int, times: list[float], blocks: int, verified: bool, extra: float = 0.0) -> Result:
    if len(times) > 1:  # the first batch is a warm-up: TCP connections opened, staging rows faulted in
        blocks -= blocks // len(times)
        times = times[1:]
    return Result.of(method, block_bytes, times, blocks, verified, extra_s=extra)


async def _size(block_bytes: int, batch: int, total_bytes: int, path: str, remote: Any,
                progress: Any) -> list[Result]:
    from uring_kv.integrations.mooncake.tiered import TieredStore

    blocks = max(2 * batch, total_bytes // block_bytes // batch * batch)
    rounds = blocks // batch
    capacity = blocks + batch
    results: list[Result] = []

    def store(name: str, **options: Any) -> tuple[TieredStore, Any]:
        caches = _caches(batch, block_bytes)
        return TieredStore(caches, os.path.join(path, name), capacity, remote=remote, **options), caches

    async def puts(caches: Any, tag: str, put: Any) -> list[float]:
        times = []
        for index in range(rounds):
            _fill(caches, index * batch, batch)
            keys = _keys(tag, block_bytes, index * batch, batch)
            started = time.perf_counter()
            await put(keys, range(batch))
            times.append(time.perf_counter() - started)
        return times

    async def gets(reader: TieredStore, caches: Any, tag: str) -> tuple[list[float], bool]:
        times, right = [], True
        for index in range(rounds):
            keys = _keys(tag, block_bytes, index * batch, batch)
            caches["kv"].fill_(-1)
            started = time.perf_counter()
            loaded = await reader.get_present(keys, range(batch))
            times.append(time.perf_counter() - started)
            right = right and loaded == keys and _check(caches, index * batch, batch)
        return times, right

    progress(f"{block_bytes >> 10} KiB blocks: puts")
    writer, caches = store("writer")
    async with writer:
        results.append(_row("put local only", block_bytes, await puts(caches, "local", writer.local.put),
                            blocks, True))
        results.append(_row("put write-through", block_bytes, await puts(caches, "through", writer.put),
                            blocks, writer.remote.stats()["store_failures"] == 0))
    back, caches = store("back", write="back")
    async with back:
        times = await puts(caches, "back", back.put)
        started = time.perf_counter()
        while back.remote.stats()["pending_stores"]:
            await asyncio.sleep(0.001)
        drained = time.perf_counter() - started
        results.append(_row("put write-back", block_bytes, times, blocks,
                            back.remote.stats()["stored"] == blocks, drained))
    progress(f"{block_bytes >> 10} KiB blocks: gets")
    for name, promote in (("get remote hit", False), ("get remote hit + promote", True)):
        reader, caches = store(name.replace(" ", "-"), promote=promote)
        async with reader:
            times, right = await gets(reader, caches, "through")
            results.append(_row(name, block_bytes, times, blocks, right and reader.stats()["remote_hits"] == blocks))
            if promote:
                times, right = await gets(reader, caches, "through")
                results.append(_row("get local hit", block_bytes, times, blocks,
                                    right and reader.stats()["remote_hits"] == blocks))
            else:
                results.append(await _raw(reader, block_bytes, batch, rounds))
    return results


async def _raw(reader: Any, block_bytes: int, batch: int, rounds: int) -> Result:
    """The Mooncake client alone, on the tier's worker thread and staging rows: no checksum, no copy."""
    tier = reader.remote
    rows = await tier.rows.acquire(batch, 5.0)
    try:
        if len(rows) < batch:
            raise RuntimeError("the raw row needs --batch staging rows")
        times, right = [], True
        for index in range(rounds):
            names = [tier.remote_key(k) for k in _keys("through", block_bytes, index * batch, batch)]
            started = time.perf_counter()
            got = await tier.client_get_into(names, rows)
            times.append(time.perf_counter() - started)
            right = right and all(size == tier.value_bytes for size in got)
    finally:
        tier.rows.give_back(rows)
    return _row("mooncake batch_get_into", block_bytes, times, batch * rounds, right)


def bench_mooncake(block_sizes: list[int], batch: int, total_bytes: int, path: str | None,
                   json_path: str | None) -> int:
    """Run the bench (see the module docstring); print the table; the exit status."""
    from uring_kv.integrations.mooncake.config import MooncakeConfig
    from uring_kv.integrations.mooncake.local import LocalMaster, StoreNode

    progress = progress_printer("bench-mooncake")
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    results: list[Result] = []
    # every size's write-through and write-back values at once, below Mooncake's eviction mark (90 %)
    segment = int(2 * total_bytes * len(block_sizes) / 0.8) + (64 << 20)
    with tempfile.TemporaryDirectory(dir=path) as work, LocalMaster() as master, StoreNode(master, segment):
        progress(f"master on {master.master_address}, a store node lending {segment >> 20} MiB")
        for block_bytes in block_sizes:
            remote = MooncakeConfig(master.master_address, master.metadata_server, segment_bytes=0,
                                    staging_rows=max(64, batch), namespace=f"bench-{block_bytes}", timeout=30.0)
            directory = os.path.join(work, str(block_bytes))
            os.mkdir(directory)
            results += asyncio.run(_size(block_bytes, batch, total_bytes, directory, remote, progress))
    lines = [f"{'method':<28}{'block':>8}{'GB/s':>8}{'p50 ms':>9}{'p99 ms':>9}{'batches':>9}  checked"]
    for r in results:
        extra = f"  (+{r.extra_s * 1e3:.1f} ms until Mooncake had all)" if r.extra_s else ""
        lines.append(f"{r.method:<28}{r.block_bytes >> 10:>6}Ki{r.gbps:>8.2f}{r.p50_ms:>9.2f}{r.p99_ms:>9.2f}"
                     f"{r.batches:>9}  {'yes' if r.verified else 'NO'}{extra}")
    title = (f"uring-kv bench-mooncake: loopback TCP, {batch} blocks a batch, {os.cpu_count()} CPUs, "
             f"{platform.node()}, {datetime.date.today().isoformat()}")
    config = {"block_sizes": block_sizes, "batch": batch, "bytes": total_bytes, "host": platform.node(),
              "cpus": os.cpu_count(), "kernel": platform.release(), "date": datetime.date.today().isoformat()}
    return framework_report(title, lines, json_path, config, results)


def add_command(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """The command's arguments, in ``uring-kv``'s parser (:func:`command` runs it)."""
    parser = commands.add_parser("bench-mooncake", formatter_class=Defaults,
                                 help="the Mooncake tier's remote hits and writes on loopback TCP, with a "
                                      "master and a store node it starts (needs Mooncake)")
    parser.add_argument("--path", help="directory for the local tiers' files (default: the temp directory)")
    parser.add_argument("--block-size", type=byte_size, action="append",
                        help="bytes per block (repeatable; default 64K, 256K and 1M)")
    parser.add_argument("--bytes", type=byte_size, default=256 << 20, help="bytes each row moves per size")
    parser.add_argument("--batch", type=at_least(1), default=32, help="blocks per call")
    parser.add_argument("--json", help="write the results as JSON to this file")
    parser.set_defaults(func=command)


def command(args: argparse.Namespace) -> int:
    """Checks what the parser cannot (sizes, the directory, its free space), then runs the bench."""
    import importlib.util

    if importlib.util.find_spec("mooncake") is None:
        raise UsageError("needs Mooncake: pip install 'uring-kv[mooncake]' (and the libibverbs1 system package)")
    sizes = args.block_size or [64 << 10, 256 << 10, 1 << 20]
    check_multiples("--block-size", sizes, 8, "the bench's rows are 8-byte words")
    args.path = usable_directory(args.path)
    check_free_space(args.path, 3 * (args.bytes + args.batch * max(sizes)))  # three stores' files of one size at once
    return bench_mooncake(sizes, args.batch, args.bytes, args.path, args.json)
