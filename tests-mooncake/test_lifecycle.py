"""The Mooncake tier's lifecycle against a real mooncake_master: two closes at once, an open that
times out while the client sets up, a SyncTieredStore dropped on its own thread. Each must leave
nothing behind: no worker thread, no registered staging rows, no client."""

from __future__ import annotations

import asyncio
import gc
import threading
import time
import weakref
from pathlib import Path

import pytest
from blocks import fill, key, make_caches

from uring_kv.integrations.mooncake import MooncakeConfig, SyncTieredStore, TieredStore
from uring_kv.integrations.mooncake.local import LocalMaster
from uring_kv.integrations.mooncake.remote import MooncakeTier

pytestmark = pytest.mark.timeout(120)


def config(master: LocalMaster) -> MooncakeConfig:
    return MooncakeConfig(master.master_address, master.metadata_server, segment_bytes=32 << 20,
                          local_buffer_bytes=4 << 20, staging_rows=4, namespace="lifecycle")


def worker_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith(("uring-kv-mooncake", "uring-kv-tiered"))]


def test_two_closes_at_once_both_return_once_torn_down(master: LocalMaster, tmp_path: Path) -> None:
    """A shutdown handler and ``async with`` closing at once: both return once the tier is torn
    down (once, the second returned at once and the first could no longer tear down: the rows
    stayed registered and the worker thread ran on)."""
    async def main() -> None:
        caches = make_caches(16)
        store = await TieredStore(caches, tmp_path / "a", 4, remote=config(master), write="back").open()
        keys = [key(i, "two-closes") for i in range(2)]
        for row, k in enumerate(keys):
            fill(caches, row, k)
        master.pause()  # the write-back cannot finish: the first close waits for it
        try:
            await store.put(keys, range(2))
            first = asyncio.ensure_future(store.remote.aclose())
            await asyncio.sleep(0.2)
            second = asyncio.ensure_future(store.remote.aclose())
            await asyncio.sleep(0.2)
            assert not second.done(), "a second close returned while the first was still closing"
        finally:
            master.resume()
        await asyncio.gather(first, second)
        assert store.remote._staging is None and store.remote._client is None
        await store.aclose()

    asyncio.run(main())
    assert not worker_threads()


def test_an_open_timed_out_during_the_client_set_up_leaves_nothing(
        master: LocalMaster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """open() cancelled (a timeout) while the client still sets up on the worker thread: the set-up
    is waited for and undone (once, it went on to register the rows and keep its client, and
    aclose() then did nothing)."""
    real = MooncakeTier._set_up

    def slow_set_up(self: MooncakeTier) -> None:
        time.sleep(0.5)  # a slow master or segment mount
        real(self)

    monkeypatch.setattr(MooncakeTier, "_set_up", slow_set_up)

    async def main() -> None:
        store = TieredStore(make_caches(8), tmp_path / "a", 4, remote=config(master))
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(store.open(), 0.1)
        await store.aclose()
        await asyncio.sleep(1.0)  # (what the set-up would still do, it would have done by now)
        assert store.remote._staging is None and store.remote._client is None

    asyncio.run(main())
    assert not worker_threads()


def test_a_sync_store_dropped_on_its_own_thread_still_closes(master: LocalMaster, tmp_path: Path) -> None:
    """A SyncTieredStore freed by the cyclic collector running on its own loop thread: the
    finalizer cannot wait there, so the loop closes the store and then stops (once, nothing
    closed it: its threads, fds and remote tier stayed)."""
    caches = make_caches(8)
    store = SyncTieredStore(caches, tmp_path / "a", 4, remote=config(master))
    fill(caches, 0, key(0, "dropped"))
    store.put([key(0, "dropped")], [0])
    loop, alive = store._loop, weakref.ref(store)
    store.cycle = store  # type: ignore[attr-defined]  # only the cyclic collector frees it
    del store

    async def collect() -> None:
        gc.collect()

    gc.disable()  # the collection then happens where it may in a real process: on the loop's thread
    try:
        loop.run(collect())
    finally:
        gc.enable()
    for _ in range(200):
        if alive() is None and not worker_threads():
            break
        time.sleep(0.05)
    assert alive() is None and not worker_threads()
