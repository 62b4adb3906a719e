"""uring_kv end to end: offload KV blocks to a file, drop them, load them back, check every byte.

Run: ``python examples/quickstart.py`` (GPU if torch sees one, else CPU mode). ``--trio`` runs the
same code under trio instead of asyncio: the engine finds out which loop it runs on when it opens.
"""

from __future__ import annotations

import asyncio
import os
import sys
import tempfile

import torch

from uring_kv import Engine


async def main() -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    # A vLLM-like layout: one tensor per layer, dim 0 = block index.
    layers, gpu_blocks = 8, 32
    caches = {f"layer{i}": torch.randn(gpu_blocks, 2, 16, 4, 64, device=device).to(torch.bfloat16)
              for i in range(layers)}
    original = {name: t.clone() for name, t in caches.items()}
    path = os.path.join(tempfile.mkdtemp(), "kv-offload.bin")

    async with Engine(caches, path, num_disk_blocks=128, num_slots=8) as engine:
        print(f"{device} mode, {engine.stats()['io']}, block = {engine.block_bytes} bytes")
        # Offload GPU blocks 0..15 into disk blocks 64..79; returns when the bytes are in the file.
        await engine.store_batch(list(range(16)), list(range(64, 80)))
        for t in caches.values():
            t[:16].zero_()  # the GPU blocks are reused for something else
        # Bring them back into GPU blocks 16..31; returns when they are resident.
        await engine.load_batch(list(range(64, 80)), list(range(16, 32)))
        same = all(torch.equal(caches[n][16:32], original[n][:16]) for n in caches)
        print("reloaded blocks identical:", same)

        # The lower-level form: returns once the copies are enqueued; a consumer stream (GPU) can
        # wait on handle.event while this coroutine does other work, then await the handle.
        handle = await engine.load_batch_async(list(range(64, 72)), list(range(0, 8)))
        await handle
        enqueued_same = all(torch.equal(caches[n][:8], original[n][:8]) for n in caches)
        print("enqueued-form load done:", enqueued_same)
        print("event loop:", engine.stats()["loop"])
    print("block file removed on close:", not os.path.exists(path))
    if not (same and enqueued_same):
        raise SystemExit(1)


if __name__ == "__main__":
    if "--trio" in sys.argv[1:]:
        import trio

        trio.run(main)
    else:
        asyncio.run(main())
