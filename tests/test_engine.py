"""The engine over both I/O backends and both devices: round trips, races, hazards, errors.

Blocks carry their own identity: every block of every tensor is a pure function of (disk block,
version, layer), with the disk block and version written into its first two elements, so a check can
tell a torn block, another block's bytes, or a stale version apart.
"""

from __future__ import annotations

import errno
import os
import random
import time
from collections import defaultdict
from typing import Any

import anyio
import pytest
import torch
from aio import gather, run_then_cancel, settle, task_group
from conftest import (
    BOTH_BACKENDS,
    EngineFactory,
    pumps_on,
    random_caches,
    release_on_submit,
    reported_errors,
    seed_race,
)

from uring_kv import BlockIOError, Engine
from uring_kv._copy import HostCopier
from uring_kv._staging import LeaseState
from uring_kv.testing import fill, id_caches, identify, store_identity


@pytest.fixture(params=BOTH_BACKENDS)
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


async def test_runs_on_the_backend_it_is_parametrised_with(make_engine: EngineFactory, anyio_backend: str) -> None:
    """The trio half of this module must really run under trio (and the engine must pick trio's services)."""
    import sniffio

    assert sniffio.current_async_library() == anyio_backend
    caches = id_caches("cpu", blocks=2)
    async with make_engine(caches, 2, num_slots=1) as engine:
        assert engine._svc.name == anyio_backend
        await store_identity(engine, caches, 2)
        await engine.load_batch([1, 0], [0, 1])
        assert [identify(caches, g) for g in (0, 1)] == [(1, 1, True), (0, 1, True)]


async def test_round_trip_is_byte_exact(make_engine: EngineFactory, device: str) -> None:
    caches = random_caches(device, layers=5, blocks=24, shape=(7, 13))
    reference = {k: v.clone() for k, v in caches.items()}
    async with make_engine(caches, 40, num_slots=3) as engine:
        await engine.store_batch(list(range(24)), [39 - i for i in range(24)])
        for t in caches.values():
            t.zero_()
        await engine.load_batch([39 - i for i in range(24)], list(range(24)))
        for name in caches:
            assert torch.equal(caches[name], reference[name]), name
        permutation = random.Random(1).sample(range(24), 24)
        await engine.load_batch([39 - i for i in permutation], list(range(24)))
        for name in caches:
            assert torch.equal(caches[name], reference[name][permutation]), name
        assert engine.stats()["leases_held"] == 0


async def test_seed_race_never_delivers_another_blocks_bytes(make_engine: EngineFactory, io_mode: str) -> None:
    """Two slots and a slow copier: a slot reissued before its copy finished would hand the copy the
    next read's bytes. On io_uring the batches run in native pumps whose copies are the native
    copier's jobs (``uring``) or block by block (``uring-python``). Mutations tried: releasing the
    lease when the copy is submitted (the test below runs exactly that mutation and sees the
    corruption); a pump starting a slot's next read as soon as its copy job is queued (corrupt
    blocks seen)."""
    caches = id_caches("cpu", blocks=8)
    async with make_engine(caches, 32, num_slots=2, copy_delay=0.003) as engine:
        assert await seed_race(engine, caches, calls=25) == 0
        assert (engine.stats()["pumped_batches"] > 0) == pumps_on(io_mode)


async def test_seed_race_detector_catches_release_on_submit(make_engine: EngineFactory,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The same race with the protection removed (slot freed as soon as its copy is enqueued, the
    drain-less bug of per-call bookkeeping) must corrupt blocks, or the test above proves nothing."""
    release_on_submit(monkeypatch)
    caches = id_caches("cpu", blocks=8)
    async with make_engine(caches, 32, num_slots=2, copy_delay=0.003) as engine:
        assert await seed_race(engine, caches, calls=25) > 0


async def mixed_workload(engine: Engine, caches: dict[str, torch.Tensor], workers: int, rounds: int,
                         disk_blocks: int, batch: int, seed: int) -> tuple[int, int]:
    """``workers`` coroutines mixing loads and stores; every loaded block is checked.

    Each worker owns its own GPU blocks. Versions are given at call time, so a load must see
    exactly the version of the last store *called* before it: it waits for that store, and a
    store called after it waits for its read. Returns (blocks checked, problems)."""
    called: dict[int, int] = defaultdict(int)  # newest version called per disk block
    checked = problems = 0
    device = str(next(iter(caches.values())).device)

    async def worker(index: int) -> None:
        nonlocal checked, problems
        rng = random.Random(seed * 1000 + index)
        own = list(range(index * batch, (index + 1) * batch))
        for _ in range(rounds):
            chosen = rng.sample(range(disk_blocks), batch)
            if rng.random() < 0.4:
                versions = []
                for gpu_block, disk_block in zip(own, chosen, strict=True):
                    called[disk_block] += 1
                    versions.append(called[disk_block])
                    fill(caches, gpu_block, disk_block, called[disk_block])
                await engine.store_batch(own, chosen)
            else:
                floor = {d: called[d] for d in chosen}
                await engine.load_batch(chosen, own)
                for gpu_block, disk_block in zip(own, chosen, strict=True):
                    checked += 1
                    found, version, intact = identify(caches, gpu_block)
                    if not (found == disk_block and intact and version == floor[disk_block]):
                        problems += 1

    # Every disk block holds version 1 first: loading a block never stored is an error (ENODATA).
    for first in range(0, disk_blocks, batch):
        chosen = list(range(first, min(first + batch, disk_blocks)))
        for gpu_block, disk_block in enumerate(chosen):
            called[disk_block] = 1
            fill(caches, gpu_block, disk_block, 1)
        await engine.store_batch(list(range(len(chosen))), chosen)
    del device
    await gather(*((worker, (i,)) for i in range(workers)))
    return checked, problems


@pytest.mark.parametrize("checksum", [False, True], ids=["plain", "checksum"])
async def test_concurrent_loads_and_stores_over_four_slots(make_engine: EngineFactory, device: str,
                                                           checksum: bool) -> None:
    """32 coroutines, 4 slots, thousands of blocks. Mutations tried: dropping the load→store hazard
    (loads then see versions older than the floor) and releasing slots on submit (torn blocks).
    With checksums on, no block may fail verification (no false positives under concurrency)."""
    caches = id_caches(device, blocks=32 * 4)
    async with make_engine(caches, 96, num_slots=4, checksum=checksum) as engine:
        checked, problems = await mixed_workload(engine, caches, workers=32, rounds=25, disk_blocks=96,
                                                 batch=4, seed=3)
        assert checked > 1500
        assert problems == 0
        assert engine.stats()["leases_held"] == 0


async def test_random_cancellation_never_leaks_or_corrupts(make_engine: EngineFactory) -> None:
    """Batches cancelled at random points (waiting for a slot, a hazard, or a completion) with a slow
    copier. Leases only move in completion handlers; an out-of-order move raises in a handler and
    fails the test through the loop's exception handler. Afterwards no lease is held and the
    engine still round-trips correctly. Mutation tried: releasing the lease in the batch
    coroutine's ``finally`` (LeaseError, then corrupt blocks)."""
    caches = id_caches("cpu", blocks=64)
    async with make_engine(caches, 48, num_slots=3, copy_delay=0.001) as engine:
        rng = random.Random(11)
        for round_index in range(12):
            async with task_group() as tasks:
                spawned = []
                for worker in range(8):
                    own = list(range(worker * 8, worker * 8 + 6))
                    chosen = rng.sample(range(48), 6)
                    if rng.random() < 0.5:
                        for gpu_block, disk_block in zip(own, chosen, strict=True):
                            fill(caches, gpu_block, disk_block, round_index + 1)
                        spawned.append(tasks.spawn(engine.store_batch, own, chosen))
                    else:
                        spawned.append(tasks.spawn(engine.load_batch, chosen, own))
                await anyio.sleep(rng.random() * 0.01)
                for task in spawned:
                    if rng.random() < 0.6:
                        task.cancel()
            assert all(task.cancelled or task.result is None for task in spawned)
        assert engine.stats()["active_batches"] == 0, "a cancelled call returned before its batch finished"
        assert engine.stats()["leases_held"] == 0
        assert all(lease.state is LeaseState.FREE for lease in engine.pool.leases)
        # still usable, and stores that did complete are intact
        for disk_block in range(8):
            fill(caches, disk_block, disk_block, 100)
        await engine.store_batch(list(range(8)), list(range(8)))
        await engine.load_batch(list(range(8)), list(range(40, 48)))
        assert [identify(caches, 40 + i) for i in range(8)] == [(i, 100, True) for i in range(8)]


async def test_load_waits_for_in_flight_store_of_same_block(make_engine: EngineFactory) -> None:
    """Mutation tried: not registering stores as hazards (the load then reads version 1)."""
    caches = id_caches("cpu", blocks=8)
    async with make_engine(caches, 8, num_slots=2, copy_delay=0.02) as engine:
        fill(caches, 0, 5, 1)
        await engine.store_batch([0], [5])
        fill(caches, 0, 5, 2)
        async with task_group() as tasks:
            store = tasks.spawn(engine.store_batch, [0], [5])
            await settle()  # the store is called (and registered) first
            await engine.load_batch([5], [3])
            assert identify(caches, 3) == (5, 2, True)
            await store.join()


async def test_store_waits_for_in_flight_load_of_same_block(make_engine: EngineFactory, io_mode: str,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A slow read (injected into the thread backend's preadv) must finish before a later store to
    the same block writes. Mutation tried: stores not waiting for loads' reads (the load then sees
    version 2)."""
    if io_mode == "uring":
        pytest.skip("slow reads are injected through the thread backend's preadv")
    caches = id_caches("cpu", blocks=8)
    async with make_engine(caches, 8, num_slots=2) as engine:
        fill(caches, 0, 5, 1)
        await engine.store_batch([0], [5])
        real_preadv = os.preadv

        def slow_preadv(fd: int, buffers: Any, offset: int) -> int:
            time.sleep(0.05)
            return real_preadv(fd, buffers, offset)

        monkeypatch.setattr(os, "preadv", slow_preadv)
        async with task_group() as tasks:
            load = tasks.spawn(engine.load_batch, [5], [3])
            await anyio.sleep(0.01)  # the read is in flight
            fill(caches, 1, 5, 2)
            await engine.store_batch([1], [5])
            await load.join()
        assert identify(caches, 3) == (5, 1, True)
        await engine.load_batch([5], [4])
        assert identify(caches, 4) == (5, 2, True)


async def test_stores_to_one_block_apply_in_call_order(make_engine: EngineFactory) -> None:
    caches = id_caches("cpu", blocks=16)
    async with make_engine(caches, 4, num_slots=4, copy_delay=0.001) as engine:
        for version in range(1, 11):
            fill(caches, version, 2, version)
        called: list[int] = []

        async def store(version: int) -> None:
            called.append(version)  # a call is ordered when it is made; trio may start tasks in any order
            await engine.store_batch([version], [2])

        await gather(*((store, (version,)) for version in range(1, 11)))
        await engine.load_batch([2], [0])
        assert identify(caches, 0) == (2, called[-1], True)


async def test_io_error_mid_batch_names_the_block_and_the_rest_complete(make_engine: EngineFactory) -> None:
    caches = id_caches("cpu", blocks=8)
    async with make_engine(caches, 8, num_slots=2) as engine:
        await store_identity(engine, caches, 8)
        os.ftruncate(engine.file.fd, 6 * engine.file.stride)  # blocks 6 and 7 now read short
        for t in caches.values():
            t.fill_(-1)
        with pytest.raises(BlockIOError, match=r"disk block\(s\) 7 \(EIO") as info:
            await engine.load_batch([0, 1, 7, 2, 3], [0, 1, 2, 3, 4])
        assert info.value.failures == {7: 5}
        assert [identify(caches, g)[:2] for g in (0, 1, 3, 4)] == [(0, 1), (1, 1), (2, 1), (3, 1)]
        assert engine.stats()["leases_held"] == 0
        await engine.load_batch([4, 5], [5, 6])  # the engine stays usable
        assert identify(caches, 5) == (4, 1, True)


async def test_enqueued_form_returns_a_handle(make_engine: EngineFactory) -> None:
    caches = id_caches("cpu", blocks=8)
    async with make_engine(caches, 8, num_slots=2) as engine:
        fill(caches, 0, 3, 1)
        await engine.store_batch([0], [3])
        handle = await engine.load_batch_async([3, 3], [4, 5])
        assert handle.event is not None
        await handle
        handle.event.synchronize()
        assert identify(caches, 4) == identify(caches, 5) == (3, 1, True)


async def test_close_waits_for_in_flight_batches(make_engine: EngineFactory) -> None:
    caches = id_caches("cpu", blocks=8)
    engine = make_engine(caches, 8, num_slots=1, copy_delay=0.01)
    await engine.open()
    for gpu_block in range(8):
        fill(caches, gpu_block, gpu_block, 1)
    async with task_group() as tasks:
        store = tasks.spawn(engine.store_batch, list(range(8)), list(range(8)))
        await anyio.sleep(0.005)
        await engine.aclose()
        assert engine.metrics()["store"]["blocks"] == 8, "aclose returned before the in-flight batch"
        await store.join()  # it finished, it was not abandoned
    assert engine.closed and not os.path.exists(engine.path)


async def test_cancelled_store_keeps_the_store_chain(make_engine: EngineFactory) -> None:
    """S1 (in flight) → S2 (cancelled before it started) → L, all on one disk block: L must still
    wait for S1. Mutation tried: finishing a never-started store's hazard at once on cancellation
    (L then reads the block before S1 has written it)."""
    caches = id_caches("cpu", blocks=8)
    async with make_engine(caches, 8, num_slots=2, copy_delay=0.05) as engine:
        fill(caches, 0, 4, 1)
        await engine.store_batch([0], [4])
        fill(caches, 1, 4, 2)
        async with task_group() as tasks:
            s1 = tasks.spawn(engine.store_batch, [1], [4])
            await anyio.sleep(0.005)  # S1 holds a slot, its copy is slow
            fill(caches, 2, 4, 3)
            s2 = tasks.spawn(engine.store_batch, [2], [4])
            await anyio.sleep(0.005)  # S2 waits for S1
            load = tasks.spawn(engine.load_batch, [4], [5])
            await settle()
            s2.cancel()
            await s2.join()
            assert s2.cancelled
            await load.join()
            await s1.join()
        assert identify(caches, 5) == (4, 2, True)


async def test_cancelled_call_returns_only_after_its_started_blocks(make_engine: EngineFactory) -> None:
    """After a cancelled load_batch returns, the engine must not write its GPU blocks any more."""
    caches = id_caches("cpu", blocks=8)
    async with make_engine(caches, 8, num_slots=2, copy_delay=0.02) as engine:
        await store_identity(engine, caches, 4)
        async with task_group() as tasks:
            # cancelled while two blocks are in flight (two slots)
            load = await run_then_cancel(tasks, 0.005, engine.load_batch, list(range(4)), list(range(4, 8)))
            assert load.cancelled
            for gpu_block in range(4, 8):
                fill(caches, gpu_block, 7, 9)  # the caller reuses its blocks at once
        await anyio.sleep(0.1)  # time for any late copy to land
        assert [identify(caches, g) for g in range(4, 8)] == [(7, 9, True)] * 4
        assert engine.stats()["active_batches"] == 0


async def test_cancelled_call_waits_for_its_enqueued_copies(make_engine: EngineFactory) -> None:
    """Cancelled once every copy is enqueued (4 blocks, 4 slots, slow copier): the call still returns
    only after the copies have landed, and the batch is accounted for. Mutation tried: awaiting the
    batch's own future directly (the cancellation then cancelled that future: the call returned at
    once, a late copy overwrote the caller's reused blocks, the batch never left the active set)."""
    caches = id_caches("cpu", blocks=8)
    async with make_engine(caches, 8, num_slots=4, copy_delay=0.05) as engine:
        await store_identity(engine, caches, 4)
        async with task_group() as tasks:
            load = tasks.spawn(engine.load_batch, [0, 1, 2, 3], [4, 5, 6, 7])
            await anyio.sleep(0.02)  # reads done, copies enqueued behind the slow copier
            assert engine.stats()["copies_pending"] > 0
            load.cancel()
            await load.join()
            assert load.cancelled
            assert engine.stats()["active_batches"] == 0
            for gpu_block in range(4, 8):
                fill(caches, gpu_block, 7, 9)  # the caller reuses its blocks at once
        await anyio.sleep(0.1)
        assert [identify(caches, g) for g in range(4, 8)] == [(7, 9, True)] * 4
        assert engine.metrics()["load"]["batches"] == 1


async def test_cancelled_aclose_still_closes(make_engine: EngineFactory) -> None:
    """aclose cancelled while a slow store is in flight: it finishes closing (file removed, nothing
    held) before the cancellation is raised. Mutation tried: aclose without run_to_completion (the
    engine stayed 'closing' with its file and threads)."""
    caches = id_caches("cpu", blocks=8)
    engine = make_engine(caches, 8, num_slots=2, copy_delay=0.02)
    await engine.open()
    async with task_group() as tasks:
        store = tasks.spawn(engine.store_batch, list(range(8)), list(range(8)))
        await anyio.sleep(0.005)
        closing = await run_then_cancel(tasks, 0.005, engine.aclose)
        assert closing.cancelled
        assert engine.closed and not os.path.exists(engine.path)
        await store.join()


async def test_cancelled_open_leaves_no_file(make_engine: EngineFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """open() cancelled while the file is being created (in a worker thread): the file that the
    thread creates anyway is closed and removed. Mutation tried: no clean-up of the thread's result."""
    import uring_kv._engine as engine_module
    from uring_kv._file import BlockFile

    real = BlockFile

    def slow_block_file(*args: Any, **kwargs: Any) -> Any:
        time.sleep(0.05)
        return real(*args, **kwargs)

    monkeypatch.setattr(engine_module, "BlockFile", slow_block_file)
    engine = make_engine(id_caches("cpu", blocks=2), 2, num_slots=1)
    async with task_group() as tasks:
        opening = await run_then_cancel(tasks, 0.01, engine.open)
    assert opening.cancelled
    assert engine.closed and not os.path.exists(engine.path)


_COPY_PATHS = {"thread-copy": ("0", "0"), "native-copy": ("0", "1"), "native-unqueued": ("0", "1"),
               "inline-copy": ("262144", "1"), "pumped-copy": ("0", "1")}


@pytest.mark.parametrize("path", list(_COPY_PATHS))
async def test_a_failed_copy_fails_its_blocks_and_poisons_stored_ones(make_engine: EngineFactory,
                                                                      monkeypatch: pytest.MonkeyPatch,
                                                                      path: str, io_mode: str) -> None:
    """A copy the copier could not do (a CUDA error in GPU mode) must fail its blocks with EIO, not
    count them as moved; a store that failed that way leaves its disk block unreadable rather than
    stale, whether the CPU-mode copy ran on the Python thread, the native copier's thread (its
    fault injection, or a job it could not even queue), inline, or as a native pump's job on the
    native copier (``pumped-copy``; on io_uring). Mutations tried: ignoring the copier's error
    (the load 'succeeded' with the old bytes); letting a queueing error out of the copy call (the
    store never finished); a pump moving a failed job's slots on as copied (the store
    'succeeded'). Pumps are off on the other paths: the memcpys of their inline copies cannot
    fail."""
    from uring_kv._native import FAIL_ENQUEUE, BlockCopier, CopyJobs

    inline_bytes, native = _COPY_PATHS[path]
    monkeypatch.setenv("URING_KV_HOST_INLINE_BYTES", inline_bytes)
    monkeypatch.setenv("URING_KV_DEBUG_NATIVE_COPIER", native)
    if path != "pumped-copy":  # (which keeps the io_mode's setting: pumps off for uring-python)
        monkeypatch.setenv("URING_KV_DEBUG_PUMP", "0")
    caches = id_caches("cpu", blocks=8)
    async with make_engine(caches, 8, num_slots=2) as engine:
        await store_identity(engine, caches, 4)
        assert engine.copier.native == (path != "thread-copy")
        if path == "native-unqueued":
            real_put = CopyJobs.put
            refusing = {"left": 1}

            def refusing_put(self: CopyJobs, token: int, to_slot: bool, *args: Any) -> None:
                if to_slot and refusing["left"]:
                    refusing["left"] -= 1
                    raise OSError(errno.ENOMEM, "queueing a copy: no memory")
                real_put(self, token, to_slot, *args)

            monkeypatch.setattr(CopyJobs, "put", refusing_put)
        elif path in ("native-copy", "pumped-copy"):
            link = engine.copier.link
            assert link is not None
            link.jobs.fail_next(999, FAIL_ENQUEUE)  # CUDA_ERROR_UNKNOWN
        else:
            real_host = BlockCopier.host
            failing = {"left": 1}

            def flaky_host(self: BlockCopier, to_slot: bool, slot_addrs: Any, gpu_blocks: Any) -> None:
                if to_slot and slot_addrs and failing["left"]:
                    failing["left"] -= 1
                    raise RuntimeError("injected copy failure")
                real_host(self, to_slot, slot_addrs, gpu_blocks)

            monkeypatch.setattr(BlockCopier, "host", flaky_host)
        fill(caches, 5, 2, 2)
        with reported_errors() as errors:
            with pytest.raises(BlockIOError) as info:
                await engine.store_batch([5], [2])
            for _ in range(500):  # with the ring thread the loop may hear of the failed job a wake-up later
                if errors:
                    break
                await anyio.sleep(0.001)
        assert info.value.failures == {2: 5}
        assert len(errors) == 1 and "copy failed" in str(errors[0])
        pumped = engine.stats()["pumped_batches"]
        assert pumped == (2 if path == "pumped-copy" and pumps_on(io_mode) else 0)  # this store, store_identity's
        with pytest.raises(BlockIOError, match="disk block"):
            await engine.load_batch([2], [6])
        await engine.load_batch([1], [7])  # the others are intact, the engine goes on
        assert identify(caches, 7) == (1, 1, True)
        assert engine.stats()["leases_held"] == 0


@pytest.mark.parametrize("native", ["0", "1"], ids=["python-bridge", "native-bridge"])
async def test_a_copy_event_that_cannot_be_waited_on_fails_its_blocks(
        make_engine: EngineFactory, monkeypatch: pytest.MonkeyPatch, native: str) -> None:
    """The bridge's wait on a copy event raising (a broken CUDA context in GPU mode) must fail the
    blocks with EIO, not kill the bridge thread and leave every later call waiting forever; the
    native copier reports the same through its fault injection. Mutation tried: letting the
    exception out of the bridge's wait (the load then hung until the test timed out)."""
    from uring_kv._copy import HostEvent
    from uring_kv._native import FAIL_WAIT

    monkeypatch.setenv("URING_KV_HOST_INLINE_BYTES", "0")  # every copy through the thread and bridge
    monkeypatch.setenv("URING_KV_DEBUG_NATIVE_COPIER", native)
    caches = id_caches("cpu", blocks=8)
    async with make_engine(caches, 8, num_slots=2) as engine:
        assert engine.copier.description == ("host memcpy native thread" if native == "1" else "host memcpy thread")
        await store_identity(engine, caches, 4)
        if native == "1":
            link = engine.copier._link
            assert link is not None
            link.jobs.fail_next(999, FAIL_WAIT)
        else:
            real_sync = HostEvent.synchronize
            broken = {"left": 1}

            def failing_sync(self: HostEvent) -> None:
                real_sync(self)  # the copy itself is done; only the wait reports an error
                if broken["left"]:
                    broken["left"] -= 1
                    raise RuntimeError("injected event failure")

            monkeypatch.setattr(HostEvent, "synchronize", failing_sync)
        with reported_errors() as errors, pytest.raises(BlockIOError) as info:
            await engine.load_batch([3], [5])
        assert info.value.failures == {3: 5}
        assert len(errors) == 1 and "copy failed" in str(errors[0])
        await engine.load_batch([2], [6])  # the bridge is still there
        assert identify(caches, 6) == (2, 1, True)
        assert engine.stats()["leases_held"] == 0


@pytest.mark.parametrize("inline_bytes", ["0", "262144"], ids=["thread-copy", "inline-copy"])
async def test_small_cpu_copies_run_inline_and_large_ones_on_the_thread(
        make_engine: EngineFactory, monkeypatch: pytest.MonkeyPatch, inline_bytes: str) -> None:
    """CPU mode copies a call of at most URING_KV_HOST_INLINE_BYTES on the loop, the rest on the
    copier thread (through the bridge); both give the same bytes, and a copy_delay always uses the
    thread (the race tests depend on it)."""
    monkeypatch.setenv("URING_KV_HOST_INLINE_BYTES", inline_bytes)
    monkeypatch.setenv("URING_KV_RING_THREAD", "off")  # (with it, pumps' jobs never reach the loop's bridge)
    caches = id_caches("cpu", blocks=64)
    async with make_engine(caches, 64, num_slots=4) as engine:
        per_block = engine.copier._blocks.bytes_per_block
        await store_identity(engine, caches, 32)
        engine.delivery_times(clear=True)
        disk = list(range(32))
        random.Random(3).shuffle(disk)
        await engine.load_batch(disk, list(range(32, 64)))
        for gpu, d in enumerate(disk, start=32):
            assert identify(caches, gpu) == (d, 1, True)
        through_bridge = len(engine.delivery_times())
        if inline_bytes == "0":
            assert through_bridge > 0
        else:
            assert per_block * 4 <= int(inline_bytes)  # every call (≤ 4 slots) fits inline
            assert through_bridge == 0, "small copies went through the thread"
    async with make_engine(id_caches("cpu", blocks=8), 8, num_slots=2, copy_delay=0.001) as slow:
        assert isinstance(slow.copier, HostCopier) and slow.copier.inline_blocks == 0


@pytest.mark.parametrize("value", ["-1", "lots"])
async def test_a_bad_inline_copy_limit_is_refused(make_engine: EngineFactory, monkeypatch: pytest.MonkeyPatch,
                                                  value: str) -> None:
    """Read when the engine is made (into its Tuning): refused there, before anything is set up."""
    monkeypatch.setenv("URING_KV_HOST_INLINE_BYTES", value)
    with pytest.raises(ValueError, match=f"URING_KV_HOST_INLINE_BYTES must be a byte count >= 0, got '{value}'"):
        make_engine(id_caches("cpu", blocks=8), 8)
