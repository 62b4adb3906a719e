"""TieredStore as a KeyStore over a real mooncake_master: a put's ``after=`` and the keys it returns,
pins in the local tier, and SyncTieredStore as the one threaded wrapper (futures that refuse
cancel, closed when dropped)."""

from __future__ import annotations

import asyncio
import gc
import threading
import time
import weakref
from pathlib import Path
from unittest import mock

import pytest
import torch
from blocks import fill, holds, key, make_caches, poison

import uring_kv._layout
from uring_kv import CacheLayout, KeyStore, SyncStore
from uring_kv.integrations.mooncake import MooncakeConfig, SyncTieredStore, TieredStore
from uring_kv.integrations.mooncake_master import LocalMaster

pytestmark = pytest.mark.timeout(120)


def config(master: LocalMaster) -> MooncakeConfig:
    return MooncakeConfig(master.master_address, master.metadata_server, segment_bytes=32 << 20,
                          local_buffer_bytes=4 << 20, staging_rows=4, namespace="keystore")


def filled(count: int, tag: str) -> tuple[dict[str, torch.Tensor], list[bytes]]:
    """Caches whose first ``count`` rows hold the blocks of keys ``key(0, tag)``..., and the keys."""
    caches = make_caches()
    keys = [key(i, tag) for i in range(count)]
    for row, k in enumerate(keys):
        fill(caches, row, k)
    return caches, keys


def test_a_tiered_put_returns_the_keys_written_and_takes_after(master: LocalMaster, tmp_path: Path) -> None:
    """put returns how many keys the local tier wrote (0 for keys it held: they are only
    refreshed, and not written to Mooncake again); ``after`` is refused before anything is written
    (host caches), and None is taken by every transfer."""
    async def main() -> None:
        caches, keys = filled(4, "after")
        async with TieredStore(caches, tmp_path / "a", 16, remote=config(master)) as store:
            assert isinstance(store, KeyStore)
            with pytest.raises(TypeError, match="only applies to CUDA caches"):
                await store.put(keys, range(4), after=object())
            assert store.lookup(keys) == 0 and store.stats()["remote_stored"] == 0
            assert await store.put(keys[:2], range(2), after=None) == 2
            assert await store.put(keys, range(4)) == 2  # the first two are held: refreshed
            assert store.stats()["remote_stored"] == 4  # each key written to Mooncake once
            poison(caches, range(4, 8))
            assert await store.get_present([keys[3], key(99, "after")], [4, 5], after=None) == [keys[3]]
            await store.get(keys[:2], [6, 7], after=None)
            assert holds(caches, 4, keys[3]) and holds(caches, 6, keys[0]) and holds(caches, 7, keys[1])
            with pytest.raises(TypeError, match="only applies to CUDA caches"):
                await store.get(keys[:1], [8], after=object())

    asyncio.run(main())


def test_tiered_pins_hold_local_keys(master: LocalMaster, tmp_path: Path) -> None:
    """A pinned local key is not evicted by puts that fill the local tier (capacity 2: the
    unpinned key goes instead); a key not held gets no pin."""
    async def main() -> None:
        caches, keys = filled(4, "pin")
        async with TieredStore(caches, tmp_path / "a", 2, remote=config(master)) as store:
            await store.put(keys[:2], range(2))
            handles = store.pin([keys[0], key(99, "pin")])
            assert handles[0] is not None and handles[1] is None
            await store.put(keys[2:3], [2])
            assert store.contains(keys[0]) and not store.contains(keys[1])
            store.unpin(handles)
            await store.put(keys[3:], [3])
            assert not store.contains(keys[0])  # unpinned: the least recently used goes

    asyncio.run(main())


def test_the_sync_tiered_store_is_the_one_wrapper(master: LocalMaster, tmp_path: Path) -> None:
    """SyncTieredStore is a SyncStore: a get in flight refuses cancel() (its rows stay the call's
    until it ends), put returns the keys written, and dropped without close() it closes both
    tiers and its threads."""
    caches, keys = filled(4, "sync")
    layout = CacheLayout.of(caches)
    store = SyncTieredStore(layout, tmp_path / "a", 8, remote=config(master), copy_delay=0.05)
    assert isinstance(store, SyncStore) and isinstance(store.store, TieredStore)
    thread, alive = store.thread, weakref.ref(store)
    assert store.put(keys, range(4)) == 4
    assert store.lookup_shared([*keys, key(99, "sync")]) == 4
    poison(caches, range(8, 12))
    future = store.submit_get(keys, range(8, 12))
    assert future.cancel() is False and not future.cancelled() and not future.done()
    assert future.result(timeout=30) is None
    assert all(holds(caches, 8 + i, k) for i, k in enumerate(keys))
    pending = store.submit_put([key(9, "sync")], [0])
    del store
    gc.collect()
    assert alive() is None and not thread.is_alive()
    assert pending.done()  # finished (or refused as closing) before the close, never left hanging
    for _ in range(200):
        if not [t for t in threading.enumerate() if t.name.startswith(("uring-kv-mooncake", "uring-kv-tiered"))]:
            break
        time.sleep(0.05)
    assert not [t for t in threading.enumerate() if t.name.startswith(("uring-kv-mooncake", "uring-kv-tiered"))]


def test_a_tiered_store_checks_its_caches_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Its capacity in bytes, its local engine and its remote tier all need the block's bytes:
    the caches are checked once, and both tiers agree on the block (built only: nothing opens)."""
    checks = mock.Mock(wraps=uring_kv._layout.normalise_caches)
    monkeypatch.setattr(uring_kv._layout, "normalise_caches", checks)
    caches = make_caches()
    unused = MooncakeConfig("127.0.0.1:1", "http://127.0.0.1:1/metadata")
    store = TieredStore(caches, tmp_path / "a", capacity_bytes=8 << 12, remote=unused)
    assert checks.call_count == 1
    assert store.local.capacity == 8 and store.local.engine.layout.block_bytes == store.remote.block_bytes == 2998
