"""What the bench moves and how it checks it: the caches, the file's content, the batches.

Each 8-byte word of disk block ``d`` holds ``d << 32 | word`` (the identity pattern), in the file
and, once loaded, in the cache rows, so a block landing in the wrong place, torn or stale is caught.
"""

from __future__ import annotations

import asyncio
import functools
import os
import random
from typing import TYPE_CHECKING

import numpy as np
import torch

from uring_kv._memory import HostBuffer
from uring_kv._native import check_identity
from uring_kv.bench.config import BenchConfig, batches_for

if TYPE_CHECKING:
    from uring_kv import Engine


def identity_words(disk_blocks: list[int], first_word: int, words: int, device: torch.device | str) -> torch.Tensor:
    """[len(disk_blocks), words] int64: word w of disk block d holds ``d << 32 | w``."""
    column = torch.arange(first_word, first_word + words, dtype=torch.int64, device=device)
    row = torch.tensor(disk_blocks, dtype=torch.int64, device=device) << 32
    return row[:, None] | column[None, :]


@functools.cache
def _word_numbers(words: int) -> np.ndarray:
    """0, 1, ..., words - 1: the low half of every word of the identity pattern."""
    return np.arange(words, dtype=np.int64)


def stamp_identity(words: np.ndarray, numbers: list[int]) -> None:
    """In place, row ``i`` of ``words`` ([len(numbers), n] int64) gets key ``numbers[i]``'s identity
    pattern (word w: ``numbers[i] << 32 | w``), as :func:`identity_words` builds it, in one pass."""
    np.bitwise_or(_word_numbers(words.shape[1]), (np.array(numbers, dtype=np.int64) << 32)[:, None], out=words)


def holds_identity(words: np.ndarray, numbers: list[int], scrub: bool = False) -> bool:
    """Whether every word of every row of ``words`` ([len(numbers), n] int64) holds what
    :func:`stamp_identity` writes there; with ``scrub``, every word is set to -1 afterwards (so a
    later load that leaves a row alone is caught). One pass in C, the GIL released, nothing the size
    of the rows built: cheap enough to check every row a bench moves without slowing what it
    measures."""
    if words.ndim != 2 or len(words) != len(numbers):
        raise ValueError(f"rows of shape {words.shape} for {len(numbers)} keys")
    if not (words.flags.c_contiguous and words.flags.aligned) or words.dtype != np.int64:
        if scrub:
            raise ValueError("scrubbing needs C-contiguous int64 rows")
        words = np.ascontiguousarray(words, dtype=np.int64)
    return check_identity(words.ctypes.data, len(numbers), words.shape[1], numbers, scrub)


class Workload:
    """The caches, the file's content and the batches for one block size."""

    def __init__(self, config: BenchConfig, block_bytes: int, device: torch.device) -> None:
        self.config = config
        self.device = device
        per_layer = block_bytes // config.layers
        if per_layer % 64 or per_layer == 0:
            raise ValueError(f"block size {block_bytes} does not split into {config.layers} layers "
                             "of 64-byte multiples")
        self.block_bytes = block_bytes
        self.per_layer = per_layer
        self.gpu_blocks = config.batch
        self.num_disk_blocks = max(config.batch, config.size // block_bytes)
        self.caches = [torch.empty(self.gpu_blocks, per_layer // 2, dtype=torch.bfloat16, device=device)
                       for _ in range(config.layers)]
        rng = random.Random(block_bytes)
        self.batches = batches_for(config, block_bytes)
        rounds = config.warmup + self.batches
        self.load_batches = [rng.sample(range(self.num_disk_blocks), config.batch) for _ in range(rounds)]
        self.gpu_order = [rng.sample(range(self.gpu_blocks), config.batch) for _ in range(rounds)]

    def slot_layout(self) -> tuple[list[int], list[int]]:
        """Each cache tensor's bytes per block and its offset in a block's slot (the engine packs
        the tensors' pieces in order)."""
        layers = len(self.caches)
        return [self.per_layer] * layers, [layer * self.per_layer for layer in range(layers)]

    def _pattern(self, disk_blocks: list[int], layer: int) -> torch.Tensor:
        words = self.per_layer // 8
        return identity_words(disk_blocks, layer * words, words, self.device)

    def fill_gpu_as(self, disk_blocks: list[int], gpu_blocks: list[int]) -> None:
        index = torch.tensor(gpu_blocks, device=self.device)
        for layer, cache in enumerate(self.caches):
            cache.view(torch.int64).index_copy_(0, index, self._pattern(disk_blocks, layer))

    def scrub(self) -> None:
        for cache in self.caches:
            cache.view(torch.int64).fill_(-1)

    def verify(self, disk_blocks: list[int], gpu_blocks: list[int]) -> bool:
        index = torch.tensor(gpu_blocks, device=self.device)
        return all(torch.equal(cache.view(torch.int64).index_select(0, index), self._pattern(disk_blocks, layer))
                   for layer, cache in enumerate(self.caches))


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (nothing to wait for in CPU mode)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


async def prefill(engine: Engine, work: Workload) -> None:
    """Write every disk block's identity pattern through the engine itself."""
    for first in range(0, work.num_disk_blocks, work.gpu_blocks):
        disk_blocks = list(range(first, min(first + work.gpu_blocks, work.num_disk_blocks)))
        gpu_blocks = list(range(len(disk_blocks)))
        work.fill_gpu_as(disk_blocks, gpu_blocks)
        await engine.store_batch(gpu_blocks, disk_blocks)


def scrub_blocks(fd: int, stride: int, disk_blocks: list[int]) -> None:
    """Zero the blocks in the file (plain pwritev, aligned for O_DIRECT): a store checked after this
    must have written every one of them itself."""
    buffer = HostBuffer(stride)
    try:
        for disk_block in disk_blocks:
            os.pwritev(fd, [buffer.view], disk_block * stride)
    finally:
        buffer.close()


async def verify_file(fd: int, stride: int, work: Workload, disk_blocks: list[int]) -> bool:
    """Read the blocks back with plain preadv and check their words (for store rows)."""
    buffer = HostBuffer(stride)
    ok = True
    words = work.per_layer // 8 * work.config.layers
    for disk_block in disk_blocks:
        await asyncio.to_thread(os.preadv, fd, [buffer.view], disk_block * stride)
        got = torch.frombuffer(buffer.view, dtype=torch.int64)[:words]
        ok &= torch.equal(got, identity_words([disk_block], 0, words, "cpu")[0])
        del got
    buffer.close()
    return ok
