"""The block file: secure creation, removal, O_DIRECT probing and fallback, alignment."""

from __future__ import annotations

import errno
import fcntl
import os
import stat
from pathlib import Path
from typing import Any

import pytest

import uring_kv._file as file_module
from uring_kv._file import BlockFile, round_up


def test_created_0600_sized_and_removed_on_close(tmp_path: Path) -> None:
    os.umask(0)  # a permissive umask must not widen the mode
    path = tmp_path / "kv.bin"
    f = BlockFile(path, block_bytes=5000, num_blocks=10)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert f.stride == round_up(5000, f.alignment)
    assert f.stride % f.alignment == 0 and f.alignment >= 512
    assert os.path.getsize(path) == 10 * f.stride
    assert f.offset(3) == 3 * f.stride
    f.close()
    assert not path.exists()
    assert f.closed
    os.umask(0o022)


def test_refuses_existing_file(tmp_path: Path) -> None:
    path = tmp_path / "kv.bin"
    path.write_bytes(b"someone else's data")
    with pytest.raises(FileExistsError):
        BlockFile(path, 4096, 4)
    assert path.read_bytes() == b"someone else's data"


def test_refuses_symlink_even_dangling(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    link = tmp_path / "kv.bin"
    link.symlink_to(target)
    with pytest.raises(FileExistsError):
        BlockFile(link, 4096, 4)
    assert not target.exists(), "the symlink was followed"


def test_close_does_not_remove_a_replaced_path(tmp_path: Path) -> None:
    path = tmp_path / "kv.bin"
    f = BlockFile(path, 4096, 4)
    os.unlink(path)
    path.write_bytes(b"new owner")
    f.close()
    assert path.read_bytes() == b"new owner"


def test_direct_probe_succeeds_where_supported(tmp_path: Path) -> None:
    f = BlockFile(tmp_path / "kv.bin", 4096, 4)
    if not f.direct:
        pytest.skip(f"this filesystem refuses O_DIRECT: {f.reason}")
    assert os.O_DIRECT & fcntl.fcntl(f.fd, fcntl.F_GETFL)
    assert os.path.getsize(f.path) == 4 * f.stride  # the probe left no bytes of its own behind
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
