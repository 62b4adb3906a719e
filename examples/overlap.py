"""Overlap reload with compute: ``load_batch_async`` returns once the copies are enqueued, with an
event the compute stream waits on, so the next layer's KV can arrive while this one computes.

Run: ``python examples/overlap.py`` (GPU if available; in CPU mode the handle is awaited instead).
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import time

import torch

from uring_kv import Engine


async def main() -> int:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    layers, blocks = 8, 64
    caches = [torch.randn(blocks, 16, 256, device=device) for _ in range(layers)]
    saved = [t.clone() for t in caches]
    weights = torch.randn(256, 256, device=device)
    path = os.path.join(tempfile.mkdtemp(), "kv.bin")
    async with Engine(caches, path, num_disk_blocks=128, num_slots=8) as engine:
        await engine.store_batch(list(range(32)), list(range(32)))
        for t in caches:
            t[:32].zero_()
        start = time.perf_counter()
        # Reload in four chunks; each chunk's compute starts as soon as its own copies are in.
        handles = [await engine.load_batch_async(list(range(i, i + 8)), list(range(i, i + 8)))
                   for i in range(0, 32, 8)]
        outputs = []
        for i, handle in zip(range(0, 32, 8), handles, strict=True):
            if device == "cuda":
                handle.wait_on(torch.cuda.current_stream())  # the compute stream waits on the GPU, not the loop
            else:
                await handle
            outputs.append(torch.stack([t[i:i + 8] @ weights for t in caches]).sum())
        for handle in handles:
            await handle  # every batch complete (and its errors raised) before leaving
        if device == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
    expected = [torch.stack([t[i:i + 8] @ weights for t in saved]).sum() for i in range(0, 32, 8)]
    same = all(torch.allclose(a, b) for a, b in zip(outputs, expected, strict=True))
    print(f"{device}: 4 chunks reloaded and computed on in {elapsed * 1e3:.1f} ms; results match: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main()))
