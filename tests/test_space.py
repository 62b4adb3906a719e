"""The block file's room on its filesystem: a capacity beyond the free space is refused at open,
one line, nothing left behind (engine, persistent store, striped store, the sync store), and
``Tuning.reserve_space`` allocates the whole file at open where the filesystem can."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from faultfs import FaultState
from tmpfs import mounted_tmpfs, take_space

import uring_kv._file as file_module
from uring_kv import BlockStore, Engine, StripedBlockStore, Tuning
from uring_kv.sync import SyncBlockStore
from uring_kv.testing import id_caches


def caches() -> dict[str, torch.Tensor]:
    """64 layers × 244 bytes: 16 KiB blocks after padding (256 of them are a 4 MiB file)."""
    return id_caches("cpu", layers=64, blocks=4)


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A 2 MiB tmpfs at ``tmp_path / "small"``."""
    with mounted_tmpfs(tmp_path / "small", "size=2m") as mountpoint:
        yield mountpoint


REFUSED = r"num_disk_blocks=256: a file of 256 × 16384 bytes \(4 MiB\) does not fit in the 2 MiB free on " \
          r"the filesystem of .*/small$"


async def test_an_engine_beyond_the_free_space_is_refused_at_open(small_fs: Path) -> None:
    engine = Engine(caches(), small_fs / "kv.bin", 256, num_slots=2)
    with pytest.raises(ValueError, match=REFUSED) as info:
        await engine.open()
    assert "\n" not in str(info.value)
    assert engine.closed and os.listdir(small_fs) == []
    async with Engine(caches(), small_fs / "kv.bin", 64, num_slots=2) as engine:  # 1 MiB fits
        assert engine.stats()["reserved"] is False


async def test_the_reproducer_a_terabyte_file_on_a_smaller_disk(tmp_path: Path) -> None:
    """2**32 blocks of 1000 bytes (at least 4 TiB once aligned) on whatever filesystem holds the
    tests: refused unless it really has that much free."""
    free = os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize
    if free >= 2**32 * 1000:
        pytest.skip(f"{tmp_path} has {free} bytes free")
    engine = Engine([torch.zeros(4, 1000, dtype=torch.uint8)], tmp_path / "kv.bin", 2**32)
    with pytest.raises(ValueError, match=r"num_disk_blocks=4294967296: .* free on the filesystem of "):
        await engine.open()
    assert engine.closed and os.listdir(tmp_path) == []


async def test_a_block_store_and_a_sync_store_say_the_same(small_fs: Path) -> None:
    store = BlockStore(caches(), small_fs / "kv.bin", capacity_bytes=4 << 20)
    with pytest.raises(ValueError, match=REFUSED):
        await store.open()
    with pytest.raises(ValueError, match=REFUSED):
        SyncBlockStore(caches(), small_fs / "kv.bin", capacity_bytes=4 << 20)
    assert os.listdir(small_fs) == []


async def test_a_persistent_store_grown_beyond_the_free_space_keeps_its_file_and_keys(small_fs: Path) -> None:
    """Reopened with a capacity the filesystem has no room for: refused, and the file keeps its
    size (the growth is undone, never anything below it), its index and its keys; reopened at its
    own size, it serves them although the disk has filled up meanwhile."""
    rows = caches()
    path = small_fs / "kv.bin"
    async with BlockStore(rows, path, 32, 2, persistent=True, fsync=False) as store:
        await store.put([b"k0", b"k1"], [0, 1])
    size = path.stat().st_size
    take_space(small_fs, leave=256 << 10)
    grown = BlockStore(rows, path, 64, 2, persistent=True, fsync=False)  # 512 KiB more, 256 KiB free
    with pytest.raises(ValueError, match=r"num_disk_blocks=64: the file's growth from 512 KiB to 1 MiB \(64 × 16384 "
                                         r"bytes\) does not fit in the .* free on the filesystem of .*/small$"):
        await grown.open()
    assert path.stat().st_size == size
    async with BlockStore(rows, path, 32, 2, persistent=True, fsync=False) as store:
        assert store.contains(b"k0") and store.contains(b"k1")


async def test_each_file_of_a_striped_store_is_checked_and_none_is_left(tmp_path: Path, small_fs: Path) -> None:
    roomy = tmp_path / "roomy"
    roomy.mkdir()
    store = StripedBlockStore(caches(), [roomy / "kv.bin", small_fs / "kv.bin"], capacity_bytes=8 << 20)
    with pytest.raises(ValueError, match=REFUSED):
        await store.open()
    assert os.listdir(roomy) == [] and os.listdir(small_fs) == []


async def test_reserving_allocates_the_whole_file_at_open(tmp_path: Path) -> None:
    tuning = Tuning(reserve_space=True)
    async with Engine(caches(), tmp_path / "kv.bin", 64, num_slots=2, tuning=tuning) as engine:
        stats = engine.stats()
        if not stats["reserved"]:
            pytest.skip(f"{tmp_path}: {stats['reserve_reason']}")
        assert stats["reserve_reason"] == ""
        st = os.fstat(engine.fileno())
        assert st.st_size == 64 * stats["stride"] and st.st_blocks * 512 >= st.st_size


def test_a_reservation_past_4_gib_is_made_whole_with_o_direct(tmp_path: Path) -> None:
    """fallocate's offset and length are 64-bit: a 5 GiB file on an O_DIRECT filesystem is reserved
    whole (the direct probe loading libc first once left fallocate without its argument types, and
    this reservation failed with EINVAL)."""
    from uring_kv._file import BlockFile
    from uring_kv.bench.run import filesystem_of

    if filesystem_of(str(tmp_path)) in ("tmpfs", "ramfs"):
        pytest.skip("a 5 GiB reservation would take the memory itself here")
    stats = os.statvfs(tmp_path)
    if stats.f_bavail * stats.f_frsize < 6 << 30:
        pytest.skip("less than 6 GiB free here")
    f = BlockFile(tmp_path / "kv.bin", 1 << 20, 5120, reserve=True)
    try:
        if not f.direct:
            pytest.skip(f"no O_DIRECT here: {f.reason}")
        assert (f.reserved, f.reserve_reason) == (True, "")
        assert os.fstat(f.fd).st_blocks * 512 >= 5 << 30
    finally:
        f.close()


async def test_a_reserved_file_holds_its_room_against_other_files(small_fs: Path) -> None:
    """On a tmpfs: what another process writes after open() cannot take the reserved blocks, so
    a store to the last block still lands."""
    rows = caches()
    async with Engine(rows, small_fs / "kv.bin", 64, num_slots=2, tuning=Tuning(reserve_space=True)) as engine:
        assert engine.stats()["reserved"] is True
        take_space(small_fs)
        await engine.store_batch([0], [63])
        await engine.load_batch([63], [1])
        assert torch.equal(rows["layer0"][1], rows["layer0"][0])


async def test_where_the_filesystem_cannot_reserve_the_file_is_used_unreserved(
        fault_fs: tuple[Path, FaultState]) -> None:
    """The FUSE filesystem of the fault tests has no fallocate: the engine says so and goes on."""
    mountpoint, _ = fault_fs
    rows = caches()
    async with Engine(rows, mountpoint / "kv.bin", 8, num_slots=2, tuning=Tuning(reserve_space=True)) as engine:
        stats = engine.stats()
        assert stats["reserved"] is False
        assert stats["reserve_reason"].startswith("the filesystem cannot reserve space (")
        await engine.store_batch([0], [7])
        await engine.load_batch([7], [1])
        assert torch.equal(rows["layer0"][1], rows["layer0"][0])


async def test_space_taken_between_the_check_and_the_reservation_is_refused(
        small_fs: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another process fills the disk between the free-space check and the fallocate: one line,
    nothing left."""
    monkeypatch.setattr(file_module, "free_bytes", lambda fd, close=False: 1 << 40)
    engine = Engine(caches(), small_fs / "kv.bin", 256, num_slots=2, tuning=Tuning(reserve_space=True))
    with pytest.raises(ValueError, match=r"num_disk_blocks=256: reserving 4 MiB for the file in .*/small failed: "
                                         r"the filesystem is full \(ENOSPC\)$"):
        await engine.open()
    assert engine.closed and os.listdir(small_fs) == []


def test_the_setting_is_read_from_the_environment() -> None:
    assert Tuning.from_env({"URING_KV_RESERVE_SPACE": "1"}).reserve_space is True
    assert Tuning.from_env({}).reserve_space is False
    with pytest.raises(ValueError, match="URING_KV_RESERVE_SPACE must be 0 or 1"):
        Tuning.from_env({"URING_KV_RESERVE_SPACE": "yes"})
