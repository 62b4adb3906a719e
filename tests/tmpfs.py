"""Small real filesystems for the space tests of every suite (main, vLLM, SGLang, LMCache): a
tmpfs of a given size mounted for a block, and a filler that takes its free space as another
process would; a directory on /dev/shm, and the kernel's own answer to an O_DIRECT read into a
given buffer there or anywhere."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest


@contextlib.contextmanager
def mounted_tmpfs(mountpoint: Path, options: str = "size=1m") -> Iterator[Path]:
    """A tmpfs mounted (with ``options``) at ``mountpoint``, made here, for the block; the test is
    skipped, with the reason, where it cannot be mounted (not root, no mount rights)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mountpoint.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(mountpoint)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield mountpoint
    finally:
        subprocess.run(["umount", "-l", str(mountpoint)], check=False)


@contextlib.contextmanager
def ram_directory() -> Iterator[Path]:
    """A fresh directory on /dev/shm for the block, removed after; the test is skipped, with the
    reason, where /dev/shm is not a tmpfs with 16 MiB free."""
    from uring_kv.bench.run import filesystem_of

    if filesystem_of("/dev/shm") != "tmpfs":
        pytest.skip("/dev/shm is not a tmpfs here")
    stats = os.statvfs("/dev/shm")
    if stats.f_bavail * stats.f_frsize < 1 << 24:
        pytest.skip("/dev/shm has less than 16 MiB free")
    directory = Path(tempfile.mkdtemp(prefix="uring-kv-test-", dir="/dev/shm"))
    try:
        yield directory
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def direct_read_into(directory: Path, target: memoryview, data: bytes) -> bool:
    """Whether the filesystem of ``directory`` takes an O_DIRECT read of ``data`` (written first,
    buffered, to an unnamed file there) into ``target``, and it brings those bytes: the kernel's
    own answer, independent of uring_kv. False where it refuses the buffer (EINVAL)."""
    fd = os.open(directory, os.O_TMPFILE | os.O_RDWR, 0o600)
    try:
        os.pwrite(fd, data, 0)
        os.fsync(fd)
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_DIRECT)
        try:
            return os.preadv(fd, [target], 0) == len(data) and bytes(target) == data
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            return False
    finally:
        os.close(fd)


def take_space(directory: Path, leave: int = 0) -> Path:
    """Fill the filesystem of ``directory`` with a file of its own until only about ``leave`` bytes
    are free (what a block file was sized for at open is then gone: the disk filled up under it);
    unlink the returned file to give the room back."""
    filler = directory / "filler"
    stats = os.statvfs(directory)
    remaining = stats.f_bavail * stats.f_frsize - leave
    chunk = b"\1" * (1 << 16)
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        while remaining > 0:
            remaining -= os.write(fd, chunk[:remaining])
    except OSError as exc:
        if exc.errno != errno.ENOSPC:
            raise
    finally:
        os.close(fd)
    return filler
