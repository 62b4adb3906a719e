"""The block store from threads: submits that never wait, lookups that skip the loop, many threads at
once, errors in the caller's future, and a close that finishes what was submitted and leaves no
thread, fd or file behind."""

from __future__ import annotations

import concurrent.futures
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from test_store import fill_keys, key

from uring_kv import BlockStore, EngineClosedError, KeyIOError, KeyMissingError, SyncBlockStore
from uring_kv.errors import NO_ROOM
from uring_kv.sync import LoopThread
from uring_kv.testing import id_caches, identify


def _threads_and_fds() -> set[str]:
    fds = {f"fd {fd} -> {os.readlink(f'/proc/self/fd/{fd}')}" for fd in os.listdir("/proc/self/fd")
           if os.path.exists(f"/proc/self/fd/{fd}")}
    return fds | {f"thread {tid}" for tid in os.listdir("/proc/self/task")}


@pytest.fixture
def leaves_nothing(tmp_path: Path) -> Iterator[None]:
    """After the test: no thread or fd the test made is left, and nothing is left in tmp_path."""
    before = _threads_and_fds()
    yield
    for _ in range(100):  # a joined thread leaves /proc/self/task a moment after
        if not _threads_and_fds() - before:
            break
        time.sleep(0.01)
    assert not _threads_and_fds() - before, "threads or fds outlived the store"
    assert os.listdir(tmp_path) == []


def test_round_trip_from_a_plain_thread(tmp_path: Path, leaves_nothing: None) -> None:
    caches = id_caches("cpu", blocks=8)
    with SyncBlockStore(caches, tmp_path / "kv.bin", 4, num_slots=2) as store:
        fill_keys(caches, [0, 1, 2], [0, 1, 2])
        store.put([key(0), key(1), key(2)], [0, 1, 2])
        assert store.lookup([key(0), key(1), key(2), key(3)]) == 3 and store.contains(key(1))
        store.get([key(2), key(0)], [4, 5])
        assert identify(caches, 4) == (2, 1, True) and identify(caches, 5) == (0, 1, True)
        assert store.stats()["keys"] == 3
        assert store.thread.is_alive() and store.thread is not threading.current_thread()
    assert store.closed and store.store.closed and not store.thread.is_alive()


def test_errors_reach_the_callers_future(tmp_path: Path, leaves_nothing: None) -> None:
    caches = id_caches("cpu", blocks=8)
    with SyncBlockStore(caches, tmp_path / "kv.bin", 1, num_slots=1) as store:
        future = store.submit_get([key(9)], [0])
        assert isinstance(future.exception(timeout=10), KeyMissingError)
        with pytest.raises(KeyMissingError, match=key(9).hex()):
            store.get([key(9)], [0])
        with pytest.raises(ValueError, match="a key appears twice"):
            store.put([key(0), key(0)], [0, 1])
        fill_keys(caches, [0, 1], [0, 1])
        with pytest.raises(KeyIOError) as info:  # capacity 1: the second key finds no room
            store.put([key(0), key(1)], [0, 1])
        assert info.value.failures == {key(1): NO_ROOM}


def test_submits_and_lookups_never_wait_for_io_or_for_the_loop(tmp_path: Path, leaves_nothing: None) -> None:
    """A slow put is in flight and the loop's thread is then held up on purpose: a submit still
    returns at once (its future pending), and lookups answer from the caller's thread."""
    caches = id_caches("cpu", blocks=16)
    with SyncBlockStore(caches, tmp_path / "kv.bin", 8, num_slots=1, copy_delay=0.05) as store:
        fill_keys(caches, list(range(8)), list(range(8)))
        store.put([key(0)], [0])
        start = time.monotonic()
        slow = store.submit_put([key(i) for i in range(1, 8)], range(1, 8))  # ~0.35 s of copies
        assert time.monotonic() - start < 0.05 and not slow.done()
        held = threading.Event()

        async def hold_the_loop() -> None:
            held.set()
            time.sleep(0.3)  # blocks the loop's thread on purpose

        blocker = store._loop.submit(hold_the_loop())
        held.wait()
        start = time.monotonic()
        queued = store.submit_get([key(0)], [8])
        assert store.contains(key(0)) and store.lookup([key(0), key(1)]) == 1 and store.stats()["writing"] == 7
        assert time.monotonic() - start < 0.05, "a submit or lookup waited for the loop"
        assert not queued.done()
        blocker.result(timeout=10)
        queued.result(timeout=10)
        slow.result(timeout=10)
        assert identify(caches, 8) == (0, 1, True) and store.lookup([key(i) for i in range(8)]) == 8


def test_many_threads_at_once(tmp_path: Path, leaves_nothing: None) -> None:
    """Eight threads put and get their own keys through one store, blocking and submitted, while
    others look up: every get delivers its own keys' bytes, intact."""
    caches = id_caches("cpu", blocks=64)
    errors: list[BaseException] = []
    with SyncBlockStore(caches, tmp_path / "kv.bin", 64, num_slots=4, copy_delay=0.0005) as store:
        def worker(index: int) -> None:
            try:
                rows = list(range(index * 8, index * 8 + 8))
                for round_ in range(10):
                    ids = [index * 1000 + round_ * 4 + i for i in range(4)]
                    fill_keys(caches, ids, rows[:4])
                    if round_ % 2:
                        store.submit_put([key(i) for i in ids], rows[:4]).result(timeout=30)
                    else:
                        store.put([key(i) for i in ids], rows[:4])
                    assert store.lookup([key(i) for i in ids]) == 4
                    store.get([key(i) for i in ids], rows[4:])
                    assert [identify(caches, r) for r in rows[4:]] == [(i, 1, True) for i in ids]
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(index,)) for index in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert not errors, errors
        stats = store.stats()
        assert stats["keys"] + stats["free_blocks"] == 64 and stats["keys"] <= 64 and stats["evictions"] > 0


def test_close_finishes_the_calls_in_flight_and_refuses_later_ones(tmp_path: Path, leaves_nothing: None) -> None:
    """Puts and gets submitted from several threads are still running when close() is called:
    when it returns every future is done (each put landed, each get delivered its bytes), the
    thread is gone, and later calls are refused."""
    caches = id_caches("cpu", blocks=32)
    store = SyncBlockStore(caches, tmp_path / "kv.bin", 16, num_slots=2, copy_delay=0.02)
    fill_keys(caches, list(range(8)), list(range(8)))
    store.put([key(i) for i in range(4)], range(4))
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futures: list[concurrent.futures.Future[Any]] = [
            *pool.map(lambda i: store.submit_put([key(i)], [i]), range(4, 8)),
            *pool.map(lambda i: store.submit_get([key(i)], [16 + i]), range(4))]
    assert not all(f.done() for f in futures)
    store.close()
    assert all(f.done() for f in futures)
    for future in futures:
        assert future.exception() is None
    assert [identify(caches, 16 + i) for i in range(4)] == [(i, 1, True) for i in range(4)]
    assert store.closed and not store.thread.is_alive()
    assert isinstance(store.store, BlockStore) and store.store.closed and store.store.engine.file.closed
    with pytest.raises(EngineClosedError):
        store.submit_put([key(9)], [9])
    with pytest.raises(EngineClosedError):
        store.get([key(0)], [0])
    assert not store.contains(key(0))
    store.close()  # again: nothing to do


def test_submits_racing_close_are_refused_or_finished(tmp_path: Path, leaves_nothing: None) -> None:
    """Four threads keep submitting while another closes the store: each submit either raises
    EngineClosedError at once or returns a future that is done by the time close() returns (a
    put of a key another put is writing included: it waits for that write, which still ends)."""
    caches = id_caches("cpu", blocks=32)
    store = SyncBlockStore(caches, tmp_path / "kv.bin", 8, num_slots=2, copy_delay=0.005)
    fill_keys(caches, list(range(4)), list(range(4)))
    futures: list[concurrent.futures.Future[int]] = []
    refused = threading.Event()

    def submitter(index: int) -> None:
        while True:
            try:
                futures.append(store.submit_put([key(index % 2)], [index]))
            except EngineClosedError:
                refused.set()
                return
            time.sleep(0.002)

    threads = [threading.Thread(target=submitter, args=(index,)) for index in range(4)]
    for thread in threads:
        thread.start()
    time.sleep(0.05)
    store.close()
    pending = [future for future in futures if not future.done()]  # (not one appended after the close)
    for thread in threads:
        thread.join(10)
    assert not pending and all(future.done() for future in futures), "a call submitted before close() is pending"
    assert refused.is_set() and len(futures) > 4
    for future in futures:
        assert future.exception() is None or isinstance(future.exception(), EngineClosedError)


def test_a_blocking_call_on_the_stores_own_thread_is_refused(tmp_path: Path, leaves_nothing: None) -> None:
    caches = id_caches("cpu", blocks=4)
    with SyncBlockStore(caches, tmp_path / "kv.bin", 2, num_slots=1) as store:
        seen: list[BaseException] = []

        def from_a_callback(_: concurrent.futures.Future[int]) -> None:  # runs on the store's thread
            calls: list[Callable[[], None]] = [lambda: store.get([key(0)], [0]), store.close]
            for call in calls:
                try:
                    call()
                except RuntimeError as exc:
                    seen.append(exc)

        fill_keys(caches, [0], [0])
        future = store.submit_put([key(0)], [0])
        future.add_done_callback(from_a_callback)
        future.result(timeout=10)
        for _ in range(100):
            if len(seen) == 2:
                break
            time.sleep(0.01)
        assert len(seen) == 2 and all("would wait for itself" in str(exc) for exc in seen)


def test_a_failed_open_leaves_no_thread(tmp_path: Path, leaves_nothing: None) -> None:
    with pytest.raises(FileNotFoundError):
        SyncBlockStore(id_caches("cpu", blocks=4), tmp_path / "missing" / "kv.bin", 2, num_slots=1)
    assert not [t for t in threading.enumerate() if t.name == "uring-kv-store"]


def test_a_loop_thread_runs_coroutines_and_closes_clean(leaves_nothing: None) -> None:
    loop = LoopThread()

    async def where() -> str:
        return threading.current_thread().name

    assert loop.run(where()) == "uring-kv-loop"
    assert loop.submit(where()).result(timeout=10) == "uring-kv-loop"
    loop.close()
    loop.close()
    assert not loop.thread.is_alive()


def test_a_store_dropped_without_close_closes_itself(tmp_path: Path, leaves_nothing: None) -> None:
    """A SyncBlockStore dropped while a put is in flight, never closed: the put finishes, and once
    the object is collected no thread or fd of it is left and the caches' memory is released."""
    import gc
    import sys

    caches = id_caches("cpu", blocks=8)
    tensor = caches["layer0"]
    references = sys.getrefcount(tensor)
    store = SyncBlockStore(caches, tmp_path / "kv.bin", capacity_blocks=16, num_slots=4, copy_delay=0.05)
    fill_keys(caches, [0, 1, 2], [0, 1, 2])
    pending = store.submit_put([key(0), key(1), key(2)], [0, 1, 2])
    del store
    gc.collect()
    assert pending.done() and pending.exception() is None  # finished before the close
    gc.collect()
    assert sys.getrefcount(tensor) == references, "the dropped store still holds the caches"


def test_cancelling_a_future_does_not_give_the_rows_back_early(tmp_path: Path, leaves_nothing: None) -> None:
    """A get's future refuses cancel(): the call owns its rows until it ends. (A future that ended
    at cancel(), as asyncio.run_coroutine_threadsafe's does, let the caller refill rows that the
    loop's get then overwrote.)"""
    caches = id_caches("cpu", blocks=16)
    with SyncBlockStore(caches, tmp_path / "kv.bin", 8, num_slots=1, copy_delay=0.05) as store:
        fill_keys(caches, list(range(4)), list(range(4)))
        store.put([key(i) for i in range(4)], range(4))
        future = store.submit_get([key(i) for i in range(4)], [8, 9, 10, 11])
        time.sleep(0.01)
        assert future.cancel() is False and not future.cancelled() and not future.done()
        assert future.result(timeout=10) is None
        assert [identify(caches, row) for row in (8, 9, 10, 11)] == [(i, 1, True) for i in range(4)]


def test_a_store_whose_last_reference_goes_on_its_own_thread_still_closes(tmp_path: Path,
                                                                          leaves_nothing: None) -> None:
    """The last reference to a SyncBlockStore held by a callback on its own thread (a framework's
    completion callback holding its tier): the finalizer cannot wait there, so the loop closes the
    store and then stops: no thread or fd is left (leaves_nothing)."""
    import gc
    import weakref

    caches = id_caches("cpu", blocks=8)
    store = SyncBlockStore(caches, tmp_path / "kv.bin", 8, num_slots=2, copy_delay=0.05)
    thread, alive = store.thread, weakref.ref(store)
    fill_keys(caches, [0], [0])
    outcomes: list[BaseException | None] = []

    def holding(done: concurrent.futures.Future[int], held: SyncBlockStore = store) -> None:
        outcomes.append(done.exception())

    pending = store.submit_put([key(0)], [0])
    pending.add_done_callback(holding)
    del store, pending, holding  # the callback, run on the store's thread, holds the last reference
    for _ in range(200):
        gc.collect()
        if alive() is None and not thread.is_alive():
            break
        time.sleep(0.01)
    assert alive() is None and not thread.is_alive()
    assert outcomes == [None]
