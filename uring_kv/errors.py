"""Exceptions raised by uring_kv."""

from __future__ import annotations

import errno as _errno
import os


class UringKVError(Exception):
    """Base class of uring_kv's own errors."""


class UringUnavailable(UringKVError):
    """io_uring cannot be used here (the reason says why); the thread fallback can."""


class EngineClosedError(UringKVError, RuntimeError):
    """The engine was closed (or is closing) and accepts no more work."""


class BlockIOError(UringKVError, OSError):
    """One or more disk blocks of a batch failed. ``failures`` maps disk block → errno.

    Every other block of the batch completed, and every staging slot went back to the pool.
    """

    def __init__(self, op: str, failures: dict[int, int]) -> None:
        self.failures = dict(sorted(failures.items()))
        first_errno = next(iter(self.failures.values()))
        parts = [f"{block} ({_errno.errorcode.get(code, code)}: {os.strerror(code)})"
                 for block, code in list(self.failures.items())[:8]]
        more = f" and {len(self.failures) - 8} more" if len(self.failures) > 8 else ""
        super().__init__(first_errno, f"{op} failed for disk block(s) {', '.join(parts)}{more}")
        self.disk_blocks = list(self.failures)
