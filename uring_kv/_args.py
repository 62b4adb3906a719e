"""Checking what callers pass: block indices (in steps, for huge batches), the size of a disk, a
store's capacity, a store call's keys and rows; every refusal is one line naming the argument. (The
caches themselves are checked once, by ``_layout.CacheLayout``.)"""

from __future__ import annotations

import contextlib
import operator
import os
from collections.abc import Generator, Iterable
from typing import TYPE_CHECKING, Any, NamedTuple

from uring_kv._file import round_up
from uring_kv._native import block_array, check_blocks, copy_blocks

if TYPE_CHECKING:
    from uring_kv._layout import CacheLayout

# capacity_bytes counts each block padded to this, the largest I/O alignment usual today: the file
# (blocks padded to the real alignment, known only once it is open) then fits in capacity_bytes.
PAD_FOR_CAPACITY = 4096
# Most blocks of one call checked or registered per loop callback (a few hundred µs of Python at
# most); a larger call is admitted over several loop turns (see Engine._admit).
ADMIT_BLOCKS = 512


class Args(NamedTuple):
    """A call's validated arguments; the block indices also as C int64 arrays."""
    disk: list[int]
    gpu: list[int]
    after: Any
    disk_c: Any
    gpu_c: Any


def block_indices(values: Iterable[Any], what: str, limit: int) -> Generator[None, None, tuple[list[int], Any]]:
    """The entries as a list and as a C int64 array, each checked to be an integer in [0, limit);
    ADMIT_BLOCKS entries per step."""
    if isinstance(values, (str, bytes)):
        raise TypeError(f"{what} must be a sequence of integers, got {type(values).__name__}")
    try:
        items = as_list(values)
    except TypeError:
        raise TypeError(f"{what} must be a sequence of integers, got {type(values).__name__}") from None
    n = len(items)
    if n <= ADMIT_BLOCKS:
        return checked_indices(items, what, limit, 0)
    out, array = [], block_array(n)
    for lo in range(0, n, ADMIT_BLOCKS):
        yield
        checked, piece = checked_indices(items[lo:lo + ADMIT_BLOCKS], what, limit, lo)
        out += checked
        copy_blocks(array, lo, piece, len(checked))
    return out, array


def checked_indices(items: list[Any], what: str, limit: int, start: int) -> tuple[list[int], Any]:
    """``items`` (entries ``start``... of ``what``) as a list of ints and a C int64 array."""
    # The common case (plain ints) is converted and range-checked in C; anything else goes through
    # the loop below, which names the first bad entry.
    if set(map(type, items)) <= {int}:
        with contextlib.suppress(OverflowError):  # beyond int64: the loop says which is out of range
            array = block_array(items)
            if check_blocks(array, len(items), limit) < 0:
                return items, array
    out = []
    for position, value in enumerate(items, start):
        if isinstance(value, bool):
            raise TypeError(f"{what}[{position}] is a bool, not a block index")
        try:
            index = operator.index(value)
        except TypeError:
            raise TypeError(f"{what}[{position}] must be an integer, got {type(value).__name__}") from None
        if not 0 <= index < limit:
            raise ValueError(f"{what}[{position}] = {index} is out of range [0, {limit})")
        out.append(index)
    return out, block_array(out)


def check_call(disk_blocks: Any, gpu_blocks: Any, after: Any, store: bool, num_disk_blocks: int, num_gpu_blocks: int,
               seen_disk: Any, seen_gpu: Any, gpu: bool) -> Generator[None, None, Args]:
    """A ``load_batch``/``store_batch`` call's arguments, checked (``seen_*``: scratch bitmaps for
    the repeat checks); ADMIT_BLOCKS indices per step."""
    disk, disk_c = yield from block_indices(disk_blocks, "disk_blocks", num_disk_blocks)
    cache, cache_c = yield from block_indices(gpu_blocks, "gpu_blocks", num_gpu_blocks)
    if len(disk) != len(cache):
        raise ValueError(f"disk_blocks has {len(disk)} entries but gpu_blocks has {len(cache)}")
    if (dup := check_blocks(cache_c, len(cache), num_gpu_blocks, seen_gpu)) >= 0:
        raise ValueError(f"gpu block {cache[dup]} appears twice in one batch")
    if store and (dup := check_blocks(disk_c, len(disk), num_disk_blocks, seen_disk)) >= 0:
        raise ValueError(f"disk block {disk[dup]} appears twice in one store batch")
    if after is not None:
        if not gpu:
            raise TypeError("after= takes a torch.cuda.Event and only applies to CUDA caches")
        import torch

        if not isinstance(after, torch.cuda.Event):
            raise TypeError(f"after must be a torch.cuda.Event, got {type(after).__name__}")
    return Args(disk, cache, after, disk_c, cache_c)


def index_bytes(num_disk_blocks: int) -> int:
    """Memory of the per-disk-block index: two bitmaps (stored; a store's repeat check)."""
    return 2 * 8 * ((num_disk_blocks + 63) // 64)


def check_disk_size(num_disk_blocks: int, block_bytes: int) -> None:
    """Refuse, naming the argument, a disk the index's memory or a file offset cannot hold. No
    syscall on the filesystem here (this runs on the caller's loop): a file larger than the
    filesystem allows is refused by open(), from its ftruncate."""
    memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if (need := index_bytes(num_disk_blocks)) > memory // 4:
        raise ValueError(f"num_disk_blocks={num_disk_blocks} needs {need / 2**30:.1f} GiB of index memory "
                         f"(2 bits per block), over a quarter of this machine's {memory / 2**30:.1f} GiB")
    file_bytes = num_disk_blocks * -(-block_bytes // 512) * 512  # at least: blocks pad to >= 512 bytes
    if file_bytes > 2**63 - 1:
        raise ValueError(f"num_disk_blocks={num_disk_blocks}: a file of {file_bytes} bytes is beyond any file "
                         "offset (2**63 - 1)")


def capacity_in_blocks(layout: CacheLayout, capacity_blocks: int | None, capacity_bytes: int | None) -> int:
    """The capacity given as ``capacity_blocks`` or as ``capacity_bytes`` (one of them), in blocks."""
    if (capacity_blocks is None) == (capacity_bytes is None):
        raise ValueError("give the capacity as capacity_blocks or as capacity_bytes (one of them)")
    if capacity_bytes is not None:
        if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int) or capacity_bytes < 1:
            raise ValueError(f"capacity_bytes must be a positive integer, got {capacity_bytes!r}")
        padded = round_up(layout.block_bytes, PAD_FOR_CAPACITY)
        capacity_blocks = capacity_bytes // padded
        if capacity_blocks < 1:
            raise ValueError(f"capacity_bytes={capacity_bytes} holds no block of {padded} bytes (padded)")
    assert capacity_blocks is not None
    return capacity_blocks


def as_list(values: Iterable[Any]) -> list[Any]:
    """A call's indices (rows, blocks) as a list of their own, as they are now (a tensor or an
    array through ``tolist``): the caller may reuse what it passed once the call is made."""
    return list(values.tolist() if hasattr(values, "tolist") else values)


def checked_keys(keys: Iterable[bytes]) -> list[bytes]:
    """A store call's keys as a list, each checked to be bytes (one key alone is refused)."""
    if isinstance(keys, (bytes, bytearray, str)):
        raise TypeError("keys must be a sequence of keys (bytes), not one key")
    key_list = list(keys)
    for position, key in enumerate(key_list):
        if not isinstance(key, bytes):
            raise TypeError(f"keys[{position}] is a {type(key).__name__}, not bytes")
    return key_list


def check_keys_and_rows(keys: Iterable[bytes], rows: Iterable[int], after: Any, gpu: bool, num_rows: int,
                        unique_keys: bool) -> tuple[list[bytes], list[int]]:
    """A store call's keys and cache rows as lists, checked (so that nothing changes before the
    engine, which checks the rows again, could refuse them): ``after`` only for CUDA caches
    (``gpu``), as many rows as keys, each an integer in [0, num_rows) and none twice, and with
    ``unique_keys`` (a put) no key twice."""
    if after is not None and not gpu:
        raise TypeError("after= takes a torch.cuda.Event and only applies to CUDA caches")
    key_list = checked_keys(keys)
    row_list = as_list(rows)
    if len(key_list) != len(row_list):
        raise ValueError(f"keys has {len(key_list)} entries but rows has {len(row_list)}")
    for position, row in enumerate(row_list):
        if isinstance(row, bool):
            raise TypeError(f"rows[{position}] is a bool, not a row index")
        try:
            row_list[position] = operator.index(row)
        except TypeError:
            raise TypeError(f"rows[{position}] must be an integer, got {type(row).__name__}") from None
        if not 0 <= row_list[position] < num_rows:
            raise ValueError(f"rows[{position}] = {row_list[position]} is out of range [0, {num_rows})")
    if len(set(row_list)) != len(row_list):
        raise ValueError("a row appears twice in one call")
    if unique_keys and len(set(key_list)) != len(key_list):
        raise ValueError("a key appears twice in one put")
    return key_list, row_list
