"""Where a block's time goes between its read and its slot coming back (GPU mode, the Python pump).

Loads and stores of random 256-block batches (32 layers, O_DIRECT when the filesystem takes it),
each followed by the ring ceiling on the same blocks; the engine's handlers and the copier are
wrapped to stamp each block and each copy call:

* read submitted → read handled on the loop; handled → copy call enqueued;
* copy call enqueued → the submit thread picks it up → its driver call returns (event recorded)
  → the bridge sees the event fire → the loop runs the completion (slot back in the pool);
* mean reads (writes) in flight: the slots' time in the kernel over the run's time.

The wrappers cost Python time on the loop, so the throughput printed here is below the bench's;
the phases are what to compare. The stamps wrap the Python copy path (submit threads and bridge
in Python), so this sets ``URING_KV_DEBUG_NATIVE_COPIER=0`` unless told otherwise. CPU caches work too
(``--device cpu``, then the copy phases are empty: the host copier is not wrapped).

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
from collections.abc import Callable
from typing import Any

import torch

from uring_kv import Engine
from uring_kv import _bridge as bridge_module
from uring_kv import _copy as copy_module
from uring_kv import _cuda as cuda_module
from uring_kv import _pypump as pypump_module
from uring_kv.bench.ceilings import RingCeiling

os.environ.setdefault("URING_KV_DEBUG_NATIVE_COPIER", "0")  # read when an engine is made
now = time.perf_counter
blocks_seen: dict[int, dict[str, float]] = {}
copies: dict[int, list[dict[str, float]]] = {}  # per event (reused from a free list): one record per use


def stamp(block: tuple[int, int], key: str) -> None:
    blocks_seen.setdefault(hash(block), {})[key] = now()


def stamp_copy(event: Any, key: str) -> None:
    records = copies.get(id(event))
    if records:
        records[-1][key] = now()


def wrap(cls: Any, name: str, before: Callable[..., None]) -> None:
    original = getattr(cls, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        before(*args)
        return original(*args, **kwargs)

    setattr(cls, name, wrapper)


def install() -> None:
    # The Python pump's handlers; a block is (pump, position).
    P = pypump_module.PyPump
    start = P._start

    def start_stamped(self: Any) -> None:
        first, began = self._next, now()
        start(self)
        for position in range(first, self._next):
            blocks_seen.setdefault(hash((id(self), position)), {})["start"] = began

    P._start = start_stamped  # type: ignore[method-assign]
    wrap(P, "_on_read", lambda self, index, addr, position, res: stamp((id(self), position), "read"))
    wrap(P, "_enqueue_copies", lambda self: [stamp((id(self), p), "enqueued") for _, _, p in self._ready])
    wrap(P, "_on_copied", lambda self, chunk, error=None: [stamp((id(self), p), "copied") for _, _, p in chunk])
    wrap(P, "_write_out", lambda self, chunk, sums: [stamp((id(self), p), "write") for _, _, p in chunk])
    wrap(P, "_on_written", lambda self, index, addr, position, sums, res: stamp((id(self), position), "written"))

    copy = copy_module.CudaCopier.copy

    def copy_stamped(self: Any, to_slot: bool, slot_addrs: Any, gpu_blocks: Any, on_done: Any) -> Any:
        if self._free:  # the event this call will take
            copies.setdefault(id(self._free[-1]), []).append({"put": now()})
        holder: list[Any] = []

        def done(error: BaseException | None = None) -> None:
            stamp_copy(holder[0], "delivered")
            on_done(error)

        event = copy(self, to_slot, slot_addrs, gpu_blocks, done)
        holder.append(event)
        return event

    copy_module.CudaCopier.copy = copy_stamped  # type: ignore[method-assign]
    staged = cuda_module.Staging.enqueue

    def staged_stamped(self: Any, ctx: int, event: Any, *args: Any) -> None:
        stamp_copy(event, "lane")
        staged(self, ctx, event, *args)
        stamp_copy(event, "recorded")

    cuda_module.Staging.enqueue = staged_stamped  # type: ignore[method-assign]
    wait, fired = bridge_module._wait, bridge_module._fired

    def wait_stamped(event: Any) -> None:
        wait(event)
        stamp_copy(event, "fired")

    def fired_stamped(event: Any) -> bool:
        done = fired(event)
        if done:
            stamp_copy(event, "fired")
        return done

    bridge_module._wait = wait_stamped
    bridge_module._fired = fired_stamped


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
        print(f"{stats['io']}; {stats['copy']}; O_DIRECT {engine.file.direct}")
        for first in range(0, count, 256):
            await engine.store_batch(list(range(256)), list(range(first, min(count, first + 256))))
        ceiling = RingCeiling(engine.file.fd, engine.file.stride, args.slots)
        rng = random.Random(3)
        for op in ("load", "store"):
            blocks_seen.clear()
            copies.clear()
            engine_s = ceiling_s = total_s = 0.0
            for round_index in range(args.rounds):
                disk, gpu = rng.sample(range(count), 256), rng.sample(range(256), 256)
                start = now()
                if op == "load":
                    await engine.load_batch(disk, gpu)
                else:
                    await engine.store_batch(gpu, disk)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                elapsed = now() - start
                total_s += elapsed
                ceiling_elapsed = await asyncio.to_thread(ceiling.run, op == "store", disk, gpu)
                if round_index:  # the first round warms up
                    engine_s += elapsed
                    ceiling_s += ceiling_elapsed
            measured = 256 * (args.rounds - 1)
            print(f"{op}: uring_kv {measured / engine_s:.0f} blocks/s, ring ceiling {measured / ceiling_s:.0f}, "
                  f"ratio {ceiling_s / engine_s:.2f}")
            records = list(blocks_seen.values())
            kernel = gaps(records, "start", "read") if op == "load" else gaps(records, "write", "written")
            print(f"  mean {'reads' if op == 'load' else 'writes'} in flight {sum(kernel) / total_s:.1f} "
                  f"of {args.slots} slots")
            if op == "load":
                show("read submitted -> handled", kernel)
                show("read handled -> copy enqueued", gaps(records, "read", "enqueued"))
            else:
                show("batch started -> copy enqueued", gaps(records, "start", "enqueued"))
                show("write submitted -> written", kernel)
            show("copy enqueued -> completion on loop", gaps(records, "enqueued", "copied"))
            calls = [r for uses in copies.values() for r in uses]
            show("copy call: enqueued -> picked up", gaps(calls, "put", "lane"))
            show("copy call: driver call", gaps(calls, "lane", "recorded"))
            show("copy call: recorded -> bridge saw it", gaps(calls, "recorded", "fired"))
            show("copy call: bridge saw -> loop ran it", gaps(calls, "fired", "delivered"))
        ceiling.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--block-size", type=int, default=128 * 1024)
    parser.add_argument("--slots", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    os.environ.setdefault("URING_KV_DEBUG_PUMP", "0")  # CPU mode: the Python pump, as on a GPU with the Python copier
    install()
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
