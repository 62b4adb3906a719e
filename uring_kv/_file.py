"""The block file: secure creation, O_DIRECT probing, alignment, layout, removal.

The file may hold user prompts (KV blocks), so by default it never has a name another process could
open, and nothing of it outlives the process, even under SIGKILL: it is made unnamed
(``O_TMPFILE|O_EXCL`` in the directory of ``path``, mode 0600: it can never be linked into the
tree), or, where the filesystem lacks O_TMPFILE, created under a fresh random name beside ``path``
(``O_CREAT|O_EXCL|O_NOFOLLOW``, 0600) and unlinked at once, before any block is written; the fd
keeps it. Only where even that unlink fails is the file left named (``named`` says so) and removed
when the engine closes.

A *kept* file (``keep=True``, a persistent store's) is ``path`` itself: opened if it exists, created
otherwise, and left in place at close. It is refused unless it is a regular file (never through a
symlink), owned by this process's user, with no access for group or others; it is created 0600,
locked with ``flock`` against a second process, and never shrunk (its bytes are blocks someone may
still index).

Space: ``open`` refuses a file the filesystem has no room for (its size, or a kept file's growth,
against the free space ``statvfs`` reports to this user), one line naming the size, the free space
and the directory, instead of serving for an hour and then failing store after store with ENOSPC.
The file is sparse: other files on the filesystem can still take the room later, unless
``reserve=True`` allocates every block now (``fallocate``); a filesystem that cannot reserve
(``reserved`` False, ``reserve_reason`` why) is used unreserved.

O_DIRECT is probed with a real aligned write and read (on a scratch unnamed file beside a kept
file, whose bytes must not be touched): some filesystems accept the flag at ``open`` and fail the
first I/O (overlayfs, FUSE, some NFS). Offsets, lengths and buffers keep ``alignment`` (the larger
of what statx reports, at least 512), except buffers on tmpfs, whose O_DIRECT is the page cache's
copy: there ``memory_alignment`` is 8 where the probe's read into a buffer 8 bytes past a page
works (elsewhere it is ``alignment``: a block device's own rule can be smaller, NVMe's is 4 bytes,
but rows off a page split its requests, and other filesystems may take a misaligned read by
quietly going through the page cache). The engine reads straight into cache rows that keep it.
This module does blocking syscalls: call it off the event loop (the engine uses ``to_thread``).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import fcntl
import os
import stat
import tempfile
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


def free_bytes(fd: int, close: bool = False) -> int | None:
    """The bytes this user may still allocate on ``fd``'s filesystem, or None where the filesystem
    reports no size at all (its ``f_blocks`` is 0, as some virtual ones do): nothing to check.
    ``close``: close ``fd`` afterwards."""
    try:
        st = os.fstatvfs(fd)
    finally:
        if close:
            os.close(fd)
    return st.f_bavail * st.f_frsize if st.f_blocks else None


def refuse_beyond_free_space(what: str, needed: int, directory: str, fd: int | None = None) -> None:
    """Raise ValueError, one line, where ``needed`` bytes exceed the free space of the filesystem
    holding ``directory`` (``fd``, an open file there, when there is one): "``what`` does not fit in
    the N free on the filesystem of ``directory``"."""
    free = free_bytes(os.open(directory, os.O_RDONLY | os.O_CLOEXEC) if fd is None else fd, close=fd is None)
    if free is not None and needed > free:
        raise ValueError(f"{what} does not fit in the {size_text(free)} free on the filesystem of {directory}")


def size_text(nbytes: int) -> str:
    """``nbytes`` in the largest binary unit it fills, e.g. '4 TiB', '71.5 GiB', '512 bytes'."""
    for shift, unit in ((40, "TiB"), (30, "GiB"), (20, "MiB"), (10, "KiB")):
        if nbytes >= 1 << shift:
            return f"{nbytes / (1 << shift):.4g} {unit}"
    return f"{nbytes} bytes"


_libc: Any = None


def _c() -> Any:
    """libc through ctypes, loaded once, with the argument types of the calls made here."""
    global _libc
    if _libc is None:
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        libc.fallocate.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64)
        libc.fstatfs.argtypes = (ctypes.c_int, ctypes.c_void_p)
        _libc = libc
    return _libc


def _fallocate(fd: int, length: int) -> None:
    """Allocate bytes [0, length) of ``fd`` (mode 0: the size grows to ``length`` if smaller).
    fallocate(2) itself, not glibc's posix_fallocate, which writes a byte per block on a
    filesystem that cannot reserve instead of saying so."""
    if _c().fallocate(fd, 0, 0, length) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))


class BlockFile:
    """A file of ``num_blocks`` blocks, each ``block_bytes`` padded to the DIO alignment."""

    def __init__(self, path: str | os.PathLike[str], block_bytes: int, num_blocks: int,
                 direct: bool | None = None, keep: bool = False, reserve: bool = False) -> None:
        """``direct``: True requires O_DIRECT, False never uses it, None probes and falls back.
        ``keep``: the file is ``path`` itself, kept at close (see the module docstring); ``created``
        then says whether it was made now (False: it existed, and its bytes are as they were).
        ``reserve``: allocate every block now (see the module docstring)."""
        self.path = os.path.abspath(os.fspath(path))
        self.keep = keep
        self.created = False
        self._lock_fd = -1  # a kept file's lock: an fd of its own (a ring's registered file outlives close)
        if keep:
            self.fd, self._lock_fd, self.created = _open_kept(self.path)
            self.naming, self.named = f"kept at {self.path}", None
        else:
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
            self.direct, self.reason, self.memory_alignment = False, "buffered I/O requested", 1
            if direct is not False:
                self.direct, self.reason, probed = self._try_direct()
                if self.direct:
                    self.memory_alignment = probed
                if direct and not self.direct:
                    raise OSError(errno.EINVAL, f"O_DIRECT requested but unusable on {self.path}: {self.reason}")
            size = self.stride * num_blocks
            was = os.fstat(self.fd).st_size
            try:
                if not keep or was < size:  # a kept file only grows
                    os.ftruncate(self.fd, size)
            except (OverflowError, OSError) as exc:
                if isinstance(exc, OSError) and exc.errno not in (errno.EFBIG, errno.EINVAL):
                    raise
                raise ValueError(f"num_disk_blocks={num_blocks}: a file of {num_blocks} × {self.stride} bytes "
                                 f"is larger than the filesystem of {os.path.dirname(self.path)} allows") from None
            try:
                self._check_space(size, was if keep else 0)
                self.reserved, self.reserve_reason = self._reserve(size) if reserve else (False, "reserve_space is off")
            except BaseException:
                if keep and was < size:  # give back only the growth made just now: those blocks were never used
                    os.ftruncate(self.fd, was)
                raise
        except BaseException:
            if self.created:  # made for nothing: leave no empty file behind
                with contextlib.suppress(OSError):
                    os.unlink(self.path)
            self._remove()
            raise

    def stats(self) -> dict[str, Any]:
        """What it shows of itself in ``Engine.stats()``: ``direct`` and why not (``direct_reason``),
        how it is named (``file``), whether it was allocated whole at open (``reserved``) and why
        not (``reserve_reason``), ``stride`` (block ``d`` at ``d * stride``)."""
        return {"direct": self.direct, "direct_reason": self.reason, "file": self.naming, "reserved": self.reserved,
                "reserve_reason": self.reserve_reason, "stride": self.stride}

    def _check_space(self, size: int, was: int) -> None:
        """Refuse a file whose growth from ``was`` bytes to ``size`` exceeds the filesystem's free
        space (a kept file that does not grow was checked when it was sized: reopening it after the
        disk filled up still serves what it holds)."""
        if size <= was:
            return
        shape = f"{self.num_blocks} × {self.stride} bytes"
        what = (f"the file's growth from {size_text(was)} to {size_text(size)} ({shape})" if was else
                f"a file of {shape} ({size_text(size)})")
        what = f"num_disk_blocks={self.num_blocks}: {what}"
        refuse_beyond_free_space(what, size - was, os.path.dirname(self.path), self.fd)

    def _reserve(self, size: int) -> tuple[bool, str]:
        """Allocate the whole file now: (True, '') or, where the filesystem cannot, (False, why)."""
        try:
            _fallocate(self.fd, size)
        except OSError as exc:
            if exc.errno == errno.ENOSPC:  # taken by another process since the check
                raise ValueError(f"num_disk_blocks={self.num_blocks}: reserving {size_text(size)} for the file in "
                                 f"{os.path.dirname(self.path)} failed: the filesystem is full (ENOSPC)") from None
            if exc.errno in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                return False, f"the filesystem cannot reserve space ({errno.errorcode[exc.errno]})"
            raise
        return True, ""

    def _try_direct(self) -> tuple[bool, str, int]:
        """(usable, why not, the memory alignment the probe found) for O_DIRECT on this file."""
        if not self.keep:
            return _probe_direct(self.fd, self.alignment)
        scratch, _, name = _create_unnamed(self.path)  # same directory, so the same filesystem
        try:
            usable, reason, memory = _probe_direct(scratch, self.alignment)
        finally:
            os.close(scratch)
            if name is not None:
                with contextlib.suppress(OSError):
                    os.unlink(name)
        if usable:
            try:
                fcntl.fcntl(self.fd, fcntl.F_SETFL, fcntl.fcntl(self.fd, fcntl.F_GETFL) | os.O_DIRECT)
            except OSError as exc:
                return False, f"O_DIRECT refused by the filesystem ({errno.errorcode.get(exc.errno or 0)})", 1
        return usable, reason, memory

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
            if self._lock_fd >= 0:
                os.close(self._lock_fd)
                self._lock_fd = -1

    def close(self) -> None:
        """Close (and so free) the file. Call only once no I/O on the fd is in flight (else the fd
        number may be reused)."""
        if self.fd >= 0:
            self._remove()

    @property
    def closed(self) -> bool:
        return self.fd < 0


def _probe_direct(fd: int, alignment: int) -> tuple[bool, str, int]:
    """Turn O_DIRECT on for ``fd`` (an empty file) if a real aligned write and read work with it:
    (usable, why not, the memory alignment it needs: ``PROBE_MISALIGNMENT`` if a read into a buffer
    that far off a page works too, else ``alignment``); the file is left empty."""
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, flags | os.O_DIRECT)
    except OSError as exc:
        return False, f"O_DIRECT refused by the filesystem ({errno.errorcode.get(exc.errno or 0)})", 1
    page = os.sysconf("SC_PAGE_SIZE")
    span = round_up(2 * page, alignment)  # across pages (one sector misaligned may pass where more does not)
    probe = HostBuffer(round_up(max(alignment, span), page) + page)
    try:
        _probe_io(fd, probe, alignment)
        memory = PROBE_MISALIGNMENT if _on_tmpfs(fd) and _reads_misaligned(fd, probe, span) else alignment
    except OSError as exc:
        fcntl.fcntl(fd, fcntl.F_SETFL, flags)
        return False, f"O_DIRECT probe I/O failed ({errno.errorcode.get(exc.errno or 0, exc.errno)})", 1
    finally:
        probe.close()
        os.ftruncate(fd, 0)  # the probe's bytes are not block data
    return True, "", memory


PROBE_MISALIGNMENT = 8  # the buffer address the memory probe tries: 8 bytes past a page
TMPFS_MAGIC = 0x01021994  # statfs(2)'s f_type of tmpfs


def _on_tmpfs(fd: int) -> bool:
    """Whether ``fd``'s file is on tmpfs (fstatfs's f_type; False where it cannot be told)."""
    buf = ctypes.create_string_buffer(256)  # struct statfs (120 bytes on 64-bit Linux), f_type first
    if _c().fstatfs(fd, buf) != 0:
        return False
    return ctypes.c_long.from_buffer(buf).value == TMPFS_MAGIC


def _reads_misaligned(fd: int, buf: HostBuffer, length: int) -> bool:
    """Whether an O_DIRECT read of ``length`` bytes at offset 0 into ``buf`` + PROBE_MISALIGNMENT
    works and reads what an aligned write put there (False if anything of it fails)."""
    pattern = bytes((i * 11 + 3) & 0xFF for i in range(256)) * (length // 256)
    buf.view[:length] = pattern
    at = buf.view[PROBE_MISALIGNMENT:PROBE_MISALIGNMENT + length]
    try:
        if os.pwritev(fd, [buf.view[:length]], 0) != length:
            return False
        at[:] = bytes(length)
        return os.preadv(fd, [at], 0) == length and at == pattern
    except OSError:  # EINVAL where the address must be aligned; ENOSPC for the write: no answer either way
        return False
    finally:
        at.release()


def _open_kept(path: str) -> tuple[int, int, bool]:
    """An fd of the kept file at ``path`` (made now, 0600, or an existing one that passes the
    checks of the module docstring), an fd holding its lock, and whether it was made now.

    The lock has an open file of its own: an io_uring ring keeps a reference to the files
    registered with it until its teardown ends in the kernel, after the engine has closed, and a
    lock taken through the registered fd would outlive the engine by that much."""
    flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC
    created = True
    try:
        fd = os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        created = False
        try:
            fd = os.open(path, flags)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise OSError(errno.ELOOP, f"{path} is a symbolic link; a kept block file must not be one") from None
            raise
    lock_fd = -1
    try:
        check_private(fd, path)
        if created:
            os.fchmod(fd, 0o600)  # (a umask may have narrowed it further)
        lock_fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        if not os.path.samestat(os.fstat(lock_fd), os.fstat(fd)):
            raise OSError(errno.EAGAIN, f"{path} was replaced while it was being opened")
        lock(lock_fd, path)
    except BaseException:
        os.close(fd)
        if lock_fd >= 0:
            os.close(lock_fd)
        if created:
            with contextlib.suppress(OSError):
                os.unlink(path)
        raise
    return fd, lock_fd, created


def check_private(fd: int, path: str) -> None:
    """Refuse ``fd`` unless it is a regular file of this process's user that group and others
    cannot access (it holds KV blocks, or the index of a persistent store)."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise OSError(errno.EINVAL, f"{path} is not a regular file")
    if st.st_uid != os.geteuid():
        raise PermissionError(errno.EPERM, f"{path} belongs to uid {st.st_uid}, not to this process's user "
                              f"(uid {os.geteuid()})")
    if stat.S_IMODE(st.st_mode) & 0o077:
        raise PermissionError(errno.EPERM, f"{path} has mode {stat.S_IMODE(st.st_mode):04o}: other users may "
                              "read it; it must be 0600")


def lock(fd: int, path: str) -> None:
    """An exclusive ``flock`` on ``fd``, or an error saying another process holds it."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise OSError(errno.EBUSY, f"{path} is in use by another process (locked)") from None


def _exactly_0600(fd: int, name: str | None = None) -> None:
    """Make a new file 0600 whatever the umask (a narrow one, 0277 or 0777, would leave the owner
    unable to write it, or to open it again through /proc/self/fd); on failure close it and remove
    its ``name`` if it has one."""
    try:
        os.fchmod(fd, 0o600)
    except BaseException:
        os.close(fd)
        if name is not None:
            with contextlib.suppress(OSError):
                os.unlink(name)
        raise


def _create_unnamed(path: str) -> tuple[int, str, str | None]:
    """An fd of a new, empty 0600 file in ``path``'s directory, how it was made, and its name if it
    kept one (None: nameless)."""
    directory = os.path.dirname(path)
    try:
        fd = os.open(directory, os.O_TMPFILE | os.O_RDWR | os.O_EXCL | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        if exc.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL, errno.ENOSYS):
            raise  # ENOENT, EACCES, EROFS, ...: the directory itself is the problem
        reason = errno.errorcode.get(exc.errno or 0, str(exc.errno))
    else:
        _exactly_0600(fd)
        return fd, "unnamed (O_TMPFILE)", None
    # mkstemp: O_CREAT|O_EXCL|O_NOFOLLOW, mode 0600, a random name nobody can have prepared
    fd, name = tempfile.mkstemp(prefix=os.path.basename(path) + ".", dir=directory)
    os.set_inheritable(fd, False)
    try:
        os.unlink(name)
    except OSError as exc:
        unlink_reason = errno.errorcode.get(exc.errno or 0, str(exc.errno))
        _exactly_0600(fd, name)
        return fd, f"named {name} (O_TMPFILE refused: {reason}; unlink refused: {unlink_reason})", name
    _exactly_0600(fd)
    return fd, f"unlinked at creation (O_TMPFILE refused: {reason})", None
