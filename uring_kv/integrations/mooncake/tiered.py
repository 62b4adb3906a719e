"""A shared remote tier on Mooncake Store under the block store: :class:`TieredStore`.

Many serving processes (on one machine or many) keep their own fast local tier, a
:class:`uring_kv.BlockStore` on their own disk, and share one Mooncake Store cluster below it, so
that a prefix one process computed is a hit for every other. This module puts the two together
through their public APIs only; the remote side is :mod:`uring_kv.integrations.mooncake.remote`.

* ``get_present``/``get``: the local tier first; the keys it misses are fetched from Mooncake into
  staging rows, checked (size, trailer, crc32c) and copied into the caller's rows, then written
  into the local tier (``promote``), so the next get of them is local. A key that fails anywhere
  remote is a miss, never a wrong block.
* ``put``: the local tier, and the keys it did not hold already are written to Mooncake too.
  ``write="through"`` (the default) returns once both answered; ``write="back"`` returns once the
  rows are copied into staging rows, and Mooncake's answer comes later (``aclose`` waits for it).
  Either way a remote failure leaves the key local only (counted in ``stats()``): ``put`` raises
  only what the local tier raises.
* When Mooncake is unreachable (master dead, partitioned, slower than ``timeout``) the tier backs
  off for ``retry_after`` seconds and every call is served by the local tier alone.

Mooncake is imported when the remote tier opens, never by ``import uring_kv``. See
docs/distributed.md for topology, consistency and failure behaviour.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from typing import Any

from uring_kv._args import check_keys_and_rows
from uring_kv._layout import CacheLayout
from uring_kv._loop import OpenClose
from uring_kv._prefetch import Prefetch
from uring_kv.errors import KeyIOError, KeyMissingError
from uring_kv.integrations.mooncake.config import MooncakeConfig, MooncakeError
from uring_kv.integrations.mooncake.remote import MooncakeTier, StoreJob
from uring_kv.store import BlockStore
from uring_kv.sync import SyncStore

__all__ = ["MooncakeConfig", "MooncakeError", "MooncakeTier", "SyncTieredStore", "TieredStore"]

WRITE_MODES = ("through", "back")


class TieredStore(OpenClose):
    """A :class:`uring_kv.BlockStore` (``self.local``) over a :class:`MooncakeTier` (``self.remote``).

    Takes :class:`BlockStore`'s arguments (host caches only), ``remote`` (a
    :class:`MooncakeConfig`), ``write`` (``"through"`` or ``"back"``, see the module docstring)
    and ``promote`` (write remote hits into the local tier). Use as ``async with`` on one event
    loop (asyncio or trio); :class:`SyncTieredStore` runs one for threads. ``open()`` raises
    :class:`MooncakeError` if the cluster cannot be reached then; afterwards no remote failure
    raises. The cache rows a call names must stay untouched until it returns."""

    def __init__(self, caches: Any, path: str | os.PathLike[str], capacity_blocks: int | None = None,
                 num_slots: int = 16, *, capacity_bytes: int | None = None, remote: MooncakeConfig,
                 write: str = "through", promote: bool = True, mooncake_client: Any = None,
                 **engine_options: Any) -> None:
        if write not in WRITE_MODES:
            raise ValueError(f"write must be one of {WRITE_MODES}, got {write!r}")
        layout = CacheLayout.of(caches)  # checked once, for both tiers
        self.remote = MooncakeTier(layout, remote, client=mooncake_client)  # refuses CUDA caches first
        self.local = BlockStore(layout, path, capacity_blocks, num_slots, capacity_bytes=capacity_bytes,
                                **engine_options)
        self.write = write
        self.promote = promote
        self._counts = {"remote_hits_promoted": 0, "promote_failures": 0}

    async def open(self) -> TieredStore:
        """Open the local tier, then the remote one (closing the local one if that fails)."""
        await self.local.open()
        try:
            await self.remote.open()
        except BaseException:
            await self.local.aclose()
            raise
        return self

    async def aclose(self) -> None:
        """Close the remote tier (waiting for write-backs in flight), then the local one."""
        try:
            await self.remote.aclose()
        finally:
            await self.local.aclose()

    # ----------------------------------------------------------------- lookups
    def contains(self, key: bytes) -> bool:
        """Whether the local tier holds ``key`` now (any thread; see :meth:`BlockStore.contains`)."""
        return self.local.contains(key)

    def lookup(self, keys: Iterable[bytes]) -> int:
        """How many of ``keys``, from the first, the local tier holds now (any thread; no remote call)."""
        return self.local.lookup(keys)

    async def lookup_shared(self, keys: Sequence[bytes]) -> int:
        """How many of ``keys``, from the first, are held by the local tier or the cluster now
        (one ``batch_is_exist`` for those not local; the local count alone if Mooncake does not
        answer). A hint, like every lookup: a key may go before it is fetched."""
        key_list = list(keys)
        count = self.local.lookup(key_list)
        rest = key_list[count:]
        if not rest:
            return count
        ask = [key for key in rest if not self.local.contains(key)]
        found = set()
        if ask and (flags := await self.remote.exists(ask)) is not None:
            found = {key for key, flag in zip(ask, flags, strict=True) if flag}
        for key in rest:
            if key not in found and not self.local.contains(key):
                break
            count += 1
        return count

    def stats(self) -> dict[str, int]:
        """The local tier's :meth:`BlockStore.stats`, the remote tier's (keys prefixed ``remote_``)
        and the promotions: remote hits written into the local tier, and those it refused."""
        remote = {f"remote_{name}": value for name, value in self.remote.stats().items()}
        return {**self.local.stats(), **remote, **self._counts}

    # ----------------------------------------------------------------- pins (the loop)
    def pin(self, keys: Iterable[bytes]) -> list[Any]:
        """:meth:`BlockStore.pin` in the local tier (a remote key cannot be pinned: None)."""
        return self.local.pin(keys)

    def unpin(self, handles: Iterable[Any]) -> None:
        """:meth:`BlockStore.unpin` in the local tier."""
        self.local.unpin(handles)

    # ----------------------------------------------------------------- transfers (the loop)
    async def get_present(self, keys: Iterable[bytes], rows: Iterable[int], after: Any = None, *,
                          prefetch: Prefetch | None = None) -> list[bytes]:
        """Load what either tier holds of ``keys`` into ``rows``; returns the keys now in their
        rows (call order). The local tier answers first; its misses are fetched from Mooncake,
        checked, copied into their rows and (``promote``) written into the local tier before
        this returns. A key neither tier could give is left out; its row is left as it was.
        ``after``: as for :meth:`BlockStore.get` (host caches: always None)."""
        key_list, row_list = self._arguments(keys, rows, after, unique_keys=False)
        present = set(await self.local.get_present(key_list, row_list, prefetch=prefetch))
        missing = [(key, row) for key, row in zip(key_list, row_list, strict=True) if key not in present]
        if missing:
            fetched = await self.remote.fetch([key for key, _ in missing], [row for _, row in missing])
            if fetched:
                present.update(fetched)
                if self.promote:
                    await self._promote(fetched, missing)
        return [key for key in key_list if key in present]

    async def get(self, keys: Iterable[bytes], rows: Iterable[int], after: Any = None, *,
                  prefetch: Prefetch | None = None) -> None:
        """:meth:`get_present`, then :class:`KeyMissingError` naming the keys neither tier gave
        (the other rows hold their keys' bytes)."""
        key_list, row_list = self._arguments(keys, rows, after, unique_keys=False)
        loaded = set(await self.get_present(key_list, row_list, prefetch=prefetch))
        if missing := [key for key in key_list if key not in loaded]:
            raise KeyMissingError(missing)

    async def put(self, keys: Iterable[bytes], rows: Iterable[int], after: Any = None) -> int:
        """Store row ``rows[i]`` under ``keys[i]`` in the local tier, and in Mooncake for the keys
        the local tier did not hold (see ``write``); returns how many keys the local tier wrote
        (as :meth:`BlockStore.put`: a key it held already is only refreshed). Raises what
        :meth:`BlockStore.put` raises (:class:`KeyIOError` for keys the local tier could not
        store); a remote failure is only counted. With ``write="back"`` the remote writes go on
        after it returns. ``after``: as for :meth:`BlockStore.put` (host caches: always None)."""
        key_list, row_list = self._arguments(keys, rows, after, unique_keys=True)
        fresh = [(key, row) for key, row in zip(key_list, row_list, strict=True) if not self.local.contains(key)]
        job: StoreJob | None = None
        if fresh:
            job = await self.remote.begin_store([key for key, _ in fresh], [row for _, row in fresh])
        try:
            written = await self.local.put(key_list, row_list)
        except BaseException:
            if job is not None:
                job.detach()
            raise
        if job is not None:
            if self.write == "through":
                await job.wait()
            else:
                job.detach()
        return written

    def _arguments(self, keys: Iterable[bytes], rows: Iterable[int], after: Any,
                   unique_keys: bool) -> tuple[list[bytes], list[int]]:
        return check_keys_and_rows(keys, rows, after, False, self.remote.num_rows, unique_keys)

    async def _promote(self, fetched: list[bytes], missing: list[tuple[bytes, int]]) -> None:
        rows: dict[bytes, int] = {}
        wanted = set(fetched)
        for key, row in missing:
            if key in wanted:
                rows.setdefault(key, row)
        try:
            await self.local.put(list(rows), list(rows.values()))
        except KeyIOError as exc:  # the rows hold the right bytes all the same; the key stays remote only
            self._counts["promote_failures"] += len(exc.failures)
            self._counts["remote_hits_promoted"] += len(rows) - len(exc.failures)
        else:
            self._counts["remote_hits_promoted"] += len(rows)


class SyncTieredStore(SyncStore[TieredStore]):
    """A :class:`TieredStore` on a private event-loop thread, callable from any thread: a
    :class:`uring_kv.SyncStore` over the store it builds.

    Takes :class:`TieredStore`'s arguments and opens it before returning (raising what ``open()``
    raised, with no thread left behind). ``put``/``get``/``get_present``/``lookup_shared`` block
    until done (not from the store's own thread), ``submit_put``/``submit_get``/``submit_get_present``
    return a future at once; ``contains``/``lookup``/``stats`` answer from the caller's thread.
    ``close()`` (or leaving ``with``) finishes what was submitted, closes both tiers and joins the
    thread."""

    def __init__(self, caches: Any, path: str | os.PathLike[str], capacity_blocks: int | None = None,
                 num_slots: int = 16, **options: Any) -> None:
        store = TieredStore(caches, path, capacity_blocks, num_slots, **options)
        super().__init__(store, thread_name="uring-kv-tiered")

    def lookup_shared(self, keys: Sequence[bytes]) -> int:
        """:meth:`TieredStore.lookup_shared`, waited for."""
        return self._wait(self.store.lookup_shared, keys)
