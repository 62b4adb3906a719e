"""The block file: secure creation, O_DIRECT probing, alignment, layout, removal.

The file may hold user prompts (KV blocks), so it never has a name another process could open, and
nothing of it outlives the process, even under SIGKILL: it is made unnamed (``O_TMPFILE|O_EXCL`` in
the directory of ``path``, mode 0600: it can never be linked into the tree), or, where the filesystem
lacks O_TMPFILE, created under a fresh random name beside ``path`` (``O_CREAT|O_EXCL|O_NOFOLLOW``,
0600) and unlinked at once, before any block is written; the fd keeps it. Only where even that
unlink fails is the file left named (``named`` says so) and removed when the engine closes.
O_DIRECT is probed with a real aligned write and read:
some filesystems accept the flag at ``open`` and fail the first I/O (overlayfs, FUSE, some NFS).
This module does blocking syscalls: call it off the event loop (the engine uses ``to_thread``).
"""

from __future__ import annotations

import errno
import fcntl
import os
import tempfile
from dataclasses import dataclass
from typing import Any

from uring_kv._memory import HostBuffer
from uring_kv._native import dio_alignment, scaled

DEFAULT_ALIGNMENT = 4096


def round_up(value: int, alignment: int) -> int:
    return -(-value // alignment) * alignment


def _probe_io(fd: int, buf: HostBuffer, length: int) -> None:
    """One aligned write and read back at offset 0 (a seam tests replace to inject EINVAL)."""
    pattern = bytes((i * 7 + 1) & 0xFF for i in range(256)) * (length // 256)
    buf.view[:length] = pattern
    if os.pwritev(fd, [buf.view[:length]], 0) != length:
        raise OSError(errno.EIO, "short O_DIRECT probe write")
    buf.view[:length] = bytes(length)
    if os.preadv(fd, [buf.view[:length]], 0) != length or buf.view[:length] != pattern:
        raise OSError(errno.EIO, "O_DIRECT probe read back different bytes")


@dataclass(frozen=True)
class FileReport:
    direct: bool
    alignment: int
    reason: str  # why buffered I/O is used ('' when direct)


class BlockFile:
    """A file of ``num_blocks`` blocks, each ``block_bytes`` padded to the DIO alignment."""

    def __init__(self, path: str | os.PathLike[str], block_bytes: int, num_blocks: int,
                 direct: bool | None = None) -> None:
        """``direct``: True requires O_DIRECT, False never uses it, None probes and falls back."""
        self.path = os.path.abspath(os.fspath(path))
        # ``named``: the file's name while it keeps one (only where the unlink failed), else None
        self.fd, self.naming, self.named = _create_unnamed(self.path)
        try:
            st = os.fstat(self.fd)
            self._identity = (st.st_dev, st.st_ino)
            try:
                reported = dio_alignment(self.fd)
            except OSError:
                reported = None
            alignment = max(reported) if reported else DEFAULT_ALIGNMENT
            self.alignment = max(alignment, 512)
            self.block_bytes = block_bytes
            self.stride = round_up(block_bytes, self.alignment)
            self.num_blocks = num_blocks
            self.direct, self.reason = False, "buffered I/O requested"
            if direct is not False:
                self.direct, self.reason = self._try_direct()
                if direct and not self.direct:
                    raise OSError(errno.EINVAL, f"O_DIRECT requested but unusable on {self.path}: {self.reason}")
            try:
                os.ftruncate(self.fd, self.stride * num_blocks)
            except (OverflowError, OSError) as exc:
                if isinstance(exc, OSError) and exc.errno not in (errno.EFBIG, errno.EINVAL):
                    raise
                raise ValueError(f"num_disk_blocks={num_blocks}: a file of {num_blocks} × {self.stride} bytes "
                                 f"is larger than the filesystem of {os.path.dirname(self.path)} allows") from None
        except BaseException:
            self._remove()
            raise

    def _try_direct(self) -> tuple[bool, str]:
        flags = fcntl.fcntl(self.fd, fcntl.F_GETFL)
        try:
            fcntl.fcntl(self.fd, fcntl.F_SETFL, flags | os.O_DIRECT)
        except OSError as exc:
            return False, f"O_DIRECT refused by the filesystem ({errno.errorcode.get(exc.errno or 0)})"
        probe = HostBuffer(round_up(self.alignment, 4096))
        try:
            _probe_io(self.fd, probe, self.alignment)
        except OSError as exc:
            fcntl.fcntl(self.fd, fcntl.F_SETFL, flags)
            return False, f"O_DIRECT probe I/O failed ({errno.errorcode.get(exc.errno or 0, exc.errno)})"
        finally:
            probe.close()
            os.ftruncate(self.fd, 0)  # the probe's bytes are not block data
        return True, ""

    @property
    def report(self) -> FileReport:
        return FileReport(self.direct, self.alignment, self.reason)

    def offset(self, disk_block: int) -> int:
        return disk_block * self.stride

    def offsets(self, disk_blocks: Any, n: int) -> Any:
        """The offsets of ``n`` blocks given as a C int64 array, as a C uint64 array (for pumps):
        the same rule as :meth:`offset`, in one C pass."""
        return scaled(disk_blocks, n, self.stride)

    def _remove(self) -> None:
        """Unlink the file's name if it still has one and it is still our file, then close the fd
        (even if the unlink failed: its error is raised after the fd is closed)."""
        try:
            if self.named is not None:
                st = os.stat(self.named, follow_symlinks=False)
                if (st.st_dev, st.st_ino) == getattr(self, "_identity", None):
                    os.unlink(self.named)
                self.named = None
        except FileNotFoundError:
            pass
        finally:
            if self.fd >= 0:
                os.close(self.fd)
                self.fd = -1

    def close(self) -> None:
        """Close (and so free) the file. Call only once no I/O on the fd is in flight (else the fd
        number may be reused)."""
        if self.fd >= 0:
            self._remove()

    @property
    def closed(self) -> bool:
        return self.fd < 0


def _create_unnamed(path: str) -> tuple[int, str, str | None]:
    """An fd of a new, empty 0600 file in ``path``'s directory, how it was made, and its name if it
    kept one (None: nameless)."""
    directory = os.path.dirname(path)
    try:
        fd = os.open(directory, os.O_TMPFILE | os.O_RDWR | os.O_EXCL | os.O_CLOEXEC, 0o600)
        return fd, "unnamed (O_TMPFILE)", None
    except OSError as exc:
        if exc.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL, errno.ENOSYS):
            raise  # ENOENT, EACCES, EROFS, ...: the directory itself is the problem
        reason = errno.errorcode.get(exc.errno or 0, str(exc.errno))
    # mkstemp: O_CREAT|O_EXCL|O_NOFOLLOW, mode 0600, a random name nobody can have prepared
    fd, name = tempfile.mkstemp(prefix=os.path.basename(path) + ".", dir=directory)
    os.set_inheritable(fd, False)
    try:
        os.unlink(name)
    except OSError as exc:
        unlink_reason = errno.errorcode.get(exc.errno or 0, str(exc.errno))
        return fd, f"named {name} (O_TMPFILE refused: {reason}; unlink refused: {unlink_reason})", name
    return fd, f"unlinked at creation (O_TMPFILE refused: {reason})", None
