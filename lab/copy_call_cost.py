"""How long the CUDA driver takes to enqueue one copy call (GPU): CPU time, not the copy time.

For groups of 1..32 blocks of 32 layer tensors, times the driver call that the copier's submit
threads make (``PieceCopies.enqueue``), with cuMemcpyBatchAsync and with per-copy calls, for H2D (load)
and D2H (store). This is why copies are enqueued off the event loop, in calls of few blocks.

    python lab/copy_call_cost.py [--block-size 131072]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from uring_kv._cuda import PieceCopies
from uring_kv._memory import HostBuffer
from uring_kv._native import BlockCopier


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--block-size", type=int, default=128 * 1024)
    parser.add_argument("--layers", type=int, default=32)
    args = parser.parse_args()
    per_layer = args.block_size // args.layers
    caches = [torch.zeros(64, per_layer // 2, dtype=torch.bfloat16, device="cuda") for _ in range(args.layers)]
    slab = HostBuffer(32 * args.block_size)
    rc = torch.cuda.cudart().cudaHostRegister(slab.addr, slab.size, 0)
    assert int(rc) == 0, rc
    blocks = BlockCopier([t.data_ptr() for t in caches], [per_layer] * args.layers,
                         [i * per_layer for i in range(args.layers)])
    stream = torch.cuda.Stream()
    for batch in (True, False):
        pieces = PieceCopies(blocks, batch)
        path = pieces.description
        for to_slot in (False, True):
            for group in (1, 8, 32):
                times = []
                for _ in range(30):
                    addrs = [slab.addr + i * args.block_size for i in range(group)]
                    start = time.perf_counter()
                    pieces.enqueue(to_slot, addrs, list(range(group)), stream.cuda_stream)
                    times.append(time.perf_counter() - start)
                    torch.cuda.synchronize()
                print(f"{path:28} {'D2H' if to_slot else 'H2D'} group {group:3d}: "
                      f"median {1e6 * statistics.median(times):8.1f} us  max {1e6 * max(times):8.1f} us")
    torch.cuda.cudart().cudaHostUnregister(slab.addr)


if __name__ == "__main__":
    main()
