"""The staging rows a Mooncake tier moves values through, the calls that own them, the values'
format, and Mooncake's codes.

Some facts, and what follows:

* ``batch_get_into``/``batch_put_from`` move bytes straight from and into memory registered with
  ``register_buffer``, so the staging rows are that memory (page-aligned, one value each), and a
  row belongs to its call until the call has *returned* in the worker thread, whatever became of
  the coroutine that made it (timed out, cancelled): the rule the engine's slots follow.
* Returning is not always enough. A call waits for its transfers' slices to finish or fail, but
  for at most 60 s (``wait_for_completion`` in Mooncake's ``transfer_task.cpp``); past that it
  gives up *without cancelling them*, and the transport may still write into (or read from) the
  row. So a row goes back at once after success, after a code that comes before any transfer or
  after its end (``BUFFER_FREE``), or after any failure that came sooner than that wait
  (``TRANSFER_FAIL`` from a dead peer comes in a millisecond: every slice failed); otherwise (a
  failure after ``TRANSFER_WAIT`` seconds, or a client call that raised) it rests for the tier's
  ``quarantine`` before reuse. When every row not in use rests, calls do not wait for one: their
  keys are simply not tried.
* A value's bytes are only as good as the memory and the network they crossed. A value is the
  block's bytes followed by a 32-byte trailer: magic, length, and the crc32c of the bytes seeded
  with the crc32c of the remote key, so that a value under another key fails as well. A fetched
  value whose size, trailer or checksum is wrong is a miss (``BAD_VALUE``), never a block.
* Mooncake's client returns its ``ErrorCode`` values as plain ints; they are named here, with the
  tier's own codes (``BAD_VALUE``, ``TIMED_OUT``, ...) beyond their range.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import struct
import time
from collections import deque
from collections.abc import Iterable
from typing import Any

import crc32c

from uring_kv._loop import LoopServices

log = logging.getLogger("uring_kv.mooncake")

# Mooncake Store's ErrorCode values (mooncake-store/include/types.h); the client returns them as ints.
NO_AVAILABLE_HANDLE = -200  # no space in any segment
INVALID_PARAMS = -600  # e.g. the buffer is smaller than the value (checked before any transfer)
REPLICA_IS_NOT_READY = -703
OBJECT_NOT_FOUND = -704
OBJECT_ALREADY_EXISTS = -705
LEASE_EXPIRED = -707  # (get) decided after the transfer ended
TRANSFER_FAIL = -800
RPC_FAIL = -900
RPC_TIMEOUT = -901
# The tier's own codes
BAD_VALUE = -1_000_001  # a fetched value of the wrong size, or whose trailer or checksum is wrong
TIMED_OUT = -1_000_002  # past the call's deadline
NOT_TRIED = -1_000_003  # the tier was backing off, or no staging row came in time
CALL_FAILED = -1_000_004  # the client raised

ERROR_NAMES = {NO_AVAILABLE_HANDLE: "NO_AVAILABLE_HANDLE", INVALID_PARAMS: "INVALID_PARAMS",
               REPLICA_IS_NOT_READY: "REPLICA_IS_NOT_READY", OBJECT_NOT_FOUND: "OBJECT_NOT_FOUND",
               OBJECT_ALREADY_EXISTS: "OBJECT_ALREADY_EXISTS", LEASE_EXPIRED: "LEASE_EXPIRED",
               TRANSFER_FAIL: "TRANSFER_FAIL", RPC_FAIL: "RPC_FAIL", RPC_TIMEOUT: "RPC_TIMEOUT",
               BAD_VALUE: "bad value (size, trailer or checksum)", TIMED_OUT: "timed out",
               NOT_TRIED: "not tried (remote tier backing off)", CALL_FAILED: "client call raised"}
# After these, Mooncake no longer touches the call's buffer: it never started a transfer, or the
# transfer ended (a bad value was fully received).
BUFFER_FREE = frozenset({0, NO_AVAILABLE_HANDLE, INVALID_PARAMS, REPLICA_IS_NOT_READY, OBJECT_NOT_FOUND,
                          OBJECT_ALREADY_EXISTS, LEASE_EXPIRED, RPC_FAIL, RPC_TIMEOUT, BAD_VALUE})
# Mooncake's wait for a transfer's slices (60 s) less a margin: a failure that came sooner left none running
TRANSFER_WAIT = 50.0
# After these, the cluster is unreachable as a whole: back off
UNREACHABLE = frozenset({RPC_FAIL, RPC_TIMEOUT, TIMED_OUT})

TRAILER = struct.Struct("<8sQII8x")  # magic, payload bytes, crc32c, reserved; 32 bytes
MAGIC = b"UKVMOON1"
PAGE = 4096


def error_name(code: int) -> str:
    """A code's name (a Mooncake ``ErrorCode``, or the tier's own)."""
    return ERROR_NAMES.get(code, f"Mooncake error {code}")


def rows_free_after(code: int, seconds: float) -> bool:
    """Whether a row is free for reuse once a call that took ``seconds`` gave it ``code``."""
    if code >= 0 or code in BUFFER_FREE:
        return True
    return code != CALL_FAILED and seconds < TRANSFER_WAIT


def checksum(name: str, payload: Any) -> int:
    """The crc32c of ``payload`` seeded with that of the remote key ``name``."""
    return int(crc32c.crc32c(payload, crc32c.crc32c(name.encode())))

def seal(view: memoryview, offset: int, block_bytes: int, name: str) -> None:
    """Write the trailer of the value at ``offset`` (its block's bytes already there) for key ``name``."""
    TRAILER.pack_into(view, offset + block_bytes, MAGIC, block_bytes,
                      checksum(name, view[offset:offset + block_bytes]), 0)


def intact(view: memoryview, offset: int, block_bytes: int, name: str) -> bool:
    """Whether the value at ``offset`` has the trailer and checksum of a block of key ``name``."""
    magic, length, sum_ = TRAILER.unpack_from(view, offset + block_bytes)[:3]
    return bool(magic == MAGIC and length == block_bytes and sum_ == checksum(name, view[offset:offset + block_bytes]))


async def wait_for(svc: LoopServices, fut: Any, timeout: float) -> Any:
    """``fut``'s result, or TimeoutError after ``timeout`` seconds; ``fut`` is never cancelled."""
    if svc.name == "trio":
        import trio

        with trio.move_on_after(timeout):
            return await svc.wait(fut)
        raise TimeoutError
    return await asyncio.wait_for(asyncio.shield(fut), timeout)


class StagingRows:
    """The staging rows' free list (row numbers; the memory is the tier's): FIFO waiters, each
    handed between one row and as many as it asked for; resting rows come back on a later take
    once their time is up. On the loop only."""

    def __init__(self, count: int, svc: LoopServices) -> None:
        self.count = count
        self._svc = svc
        self._free = list(range(count))
        self._resting: list[tuple[float, int]] = []  # (until, row)
        self._waiters: deque[tuple[int, Any]] = deque()
        self._idle: list[Any] = []  # futures of drained(): no row held by a call

    @property
    def resting(self) -> int:
        return len(self._resting)

    def _take(self, wanted: int) -> list[int]:
        if self._resting:
            now = time.monotonic()
            back = [row for until, row in self._resting if until <= now]
            if back:
                self._resting = [(until, row) for until, row in self._resting if until > now]
                self._free += back
        taken, self._free = self._free[:wanted], self._free[wanted:]
        return taken

    async def acquire(self, wanted: int, timeout: float) -> list[int]:
        """Between 1 and ``wanted`` rows; TimeoutError if none came within ``timeout`` seconds, at
        once if no row is in use (all the others rest: none would come back in time)."""
        if not self._waiters and (taken := self._take(wanted)):
            return taken
        if len(self._free) + len(self._resting) == self.count:
            raise TimeoutError
        fut = self._svc.create_future()
        entry = (wanted, fut)
        self._waiters.append(entry)
        try:
            rows: list[int] = await wait_for(self._svc, fut, timeout)
            return rows
        except BaseException:
            if fut.done() and not fut.cancelled():  # handed rows just as it gave up: pass them on
                self.give_back(fut.result())
            else:
                with contextlib.suppress(ValueError):
                    self._waiters.remove(entry)
            raise

    def give_back(self, rows: Iterable[int]) -> None:
        self._free += rows
        while self._waiters and self._free:
            wanted, fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(self._take(wanted))
        self._check_idle()

    def rest(self, rows: Iterable[int], seconds: float) -> None:
        until = time.monotonic() + seconds
        self._resting += [(until, row) for row in rows]
        self._check_idle()

    async def drained(self) -> None:
        """Return once no row is held by a call or by the coroutine reading it (resting rows do
        not count): the memory may then be unregistered. Waits through cancellation."""
        while len(self._free) + len(self._resting) < self.count:
            fut = self._svc.create_future()
            self._idle.append(fut)
            await self._svc.wait_through_cancellation(fut)

    def _check_idle(self) -> None:
        if self._idle and len(self._free) + len(self._resting) == self.count:
            idle, self._idle = self._idle, []
            for fut in idle:
                if not fut.done():
                    fut.set_result(None)


class Call:
    """One client call on the tier's worker thread, and the staging rows it owns until it returns.

    ``tier`` is the :class:`~uring_kv.integrations.mooncake.remote.MooncakeTier` that made it
    (its loop services, rows, config, and its counts of stuck calls and errors). On the loop only,
    but for :meth:`settle`, which the worker schedules there."""

    __slots__ = ("abandoned", "fut", "outcome", "rows", "seconds", "stores", "tier", "timed_out")
    # abandoned: nobody reads the rows after the worker returns, so they go back right then;
    # stores: a put, whose keys are counted when it returns (whoever waits for it, if anyone)

    def __init__(self, tier: Any, rows: list[int]) -> None:
        self.tier, self.rows = tier, rows
        self.fut = tier.svc.create_future()
        self.outcome: Any = None
        self.seconds = 0.0  # how long the client call took
        self.abandoned = self.timed_out = self.stores = False

    def settle(self, ok: bool, outcome: Any, seconds: float) -> None:
        """On the loop, once the worker returned."""
        self.outcome = outcome if ok else [CALL_FAILED] * len(self.rows)
        self.seconds = seconds
        if not ok:
            self.tier.note_error(f"Mooncake client call raised {outcome!r}", back_off=False)
        if self.timed_out:
            self.tier.stuck -= 1
            self.tier.back_off()
        if self.abandoned:
            self.release()
        if self.stores:
            self.tier.tally(self.outcome, store=True)
        if not self.fut.done():
            self.fut.set_result(self.outcome)

    def abandon(self, timed_out: bool) -> None:
        """The caller stopped waiting: the rows go back when the worker returns (now, if it did)."""
        self.abandoned = True
        if self.outcome is not None:
            self.release()
        elif timed_out:
            self.timed_out = True
            self.tier.stuck += 1

    def release(self) -> None:
        """Rows whose code says Mooncake is done with them go back; the others rest (quarantine)."""
        rows, self.rows = self.rows, []
        if not rows:
            return
        done = [rows_free_after(code, self.seconds) for code in self.outcome]
        free = [row for row, ok in zip(rows, done, strict=True) if ok]
        resting = [row for row, ok in zip(rows, done, strict=True) if not ok]
        if resting:
            self.tier.rows.rest(resting, self.tier.config.quarantine)
            log.warning("uring_kv: %d Mooncake staging row(s) rest %.0f s: their call ended after %.0f s with %s",
                        len(resting), self.tier.config.quarantine, self.seconds,
                        ", ".join(sorted({error_name(c) for c in self.outcome if c < 0})))
        self.tier.rows.give_back(free)
