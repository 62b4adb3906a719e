"""Native pumps (io_uring): a batch's blocks are read, copied (or their copies queued) and refilled in C.

What C takes over from the per-block handlers must keep their rules: hazards between batches on
the same disk block, a cancelled call starting nothing new and returning only after what it started,
slots handed to a waiting batch, and a plain fallback when no pump is free. Slow I/O comes from the
FUSE filesystem of ``faultfs`` (real requests through io_uring, answered late), which widens the
windows these rules close.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import anyio
import pytest
import torch
from aio import gather, run_then_cancel, settle, task_group
from conftest import BOTH_BACKENDS, EngineFactory, use_python_pump
from faultfs import FaultState
from tmpfs import direct_read_into, ram_directory

from uring_kv import Engine, _native
from uring_kv._staging import LeaseState
from uring_kv.testing import fill, id_caches, identify, store_identity


@pytest.fixture(params=BOTH_BACKENDS)
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def io_mode() -> str:
    return "uring"  # pumps run on io_uring only


@pytest.fixture(autouse=True, params=["memcpy", "copier"])
def copies(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each test twice: the pumps' copies as memcpys in the reap, and as copy jobs for the native
    copier's thread (every copy too large to run inline), as in GPU mode."""
    if request.param == "copier":
        monkeypatch.setenv("URING_KV_HOST_INLINE_BYTES", "0")
    return str(request.param)


@pytest.mark.parametrize("direct", [None, False], ids=["direct", "buffered"])
async def test_cpu_batches_run_in_pumps_and_move_exact_bytes(make_engine: EngineFactory, direct: bool | None) -> None:
    """On a buffered file the pumps' reads and writes of small blocks go without IOSQE_ASYNC
    (page-cache hits are copied inside the submission); on O_DIRECT as always."""
    caches = id_caches("cpu", blocks=64)
    async with make_engine(caches, 64, num_slots=4, direct=direct) as engine:
        await store_identity(engine, caches, 64)
        for tensor in caches.values():
            tensor.fill_(-1)
        order = random.Random(5).sample(range(64), 64)
        await engine.load_batch(order, list(range(64)))
        assert [identify(caches, g) for g in range(64)] == [(d, 1, True) for d in order]
        stats, metrics = engine.stats(), engine.metrics()
        assert stats["pumped_batches"] == 2
        # CPU mode submits direct I/O inline (GPU mode hands it to io-wq): a buffered file's SQEs
        # carry IOSQE_ASYNC (the pumps' small blocks excepted), direct ones do not
        assert ("IOSQE_ASYNC" in stats["io"]) == (not engine.file.direct)
        assert metrics["load"]["blocks"] == metrics["store"]["blocks"] == 64
        assert engine.io._ring.pumps == {}, "a finished pump is still attached to the ring"  # type: ignore[attr-defined]
        assert all(lease.state is LeaseState.FREE for lease in engine.pool.leases)


async def test_slot_phases_count_every_pumped_block_once(make_engine: EngineFactory, copies: str) -> None:
    """Engine.slot_phases: each pumped block's I/O is timed once; with copy jobs each block's copy
    too, in the copier's per-direction books; a clear starts them again."""
    caches = id_caches("cpu", blocks=32)
    async with make_engine(caches, 64, num_slots=8) as engine:
        await store_identity(engine, caches, 32)
        stored = engine.slot_phases(clear=True)
        await engine.load_batch(list(range(32)), list(range(32)))
        loaded = engine.slot_phases()
        assert stored["pump_io"]["count"] == loaded["pump_io"]["count"] == 32
        assert loaded["pump_io"]["mean_us"] > 0
        jobs = copies == "copier"
        assert loaded["pump_copy"]["count"] == (32 if jobs else 0)
        # (the native copier runs either way; the memcpy pumps give it nothing)
        assert stored["copy_jobs"]["store"]["blocks"] == loaded["copy_jobs"]["load"]["blocks"] == (32 if jobs else 0)
        assert loaded["copy_jobs"]["store"] == {"jobs": 0, "blocks": 0, "queued_us": None, "enqueue_us": None,
                                                "run_us": None, "handover_us": None}
        if jobs:
            load = loaded["copy_jobs"]["load"]
            assert 4 <= load["jobs"] <= 32 and load["enqueue_us"] > 0 and load["handover_us"] > 0
        cleared = engine.slot_phases(clear=True)
        assert cleared == loaded
        assert engine.slot_phases()["pump_io"] == {"count": 0, "mean_us": None}


def record_hand_overs(engine: Engine, monkeypatch: pytest.MonkeyPatch, into: list[str]) -> None:
    """Append "submit" to ``into`` each time slots are handed to a pump (its reads then start)."""

    def tracer(event: str, kind: object, count: int) -> None:
        if event == "grow":
            into.append("submit")

    engine.trace(tracer)


@pytest.mark.parametrize("hop", [True, pytest.param(False, marks=pytest.mark.xfail(strict=True,
                         reason="the mutation: without the hop the client waits for the submissions"))],
                         ids=["hop", "no-hop"])
async def test_io_ready_during_a_batch_set_up_runs_before_its_first_submissions(
        make_engine: EngineFactory, monkeypatch: pytest.MonkeyPatch, hop: bool) -> None:
    """A pumped batch's start yields the loop between its set-up (validation, the pump, hazards)
    and handing slots to its pump: a task woken by a socket that became ready meanwhile runs first,
    so it waits for one part of the start rather than the whole (a loop-lag spike the bench's probe
    saw). ``no-hop`` turns the yield off and must fail."""
    monkeypatch.setenv("URING_KV_DEBUG_START_HOP", "1" if hop else "0")
    caches = id_caches("cpu", blocks=64)
    async with make_engine(caches, 64, num_slots=4) as engine:
        await store_identity(engine, caches, 64)
        order: list[str] = []
        record_hand_overs(engine, monkeypatch, order)
        read_end, write_end = os.pipe()

        async def client() -> None:
            await anyio.wait_readable(read_end)
            order.append("client")

        try:
            async with task_group() as tasks:
                woken = tasks.spawn(client)
                await settle()  # the client waits on its pipe
                os.write(write_end, b"x")  # ready from now on: the loop's next poll finds it
                await engine.load_batch(list(range(64)), list(range(64)))
                await woken.join()
        finally:
            os.close(read_end)
            os.close(write_end)
        assert order[:2] == ["client", "submit"]
        assert [identify(caches, g) for g in range(64)] == [(d, 1, True) for d in range(64)]


async def test_a_batch_cancelled_in_its_start_hop_starts_nothing(make_engine: EngineFactory,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Cancelled after its set-up, while it yields the loop before its first submissions: the call
    raises its cancellation, no slot stays held, nothing was written, and its hazard entries let a
    later load of the same blocks go (it reads what was there before). Mutation tried: the yield
    before the driver's ``try`` (the pump is never stopped, the call never returns)."""
    caches = id_caches("cpu", blocks=16)
    async with make_engine(caches, 16, num_slots=4) as engine:
        await store_identity(engine, caches, 8)
        submits: list[str] = []
        record_hand_overs(engine, monkeypatch, submits)
        for gpu_block in range(8):
            fill(caches, gpu_block, gpu_block, 2)
        before = engine.stats()["pumped_batches"]
        async with task_group() as tasks:
            store = tasks.spawn(engine.store_batch, list(range(8)), list(range(8)))
            while engine.stats()["pumped_batches"] == before:
                await anyio.sleep(0)
            assert submits == [], "the batch was not cancelled inside its start's yield"
            store.cancel()
            await store.join()
        assert store.cancelled and submits == []
        assert engine.pool.held == 0 and engine.stats()["active_batches"] == 0
        with anyio.fail_after(5):
            await engine.load_batch(list(range(8)), list(range(8, 16)))
        assert [identify(caches, 8 + d) for d in range(8)] == [(d, 1, True) for d in range(8)]


async def store_then_load_shuffled(engine: Engine, cache: torch.Tensor, seed: int) -> None:
    """Random bytes in cache blocks 0..n-1 stored to disk blocks 0..n-1, the cache cleared, the
    blocks loaded back in a shuffled order: each must be exact."""
    n = cache.shape[0]
    source = torch.randint(-2**31, 2**31 - 1, tuple(cache.shape), dtype=torch.int32)
    cache.copy_(source)
    await engine.store_batch(list(range(n)), list(range(n)))
    cache.zero_()
    order = random.Random(seed).sample(range(n), n)
    await engine.load_batch(order, list(range(n)))
    assert torch.equal(cache, source[order])


@pytest.mark.parametrize("slots", [4, 32])
@pytest.mark.parametrize("direct", [None, False], ids=["direct", "buffered"])
async def test_pumped_writes_to_a_buffered_file_go_without_iosqe_async(make_engine: EngineFactory, direct: bool | None,
                                                                       slots: int,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Blocks too large to submit without the flag: on a buffered file the pumps' reads go to
    io-wq (IOSQE_ASYNC: a page-cache hit would be copied on the loop thread), their writes do not
    (on the H200, buffered 2 MiB writes on io-wq took ~9x the CPU and held the loop up to 5 ms, at
    the same throughput). Direct I/O: submitted inline both ways by CPU mode's inline-copy
    set-ups (4 slots of 64 KiB), on io-wq both ways once the slots hold over 1 MiB (32: copier
    pumps, whose direct submissions waited in io_uring_enter). Bytes exact every way."""
    seen: set[tuple[bool, int]] = set()  # (write, IOSQE_ASYNC set) of every pump
    made = _native.NativePump.__init__

    def spy(pump: _native.NativePump, ring: _native.NativeRing, write: bool, fd: int, sqe_flags: int,
            *args: object, **kwargs: object) -> None:
        seen.add((write, sqe_flags & _native.SqeFlag.ASYNC))
        made(pump, ring, write, fd, sqe_flags, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(_native.NativePump, "__init__", spy)
    caches = {"k": torch.zeros(16, 16 << 10, dtype=torch.int32)}  # 64 KiB blocks: over the inline limit
    async with make_engine(caches, 16, num_slots=slots, direct=direct) as engine:
        await store_then_load_shuffled(engine, caches["k"], seed=3)
        buffered = not engine.file.direct
        on_wq = _native.SqeFlag.ASYNC if slots == 32 and not buffered else 0
        assert seen == {(False, _native.SqeFlag.ASYNC if buffered else on_wq), (True, on_wq)}
        assert ("IOSQE_ASYNC on reads" in engine.stats()["io"]) == buffered


async def test_a_reap_pass_ends_when_its_budget_is_spent(make_engine: EngineFactory, copies: str,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The reap checks its budget after each pump completion, not only between passes: a pass
    over a full CQ of memcpy pumps would otherwise copy every slot's block before the loop got a
    turn. With a 1 µs budget each reap moves about one 32 KiB block of a hot batch (copied from
    the slot; refills complete inside their submission), so 256 blocks take over 128 reaps; bytes
    exact. Mutation tried: the check only between passes (33 reaps: a pass handled all 8 slots)."""
    if copies != "memcpy":
        pytest.skip("copier pumps copy on the copier's thread; their refills wait for its jobs")
    monkeypatch.setenv("URING_KV_RING_THREAD", "off")  # the loop's own reap is what this measures
    monkeypatch.setenv("URING_KV_REAP_BUDGET_US", "1")
    monkeypatch.setenv("URING_KV_DEBUG_PUMP_SCATTER", "0")  # each block read into its slot, then copied
    caches = {"k": torch.zeros(256, 8 << 10, dtype=torch.int32)}  # 32 KiB blocks: the largest pumped inline
    source = torch.randint(-2**31, 2**31 - 1, (256, 8 << 10), dtype=torch.int32)
    async with make_engine(caches, 256, num_slots=8, direct=False) as engine:
        caches["k"].copy_(source)
        await engine.store_batch(list(range(256)), list(range(256)))
        caches["k"].zero_()
        ring = engine.io._ring  # type: ignore[attr-defined]
        reap, reaps = ring.reap, [0]

        def counted() -> list[tuple[int, int]]:
            reaps[0] += 1
            return reap()  # type: ignore[no-any-return]

        monkeypatch.setattr(ring, "reap", counted)
        order = random.Random(7).sample(range(256), 256)
        await engine.load_batch(order, list(range(256)))
        assert engine.stats()["pumped_batches"] == 2
        assert torch.equal(caches["k"], source[order])
        assert reaps[0] > 128


@pytest.mark.parametrize(("slots", "on_copier"), [(8, False), (32, True)])
async def test_memcpy_pumps_only_while_all_slots_hold_at_most_1_mib(make_engine: EngineFactory, copies: str,
                                                                    slots: int, on_copier: bool) -> None:
    """CPU mode copies a pump's blocks inline (in the reap, on the loop) only while slots × block
    is at most 1 MiB: a pump's start and a reap pass over a full CQ copy every slot's block at
    once. Beyond, the copies are jobs for the native copier's thread. 64 KiB blocks: 8 slots
    inline, 32 on the copier; bytes exact both ways."""
    if copies != "memcpy":
        pytest.skip("every copy goes to the copier in that case")
    caches = {"k": torch.zeros(64, 16 << 10, dtype=torch.int32)}  # 64 KiB blocks
    async with make_engine(caches, 64, num_slots=slots) as engine:
        assert (engine.stats()["plan"]["pump_copies"] == "jobs") == on_copier
        await store_then_load_shuffled(engine, caches["k"], seed=11)
        assert engine.stats()["pumped_batches"] == 2


@pytest.mark.parametrize("direct", [None, False], ids=["direct", "buffered"])
async def test_spare_slots_take_a_reaps_refills_before_it_copies(make_engine: EngineFactory, copies: str,
                                                                 direct: bool | None,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Memcpy pumps (CPU mode's small blocks) holding more slots than the I/O depth keep the spare
    ones parked. A reap starts the next blocks in those and submits them before it copies the blocks
    that just completed (whose slots then park in turn): refills do not wait for the loop's copies.
    Bytes exact, the depth kept, every slot back; without spare slots nothing is copied late.
    Mutation tried: every completion copied at once (copied_late stayed 0)."""
    if copies != "memcpy":
        pytest.skip("copier pumps copy on the copier's thread")
    monkeypatch.setenv("URING_KV_DEBUG_PUMP_SCATTER", "0")  # buffered loads read into the slot as well
    caches = id_caches("cpu", blocks=64)
    for slots, late in ((4, False), (8, True)):
        async with make_engine(caches, 64, num_slots=slots, io_depth=4, direct=direct) as engine:
            await store_identity(engine, caches, 64)
            for tensor in caches.values():
                tensor.fill_(-1)
            order = random.Random(slots).sample(range(64), 64)
            await engine.load_batch(order, list(range(64)))
            assert [identify(caches, g) for g in range(64)] == [(d, 1, True) for d in order]
            assert engine.stats()["pumped_batches"] == 2
            ring = engine.io._ring  # type: ignore[attr-defined]
            assert (ring.copied_late > 0) is late
            assert ring.pump_io() == (0, 4), "more reads in flight than the depth"
            assert all(lease.state is LeaseState.FREE for lease in engine.pool.leases)


async def test_a_hot_pumped_batch_lets_the_loop_run_between_reap_passes(make_engine: EngineFactory,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Refills of a hot buffered batch complete inside their own submission, so one reap could go
    on until the whole batch is done, holding the loop. With no budget each reap makes one pass
    (one refill of each slot) and asks for another loop turn: a task that only yields must get
    many turns while 512 blocks go through 4 slots, and the batch must still finish with exact
    bytes. Mutation tried: the C reap ignoring its budget (the whole batch went in one reap, the
    task got 2 turns)."""
    monkeypatch.setenv("URING_KV_RING_THREAD", "off")  # the loop's own reap is what this measures
    monkeypatch.setenv("URING_KV_REAP_BUDGET_US", "0")
    caches = id_caches("cpu", blocks=512)
    async with make_engine(caches, 512, num_slots=4, direct=False) as engine:
        await store_identity(engine, caches, 512)  # through the page cache: the loads below hit it
        for tensor in caches.values():
            tensor.fill_(-1)
        turns = 0
        done = False

        async def yielder() -> None:
            nonlocal turns
            while not done:
                await anyio.sleep(0)
                turns += 1

        async def load() -> None:
            nonlocal done
            await engine.load_batch(list(range(512)), list(range(512)))
            done = True

        await gather((yielder, ()), (load, ()))
        assert [identify(caches, g) for g in range(512)] == [(g, 1, True) for g in range(512)]
        assert turns >= 512 // 4 // 4, f"the loop got {turns} turns while 128 refill rounds ran"


async def test_a_load_waits_for_a_pumped_store_of_the_same_block(make_engine: EngineFactory) -> None:
    """A store of 64 blocks through 4 slots, then a load of its last block before it is written.
    Mutation tried: not waiting for the batch's hazards (the load took a slot handed over by the
    store's pump and read version 1)."""
    caches = id_caches("cpu", blocks=128)
    async with make_engine(caches, 64, num_slots=4) as engine:
        await store_identity(engine, caches, 64)
        for block in range(64):
            fill(caches, block, block, 2)
        async with task_group() as tasks:
            store = tasks.spawn(engine.store_batch, list(range(64)), list(range(64)))
            await settle()  # called (and its hazards registered) first
            await engine.load_batch([63], [100])
            assert identify(caches, 100) == (63, 2, True)
            await store.join()


@pytest.mark.parametrize("store_pumped", [True, False], ids=["pumped-store", "per-block-store"])
async def test_a_store_waits_for_a_pumped_load_of_the_same_block(fault_fs: tuple[Path, FaultState],
                                                                 make_engine: EngineFactory,
                                                                 store_pumped: bool) -> None:
    """The load's read of block 7 is slow; a store to block 7 called meanwhile must not write
    before that read is done, whether the store runs in a pump or a block at a time (as when every
    pump is busy). A pumped load registers its blocks once, as a set. Mutations tried: stores not
    waiting for the load batch, and per-block stores not looking in pumped loads' sets (the load
    then delivered version 2)."""
    mountpoint, state = fault_fs
    caches = id_caches("cpu", blocks=16)
    async with make_engine(caches, 8, num_slots=4, path=mountpoint / "kv.bin") as engine:
        await store_identity(engine, caches, 8)
        state.slow_down(engine.file.offset(7), engine.file.stride, 0.2, writes=False)
        fill(caches, 0, 7, 2)
        async with task_group() as tasks:
            load = tasks.spawn(engine.load_batch, list(range(8)), list(range(8, 16)))
            await anyio.sleep(0.05)  # the slow read is in flight, the other slots are free again
            use_python_pump(engine, not store_pumped)
            await engine.store_batch([0], [7])
            await load.join()
        assert identify(caches, 15) == (7, 1, True)
        await engine.load_batch([7], [1])
        assert identify(caches, 1) == (7, 2, True)


def slot_layout(layout: str, monkeypatch: pytest.MonkeyPatch, depth: int) -> dict[str, int]:
    """Engine arguments for ``depth`` I/Os in flight: as many slots ("depth"), or twice as many
    with the spare ones parked ("spare"; loads read into the slots, so a reap may refill through a
    parked slot before it copies)."""
    if layout == "depth":
        return {"num_slots": depth}
    monkeypatch.setenv("URING_KV_DEBUG_PUMP_SCATTER", "0")
    return {"num_slots": 2 * depth, "io_depth": depth}


@pytest.mark.parametrize("layout", ["depth", "spare"])
async def test_a_cancelled_pumped_load_stops_starting_blocks(fault_fs: tuple[Path, FaultState],
                                                            make_engine: EngineFactory, layout: str, copies: str,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Cancelled part way, the call returns once its started blocks are in place: each cache block
    then holds either its bytes or is untouched, the count of untouched ones is the metrics'
    cancelled blocks, and every slot is free. Odd blocks read slower, so the pump's slots come back
    one at a time after the stop. Mutations tried: not stopping the pump (all 12 blocks were
    loaded, none counted as cancelled); offering a stopped pump the slot it just handed back (it
    handed it back again, without end)."""
    mountpoint, state = fault_fs
    caches = id_caches("cpu", blocks=32)
    async with make_engine(caches, 12, path=mountpoint / "kv.bin", **slot_layout(layout, monkeypatch, 2)) as engine:
        await store_identity(engine, caches, 12)
        for tensor in caches.values():
            tensor.fill_(-1)
        stride = engine.file.stride
        for block in range(12):
            state.slow_down(block * stride, stride, 0.02 if block % 2 == 0 else 0.035, writes=False)
        async with task_group() as tasks:
            load = await run_then_cancel(tasks, 0.05, engine.load_batch, list(range(12)), list(range(16, 28)))
        assert load.cancelled
        assert engine.io.inflight == 0 and engine.pool.held == 0
        found = [identify(caches, 16 + i) for i in range(12)]
        loaded = [i for i, (disk, version, ok) in enumerate(found) if (disk, version, ok) == (i, 1, True)]
        untouched = [i for i in range(12) if all(bool((t[16 + i] == -1).all()) for t in caches.values())]
        assert sorted(loaded + untouched) == list(range(12)), f"a block is neither loaded nor untouched: {found}"
        assert 0 < len(untouched) < 12
        assert engine.metrics()["load"]["cancelled_blocks"] == len(untouched)
        late = engine.io._ring.copied_late  # type: ignore[attr-defined]
        assert (late > 0) is (layout == "spare" and copies == "memcpy"), "the spare slots took no refill"
        state.clear()
        await engine.load_batch([11], [0])  # still usable
        assert identify(caches, 0) == (11, 1, True)


async def test_a_put_off_copy_reads_its_slot_before_the_slots_next_read(make_engine: EngineFactory,
                                                                        copies: str,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Spare slots on a buffered file: a reap submits the refills parked slots can take, then
    copies the blocks that just completed; only then does each of those slots take its next
    block. Page-cache reads complete inside the submission, so a slot whose next read went out
    before its copy would hand the next block's bytes to the cache, on every run. Mutation
    tried: the slot's next read started in the reap, before its put-off memcpy (every run failed
    here and in the buffered spare-slot test; the FUSE-backed tests caught it now and then)."""
    if copies != "memcpy":
        pytest.skip("copier pumps copy on the copier's thread: no copy is put off")
    caches = id_caches("cpu", blocks=96)
    async with make_engine(caches, 64, direct=False, **slot_layout("spare", monkeypatch, 4)) as engine:
        await store_identity(engine, caches, 64)
        for tensor in caches.values():
            tensor.fill_(-1)
        order = random.Random(9).sample(range(64), 64)
        for _ in range(3):
            await engine.load_batch(order, list(range(32, 96)))
            assert [identify(caches, g) for g in range(32, 96)] == [(d, 1, True) for d in order]
        assert engine.io._ring.copied_late > 0  # type: ignore[attr-defined]


@pytest.mark.parametrize("layout", ["depth", "spare"])
async def test_a_pump_hands_its_slots_to_a_waiting_batch(fault_fs: tuple[Path, FaultState],
                                                         make_engine: EngineFactory, layout: str, copies: str,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A long load holds every slot; a one-block load called after it gets the next slot that
    frees up instead of waiting for the long one to finish (with spare slots, a parked one).
    The long load's second read is slower: its first slot frees up alone, the short load gets it,
    and the long one takes the other free ones back at once, so their refills and the short
    load's slot wait for I/O room together. Mutations tried: pumps refilling their slots whoever
    waits; parked slots getting room pump by pump, the lowest id first (the short load finished
    last: its parked slot got room only once the long one had no block left)."""
    mountpoint, state = fault_fs
    caches = id_caches("cpu", blocks=32)
    async with make_engine(caches, 16, path=mountpoint / "kv.bin", **slot_layout(layout, monkeypatch, 2)) as engine:
        await store_identity(engine, caches, 16)
        state.slow_down(0, 16 * engine.file.stride, 0.03, writes=False)
        state.slow_down(engine.file.stride, engine.file.stride, 0.1, writes=False)
        finished: list[str] = []

        async def load(name: str, disk: list[int], gpu: list[int]) -> None:
            await engine.load_batch(disk, gpu)
            finished.append(name)

        async with task_group() as tasks:
            tasks.spawn(load, "long", list(range(12)), list(range(16, 28)))
            await anyio.sleep(0.01)
            tasks.spawn(load, "short", [15], [30])
        assert finished == ["short", "long"]
        late = engine.io._ring.copied_late  # type: ignore[attr-defined]
        assert (late > 0) is (layout == "spare" and copies == "memcpy"), "the spare slots took no refill"
        assert identify(caches, 30) == (15, 1, True)
        assert [identify(caches, 16 + i) for i in range(12)] == [(i, 1, True) for i in range(12)]


async def test_batches_beyond_the_free_pumps_run_without_one(make_engine: EngineFactory) -> None:
    """300 one-block loads at once: the ring has 256 pumps; the others run in the Python pump,
    and every block arrives."""
    caches = id_caches("cpu", blocks=300)
    async with make_engine(caches, 300, num_slots=2) as engine:
        await store_identity(engine, caches, 300)
        for tensor in caches.values():
            tensor.fill_(-1)
        before = engine.stats()["pumped_batches"]
        await gather(*((engine.load_batch, ([d], [299 - d])) for d in range(300)))
        assert [identify(caches, 299 - d) for d in range(300)] == [(d, 1, True) for d in range(300)]
        assert 0 < engine.stats()["pumped_batches"] - before < 300


async def test_an_op_waiting_behind_a_pump_goes_when_its_copy_jobs_hand_slots_back(
        make_engine: EngineFactory, monkeypatch: pytest.MonkeyPatch, copies: str) -> None:
    """4 slots, depth 2, slow copies: a pumped load holds 3 slots while a per-block load (no pump
    free for it) waits in the backlog for room; the pump hands its slots back when its copy jobs
    are collected, with no CQE after that to wake the ring, and the waiting read must go then.
    Mutation tried: no backlog flush after collecting copy jobs (the second load hung)."""
    if copies != "copier":
        pytest.skip("pumps with memcpy copies keep an I/O per slot: they do not run under a depth cap")
    caches = id_caches("cpu", blocks=8)
    async with make_engine(caches, 8, num_slots=4, io_depth=2, copy_delay=0.02) as engine:
        await store_identity(engine, caches, 4)
        async with task_group() as tasks:
            tasks.spawn(engine.load_batch, [0, 1, 2], [4, 5, 6])
            await settle()
            assert engine.pool.held == 3
            use_python_pump(engine)
            with anyio.fail_after(10):
                await engine.load_batch([3], [7])
        assert [identify(caches, g) for g in range(4, 8)] == [(d, 1, True) for d in range(4)]
        assert engine.stats()["pumped_batches"] == 2  # store_identity's, the first load


@pytest.mark.parametrize("where", ["disk", "tmpfs"])
async def test_rows_off_a_page_are_read_straight_into_where_the_kernel_takes_them(tmp_path: Path, where: str) -> None:
    """Torch's own CPU tensors start 64 bytes past a page. With O_DIRECT the engine reads straight
    into (and writes straight from) such rows on tmpfs, where an O_DIRECT read into them works (its
    O_DIRECT is the page cache's copy), and not on a disk (this machine's refuses such buffers);
    the bytes are right either way."""
    import contextlib
    import ctypes

    rows, row = 16, 8192
    # 64 bytes past a page, as torch's allocator usually places them (it only promises 64)
    memory = torch.zeros(rows * row + 4096, dtype=torch.int8)
    skip = (64 - memory.data_ptr()) % 4096
    caches = {"rows": memory[skip:skip + rows * row].view(rows, row)}
    source = torch.randint(-128, 127, (32, row), dtype=torch.int8)
    with ram_directory() if where == "tmpfs" else contextlib.nullcontext(tmp_path) as directory:
        # the kernel's own answer: an O_DIRECT read of a block into row 1
        target = memoryview((ctypes.c_char * row).from_address(caches["rows"][1].data_ptr())).cast("B")
        takes = direct_read_into(directory, target, source[0].numpy().tobytes())
        if where == "tmpfs":
            assert takes, "tmpfs refused an O_DIRECT read into a row off a page"
        async with Engine(caches, directory / "kv.bin", 32, 4) as engine:
            if not engine.file.direct:
                pytest.skip(f"no O_DIRECT here: {engine.file.reason}")
            assert caches["rows"].data_ptr() % 4096 == 64
            into = takes and where == "tmpfs"
            assert engine.stats()["loads_into_caches"] is engine.stats()["stores_from_caches"] is into
            for first in range(0, 32, rows):
                caches["rows"][:] = source[first:first + rows]
                await engine.store_batch(list(range(rows)), list(range(first, first + rows)))
            for disk in (list(range(31, -1, -2)), list(range(0, 32, 2))):
                caches["rows"].zero_()
                await engine.load_batch(disk, list(range(rows)))
                assert torch.equal(caches["rows"], source[disk])


@pytest.mark.parametrize("aligned", [True, False])
async def test_o_direct_loads_read_straight_into_page_aligned_caches(tmp_path: Path, aligned: bool) -> None:
    """CPU mode with O_DIRECT: rows of page-aligned memory whose size is a multiple of the file's
    alignment (vLLM's and SGLang's host pools) are read straight into, and written straight from,
    one readv or writev per block; rows that are not go through the slots. Both move the exact
    bytes, many batches over few slots, and the file holds each stored row at its block."""
    import mmap

    import numpy as np

    rows, row = 24, 8192 if aligned else 8192 + 64
    memory = mmap.mmap(-1, rows * row)  # page-aligned
    caches = {"rows": torch.from_numpy(np.frombuffer(memory, dtype=np.int8).reshape(rows, row))}
    source = torch.randint(-128, 127, (64, row), dtype=torch.int8)
    rng = random.Random(5)
    try:
        async with Engine(caches, tmp_path / "kv.bin", 64, 4) as engine:
            if not engine.file.direct:
                pytest.skip(f"no O_DIRECT here: {engine.file.reason}")
            assert engine.stats()["loads_into_caches"] is engine.stats()["stores_from_caches"] is aligned
            for first in range(0, 64, rows):
                chosen = list(range(first, min(first + rows, 64)))
                caches["rows"][:len(chosen)] = source[chosen]
                await engine.store_batch(list(range(len(chosen))), chosen)
            stride = engine.stats()["stride"]
            buffered = os.open(f"/proc/self/fd/{engine.fileno()}", os.O_RDONLY)  # (the engine's fd is O_DIRECT)
            try:
                for d in (0, 23, 63):
                    assert os.pread(buffered, row, d * stride) == source[d].numpy().tobytes(), f"disk block {d}"
            finally:
                os.close(buffered)

            for _ in range(10):
                disk = rng.sample(range(64), rows)
                caches["rows"].zero_()
                await engine.load_batch(disk, list(range(rows)))
                assert torch.equal(caches["rows"], source[disk])
            assert engine.stats()["pumped_batches"] >= 10
    finally:
        del caches
