"""Real faults: EIO from a FUSE filesystem, ENOSPC from a 1 MiB tmpfs, a file truncated under the
engine. Each failing block raises an error naming it and its errno; every other block is correct,
every slot returns, nothing already stored is harmed, and the engine stays usable."""

from __future__ import annotations

import errno
import os
import sys
from pathlib import Path

import anyio
import pytest
import torch
from aio import settle, task_group
from conftest import EngineFactory, reported_errors
from faultfs import FaultState
from tmpfs import take_space

from uring_kv import BlockIOError, Engine, _pypump
from uring_kv.testing import block_file, content, fill, id_caches, identify, store_identity

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="mounting needs root")


@pytest.mark.parametrize("direct", [None, False], ids=["direct", "buffered"])
async def test_eio_on_read_names_the_block(fault_fs: tuple[Path, FaultState], make_engine: EngineFactory,
                                           direct: bool | None) -> None:
    """Buffered, CPU-mode loads on io_uring read straight into the caches (pumps scatter them)."""
    mountpoint, state = fault_fs
    caches = id_caches("cpu", blocks=8)
    engine = make_engine(caches, 8, num_slots=2, path=mountpoint / "kv.bin", direct=direct)
    async with engine:
        await store_identity(engine, caches, 8)
        state.fail_reads(engine.file.offset(5), engine.file.stride)
        with pytest.raises(BlockIOError, match=r"disk block\(s\) 5 \(EIO") as info:
            await engine.load_batch([3, 5, 6], [0, 1, 2])
        assert info.value.failures == {5: errno.EIO}
        assert identify(caches, 0) == (3, 1, True) and identify(caches, 2) == (6, 1, True)
        assert engine.stats()["leases_held"] == 0
        state.clear()
        await engine.load_batch([5], [1])
        assert identify(caches, 1) == (5, 1, True)


async def test_eio_on_write_names_the_block_and_poisons_only_it(fault_fs: tuple[Path, FaultState],
                                                                make_engine: EngineFactory) -> None:
    mountpoint, state = fault_fs
    caches = id_caches("cpu", blocks=8)
    engine = make_engine(caches, 8, num_slots=2, path=mountpoint / "kv.bin")
    async with engine:
        for gpu_block in range(4):
            fill(caches, gpu_block, gpu_block, 1)
        state.fail_writes(engine.file.offset(2), engine.file.stride)
        with pytest.raises(BlockIOError) as info:
            await engine.store_batch([0, 1, 2, 3], [0, 1, 2, 3])
        assert info.value.failures == {2: errno.EIO}
        await engine.load_batch([0, 1, 3], [4, 5, 6])
        assert [identify(caches, g) for g in (4, 5, 6)] == [(0, 1, True), (1, 1, True), (3, 1, True)]
        with pytest.raises(BlockIOError, match="EIO"):  # never silently hand out the half-written block
            await engine.load_batch([2], [7])
        state.clear()
        await engine.store_batch([2], [2])
        await engine.load_batch([2], [7])
        assert identify(caches, 7) == (2, 1, True)
        assert engine.stats()["leases_held"] == 0


@needs_root
async def test_enospc_raises_and_stored_blocks_survive(tiny_tmpfs: Path, make_engine: EngineFactory) -> None:
    caches = id_caches("cpu", layers=64, blocks=8)  # 64 layers × 244 bytes: 16 KiB blocks after padding
    engine = make_engine(caches, 256, num_slots=4, path=tiny_tmpfs / "kv.bin")
    async with engine:
        take_space(tiny_tmpfs, leave=1 << 20)  # room for 64 of the 256 blocks
        stored: list[int] = []
        failed: dict[int, int] = {}
        for first in range(0, 256, 8):
            disk_blocks = list(range(first, first + 8))
            for gpu_block, disk_block in enumerate(disk_blocks):
                fill(caches, gpu_block, disk_block, 1)
            try:
                await engine.store_batch(list(range(8)), disk_blocks)
                stored.extend(disk_blocks)
            except BlockIOError as exc:
                failed.update(exc.failures)
                stored.extend(d for d in disk_blocks if d not in exc.failures)
        assert failed, "a tmpfs with 1 MiB left should have run out of space"
        assert set(failed.values()) == {errno.ENOSPC}
        assert len(stored) >= 8
        for first in range(0, len(stored), 8):
            chunk = stored[first:first + 8]
            await engine.load_batch(chunk, list(range(len(chunk))))
            assert [identify(caches, g) for g in range(len(chunk))] == [(d, 1, True) for d in chunk]
        with pytest.raises(BlockIOError, match="ENOSPC"):
            await engine.load_batch([next(iter(failed))], [0])
        assert engine.stats()["leases_held"] == 0


async def test_a_load_called_during_a_store_that_fails_raises_instead_of_stale_bytes(
        fault_fs: tuple[Path, FaultState], make_engine: EngineFactory) -> None:
    """Block 5 holds version 1; a store of version 2 to it is in flight (slow) and fails with EIO;
    a load of block 5 called meanwhile waits for it, and must then fail too: the last store left
    no bytes to trust. The pumped path checked the block only when called and returned what was
    on disk."""
    mountpoint, state = fault_fs
    caches = id_caches("cpu", blocks=16)
    async with make_engine(caches, 8, num_slots=4, path=mountpoint / "kv.bin") as engine:
        await store_identity(engine, caches, 8)
        fill(caches, 5, 5, 2)
        state.slow_down(engine.file.offset(5), engine.file.stride, 0.1, reads=False)
        state.fail_writes(engine.file.offset(5), engine.file.stride)
        async with task_group() as tasks:
            store = tasks.spawn(engine.store_batch, [5], [5])
            await settle()  # the store is called, its write in flight
            with pytest.raises(BlockIOError) as info:
                await engine.load_batch([4, 5, 6], [8, 9, 10])
            assert info.value.failures == {5: errno.EIO}
            with pytest.raises(BlockIOError):
                await store.join()
        assert identify(caches, 8) == (4, 1, True) and identify(caches, 10) == (6, 1, True)
        assert identify(caches, 9) == (-1, -1, False)  # untouched
        assert engine.stats()["leases_held"] == 0


@needs_root
async def test_a_load_called_during_a_first_store_that_runs_out_of_space_raises(
        tiny_tmpfs: Path, make_engine: EngineFactory) -> None:
    """The same on a full tmpfs: the first store of a block fails with ENOSPC while a load
    of it waits; the load raises ENOSPC (it used to return zeros with no error)."""
    caches = id_caches("cpu", layers=64, blocks=8)
    engine = make_engine(caches, 256, num_slots=4, path=tiny_tmpfs / "kv.bin", direct=False)
    async with engine:
        filler = take_space(tiny_tmpfs)  # every page the tmpfs has
        fill(caches, 0, 3, 1)
        async with task_group() as tasks:
            store = tasks.spawn(engine.store_batch, [0], [3])
            load = tasks.spawn(engine.load_batch, [3], [1])
        with pytest.raises(BlockIOError) as stored:
            await store.join()
        with pytest.raises(BlockIOError) as loaded:
            await load.join()
        assert stored.value.failures == {3: errno.ENOSPC}
        assert loaded.value.failures == {3: errno.ENOSPC}
        assert identify(caches, 1) == (-1, -1, False)
        os.unlink(filler)
        await engine.store_batch([0], [3])
        await engine.load_batch([3], [1])
        assert identify(caches, 1) == (3, 1, True)


@pytest.mark.parametrize("direct", [None, False], ids=["direct", "buffered"])
async def test_file_truncated_under_the_engine_raises_no_stale_bytes(make_engine: EngineFactory,
                                                                     direct: bool | None) -> None:
    caches = id_caches("cpu", blocks=4)
    async with make_engine(caches, 4, num_slots=2, direct=direct) as engine:
        await store_identity(engine, caches, 4)
        os.truncate(block_file(engine), 0)
        for t in caches.values():
            t.fill_(-1)
        with pytest.raises(BlockIOError) as info:
            await engine.load_batch([0, 1, 2, 3], [0, 1, 2, 3])
        assert set(info.value.failures) == {0, 1, 2, 3}
        assert all(identify(caches, g)[0] == -1 for g in range(4)), "a failed block's slot bytes reached the cache"


@pytest.mark.parametrize("direct", [None, False], ids=["direct", "buffered"])
async def test_a_short_read_fails_its_block_and_delivers_no_other_blocks_bytes(make_engine: EngineFactory,
                                                                               direct: bool | None) -> None:
    """The file ends part-way through block 2 (two tensors in): blocks 0 and 1 load, 2 and 3 fail
    with EIO. Each tensor's piece of a failed block is either untouched or block 2's own bytes
    (a buffered CPU-mode load reads straight into the caches, so a short read can fill a prefix);
    never the bytes a slot held from another block. The slots carried blocks 0 and 1 first."""
    caches = id_caches("cpu", blocks=8)
    async with make_engine(caches, 4, num_slots=2, direct=direct) as engine:
        await store_identity(engine, caches, 4)
        piece = caches["layer0"][0].nbytes  # the file holds each block as its tensors' pieces in turn
        os.truncate(block_file(engine), engine.file.offset(2) + 2 * piece)
        for t in caches.values():
            t.fill_(-1)
        with pytest.raises(BlockIOError) as info:
            await engine.load_batch([0, 1, 2, 3], [4, 5, 6, 7])
        assert info.value.failures == {2: errno.EIO, 3: errno.EIO}
        assert identify(caches, 4) == (0, 1, True) and identify(caches, 5) == (1, 1, True)
        for gpu_block, disk_block in ((6, 2), (7, 3)):
            for layer, t in enumerate(caches.values()):
                got = t[gpu_block]
                assert bool((got == -1).all()) or torch.equal(got, content(disk_block, 1, layer, "cpu")), (
                    f"gpu block {gpu_block} layer {layer} holds bytes of another block: {got[:2].tolist()}")
        assert engine.stats()["leases_held"] == 0


async def test_a_sum_that_raises_fails_the_load_instead_of_hanging_it(make_engine: EngineFactory,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """checksum=True sums slots on worker threads. When summing raises, the error is reported and
    the block goes on: a load fails it with EIO (its bytes are unverified, not known bad), a store
    writes it unsummed. Mutation tried: the worker's error left in its thread (the calls never return)."""
    caches = id_caches("cpu", blocks=8)
    async with make_engine(caches, 8, num_slots=2, checksum=True) as engine:
        await store_identity(engine, caches, 2)
        real = _pypump.crc32c_of

        def broken(addr: int, length: int) -> int:
            raise RuntimeError("injected summing failure")

        monkeypatch.setattr(_pypump, "crc32c_of", broken)
        with reported_errors() as errors, anyio.fail_after(10):
            with pytest.raises(BlockIOError) as info:
                await engine.load_batch([0, 1], [4, 5])
            assert info.value.failures == {0: errno.EIO, 1: errno.EIO}
            fill(caches, 2, 3, 1)
            await engine.store_batch([2], [3])  # written unsummed
        assert len(errors) == 3 and all("summing" in str(error) for error in errors)
        monkeypatch.setattr(_pypump, "crc32c_of", real)
        for t in caches.values():
            t[4:8].fill_(-1)
        await engine.load_batch([0, 1, 3], [4, 5, 6])  # sums as before; block 3 has none to check
        assert [identify(caches, g) for g in (4, 5, 6)] == [(0, 1, True), (1, 1, True), (3, 1, True)]
        assert engine.stats()["leases_held"] == 0


def test_checksum_without_crc32c_is_refused_clearly(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "crc32c", None)  # import crc32c now raises ImportError
    with pytest.raises(ImportError, match="checksum=True needs the crc32c package"):
        Engine(id_caches("cpu", blocks=2), tmp_path / "kv.bin", 2, 1, checksum=True)


def _flip_a_byte(path: str, offset: int) -> None:
    fd = os.open(path, os.O_RDWR)
    try:
        old = os.pread(fd, 1, offset)
        os.pwrite(fd, bytes([old[0] ^ 0x5A]), offset)
        os.fsync(fd)
    finally:
        os.close(fd)


@pytest.mark.parametrize("checksum", [True, False], ids=["checksum", "no-checksum"])
async def test_checksum_catches_bytes_changed_on_disk(make_engine: EngineFactory, checksum: bool) -> None:
    """With checksum=True a block whose bytes changed on disk fails with EBADMSG and never reaches
    the cache; without it the same damage is delivered silently (which is why the option exists)."""
    caches = id_caches("cpu", blocks=8)
    async with make_engine(caches, 8, num_slots=2, checksum=checksum) as engine:
        await store_identity(engine, caches, 4)
        await engine.load_batch(list(range(4)), list(range(4, 8)))  # sums verify when nothing changed
        assert [identify(caches, g) for g in range(4, 8)] == [(d, 1, True) for d in range(4)]
        _flip_a_byte(block_file(engine), engine.file.offset(2) + 100)
        for t in caches.values():
            t[4:8].fill_(-1)
        if checksum:
            with pytest.raises(BlockIOError, match="EBADMSG") as info:
                await engine.load_batch(list(range(4)), list(range(4, 8)))
            assert info.value.failures == {2: errno.EBADMSG}
            assert identify(caches, 6)[0] == -1, "a block that failed its checksum reached the cache"
            assert [identify(caches, g) for g in (4, 5, 7)] == [(0, 1, True), (1, 1, True), (3, 1, True)]
            fill(caches, 0, 2, 2)
            await engine.store_batch([0], [2])  # rewriting the block heals it
            await engine.load_batch([2], [6])
            assert identify(caches, 6) == (2, 2, True)
        else:
            await engine.load_batch(list(range(4)), list(range(4, 8)))
            assert identify(caches, 6)[2] is False
        assert engine.stats()["leases_held"] == 0
