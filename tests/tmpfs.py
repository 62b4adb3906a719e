"""Small real filesystems for the space tests of every suite (main, vLLM, SGLang, LMCache): a
tmpfs of a given size mounted for a block, and a filler that takes its free space as another
process would."""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
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
