"""Where the engine's CPU goes, thread by thread: uring_kv alone moving blocks between a RAM-backed
file (``--dir``, default /dev/shm: the disk out of the way) and its caches, with each thread's CPU
time read from /proc before and after, in core-seconds per GB moved.

The threads, by the names they carry: the event loop (``MainThread``: Python, the native pumps'
submissions and reaps, copies small enough to run inline), the native copier's C threads
(``ukv-copy-h2d``/``ukv-copy-d2h``) and bridge (``ukv-bridge``), the Python copier or bridge
threads (``uring-kv-*``), and the kernel's io-wq workers (``iou-wrk-*``: reads and writes handed
off with IOSQE_ASYNC, i.e. the syscalls' own work) and the ring thread (``ukv-ring``, where
URING_KV_RING_THREAD puts the pumps on it); and the loop's and the ring thread's wake-ups per block.
Threads that exited during the run are one
line ("exited"), the rest of the process's total.

    python -P lab/cpu_by_thread.py [--dir /dev/shm] [--block-size 128K] [--batches 64] [--batch 256]
                                   [--slots 48] [--io-depth 32] [--device cpu] [--json OUT]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import threading
import time
from typing import Any

import torch

from uring_kv import Engine

TICKS = os.sysconf("SC_CLK_TCK")


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * units[text[-1].upper()] if text[-1].upper() in units else int(text)


def _seconds(stat_line: str) -> float:
    fields = stat_line[stat_line.rindex(")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) / TICKS  # utime, stime


def thread_cpu() -> tuple[dict[int, tuple[str, float]], float]:
    """Each live thread's (name, CPU seconds) by thread id, and the process's total."""
    names = {t.native_id: t.name for t in threading.enumerate() if t.native_id is not None}
    threads: dict[int, tuple[str, float]] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as stat, open(f"/proc/self/task/{tid}/comm") as comm:
                line, name = stat.read(), comm.read().strip()
        except OSError:
            continue  # exited meanwhile
        threads[int(tid)] = (names.get(int(tid), name), _seconds(line))
    with open("/proc/self/stat") as stat:
        return threads, _seconds(stat.read())


def group(name: str) -> str:
    if name == "MainThread":
        return "event loop (MainThread)"
    if name.startswith("iou-wrk"):
        return "io-wq workers (iou-wrk-*)"
    if name.startswith("iou-sqp"):
        return "SQPOLL thread"
    return re.sub(r"-\d+$", "-N", name)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(args.device)
    layers, per_layer = 32, args.block_size // 32
    blocks = args.batch * 2
    caches = [torch.randint(0, 255, (blocks, per_layer), dtype=torch.uint8, device=device) for _ in range(layers)]
    num_disk_blocks = args.batch * 4
    result: dict[str, Any] = {"machine": platform.node(), "kernel": platform.release(), "cpus": os.cpu_count(),
                              "date": time.strftime("%Y-%m-%d"), "device": str(device), "dir": args.dir,
                              "block_bytes": args.block_size, "batch": args.batch, "batches": args.batches}
    async with Engine(caches, os.path.join(args.dir, "kv.bin"), num_disk_blocks, args.slots,
                      io_depth=args.io_depth) as engine:
        stats = engine.stats()
        result.update(io=stats["io"], copy=stats["copy"], direct=stats["direct"])
        disk = list(range(num_disk_blocks))
        for first in range(0, num_disk_blocks, args.batch):  # every block written once
            await engine.store_batch(list(range(args.batch)), disk[first:first + args.batch])
        for op in ("load", "store"):
            woken0 = engine.stats()
            before, total0 = thread_cpu()
            start = time.perf_counter()
            for i in range(args.batches):
                first = (i * args.batch) % num_disk_blocks
                gpu = list(range(args.batch))
                if op == "load":
                    await engine.load_batch(disk[first:first + args.batch], gpu)
                else:
                    await engine.store_batch(gpu, disk[first:first + args.batch])
            elapsed = time.perf_counter() - start
            after, total1 = thread_cpu()
            woken1 = engine.stats()
            moved = args.batches * args.batch
            wakeups = {name: (woken1.get(name, 0) - woken0.get(name, 0)) / moved
                       for name in ("loop_wakeups", "ring_thread_wakeups")}
            gigabytes = args.batches * args.batch * args.block_size / 1e9
            groups: dict[str, float] = {}
            for tid, (name, seconds) in after.items():
                groups[group(name)] = groups.get(group(name), 0.0) + seconds - before.get(tid, (name, 0.0))[1]
            groups["exited threads"] = (total1 - total0) - sum(groups.values())
            result[op] = {"gbps": gigabytes / elapsed, "core_s_per_gb_total": (total1 - total0) / gigabytes,
                          "wakeups_per_block": wakeups,
                          "core_s_per_gb": {k: v / gigabytes for k, v in sorted(groups.items(), key=lambda kv: -kv[1])
                                            if abs(v) > 1e-9}}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default="/dev/shm")
    parser.add_argument("--block-size", type=parse_size, default=128 << 10)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--batches", type=int, default=64)
    parser.add_argument("--slots", type=int, default=48)
    parser.add_argument("--io-depth", type=int, default=32)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json")
    args = parser.parse_args()
    result = asyncio.run(run(args))
    print(f"{result['block_bytes'] >> 10} KiB blocks on {result['dir']} ({result['device']}; {result['io']}; "
          f"{result['copy']}; O_DIRECT {result['direct']})")
    for op in ("load", "store"):
        part = result[op]
        woken = part["wakeups_per_block"]
        print(f"{op}: {part['gbps']:.2f} GB/s, {part['core_s_per_gb_total']:.3f} core-s/GB in all; wake-ups per "
              f"block: loop {woken['loop_wakeups']:.3f}, ring thread {woken['ring_thread_wakeups']:.3f}")
        for name, value in part["core_s_per_gb"].items():
            print(f"  {name:<32} {value:7.3f} core-s/GB  {value / part['core_s_per_gb_total']:5.0%}")
    if args.json:
        with open(args.json, "w") as out:
            json.dump(result, out, indent=1)


if __name__ == "__main__":
    main()
