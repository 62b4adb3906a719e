"""Keys spread over several block files, one per drive: a :class:`BlockStore` per file, all on one
event loop, each with its own engine (ring, staging slots, depth).

It owns only the placement: which stripe (file) holds a key. It never moves a key between stripes,
and never lets one stripe's failure touch another's keys.

Some facts, and what follows here:

* A serving node has several NVMe drives, and a drive's throughput needs its own queue depth. So
  each file gets a whole engine, and a put or get splits its keys by stripe and runs the parts at
  once (``LoopServices.gather``): a batch fans out across the drives, each stripe filling its own
  ring. One ring for all files would share one depth and one slot pool among drives that complete
  at their own pace.
* A call waits for its slowest part, so a batch's keys must split evenly: with placement by hash,
  batches of 256 random keys over 4 stripes gave the fullest stripe 14-19% more keys than an even
  share on average, and that was what the batches cost (``docs/performance.md``). So a put places
  each key it finds in no stripe on the stripe with the fewest of the call's keys so far, ties
  going round a turn that moves on with every key placed (one-key puts go round the stripes).
  Blocks stored together are read together (a request's prefix), so the gets split as evenly as
  the puts did. A key held somewhere stays there (a put of it again refreshes it in its stripe),
  and a key some put is placing goes where that put sends it, so one key is in at most one stripe.
* Lookups (``contains``, ``lookup``, ``stripe_of``) ask every stripe (a dict lookup each, from any
  thread); a persistent stripe set finds each key in whichever file's index holds it after a
  restart. Each persistent stripe's fingerprint names its place ("stripe 2 of 4"), so paths
  reordered or added between runs are refused (``GeometryMismatchError``): a set of files is
  reopened as the set it was.
* The capacity is split evenly and each stripe evicts its own least recently used key: with
  even placement that is a sharded LRU, not one global order.
* Failures stay per stripe: a drive that fails turns its keys into failures and misses
  (``KeyIOError`` naming them), and the other stripes' keys of the same call land or load.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterable, Sequence
from typing import Any

from uring_kv._args import capacity_in_blocks, check_keys_and_rows
from uring_kv._layout import CacheLayout
from uring_kv._loop import CallsUnderWay, LoopServices, current_services
from uring_kv._prefetch import Prefetch
from uring_kv.errors import EngineClosedError, KeyIOError, KeyMissingError
from uring_kv.store import BlockStore


class StripedBlockStore:
    """Keys (bytes) → blocks spread over the files ``paths`` (one per drive), with
    :class:`BlockStore`'s interface and guarantees per key.

    ``capacity_blocks`` (or ``capacity_bytes``) is the total, split evenly (the first stripes take
    one block more when it does not divide). ``num_slots`` and ``engine_options`` apply to each
    stripe's engine (``stripes[i].engine``): pinned memory is ``len(paths)`` times a single store's.
    ``persistent``, ``fingerprint`` and ``fsync``: as for :class:`BlockStore`, per file (each file
    has its index beside it). A put places each new key on the stripe with the fewest of the call's
    keys (see the module docstring); a key held already stays in its stripe.

    A put or get runs its stripes' parts at once and raises one :class:`KeyIOError` naming every
    key that failed, in any stripe; the others landed or loaded. ``get`` checks every key first
    (:class:`KeyMissingError` before any I/O); a key evicted in the instant between that check and
    its stripe's start fails with ``ENOENT`` in the :class:`KeyIOError` instead (its row
    untouched)."""

    def __init__(self, caches: Any, paths: Sequence[str | os.PathLike[str]], capacity_blocks: int | None = None,
                 num_slots: int = 16, *, capacity_bytes: int | None = None, persistent: bool = False,
                 fingerprint: str = "", fsync: bool | None = None, **engine_options: Any) -> None:
        if isinstance(paths, (str, bytes, os.PathLike)):
            raise TypeError("paths must be a sequence of paths (one per file), not one path")
        resolved = [os.path.abspath(os.fspath(path)) for path in paths]
        if not resolved:
            raise ValueError("paths is empty: give one path per file")
        if len(set(resolved)) != len(resolved):
            raise ValueError("a path appears twice in paths")
        layout = CacheLayout.of(caches)  # checked once, for every stripe
        total = capacity_in_blocks(layout, capacity_blocks, capacity_bytes)
        count = len(resolved)
        if total < count:
            raise ValueError(f"a capacity of {total} blocks cannot give each of the {count} files a block")
        shares = [total // count + (position < total % count) for position in range(count)]
        self.capacity = total
        self.persistent = persistent
        self.stripes = [BlockStore(layout, path, share, num_slots, persistent=persistent, fsync=fsync,
                                   fingerprint=f"{fingerprint} (stripe {position + 1} of {count})" if persistent
                                   else fingerprint, **engine_options)
                        for position, (path, share) in enumerate(zip(resolved, shares, strict=True))]
        self._svc: LoopServices | None = None
        self._state = "new"  # then opening, open; closed if opening failed (closing: see _closing)
        self._closing = False
        self._calls = CallsUnderWay()  # puts and gets: aclose() lets them end before it closes a stripe
        self._placing: dict[bytes, list[int]] = {}  # keys puts are placing: [stripe, puts placing it]
        self._turn = 0  # the stripe that takes the next new key among equally full ones

    def stripe_of(self, key: bytes) -> int | None:
        """The stripe (index into ``paths``) that holds ``key`` now, or one that a put is placing it
        on; None when neither."""
        placing = self._placing.get(key)
        return placing[0] if placing is not None else self._holder(key)

    def _holder(self, key: bytes) -> int | None:
        """The stripe where ``key`` is visible, or None."""
        return next((n for n, stripe in enumerate(self.stripes) if stripe.contains(key)), None)

    # ----------------------------------------------------------------- lifecycle
    async def open(self) -> StripedBlockStore:
        """Open every stripe (one after the other); if one fails, close those opened and raise."""
        self._svc = current_services()
        self._state = "opening"
        for position, stripe in enumerate(self.stripes):
            try:
                await stripe.open()
            except BaseException:
                self._state = "closed"
                for opened in self.stripes[:position + 1]:
                    await self._svc.run_to_completion(opened.aclose())
                raise
        self._state = "open"
        return self

    async def __aenter__(self) -> StripedBlockStore:
        return await self.open()

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Refuse new calls, let those under way end (a put's or get's stripes all run, so no call
        is cut in half), then close every stripe (each even if another's closing failed; the first
        failure is raised). A cancelled aclose() still closes, then raises the cancellation."""
        self._closing = True
        if self._svc is None:
            await self._close_stripes()
        else:
            await self._svc.run_to_completion(self._close(self._svc))

    async def _close(self, svc: LoopServices) -> None:
        await self._calls.none_left(svc)
        await self._close_stripes()

    async def _close_stripes(self) -> None:
        failure: BaseException | None = None
        for stripe in self.stripes:
            try:
                await stripe.aclose()
            except BaseException as exc:
                failure = failure or exc
        if failure is not None:
            raise failure

    @property
    def closed(self) -> bool:
        return all(stripe.closed for stripe in self.stripes)

    # ----------------------------------------------------------------- lookups (any thread)
    def contains(self, key: bytes) -> bool:
        """Whether ``key`` is visible now, in some stripe (see :meth:`BlockStore.contains`)."""
        return any(stripe.contains(key) for stripe in self.stripes)

    def lookup(self, keys: Iterable[bytes]) -> int:
        """How many of ``keys``, from the first, are visible now; no I/O, any thread."""
        count = 0
        for key in keys:
            if not self.contains(key):
                break
            count += 1
        return count

    def pin(self, keys: Iterable[bytes]) -> list[Any]:
        """:meth:`BlockStore.pin`, each key in the stripe that holds it: a handle per key (None
        for a key no stripe holds). On the store's loop; the caller must unpin every handle."""
        if isinstance(keys, (bytes, bytearray, str)):
            raise TypeError("keys must be a sequence of keys (bytes), not one key")
        self._check_open()
        handles: list[Any] = []
        for key in keys:
            position = self._holder(key)
            handles.append(None if position is None else (position, self.stripes[position].pin([key])[0]))
        return handles

    def unpin(self, handles: Iterable[Any]) -> None:
        """Release pins taken by :meth:`pin` (None handles are skipped)."""
        for handle in handles:
            if handle is not None:
                position, entry = handle
                self.stripes[position].unpin([entry])

    def stats(self) -> dict[str, int]:
        """:meth:`BlockStore.stats` summed over the stripes, and ``stripes``."""
        total: dict[str, int] = {}
        for stripe in self.stripes:
            for name, value in stripe.stats().items():
                total[name] = total.get(name, 0) + value
        total["stripes"] = len(self.stripes)
        return total

    # ----------------------------------------------------------------- transfers (the loop)
    async def put(self, keys: Iterable[bytes], rows: Iterable[int], after: Any = None) -> int:
        """:meth:`BlockStore.put`, each key in its stripe, the stripes at once: the keys written."""
        key_list, row_list = self._arguments(keys, rows, after, unique_keys=True)
        svc = self._check_open()
        parts = self._place(key_list, row_list)
        self._calls.enter()
        try:
            return await self._fan_out(svc, "put", key_list, parts, after)
        finally:
            for key in key_list:
                entry = self._placing[key]
                entry[1] -= 1
                if not entry[1]:
                    del self._placing[key]
            self._calls.leave()

    async def get(self, keys: Iterable[bytes], rows: Iterable[int], after: Any = None, *,
                  prefetch: Prefetch | None = None) -> None:
        """:meth:`BlockStore.get`, each key from its stripe, the stripes at once."""
        key_list, row_list = self._arguments(keys, rows, after, unique_keys=False)
        svc = self._check_open()
        parts, missing = self._split(key_list, row_list)
        if missing:
            raise KeyMissingError(missing)
        self._calls.enter()
        try:
            await self._fan_out(svc, "get", key_list, parts, after, prefetch)
        finally:
            self._calls.leave()

    async def get_present(self, keys: Iterable[bytes], rows: Iterable[int], after: Any = None, *,
                          prefetch: Prefetch | None = None) -> list[bytes]:
        """:meth:`BlockStore.get_present`, over the stripes at once: the keys loaded, in call order."""
        key_list, row_list = self._arguments(keys, rows, after, unique_keys=False)
        svc = self._check_open()
        parts, _ = self._split(key_list, row_list)
        self._calls.enter()
        try:
            stripes = self.stripes
            loaded = await svc.gather([stripes[position].get_present(part_keys, part_rows, after, prefetch=prefetch)
                                       for position, (part_keys, part_rows) in parts.items()])
        finally:
            self._calls.leave()
        held = {key for part in loaded for key in part}
        return [key for key in key_list if key in held]

    # ----------------------------------------------------------------- internals
    def _split(self, keys: list[bytes], rows: list[int]
               ) -> tuple[dict[int, tuple[list[bytes], list[int]]], list[bytes]]:
        """The keys and rows of each stripe that holds some of ``keys`` (visible there), and the
        keys no stripe holds."""
        parts: dict[int, tuple[list[bytes], list[int]]] = {}
        missing = []
        for key, row in zip(keys, rows, strict=True):
            position = self._holder(key)
            if position is None:
                missing.append(key)
                continue
            part = parts.setdefault(position, ([], []))
            part[0].append(key)
            part[1].append(row)
        return parts, missing

    def _place(self, keys: list[bytes], rows: list[int]) -> dict[int, tuple[list[bytes], list[int]]]:
        """A put's parts: a key held or being placed goes to that stripe, each other one to the
        stripe with the fewest of the call's keys so far (ties: the first from ``_turn`` on).
        Every key is registered in ``_placing`` until the put ends."""
        count = len(self.stripes)
        where = [self.stripe_of(key) for key in keys]
        sizes = [0] * count
        for position in where:
            if position is not None:
                sizes[position] += 1
        parts: dict[int, tuple[list[bytes], list[int]]] = {}
        for key, row, position in zip(keys, rows, where, strict=True):
            if position is None:
                position = min(range(count), key=lambda n: (sizes[n], (n - self._turn) % count))
                sizes[position] += 1
                self._turn = (position + 1) % count
            entry = self._placing.setdefault(key, [position, 0])
            entry[1] += 1
            part = parts.setdefault(position, ([], []))
            part[0].append(key)
            part[1].append(row)
        return parts

    async def _fan_out(self, svc: LoopServices, op: str, keys: list[bytes],
                       parts: dict[int, tuple[list[bytes], list[int]]], after: Any,
                       prefetch: Prefetch | None = None) -> int:
        """Run each stripe's part at once: the keys written (puts), or KeyIOError naming every key
        that failed in any stripe."""
        async def part(position: int, part_keys: list[bytes], part_rows: list[int]) -> tuple[dict[bytes, int], int]:
            stripe = self.stripes[position]
            # A part starts a loop turn after the call checked its keys: a key of a get's part
            # evicted meanwhile fails alone (ENOENT); the others are loaded. (The stripe's own
            # get, checking again with no await in between, then finds every key it is given.)
            gone = {} if op == "put" else {key: errno.ENOENT for key in part_keys if not stripe.contains(key)}
            if gone:
                kept = [(key, row) for key, row in zip(part_keys, part_rows, strict=True) if key not in gone]
                part_keys, part_rows = [key for key, _ in kept], [row for _, row in kept]
            written = 0
            try:
                if part_keys and op == "put":
                    written = await stripe.put(part_keys, part_rows, after)
                elif part_keys:
                    await stripe.get(part_keys, part_rows, after, prefetch=prefetch)
            except KeyIOError as exc:
                return {**gone, **exc.failures}, exc.written
            return gone, written

        results = await svc.gather([part(position, part_keys, part_rows)
                                    for position, (part_keys, part_rows) in parts.items()])
        failures = {key: code for result, _ in results for key, code in result.items()}
        written = sum(int(count) for _, count in results)
        if failures:
            raise KeyIOError(op, {key: failures[key] for key in keys if key in failures}, written)
        return written

    def _arguments(self, keys: Iterable[bytes], rows: Iterable[int], after: Any,
                   unique_keys: bool) -> tuple[list[bytes], list[int]]:
        engine = self.stripes[0].engine  # (every stripe's engine has the same caches)
        return check_keys_and_rows(keys, rows, after, engine.gpu, engine.num_gpu_blocks, unique_keys)

    def _check_open(self) -> LoopServices:
        """The loop's services; EngineClosedError unless open, RuntimeError off its loop's thread
        (before anything changes: the placements belong to the loop's thread)."""
        if self._closing:
            raise EngineClosedError(f"striped block store is {'closed' if self.closed else 'closing'}")
        if self._state != "open":
            raise EngineClosedError(f"striped block store is {self._state}")
        assert self._svc is not None
        if not self._svc.is_current():
            raise RuntimeError("uring_kv StripedBlockStore called outside the event loop (and thread) that opened it")
        return self._svc

