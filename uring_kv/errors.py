"""Exceptions raised by uring_kv."""

from __future__ import annotations

import errno as _errno
import os
from typing import Any


class UringKVError(Exception):
    """Base class of uring_kv's own errors."""


class UringUnavailable(UringKVError):
    """io_uring cannot be used here (the reason says why); the thread fallback can."""


class EngineClosedError(UringKVError, RuntimeError):
    """The engine was closed (or is closing) and accepts no more work."""


class EngineBusyError(UringKVError, OSError):
    """A call refused at once, having taken nothing: its class's queued and in-flight bytes would
    pass the budget given to the engine (``Engine(budgets=...)``). errno EBUSY; ``kind`` ("load",
    "store"), the call's ``nbytes``, the class's ``pending`` bytes and its ``budget``."""

    def __init__(self, kind: str, nbytes: int, pending: int, budget: int) -> None:
        super().__init__(_errno.EBUSY, f"{kind} of {nbytes} bytes refused: {pending} bytes of {kind}s are queued "
                                       f"or in flight, the budget is {budget}")
        self.kind, self.nbytes, self.pending, self.budget = kind, nbytes, pending, budget

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.kind, self.nbytes, self.pending, self.budget)


class GeometryMismatchError(UringKVError, ValueError):
    """A persistent store's files were written for other caches or another model than the store
    being opened (the message names the first difference): they are left untouched, and their
    bytes are never read as this store's blocks."""


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


def describe_key(key: bytes) -> str:
    """A key as error messages show it: its hex, cut at 32 bytes."""
    text = key[:32].hex()
    return text + "…" if len(key) > 32 else text or "b''"


class KeyMissingError(UringKVError, KeyError):
    """``get()`` was given keys the store does not hold: never put, evicted, still being written,
    or dropped after a failed store or load. ``keys`` lists them in call order. Raised before any
    I/O: no row was touched."""

    def __init__(self, keys: list[bytes]) -> None:
        self.keys = list(keys)
        shown = ", ".join(describe_key(key) for key in self.keys[:8])
        more = f" and {len(self.keys) - 8} more" if len(self.keys) > 8 else ""
        super().__init__(f"{len(self.keys)} key(s) not in the store: {shown}{more}")

    def __str__(self) -> str:  # KeyError's own shows the repr of its argument
        return str(self.args[0])


NO_ROOM = _errno.EBUSY  # the errno ``KeyIOError`` gives a key a put found no block for


class KeyIOError(UringKVError, OSError):
    """A ``put()`` or ``get()`` failed for some keys; ``failures`` maps key → errno.

    Every key it names is absent from the store afterwards (a later ``get`` raises
    :class:`KeyMissingError`); every other key of the call was stored or loaded. ``EBUSY``
    (``NO_ROOM``) means the put found no block to evict: every block was in flight. ``written``
    (a put's): how many of the other keys this put wrote (as ``put`` returns when nothing fails)."""

    def __init__(self, op: str, failures: dict[bytes, int], written: int = 0) -> None:
        self.failures = dict(failures)
        self.written = written
        first_errno = next(iter(self.failures.values()))
        parts = [f"{describe_key(key)} ({_reason(code)})" for key, code in list(self.failures.items())[:8]]
        more = f" and {len(self.failures) - 8} more" if len(self.failures) > 8 else ""
        super().__init__(first_errno, f"{op} failed for key(s) {', '.join(parts)}{more}")
        self.keys = list(self.failures)


def _reason(code: int) -> str:
    if code == NO_ROOM:
        return "no room: every block is being read or written"
    return f"{_errno.errorcode.get(code, code)}: {os.strerror(code)}"
