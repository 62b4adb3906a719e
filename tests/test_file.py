"""The block file: secure creation, removal, O_DIRECT probing and fallback, alignment."""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from tmpfs import direct_read_into, ram_directory

import uring_kv._file as file_module
from uring_kv._file import BlockFile, round_up
from uring_kv.bench.run import filesystem_of


def test_created_0600_sized_and_nameless(tmp_path: Path) -> None:
    os.umask(0)  # a permissive umask must not widen the mode
    try:
        f = BlockFile(tmp_path / "kv.bin", block_bytes=5000, num_blocks=10)
    finally:
        os.umask(0o022)
    st = os.fstat(f.fd)
    assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_nlink == 0
    assert f.naming == "unnamed (O_TMPFILE)" and f.named is None
    assert os.listdir(tmp_path) == []
    assert f.stride == round_up(5000, f.alignment)
    assert f.stride % f.alignment == 0 and f.alignment >= 512
    assert st.st_size == 10 * f.stride
    assert f.offset(3) == 3 * f.stride
    f.close()
    assert f.closed


@pytest.mark.parametrize("umask", [0o277, 0o777], ids=["0277", "0777"])
@pytest.mark.parametrize("tmpfile", [True, False], ids=["O_TMPFILE", "mkstemp"])
def test_the_unnamed_file_is_0600_under_a_narrow_umask(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      umask: int, tmpfile: bool) -> None:
    """A narrow umask must not narrow it either: 0400 or 0000 would leave the owner unable to
    write it through a second open (e.g. /proc/self/fd)."""
    if not tmpfile:
        monkeypatch.setattr(os, "open", _no_tmpfile(os.open))
    old = os.umask(umask)
    try:
        f = BlockFile(tmp_path / "kv.bin", 4096, 4)
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.fstat(f.fd).st_mode) == 0o600
    f.close()


def test_an_existing_file_at_the_path_is_left_alone(tmp_path: Path) -> None:
    path = tmp_path / "kv.bin"
    path.write_bytes(b"someone else's data")
    f = BlockFile(path, 4096, 4)
    f.close()
    assert path.read_bytes() == b"someone else's data"


def test_a_symlink_at_the_path_is_not_followed(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    link = tmp_path / "kv.bin"
    link.symlink_to(target)
    f = BlockFile(link, 4096, 4)
    f.close()
    assert not target.exists(), "the symlink was followed"
    assert link.is_symlink()


def test_a_missing_directory_is_named(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="nowhere"):
        BlockFile(tmp_path / "nowhere" / "kv.bin", 4096, 4)


def _no_tmpfile(real_open: Any) -> Any:
    def open_(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if flags & os.O_TMPFILE == os.O_TMPFILE:
            raise OSError(errno.EOPNOTSUPP, os.strerror(errno.EOPNOTSUPP))
        return int(real_open(path, flags, *args, **kwargs))
    return open_


def test_without_o_tmpfile_a_random_name_is_made_and_unlinked(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "open", _no_tmpfile(os.open))
    f = BlockFile(tmp_path / "kv.bin", 4096, 4)
    assert f.naming.startswith("unlinked at creation (O_TMPFILE refused: ") and f.named is None
    assert os.listdir(tmp_path) == [] and os.fstat(f.fd).st_nlink == 0
    f.close()


def test_a_file_that_keeps_its_name_is_removed_unless_replaced(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Where even the unlink at creation fails, the file keeps a random name, which close()
    removes, but only while that name is still this file."""
    monkeypatch.setattr(os, "open", _no_tmpfile(os.open))
    real_unlink = os.unlink

    def refuse(path: Any, *args: Any, **kwargs: Any) -> None:
        raise OSError(errno.EBUSY, os.strerror(errno.EBUSY))

    monkeypatch.setattr(os, "unlink", refuse)
    kept = BlockFile(tmp_path / "kv.bin", 4096, 4)
    replaced = BlockFile(tmp_path / "kv.bin", 4096, 4)
    monkeypatch.setattr(os, "unlink", real_unlink)
    name, other = kept.named, replaced.named
    assert name is not None and other is not None and "unlink refused: EBUSY" in kept.naming
    assert os.path.basename(name).startswith("kv.bin.")
    assert stat.S_IMODE(os.stat(name).st_mode) == 0o600
    kept.close()
    assert not os.path.exists(name)
    os.unlink(other)
    Path(other).write_bytes(b"new owner")
    replaced.close()
    assert Path(other).read_bytes() == b"new owner"


def test_direct_probe_succeeds_where_supported(tmp_path: Path) -> None:
    f = BlockFile(tmp_path / "kv.bin", 4096, 4)
    if not f.direct:
        pytest.skip(f"this filesystem refuses O_DIRECT: {f.reason}")
    assert os.O_DIRECT & fcntl.fcntl(f.fd, fcntl.F_GETFL)
    assert os.fstat(f.fd).st_size == 4 * f.stride  # the probe left no bytes of its own behind
    f.close()


@pytest.fixture(params=["disk", "tmpfs"])
def probe_dir(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Path]:
    """The test's temp directory, and one on /dev/shm (tmpfs: O_DIRECT there is the page cache's
    copy, which takes any buffer address)."""
    if request.param == "disk":
        yield tmp_path
        return
    with ram_directory() as directory:
        yield directory


def _direct_read_at(directory: Path, misalignment: int, length: int) -> bool:
    """Whether this filesystem takes an O_DIRECT read of ``length`` bytes into a buffer
    ``misalignment`` bytes past a page."""
    buf = mmap.mmap(-1, 2 * max(length, 4096))
    at = memoryview(buf)[misalignment:misalignment + length]
    try:
        return direct_read_into(directory, at, bytes(range(256)) * (length // 256))
    finally:
        at.release()
        buf.close()


def test_the_memory_alignment_is_8_on_tmpfs_where_the_kernel_takes_it(probe_dir: Path) -> None:
    """``memory_alignment`` (what O_DIRECT needs of a buffer's address: the engine reads straight
    into cache rows that keep it) is 8 on tmpfs, where a read into a buffer 8 bytes past a page
    (across pages) works, and the file's alignment everywhere else (a disk reporting 512 through
    statx refuses that read); a read into a buffer at it works either way."""
    f = BlockFile(probe_dir / "kv.bin", 4096, 4)
    try:
        if not f.direct:
            pytest.skip(f"this filesystem refuses O_DIRECT: {f.reason}")
        span = round_up(2 * os.sysconf("SC_PAGE_SIZE"), f.alignment)
        takes = _direct_read_at(probe_dir, 8, span)
        assert f.memory_alignment == (8 if takes and filesystem_of(str(probe_dir)) == "tmpfs" else f.alignment)
        assert _direct_read_at(probe_dir, f.memory_alignment, span)
        if probe_dir.is_relative_to("/dev/shm"):
            assert f.memory_alignment == 8
        assert os.fstat(f.fd).st_size == 4 * f.stride  # the probes left no bytes of their own behind
    finally:
        f.close()


def test_a_buffered_file_needs_no_memory_alignment(tmp_path: Path) -> None:
    f = BlockFile(tmp_path / "kv.bin", 4096, 4, direct=False)
    assert (f.direct, f.memory_alignment) == (False, 1)
    f.close()


def _einval(*args: Any) -> None:
    raise OSError(errno.EINVAL, "Invalid argument")


def test_direct_probe_io_failure_falls_back_and_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(file_module, "_probe_io", _einval)
    f = BlockFile(tmp_path / "kv.bin", 4096, 4)
    assert not f.direct
    assert "O_DIRECT probe I/O failed (EINVAL)" in f.reason
    assert not os.O_DIRECT & fcntl.fcntl(f.fd, fcntl.F_GETFL)
    f.close()


def test_direct_required_but_unusable_raises_and_removes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(file_module, "_probe_io", _einval)
    with pytest.raises(OSError, match="O_DIRECT requested but unusable"):
        BlockFile(tmp_path / "kv.bin", 4096, 4, direct=True)
    assert not (tmp_path / "kv.bin").exists()


def test_buffered_on_request(tmp_path: Path) -> None:
    f = BlockFile(tmp_path / "kv.bin", 100, 4, direct=False)
    assert not f.direct and f.reason == "buffered I/O requested"
    f.close()


def test_a_kept_file_is_the_path_itself_0600_and_stays_after_close(tmp_path: Path) -> None:
    path = tmp_path / "kv.bin"
    old = os.umask(0)
    try:
        f = BlockFile(path, 5000, 4, keep=True)
    finally:
        os.umask(old)
    assert f.created and f.naming == f"kept at {path}" and f.named is None
    st = os.fstat(f.fd)
    assert os.path.samestat(st, os.stat(path)) and stat.S_IMODE(st.st_mode) == 0o600
    assert st.st_size == 4 * f.stride and os.listdir(tmp_path) == ["kv.bin"]  # no probe file left
    f.close()
    assert path.exists()


def test_reopening_a_kept_file_keeps_its_bytes_and_never_shrinks_it(tmp_path: Path) -> None:
    """The O_DIRECT probe runs on a scratch file: a kept file's first block is data. Mutation
    tried: probing on the kept file itself (the probe truncated it: its blocks were gone)."""
    path = tmp_path / "kv.bin"
    f = BlockFile(path, 4096, 8, keep=True)
    stride = f.stride
    f.close()
    with path.open("r+b") as data:
        data.write(b"block zero")
    again = BlockFile(path, 4096, 2, keep=True)  # (probing O_DIRECT where the filesystem has it)
    assert not again.created and os.fstat(again.fd).st_size == 8 * stride
    again.close()
    assert path.read_bytes()[:10] == b"block zero"
    grown = BlockFile(path, 4096, 16, keep=True)
    assert os.fstat(grown.fd).st_size == 16 * stride
    grown.close()
    assert path.read_bytes()[:10] == b"block zero"


def test_a_kept_file_is_locked_and_refused_when_shared_or_foreign(tmp_path: Path) -> None:
    path = tmp_path / "kv.bin"
    f = BlockFile(path, 4096, 4, keep=True)
    with pytest.raises(OSError, match="in use by another process"):
        BlockFile(path, 4096, 4, keep=True)
    f.close()
    path.chmod(0o640)
    with pytest.raises(PermissionError, match="mode 0640"):
        BlockFile(path, 4096, 4, keep=True)
    path.unlink()
    path.mkdir()
    with pytest.raises(OSError):
        BlockFile(path, 4096, 4, keep=True)
    path.rmdir()
    (tmp_path / "target").write_bytes(b"")
    path.symlink_to(tmp_path / "target")
    with pytest.raises(OSError, match="symbolic link"):
        BlockFile(path, 4096, 4, keep=True)


def test_a_kept_file_made_for_nothing_is_removed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(file_module, "_probe_io", _einval)
    with pytest.raises(OSError, match="O_DIRECT requested but unusable"):
        BlockFile(tmp_path / "kv.bin", 4096, 4, direct=True, keep=True)
    assert os.listdir(tmp_path) == []
