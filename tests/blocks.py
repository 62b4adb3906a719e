"""Self-identifying KV blocks for tests.

Every block of every tensor is a pure function of (disk block, version, layer), with the disk block
and version written into its first two elements, so a check can tell a torn block, another block's
bytes, or a stale version apart.
"""

from __future__ import annotations

import torch

ELEMS = 61  # odd on purpose: 244 bytes per tensor per block, padded by the engine


def content(disk_block: int, version: int, layer: int, device: str) -> torch.Tensor:
    base = torch.arange(ELEMS, dtype=torch.int64) * 2654435761 + disk_block * 1000003 + version * 7919 + layer * 31
    block = (base % (2**31 - 1)).to(torch.int32)
    block[0], block[1] = disk_block, version
    return block.to(device)


def id_caches(device: str, layers: int = 4, blocks: int = 64) -> dict[str, torch.Tensor]:
    return {f"layer{i}": torch.full((blocks, ELEMS), -1, dtype=torch.int32, device=device) for i in range(layers)}


def fill(caches: dict[str, torch.Tensor], gpu_block: int, disk_block: int, version: int) -> None:
    for layer, t in enumerate(caches.values()):
        t[gpu_block] = content(disk_block, version, layer, str(t.device))


def identify(caches: dict[str, torch.Tensor], gpu_block: int) -> tuple[int, int, bool]:
    """(disk block, version, intact) of what sits in gpu_block."""
    tensors = list(caches.values())
    disk_block, version = (int(x) for x in tensors[0][gpu_block, :2].tolist())
    intact = all(torch.equal(t[gpu_block], content(disk_block, version, layer, str(t.device)))
                 for layer, t in enumerate(tensors))
    return disk_block, version, intact
