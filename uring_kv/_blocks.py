"""Per-disk-block state: what is in flight on each block (``HazardTable``) and what the file holds
(``Contents``).

Hazards, per batch. Each batch has one future, ``phase_done``, that stands for all its reads (a
load) or all its writes (a store); it is set once the last of them has finished (a cancelled
batch: once the blocks it started finished and its own hazards cleared, so the order holds for
whoever waits on it). A batch is registered, whole, when it is admitted, in call order, before any
later call's batch (see ``Engine._admit``); what it must wait for is then known:

- a load waits for the latest store registered to each of its blocks;
- a store waits for every load registered that reads any of its blocks, and for the latest store
  to each of them (writes to one block land in call order).

So a load sees exactly the stores called before it, and a store never overwrites a block a load
called before it still reads. One registration path serves every batch, whichever pump carries it.
"""

from __future__ import annotations

import errno
from collections.abc import Mapping
from typing import Any

from uring_kv._native import bitmap, first_unset, mark
from uring_kv._staging import Kind


class HazardTable:
    """The reads and writes in flight, by disk block. ``register`` adds a batch (a piece at a time
    for a large one) and collects the futures it must wait for; ``loads_done`` / ``stores_done``
    drop it once its ``phase_done`` is set."""

    __slots__ = ("_last_store", "_reads")

    def __init__(self) -> None:
        self._last_store: dict[int, Any] = {}  # disk block → phase_done of its latest store
        self._reads: dict[Any, set[int]] = {}  # phase_done of a load → the disk blocks it reads

    def register(self, kind: Kind, piece: list[int], phase_done: Any, deps: dict[int, Any]) -> None:
        """Register ``piece`` (disk blocks) of a batch whose reads or writes ``phase_done`` stands
        for, adding to ``deps`` (by id) the futures it must wait for."""
        last_store = self._last_store
        if kind is Kind.LOAD:
            if last_store:  # some store is in flight
                for d in piece:
                    if (store := last_store.get(d)) is not None:
                        deps[id(store)] = store
            reads = self._reads.get(phase_done)
            if reads is None:
                reads = self._reads[phase_done] = set()
            reads.update(piece)
            return
        for d in piece:
            if (store := last_store.get(d)) is not None:
                deps[id(store)] = store
            last_store[d] = phase_done
        for load, reads in self._reads.items():
            if not reads.isdisjoint(piece):
                deps[id(load)] = load

    def loads_done(self, phase_done: Any) -> None:
        """The load ``phase_done`` stands for has read all it will."""
        self._reads.pop(phase_done, None)

    def stores_done(self, piece: list[int], phase_done: Any) -> None:
        """The store ``phase_done`` stands for has written ``piece`` (or never will)."""
        last_store = self._last_store
        for d in piece:
            if last_store.get(d) is phase_done:
                del last_store[d]

    def writer(self, disk_block: int) -> Any:
        """The latest store to ``disk_block`` in flight (its ``phase_done``), or None."""
        return self._last_store.get(disk_block)

    def readers(self, disk_block: int) -> list[Any]:
        """The loads in flight that read ``disk_block`` (their ``phase_done``)."""
        return [load for load, reads in self._reads.items() if disk_block in reads]

    def __len__(self) -> int:
        """Entries registered: blocks with a store in flight, plus each load's blocks."""
        return len(self._last_store) + sum(map(len, self._reads.values()))


class Contents:
    """Which disk blocks hold bytes a load may trust: those whose last store succeeded. For the
    others, the errno their last store failed with; with checksums, the crc32c of each block as
    last written. One bit per block, and entries only for failed or summed blocks."""

    __slots__ = ("failed", "stored", "sums")

    def __init__(self, num_disk_blocks: int) -> None:
        self.stored = bitmap(num_disk_blocks)
        self.failed: dict[int, int] = {}  # disk block → errno of its last store, which failed
        self.sums: dict[int, int] = {}  # disk block → crc32c of its padded bytes (checksum=True)

    def first_unheld(self, disk_c: Any, n: int) -> int:
        """The first position among the ``n`` blocks of ``disk_c`` (a C int64 array) that holds
        nothing to trust, or -1 (one C pass)."""
        return first_unset(disk_c, n, self.stored)

    def holds(self, d: int) -> bool:
        return bool(self.stored[d >> 6] >> (d & 63) & 1)

    def error(self, d: int) -> int:
        """Why a load of ``d`` (not held) fails: its last store's errno, or ENODATA."""
        return self.failed.get(d, errno.ENODATA)

    def written(self, disk_c: Any, n: int) -> None:
        """The first ``n`` blocks of ``disk_c`` (a C int64 array) were written (their failures are
        then reported to :meth:`unstore`)."""
        mark(disk_c, n, self.stored, True)
        if failed := self.failed:  # its entries hold for blocks whose bit is clear: drop the rest
            for d in [d for d in failed if self.holds(d)]:
                del failed[d]

    def store_done(self, disk_c: Any, n: int, failures: Mapping[int, int]) -> None:
        """A store wrote the first ``n`` blocks of ``disk_c`` (a C int64 array) but ``failures``'
        (disk block → errno): a failed write leaves no bytes to trust."""
        self.written(disk_c, n)
        for d, code in failures.items():
            self.unstore(d, code)

    def adopt(self, sums: Mapping[int, int]) -> None:
        """Trust the bytes of ``sums``' blocks (a previous engine wrote them), each with its crc32c."""
        stored, failed = self.stored, self.failed
        for d, crc in sums.items():
            stored[d >> 6] |= 1 << (d & 63)
            failed.pop(d, None)
            self.sums[d] = crc

    def unstore(self, d: int, code: int) -> None:
        """A store to ``d`` failed with ``code``: its bytes are not to be trusted any more."""
        self.stored[d >> 6] &= ~(1 << (d & 63))
        self.failed[d] = code
        self.sums.pop(d, None)
