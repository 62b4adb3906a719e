"""What every key store offers: :class:`KeyStore`, the interface of ``BlockStore``,
``StripedBlockStore`` and the Mooncake ``TieredStore``.

It owns the contract only, no code: a caller written against it (``uring_kv.SyncStore``, the
threaded wrapper, is one) takes any of the stores, and a new store is one more class with these
methods. It never imports a store.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol, Self, runtime_checkable

from uring_kv._prefetch import Prefetch


@runtime_checkable
class KeyStore(Protocol):
    """Keys (bytes) → cache rows through some storage, on one event loop.

    * ``open()`` (once) binds the store to the running loop and returns it; ``aclose()`` refuses
      new calls, lets those under way end, frees everything, and may be called again.
    * ``contains``, ``lookup`` and ``stats`` answer from any thread, at once, without I/O: a
      lookup is a hint (a key may go before a later get).
    * ``put``, ``get``, ``get_present``, ``pin`` and ``unpin`` run on the store's loop. ``rows[i]``
      is the cache row of ``keys[i]``; the rows a call names stay the caller's to leave untouched
      until it returns. ``after``: a CUDA event the copies wait for (CUDA caches only).
    * ``put`` returns how many keys it wrote (a key held already is only refreshed) or raises
      :class:`uring_kv.KeyIOError` naming those it could not store (``written``: how many it did);
      ``get`` raises :class:`uring_kv.KeyMissingError` before any I/O when a key is not held;
      ``get_present`` loads what is held and returns those keys, in call order.
    * ``get`` and ``get_present`` take ``prefetch=`` (a :class:`uring_kv.Prefetch`): their loads run
      as prefetches, behind demand loads, until ``prefetch.upgrade()``.
    * ``pin`` holds each held key against eviction until ``unpin`` (a handle per key, None for a
      key not held).

    ``isinstance(store, KeyStore)`` checks that the methods are there (not their signatures).
    """

    async def open(self) -> Self: ...

    async def aclose(self) -> None: ...

    def contains(self, key: bytes) -> bool: ...

    def lookup(self, keys: Iterable[bytes]) -> int: ...

    def stats(self) -> dict[str, int]: ...

    async def put(self, keys: Iterable[bytes], rows: Iterable[int], after: Any = None) -> int: ...

    async def get(self, keys: Iterable[bytes], rows: Iterable[int], after: Any = None, *,
                  prefetch: Prefetch | None = None) -> None: ...

    async def get_present(self, keys: Iterable[bytes], rows: Iterable[int], after: Any = None, *,
                          prefetch: Prefetch | None = None) -> list[bytes]: ...

    def pin(self, keys: Iterable[bytes]) -> list[Any]: ...

    def unpin(self, handles: Iterable[Any]) -> None: ...
