"""Helpers for testing code that uses uring_kv, and the soak run.

Blocks here identify themselves: every block of every tensor is a pure function of (disk block,
version, layer), with the disk block and version written into its first two elements, so a check
can tell a torn block, another block's bytes, or a stale version apart.
"""

from __future__ import annotations

import asyncio
import os
import random
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

ELEMS = 61  # odd on purpose: 244 bytes per tensor per block, padded by the engine


def block_file(engine: Any) -> str:
    """A path to an open engine's block file (which has no name of its own), for tests that read,
    truncate or corrupt it behind the engine's back."""
    return f"/proc/self/fd/{engine.file.fd}"


def content(disk_block: int, version: int, layer: int, device: str) -> torch.Tensor:
    base = torch.arange(ELEMS, dtype=torch.int64) * 2654435761 + disk_block * 1000003 + version * 7919 + layer * 31
    block = (base % (2**31 - 1)).to(torch.int32)
    block[0], block[1] = disk_block, version
    return block.to(device)


def id_caches(device: str, layers: int = 4, blocks: int = 64) -> dict[str, torch.Tensor]:
    """Caches of int32 blocks filled with -1 (no block)."""
    return {f"layer{i}": torch.full((blocks, ELEMS), -1, dtype=torch.int32, device=device) for i in range(layers)}


def fill(caches: dict[str, torch.Tensor], gpu_block: int, disk_block: int, version: int) -> None:
    for layer, t in enumerate(caches.values()):
        t[gpu_block] = content(disk_block, version, layer, str(t.device))


async def store_identity(engine: Any, caches: dict[str, torch.Tensor], count: int, version: int = 1) -> None:
    """Fill GPU blocks 0..count-1 with disk blocks 0..count-1 at ``version`` and store them there."""
    for block in range(count):
        fill(caches, block, block, version)
    await engine.store_batch(list(range(count)), list(range(count)))


def identify(caches: dict[str, torch.Tensor], gpu_block: int) -> tuple[int, int, bool]:
    """(disk block, version, intact) of what sits in gpu_block."""
    tensors = list(caches.values())
    disk_block, version = (int(x) for x in tensors[0][gpu_block, :2].tolist())
    intact = all(torch.equal(t[gpu_block], content(disk_block, version, layer, str(t.device)))
                 for layer, t in enumerate(tensors))
    return disk_block, version, intact


@dataclass
class SoakResult:
    blocks: int
    checked: int
    corrupt: int
    leaked: int
    pending: int
    cancelled: int
    errors: int  # errors nothing explains: any BlockIOError when no store fails
    file_removed: bool  # the file is closed, and nothing is left at its path
    seconds: float
    failed_stores: int = 0  # store calls that raised (only with ``faults``)
    refused_loads: int = 0  # loaded blocks refused because their last store failed (only with ``faults``)

    def summary(self) -> str:
        faults = (f" failed_stores={self.failed_stores} refused_loads={self.refused_loads}"
                  if self.failed_stores or self.refused_loads else "")
        return (f"blocks={self.blocks} checked={self.checked} corrupt={self.corrupt} leaked={self.leaked} "
                f"pending={self.pending} cancelled={self.cancelled} errors={self.errors}{faults} "
                f"file_removed={'yes' if self.file_removed else 'NO'} seconds={self.seconds:.1f}")

    @property
    def ok(self) -> bool:
        return self.corrupt == 0 and self.leaked == 0 and self.pending == 0 and self.errors == 0 and self.file_removed


async def soak(blocks: int, *, device: str = "cpu", slots: int = 4, workers: int = 16, batch: int = 8,
               disk_blocks: int = 256, cancel_rate: float = 0.1, directory: str | None = None, seed: int = 0,
               faults: Any = None, progress: Callable[[int], None] | None = None, stall_seconds: float = 60.0,
               **engine_options: Any) -> SoakResult:
    """Concurrent loads, stores and cancellations over few slots until ``blocks`` blocks have moved.

    Every disk block is stored once (version 1) first. A load must then return, for each block, a
    version at least that of the newest store to it that completed before the load was called, at
    most the newest one *called* before the load was called (a store called later waits for the
    load's read), intact, and never a version whose store failed.

    ``faults``: ``(engine, rng) -> None``, called every millisecond or so while the workers run, to
    make stores fail (e.g. a fault filesystem's failing ranges). Store errors are then expected; a
    load may fail only for blocks with a failed store called before it returned, with that
    store's errno (or with the faults' errno after a cancelled store of the block, whose write may
    have failed unseen), and any other load error counts in ``errors``.

    ``progress(moved)`` is called about five times a second. A soak in which no block moves for
    ``stall_seconds`` (every I/O failing, say) stops there, with one error counted for the stall."""
    from uring_kv import BlockIOError, Engine

    caches = id_caches(device, blocks=workers * batch)
    path = os.path.join(directory or tempfile.gettempdir(), f"uring-kv-soak-{os.getpid()}-{seed}.bin")
    called: dict[int, int] = defaultdict(int)
    completed: dict[int, int] = defaultdict(int)
    failed: dict[int, dict[int, int]] = defaultdict(dict)  # disk block → version → errno of its failed store
    cancelled_stores: dict[int, int] = defaultdict(int)  # disk block → store calls to it cancelled
    moved = checked = corrupt = cancelled = errors = failed_stores = refused = 0
    refusals: list[tuple[int, int]] = []  # (disk block, errno) of loaded blocks refused
    delivered: list[tuple[int, int]] = []  # (disk block, version) loaded while stores fail
    running = True
    stalled = False
    start = time.perf_counter()
    engine = Engine(caches, path, disk_blocks, slots, **engine_options)

    async def worker(index: int) -> None:
        nonlocal moved, checked, corrupt, cancelled, errors, failed_stores
        rng = random.Random(seed * 7919 + index)
        own = list(range(index * batch, (index + 1) * batch))
        while moved < blocks and not stalled:
            chosen = rng.sample(range(disk_blocks), batch)
            store = rng.random() < 0.4
            if store:
                versions = []
                for gpu_block, disk_block in zip(own, chosen, strict=True):
                    called[disk_block] += 1
                    versions.append(called[disk_block])
                    fill(caches, gpu_block, disk_block, called[disk_block])
                task = asyncio.ensure_future(engine.store_batch(own, chosen))
            else:
                floor = {d: completed[d] for d in chosen}
                ceiling = {d: called[d] for d in chosen}
                task = asyncio.ensure_future(engine.load_batch(chosen, own))
            if rng.random() < cancel_rate:
                await asyncio.sleep(rng.random() * 0.002)
                task.cancel()
            failures: dict[int, int] = {}
            try:
                await task
            except asyncio.CancelledError:
                cancelled += 1  # the call returned: the engine is done with this worker's blocks
                if store:  # its writes may have failed all the same, unseen by this caller
                    for disk_block in chosen:
                        cancelled_stores[disk_block] += 1
                continue
            except BlockIOError as exc:
                failures = exc.failures
                if store:
                    failed_stores += 1
                    for disk_block, version in zip(chosen, versions, strict=True):
                        if disk_block in failures:
                            failed[disk_block][version] = failures[disk_block]
                elif faults is None:
                    errors += 1
                    continue
            moved += batch - len(failures)
            if store:
                for disk_block, version in zip(chosen, versions, strict=True):
                    if disk_block not in failures:
                        completed[disk_block] = max(completed[disk_block], version)
                continue
            for gpu_block, disk_block in zip(own, chosen, strict=True):
                checked += 1
                if disk_block in failures:  # explained only by a failed store of it, with that errno
                    refusals.append((disk_block, failures[disk_block]))  # (checked at the end: that
                    continue  # store's own call may return after this load's)
                found, version, intact = identify(caches, gpu_block)
                if not (found == disk_block and intact and floor[disk_block] <= version <= ceiling[disk_block]):
                    corrupt += 1
                elif faults is not None:
                    delivered.append((disk_block, version))

    async def watch() -> None:
        nonlocal stalled, errors
        last, since = -1, time.monotonic()
        while running:
            if progress is not None:
                progress(moved)
            if moved != last:
                last, since = moved, time.monotonic()
            elif time.monotonic() - since > stall_seconds:
                stalled = True
                errors += 1
                return
            await asyncio.sleep(0.2)

    async def chaos() -> None:
        rng = random.Random(seed)
        while running:
            faults(engine, rng)
            await asyncio.sleep(0.001)

    await engine.open()
    try:
        for first in range(0, disk_blocks, len(caches["layer0"])):
            chosen = list(range(first, min(first + len(caches["layer0"]), disk_blocks)))
            for gpu_block, disk_block in enumerate(chosen):
                called[disk_block] = completed[disk_block] = 1
                fill(caches, gpu_block, disk_block, 1)
            await engine.store_batch(list(range(len(chosen))), chosen)
        chaos_task = asyncio.ensure_future(chaos()) if faults is not None else None
        watch_task = asyncio.ensure_future(watch())
        try:
            await asyncio.gather(*(worker(i) for i in range(workers)))
        finally:
            running = False
            if chaos_task is not None:
                await chaos_task
            await watch_task
        if progress is not None:
            progress(moved)
        seen = {code for versions in failed.values() for code in versions.values()}
        for disk_block, code in refusals:
            # explained by a failed store of the block with that errno, or by a cancelled store of
            # it whose write failed as others did (its caller never learned the errno)
            if code in failed[disk_block].values() or (cancelled_stores[disk_block] and code in seen):
                refused += 1
            else:
                errors += 1
        corrupt += sum(version in failed[disk_block] for disk_block, version in delivered)
        while engine.stats()["active_batches"]:
            await asyncio.sleep(0.005)
        stats = engine.stats()
    finally:
        await engine.aclose()
    return SoakResult(moved, checked, corrupt, stats["leases_held"], stats["copies_pending"] + stats["io_inflight"],
                      cancelled, errors, engine.file.closed and not os.path.exists(path),
                      time.perf_counter() - start, failed_stores, refused)
