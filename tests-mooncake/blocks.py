"""Caches, keys and block contents the Mooncake tests share (also imported by the peer processes).

Every key's block is a pure function of the key, so any process can say what bytes a key must have.
Odd sizes on purpose: a block is 3 × 333 float16 + 1000 bytes (2998 bytes), never a page multiple."""

from __future__ import annotations

import hashlib

import torch

ROWS = 16


def make_caches(rows: int = ROWS) -> dict[str, torch.Tensor]:
    return {"k": torch.zeros(rows, 3, 333, dtype=torch.float16), "v": torch.zeros(rows, 1000, dtype=torch.uint8)}


def key(i: int, tag: str = "prefix") -> bytes:
    return hashlib.sha256(f"{tag}/{i}".encode()).digest()


def block_of(k: bytes, caches: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """The bytes key ``k`` stands for, one uint8 tensor per cache."""
    generator = torch.Generator().manual_seed(int.from_bytes(k[:8], "little"))
    out = []
    for tensor in caches.values():
        per_row = tensor[0].numel() * tensor.element_size()
        out.append(torch.randint(0, 256, (per_row,), generator=generator, dtype=torch.uint8))
    return out


def fill(caches: dict[str, torch.Tensor], row: int, k: bytes) -> None:
    for tensor, data in zip(caches.values(), block_of(k, caches), strict=True):
        tensor[row].view(-1).view(torch.uint8).copy_(data)


def holds(caches: dict[str, torch.Tensor], row: int, k: bytes) -> bool:
    return all(torch.equal(tensor[row].reshape(-1).view(torch.uint8), data)
               for tensor, data in zip(caches.values(), block_of(k, caches), strict=True))


def row_bytes(caches: dict[str, torch.Tensor], row: int) -> bytes:
    return b"".join(tensor[row].reshape(-1).view(torch.uint8).numpy().tobytes() for tensor in caches.values())


def poison(caches: dict[str, torch.Tensor], rows: range | list[int]) -> None:
    """Fill rows with a pattern no key's block has, so that a row left alone is seen as such."""
    for tensor in caches.values():
        for row in rows:
            tensor[row].view(-1).view(torch.uint8).fill_(0xA5)
