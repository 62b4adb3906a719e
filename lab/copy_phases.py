"""Where a block's time goes between its read and its slot coming back (GPU mode, the Python pump).

Loads and stores of random 256-block batches (32 layers, O_DIRECT when the filesystem takes it),
each followed by the ring ceiling on the same blocks, every batch in the Python pump
(``URING_KV_DEBUG_PUMP=0``), whose per-block events the engine's diagnostic hook (``Engine.trace``)
stamps:

* loads: read submitted → read handled on the loop → copy enqueued → copy done, on the loop;
* stores: batch started → copy enqueued → copy done → write submitted → written;
* the copies' hand-over: each finished copy (CUDA event or copier job) → the loop taking it
  (``Engine.delivery_times``);
* mean reads (writes) in flight: the slots' time in the kernel over the run's time.

The tracer costs Python time on the loop, so the throughput printed here is below the bench's;
the phases are what to compare. CPU caches work too (``--device cpu``; copies the host copier runs
inline hand nothing over: ``URING_KV_HOST_INLINE_BYTES=0`` sends them all to its thread).

The breakdown of each copy call quoted in docs/design.md (picked up by a submit thread, driver
call, the bridge seeing its event, the loop running it) was measured with the Python copier's
threads (``URING_KV_DEBUG_NATIVE_COPIER=0``), which this version no longer stamps: the engine has
no hook inside its copiers.

    python lab/copy_phases.py [--block-size 131072] [--slots 32] [--rounds 9] [--device cuda]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import tempfile
import time
from typing import Any

import torch

from uring_kv import Engine
from uring_kv.bench.ceilings import RingCeiling

now = time.perf_counter
blocks_seen: dict[int, dict[str, float]] = {}  # the batch running: position → block event → time


def tracer(event: str, kind: Any, count: int) -> None:
    """The engine's diagnostic hook: the Python pump's per-block events (``block_read`` and so on)."""
    if event.startswith("block_"):
        blocks_seen.setdefault(count, {})[event.removeprefix("block_")] = now()


def show(label: str, seconds: list[float]) -> None:
    if not seconds:
        return
    us = sorted(s * 1e6 for s in seconds)
    print(f"  {label:34s} n={len(us):5d}  p50 {us[len(us) // 2]:8.1f} µs  p90 {us[int(len(us) * 0.9)]:8.1f}"
          f"  mean {statistics.mean(us):8.1f}")


def gaps(records: list[dict[str, float]], first: str, second: str) -> list[float]:
    return [r[second] - r[first] for r in records if first in r and second in r]


async def run(args: argparse.Namespace) -> None:
    device = torch.device(args.device)
    layers, count = 32, (1 << 30) // args.block_size
    caches = [torch.zeros(256, args.block_size // layers // 2, dtype=torch.bfloat16, device=device)
              for _ in range(layers)]
    path = os.path.join(tempfile.gettempdir(), f"uring-kv-phases-{os.getpid()}.bin")
    async with Engine(caches, path, count, args.slots) as engine:
        stats = engine.stats()
        print(f"{stats['io']}; {stats['copy']}; O_DIRECT {stats['direct']}")
        for first in range(0, count, 256):
            await engine.store_batch(list(range(256)), list(range(first, min(count, first + 256))))
        ceiling = RingCeiling(engine.fileno(), stats["stride"], args.slots)
        rng = random.Random(3)
        engine.trace(tracer)
        for op in ("load", "store"):
            records: list[dict[str, float]] = []
            engine.delivery_times(clear=True)
            engine_s = ceiling_s = total_s = 0.0
            for round_index in range(args.rounds):
                disk, gpu = rng.sample(range(count), 256), rng.sample(range(256), 256)
                blocks_seen.clear()
                start = now()
                if op == "load":
                    await engine.load_batch(disk, gpu)
                else:
                    await engine.store_batch(gpu, disk)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                elapsed = now() - start
                total_s += elapsed
                records.extend(blocks_seen.values())
                ceiling_elapsed = await asyncio.to_thread(ceiling.run, op == "store", disk, gpu)
                if round_index:  # the first round warms up
                    engine_s += elapsed
                    ceiling_s += ceiling_elapsed
            measured = 256 * (args.rounds - 1)
            print(f"{op}: uring_kv {measured / engine_s:.0f} blocks/s, ring ceiling {measured / ceiling_s:.0f}, "
                  f"ratio {ceiling_s / engine_s:.2f}")
            kernel = gaps(records, "start", "read") if op == "load" else gaps(records, "write", "written")
            print(f"  mean {'reads' if op == 'load' else 'writes'} in flight {sum(kernel) / total_s:.1f} "
                  f"of {args.slots} slots")
            if op == "load":
                show("read submitted -> handled", kernel)
                show("read handled -> copy enqueued", gaps(records, "read", "copy"))
            else:
                show("batch started -> copy enqueued", gaps(records, "start", "copy"))
                show("write submitted -> written", kernel)
            show("copy enqueued -> completion on loop", gaps(records, "copy", "copied"))
            delivered = engine.delivery_times(clear=True)
            if delivered:
                show("copy finished -> loop took it", [ns / 1e9 for ns in delivered])
            else:
                print("  copy finished -> loop took it      none handed over (every copy ran inline)")
        ceiling.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--block-size", type=int, default=128 * 1024)
    parser.add_argument("--slots", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    os.environ.setdefault("URING_KV_DEBUG_PUMP", "0")  # CPU mode: the Python pump, as on a GPU with the Python copier
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
