"""A small in-memory FUSE filesystem that fails reads or writes with EIO at chosen byte ranges,
and can lose the writes no fsync made durable, as a power loss does.

Real faults, not mocks: the engine's reads and writes go through the kernel (io_uring → FUSE → this
process), and the error the engine sees is the one the kernel returns. Needs root, /dev/fuse and
libfuse3 (``mfusepy``); the fixture skips with the reason when any is missing.

Power loss (``FaultState.volatile``): every file keeps, beside what reads see, its *durable*
bytes, which an ``fsync``/``fdatasync`` of the file (the FUSE fsync request) brings up to date.
``freeze()`` makes every later change fail (EIO), as if the power went at that instant;
``power_cut(rng)`` then rebuilds each file from its durable bytes plus a random part of the
writes made since its last sync: each 4 KiB piece of each such write (and each truncation) kept or
lost independently, as a disk's volatile cache may reorder and drop them. Not modelled: directory
entries (a file once created stays, synced or not) and sub-page tearing.
"""

from __future__ import annotations

import errno
import os
import stat
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

WATCHDOG_SECONDS = 60


class FaultState:
    def __init__(self) -> None:
        self._mutex = threading.Lock()
        self.bad_reads: list[tuple[int, int]] = []
        self.bad_writes: list[tuple[int, int]] = []
        self.slow_reads: list[tuple[int, int, float]] = []  # (start, end, seconds)
        self.slow_writes: list[tuple[int, int, float]] = []
        self.once_reads: list[list[Any]] = []  # [start, end, seconds, requests left]
        self.once_writes: list[list[Any]] = []
        self.volatile = False  # keep the writes since each file's last sync apart (power loss)
        self.frozen = False  # every change fails (EIO): the power went
        self.syncs = 0  # fsync requests served
        self.sync_delay = 0.0  # seconds each fsync takes (a disk's cache flush), before it makes anything durable
        self.cut: Any = None  # set by the filesystem: rebuilds the files as after a power loss
        self.reads: list[int] = []  # the offset of every read request, in the order they arrived
        self.held_reads: list[tuple[int, int]] = []  # reads touching these wait at the gate
        self.holding = 0  # reads waiting at the gate now
        self._passes = 0  # how many of them may go on
        self._gate = threading.Condition(self._mutex)

    def freeze(self) -> None:
        """From now on every write, truncation, creation and sync fails with EIO."""
        with self._mutex:
            self.frozen = True

    def power_cut(self, rng: Any, keep: float = 0.5) -> int:
        """Lose a random part of every file's unsynced writes (see the module docstring; each
        piece is kept with probability ``keep``), then thaw; returns how many pieces were lost."""
        assert self.frozen, "freeze() first: nothing may change while the files are rebuilt"
        lost = int(self.cut(rng, keep))
        with self._mutex:
            self.frozen = False
        return lost

    def fail_reads(self, start: int, length: int) -> None:
        with self._mutex:
            self.bad_reads.append((start, start + length))

    def fail_writes(self, start: int, length: int) -> None:
        with self._mutex:
            self.bad_writes.append((start, start + length))

    def slow_down(self, start: int, length: int, delay: float, reads: bool = True, writes: bool = True) -> None:
        """Reads and/or writes touching the range take ``delay`` seconds. Requests are served on
        several threads, and a slow one sleeps before it touches the bytes: a read slowed this way
        returns the bytes as they are at its end."""
        with self._mutex:
            if reads:
                self.slow_reads.append((start, start + length, delay))
            if writes:
                self.slow_writes.append((start, start + length, delay))

    def slow_next(self, start: int, length: int, delay: float, reads: bool = True, count: int = 1) -> None:
        """Only the next ``count`` reads (or writes) touching the range take ``delay`` seconds: of
        several requests for the same bytes, the first is slow and the later ones are not."""
        with self._mutex:
            (self.once_reads if reads else self.once_writes).append([start, start + length, delay, count])

    def hold_reads(self, start: int, length: int) -> None:
        """Reads touching the range wait, before they touch the bytes, until ``let_through``
        lets them on one by one, or ``clear`` opens the gate."""
        with self._mutex:
            self.held_reads.append((start, start + length))

    def let_through(self, count: int = 1) -> None:
        """Let ``count`` of the reads waiting at the gate (or the next to come) go on."""
        with self._mutex:
            self._passes += count
            self._gate.notify_all()

    def wait_at_gate(self, offset: int, size: int) -> None:
        with self._mutex:
            if not any(offset < end and start < offset + size for start, end in self.held_reads):
                return
            self.holding += 1
            try:
                opened = self._gate.wait_for(lambda: self._passes > 0 or not self.held_reads, WATCHDOG_SECONDS)
                assert opened, "a held read was never let through"
                if self.held_reads:
                    self._passes -= 1
            finally:
                self.holding -= 1

    def clear(self) -> None:
        with self._mutex:
            self.held_reads.clear()
            self._passes = 0
            self._gate.notify_all()
            self.bad_reads.clear()
            self.bad_writes.clear()
            self.slow_reads.clear()
            self.slow_writes.clear()
            self.once_reads.clear()
            self.once_writes.clear()

    def pause(self, ranges: list[tuple[int, int, float]], offset: int, size: int,
              once: list[list[Any]] | None = None) -> None:
        with self._mutex:
            delays = [delay for start, end, delay in ranges if offset < end and start < offset + size]
            for entry in once or ():
                if entry[3] > 0 and offset < entry[1] and entry[0] < offset + size:
                    entry[3] -= 1
                    delays.append(entry[2])
        if delays:
            time.sleep(max(delays))

    def hits(self, ranges: list[tuple[int, int]], offset: int, size: int) -> bool:
        with self._mutex:
            return any(offset < end and start < offset + size for start, end in ranges)


def _operations(state: FaultState) -> Any:
    import mfusepy

    class FaultFS(mfusepy.Operations):  # type: ignore[misc]
        use_ns = True  # times in integer nanoseconds

        def __init__(self) -> None:
            self.files: dict[str, bytearray] = {}
            self.modes: dict[str, int] = {}
            self.durable: dict[str, bytearray] = {}  # (volatile) the bytes as of the file's last sync
            self.unsynced: dict[str, list[tuple[int, bytes | None]]] = {}  # writes (offset, data) and
            # truncations (length, None) since then, in order
            self._mutex = threading.Lock()
            self.now = time.time_ns()

        def _change(self) -> None:
            if state.frozen:
                raise mfusepy.FuseOSError(errno.EIO)

        def fsync(self, path: str, datasync: int, fh: Any) -> int:
            self._change()
            if state.sync_delay:
                time.sleep(state.sync_delay)
                self._change()
            with self._mutex:
                state.syncs += 1
                if path in self.files:
                    self.durable[path] = bytearray(self.files[path])
                    self.unsynced[path] = []
            return 0

        def power_cut(self, rng: Any, keep: float) -> int:
            lost = 0
            with self._mutex:
                for path in list(self.files):
                    content = bytearray(self.durable.get(path, b""))
                    for where, data in self.unsynced.get(path, []):
                        if data is None:
                            if rng.random() < keep:
                                del content[where:]
                                content.extend(bytes(where - len(content)))
                            else:
                                lost += 1
                            continue
                        for start in range(0, len(data), 4096):
                            if rng.random() >= keep:
                                lost += 1
                                continue
                            piece = data[start:start + 4096]
                            end = where + start + len(piece)
                            if len(content) < end:
                                content.extend(bytes(end - len(content)))
                            content[where + start:end] = piece
                    self.files[path] = content
                    self.durable[path] = bytearray(content)
                    self.unsynced[path] = []
            return lost

        def getattr(self, path: str, fh: Any = None) -> dict[str, Any]:
            base = {"st_uid": 0, "st_gid": 0, "st_atime": self.now, "st_mtime": self.now, "st_ctime": self.now}
            if path == "/":
                return {**base, "st_mode": stat.S_IFDIR | 0o755, "st_nlink": 2}
            with self._mutex:
                if path not in self.files:
                    raise mfusepy.FuseOSError(errno.ENOENT)
                return {**base, "st_mode": stat.S_IFREG | self.modes[path], "st_nlink": 1,
                        "st_size": len(self.files[path])}

        def readdir(self, path: str, fh: Any) -> list[str]:
            return [".", "..", *(name[1:] for name in self.files)]

        def create(self, path: str, mode: int, fi: Any = None) -> int:
            self._change()
            with self._mutex:
                self.files[path] = bytearray()
                self.modes[path] = mode & 0o7777
                self.unsynced[path] = []
            return 0

        def open(self, path: str, flags: int) -> int:
            return 0

        def read(self, path: str, size: int, offset: int, fh: Any) -> bytes:
            with state._mutex:
                state.reads.append(offset)
            state.wait_at_gate(offset, size)
            state.pause(state.slow_reads, offset, size, state.once_reads)
            if state.hits(state.bad_reads, offset, size):
                raise mfusepy.FuseOSError(errno.EIO)
            with self._mutex:
                return bytes(self.files[path][offset:offset + size])

        def write(self, path: str, data: bytes, offset: int, fh: Any) -> int:
            state.pause(state.slow_writes, offset, len(data), state.once_writes)
            if state.hits(state.bad_writes, offset, len(data)):
                raise mfusepy.FuseOSError(errno.EIO)
            self._change()
            with self._mutex:
                buf = self.files[path]
                if len(buf) < offset + len(data):
                    buf.extend(bytes(offset + len(data) - len(buf)))
                buf[offset:offset + len(data)] = data
                if state.volatile:
                    self.unsynced.setdefault(path, []).append((offset, bytes(data)))
            return len(data)

        def truncate(self, path: str, length: int, fh: Any = None) -> None:
            self._change()
            with self._mutex:
                buf = self.files[path]
                del buf[length:]
                buf.extend(bytes(length - len(buf)))
                if state.volatile:
                    self.unsynced.setdefault(path, []).append((length, None))

        def unlink(self, path: str) -> None:
            self._change()
            with self._mutex:
                self.files.pop(path, None)
                self.modes.pop(path, None)
                self.durable.pop(path, None)
                self.unsynced.pop(path, None)

        def rename(self, old: str, new: str) -> None:
            # FUSE's own way to keep an open file that was unlinked (the engine's block file is):
            # it renames it to .fuse_hidden*, which is unlinked at the last close
            with self._mutex:
                if old not in self.files:
                    raise mfusepy.FuseOSError(errno.ENOENT)
                self.files[new] = self.files.pop(old)
                self.modes[new] = self.modes.pop(old)
                if old in self.durable:
                    self.durable[new] = self.durable.pop(old)
                self.unsynced[new] = self.unsynced.pop(old, [])

        def chmod(self, path: str, mode: int) -> None:
            with self._mutex:
                self.modes[path] = mode & 0o7777

        def statfs(self, path: str) -> dict[str, int]:
            return {"f_bsize": 4096, "f_frsize": 4096, "f_blocks": 1 << 20, "f_bfree": 1 << 19,
                    "f_bavail": 1 << 19, "f_namemax": 255}

    return FaultFS()


@contextmanager
def mounted(mountpoint: Path, watchdog_seconds: float = WATCHDOG_SECONDS) -> Iterator[FaultState]:
    """Mount the fault filesystem at ``mountpoint`` for the duration of the block (aborted after
    ``watchdog_seconds``: a test's safety net; long runs pass more)."""
    import mfusepy

    state = FaultState()
    ops = _operations(state)
    state.cut = ops.power_cut
    failure: list[BaseException] = []

    def serve() -> None:
        try:
            mfusepy.FUSE(ops, str(mountpoint), foreground=True, nothreads=False, direct_io=True, hard_remove=False)
        except BaseException as exc:  # surfaced below as a skip reason
            failure.append(exc)

    thread = threading.Thread(target=serve, name="faultfs", daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not os.path.ismount(mountpoint):
        if failure or not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError(f"could not mount the fault filesystem: {failure[0] if failure else 'timeout'}")
        time.sleep(0.02)
    # A watchdog: should anything wedge on this filesystem, abort the connection so every pending
    # request fails (ENOTCONN) and the test fails instead of hanging in the kernel.
    watchdog = threading.Timer(watchdog_seconds, _abort_connection, [mountpoint])
    watchdog.daemon = True
    watchdog.start()
    try:
        yield state
    finally:
        watchdog.cancel()
        if subprocess.run(["umount", str(mountpoint)], check=False, capture_output=True).returncode != 0:
            _abort_connection(mountpoint)
        thread.join(10)


def _abort_connection(mountpoint: Path) -> None:
    """Last resort: abort the FUSE connection so no thread waits forever on a dead server.
    Never touches the mountpoint itself (a stat there could hang too)."""
    connections = Path("/sys/fs/fuse/connections")
    if not os.path.ismount(connections):
        subprocess.run(["mount", "-t", "fusectl", "none", str(connections)], check=False, capture_output=True)
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        abort = connections / fields[2].split(":")[1] / "abort"
        if fields[4] == str(mountpoint) and abort.exists():
            abort.write_text("1")
    subprocess.run(["umount", "-l", str(mountpoint)], check=False, capture_output=True)
