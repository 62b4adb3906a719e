"""One store interface: the stores are ``KeyStore``s, ``SyncStore`` runs any of them on a thread (the
same futures and finalizer for each), and a store's caches are checked once, into one
``CacheLayout`` handed down to everything it builds."""

from __future__ import annotations

import gc
import os
import threading
import time
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
from test_store import fill_keys, key

import uring_kv._layout
from uring_kv import (
    BlockStore,
    CacheLayout,
    EngineClosedError,
    KeyStore,
    StripedBlockStore,
    SyncBlockStore,
    SyncStore,
)
from uring_kv.testing import id_caches, identify


@pytest.fixture
def no_thread_left() -> Iterator[None]:
    before = set(threading.enumerate())
    yield
    for _ in range(200):
        if not set(threading.enumerate()) - before:
            break
        time.sleep(0.01)
    assert not set(threading.enumerate()) - before, "a store's thread outlived it"


def _stores(caches: Any, tmp_path: Path) -> list[BlockStore | StripedBlockStore]:
    return [BlockStore(caches, tmp_path / "one.bin", 8, 2),
            StripedBlockStore(caches, [tmp_path / "a.bin", tmp_path / "b.bin"], 8, 2)]


def test_the_stores_are_key_stores_and_run_through_the_one_wrapper(tmp_path: Path, no_thread_left: None) -> None:
    """Each store passes the wrapper's runtime check and gives the protocol's answers through it:
    a put returns the keys it wrote (0 for keys held already), get_present the keys loaded."""
    caches = id_caches("cpu", blocks=16)
    fill_keys(caches, [0, 1, 2], [0, 1, 2])
    for store in _stores(caches, tmp_path):
        assert isinstance(store, KeyStore)
        with SyncStore(store) as synced:
            assert synced.store is store
            assert synced.put([key(0), key(1)], [0, 1]) == 2
            assert synced.put([key(0), key(1), key(2)], [0, 1, 2]) == 1  # two held: refreshed only
            assert synced.lookup([key(0), key(1), key(2)]) == 3 and synced.contains(key(2))
            assert synced.get_present([key(3), key(2), key(0)], [8, 9, 10]) == [key(2), key(0)]
            assert identify(caches, 9) == (2, 1, True) and identify(caches, 10) == (0, 1, True)
            assert synced.submit_get([key(1)], [11]).result(timeout=10) is None
            assert identify(caches, 11) == (1, 1, True)
            assert synced.stats()["keys"] == 3
        assert synced.closed and store.closed and not synced.thread.is_alive()


def test_the_wrapper_refuses_what_is_not_a_key_store(no_thread_left: None) -> None:
    class LooksLikeOne:  # lookups only: no put, get, pin...
        def contains(self, key: bytes) -> bool:
            return False

        def lookup(self, keys: Any) -> int:
            return 0

    assert not isinstance(LooksLikeOne(), KeyStore)
    with pytest.raises(TypeError, match=r"SyncStore takes a uring_kv\.KeyStore, got LooksLikeOne"):
        SyncStore(LooksLikeOne())  # type: ignore[type-var]


def test_the_wrapper_over_a_store_refuses_cancel_and_is_closed_when_dropped(tmp_path: Path,
                                                                            no_thread_left: None) -> None:
    """A SyncStore made over a store the caller built: its futures refuse cancel() while the call
    runs, and dropped without close() it closes the store and ends its thread."""
    caches = id_caches("cpu", blocks=16)
    store = StripedBlockStore(caches, [tmp_path / "a.bin", tmp_path / "b.bin"], 8, 1, copy_delay=0.05)
    synced = SyncStore(store, thread_name="striped-under-test")
    thread, alive = synced.thread, weakref.ref(synced)
    assert thread.name == "striped-under-test"
    fill_keys(caches, [0, 1, 2, 3], [0, 1, 2, 3])
    future = synced.submit_put([key(i) for i in range(4)], range(4))
    assert future.cancel() is False and not future.cancelled() and not future.done()
    assert future.result(timeout=10) == 4
    pending = synced.submit_get([key(i) for i in range(4)], [8, 9, 10, 11])
    del synced
    gc.collect()
    assert alive() is None and not thread.is_alive() and store.closed
    assert pending.done() and pending.exception() is None  # finished before the close
    assert [identify(caches, row) for row in (8, 9, 10, 11)] == [(i, 1, True) for i in range(4)]


def test_a_closed_wrapper_refuses_calls_by_its_own_name(tmp_path: Path, no_thread_left: None) -> None:
    caches = id_caches("cpu", blocks=8)
    for synced in (SyncStore(BlockStore(caches, tmp_path / "kv.bin", 4, 1)),
                   SyncBlockStore(caches, tmp_path / "kv.bin", 4, 1)):
        synced.close()
        with pytest.raises(EngineClosedError, match=f"^{type(synced).__name__} is closed$"):
            synced.submit_put([key(0)], [0])
    assert os.listdir(tmp_path) == []


def test_a_layout_is_the_caches_checked_once_with_their_block_bytes() -> None:
    """Odd sizes: a float16 tensor of 3 × 333 per row and a uint8 one of 1000: the block is both
    rows back to back; a layout given where caches go comes back as it is."""
    caches = {"k": torch.zeros(5, 3, 333, dtype=torch.float16), "v": torch.zeros(5, 1000, dtype=torch.uint8)}
    layout = CacheLayout.of(caches)
    assert layout.names == ("k", "v") and layout.num_rows == 5 and not layout.gpu
    assert layout.tensor_block_bytes == (1998, 1000) and layout.offsets == (0, 1998) and layout.block_bytes == 2998
    assert layout.geometry() == [["k", "float16", [3, 333], 1998], ["v", "uint8", [1000], 1000]]
    assert CacheLayout.of(layout) is layout
    assert CacheLayout.of([caches["v"]]).names == ("0",)
    with pytest.raises(TypeError, match="not one tensor"):
        CacheLayout.of(caches["k"])
    with pytest.raises(ValueError, match="caches is empty"):
        CacheLayout.of({})


def test_a_store_checks_its_caches_once_and_hands_the_layout_down(tmp_path: Path, no_thread_left: None,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A threaded striped store, sized in bytes and persistent (so its capacity, each stripe's
    engine and each stripe's index all need the geometry): the caches are checked once, and every
    engine holds that one layout."""
    checks = mock.Mock(wraps=uring_kv._layout.normalise_caches)
    monkeypatch.setattr(uring_kv._layout, "normalise_caches", checks)
    caches = id_caches("cpu", blocks=8)
    paths = [tmp_path / "a.bin", tmp_path / "b.bin", tmp_path / "c.bin"]
    with SyncBlockStore(caches, paths, capacity_bytes=6 * 4096, num_slots=1, persistent=True) as synced:
        assert synced.store.capacity == 6
        assert checks.call_count == 1
        assert isinstance(synced.store, StripedBlockStore)
        layouts = {id(stripe.engine.layout) for stripe in synced.store.stripes}
        assert len(layouts) == 1 and synced.store.stripes[0].engine.block_bytes == 4 * caches["layer0"][0].nbytes
