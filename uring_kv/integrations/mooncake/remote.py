"""Mooncake Store as a remote block tier: cache rows ↔ checksummed values in a Mooncake cluster.

It owns one Mooncake client (``mooncake.store.MooncakeDistributedStore``), the staging rows
registered with it (``mooncake_staging``: their lifetime and the values' format), and the one
worker thread every client call runs on. It never touches the local block store
(``uring_kv.integrations.mooncake.TieredStore`` puts the two together), and ``import uring_kv``
never imports it or Mooncake.

Some facts about the Mooncake client (0.3.13), and what follows for the tier:

* Its calls block (a master RPC, then a TCP or RDMA transfer) and release the GIL, except
  ``setup`` and ``close``, which hold it. So they run on a worker thread of their own and the
  event loop waits for a future; ``open()`` and ``aclose()`` still stall the process while the
  client sets up (tens of ms) and closes (up to 2 s).
* A master that is down makes ``setup`` retry for about 90 s (holding the GIL), so ``open()``
  first opens a TCP connection to it (and to an HTTP metadata server) and fails at once if it
  cannot.
* A call to a master that does not answer (paused, partitioned) returns ``RPC_TIMEOUT`` only
  after 30 s; a dead master gives ``RPC_FAIL`` at once, a put up to 4 s later. So each call has
  a deadline of ``timeout`` seconds: past it, its keys are misses (gets) or not stored (puts),
  and the tier stops calling Mooncake until the late call returns and ``retry_after`` more
  seconds have passed (the same after an ``RPC_FAIL``): a down cluster costs one timeout, not
  one per call, and the local tier keeps serving meanwhile.
* A restarted master knows no object and no segment; clients mount theirs again by themselves
  within about 2 s (puts meanwhile fail with ``NO_AVAILABLE_HANDLE``). A client that exits takes
  the values in its segment with it (gets of them fail, then miss).
* Remote keys are ``{namespace}/{block bytes}-{layout crc}/{key hex}``: processes with the same
  namespace and the same cache layout share them; another layout never reads them.
* A key a put finds already there (``OBJECT_ALREADY_EXISTS``) counts as stored: keys are content
  hashes, so its bytes are the same.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from urllib.parse import urlsplit

import crc32c

from uring_kv._args import as_list, checked_keys
from uring_kv._layout import CacheLayout
from uring_kv._loop import LoopServices, OpenClose, current_services
from uring_kv._memory import HostBuffer
from uring_kv._native import BlockCopier
from uring_kv.errors import EngineClosedError
from uring_kv.integrations.mooncake.config import MooncakeConfig, MooncakeError, check_reachable
from uring_kv.integrations.mooncake.staging import (
    BAD_VALUE,
    NO_AVAILABLE_HANDLE,
    NOT_TRIED,
    OBJECT_ALREADY_EXISTS,
    OBJECT_NOT_FOUND,
    PAGE,
    TIMED_OUT,
    TRAILER,
    UNREACHABLE,
    Call,
    StagingRows,
    error_name,
    intact,
    seal,
    wait_for,
)

log = logging.getLogger("uring_kv.mooncake")

class MooncakeTier(OpenClose):
    """Cache rows ↔ values in a Mooncake cluster, for one layout of CPU caches (see the module
    docstring). ``caches``: as for :class:`uring_kv.BlockStore` (host tensors; dim 0 = row), or
    their :class:`uring_kv.CacheLayout`.

    ``await open()`` sets the client up and registers the staging rows (MooncakeError if it
    cannot); then, on that loop, :meth:`fetch` loads keys into rows, :meth:`begin_store` writes
    rows under keys and :meth:`exists` asks which keys the cluster holds. None of them raises for
    a remote failure: a failed key is a miss or an unstored key, counted in :meth:`stats`. The
    rows a call names must stay untouched until it returns. ``client``: a ready client to use
    instead of making one (tests)."""

    def __init__(self, caches: Any, config: MooncakeConfig, *, client: Any = None) -> None:
        layout = CacheLayout.of(caches)
        if layout.device.type != "cpu":
            raise ValueError(f"MooncakeTier takes host (CPU) caches; these are on {layout.device}")
        self.config = config
        self._layout = layout  # keeps the tensors alive: the copier holds their addresses
        tensor_bytes = list(layout.tensor_block_bytes)
        self.block_bytes = layout.block_bytes
        self.value_bytes = self.block_bytes + TRAILER.size
        self.num_rows = layout.num_rows
        self._stride = -(-self.value_bytes // PAGE) * PAGE
        self._copier = BlockCopier([t.data_ptr() for t in layout.tensors], tensor_bytes, layout.offsets)
        layout_crc = crc32c.crc32c(repr(tensor_bytes).encode())
        self.prefix = f"{config.namespace}/{self.block_bytes}-{layout_crc:08x}/"
        self._client = client
        self._own_client = client is None
        self._executor: ThreadPoolExecutor | None = None
        self._staging: HostBuffer | None = None
        self._svc: LoopServices | None = None
        self.rows: StagingRows
        self.stuck = 0  # calls past their deadline that have not returned
        self._quiet_until = 0.0  # no calls before this (monotonic)
        self.last_error = ""
        self._pending: set[Any] = set()  # write-back stores not yet answered
        self._state = "new"
        self._ended: Any = None  # a future: the open() or aclose() under way ended (see aclose)
        self._counts = dict.fromkeys(("hits", "misses", "bad_values", "errors", "timeouts", "not_tried", "stored",
                                      "store_failures", "no_space"), 0)

    # ----------------------------------------------------------------- lifecycle
    @property
    def svc(self) -> LoopServices:
        assert self._svc is not None
        return self._svc

    async def open(self) -> MooncakeTier:
        """Set the client up (on the worker thread), make and register the staging rows."""
        if self._state != "new":
            raise RuntimeError(f"Mooncake tier is {self._state}; open() is called once")
        self._svc = current_services()
        self._state = "opening"
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="uring-kv-mooncake")
        set_up = self._submit(self._set_up)
        try:
            await self._svc.wait(set_up)
        except BaseException:
            # Cancelled (a timeout), the set-up still runs on the worker: wait for it, then undo
            # whatever it made (its client, the registered rows), so nothing outlives the tier.
            await self._svc.wait_through_cancellation(set_up)
            with contextlib.suppress(BaseException):
                await self._svc.wait_through_cancellation(self._submit(self._tear_down))
            self._state = "closed"
            await self._svc.run_to_completion(self._svc.to_thread(self._executor.shutdown, True))
            self._finished()
            raise
        self.rows = StagingRows(self.config.staging_rows, self._svc)
        self._state = "open"
        self._finished()
        return self

    def _set_up(self) -> None:
        bind = self.config.resolved_bind_address()
        if bind is not None:
            os.environ["MC_TCP_BIND_ADDRESS"] = bind
        if self._client is None:
            from mooncake.store import MooncakeDistributedStore

            c = self.config
            check_reachable("master", c.master_address, c.timeout)  # set-up retries for 90 s, holding the GIL
            if c.metadata_server.startswith("http://"):
                check_reachable("metadata server", urlsplit(c.metadata_server).netloc, c.timeout)
            client = MooncakeDistributedStore()
            rc = client.setup(c.local_hostname, c.metadata_server, c.segment_bytes, c.local_buffer_bytes, c.protocol,
                              c.rdma_devices, c.master_address)
            if rc != 0:
                raise MooncakeError(f"Mooncake client set-up failed ({rc}): master {c.master_address}, "
                                    f"metadata {c.metadata_server}, protocol {c.protocol}")
            self._client = client
        staging = HostBuffer(self.config.staging_rows * self._stride)
        rc = self._client.register_buffer(staging.addr, staging.size)
        if rc != 0:
            staging.close()
            self._close_client()
            raise MooncakeError(f"registering {staging.size} bytes of staging rows with Mooncake failed ({rc})")
        self._staging = staging

    async def aclose(self) -> None:
        """Wait for the write-backs and calls in flight (a call stuck on an unresponsive master
        returns within Mooncake's own RPC timeout, 30 s), unregister the rows, close the client
        (if it made it) and stop the worker thread. Idempotent."""
        if self._state in ("new", "closed"):
            self._state = "closed"
            return
        if self._state != "open":  # closing, or still opening: wait for that to end (then closed)
            if self._ended is None:
                self._ended = self.svc.create_future()
            await self.svc.wait_through_cancellation(self._ended)
            if self._state == "open":  # open() finished meanwhile: close it now
                await self.aclose()
            return
        self._state = "closing"
        svc = self.svc
        try:
            for fut in list(self._pending):
                await svc.wait_through_cancellation(fut)
            await svc.run_to_completion(self.rows.drained())  # a get may still be copying out of its rows
            assert self._executor is not None
            await svc.wait_through_cancellation(self._submit(self._tear_down))
            await svc.run_to_completion(svc.to_thread(self._executor.shutdown, True))
        finally:
            self._state = "closed"
            self._finished()

    def _finished(self) -> None:
        """open() or aclose() has ended: wake any aclose() waiting for it."""
        ended, self._ended = self._ended, None
        if ended is not None and not ended.done():
            ended.set_result(None)

    def _tear_down(self) -> None:
        staging, self._staging = self._staging, None
        if staging is not None:
            self._client.unregister_buffer(staging.addr)
            if hasattr(self, "rows") and self.rows.resting:  # (no rows: open() did not finish)
                _KEPT.append(staging)  # a resting row may still be a transfer's target: never unmap it
            else:
                staging.close()
        self._close_client()

    def _close_client(self) -> None:
        if self._own_client and self._client is not None:
            client, self._client = self._client, None
            client.close()

    # ----------------------------------------------------------------- state
    @property
    def available(self) -> bool:
        """Whether calls go to Mooncake now (open, no call stuck past its deadline, not backing off)."""
        return self._state == "open" and self.stuck == 0 and time.monotonic() >= self._quiet_until

    def back_off(self) -> None:
        self._quiet_until = time.monotonic() + self.config.retry_after

    def note_error(self, message: str, back_off: bool = True) -> None:
        if message != self.last_error or self.available:
            log.warning("uring_kv: Mooncake tier: %s%s", message,
                        f"; calls resume in {self.config.retry_after:g} s" if back_off else "")
        self.last_error = message
        if back_off:
            self.back_off()

    def stats(self) -> dict[str, int]:
        """Counts since open, of keys: hits, misses (not in the cluster), bad_values (wrong size
        or checksum: dropped), errors, not_tried (skipped while backing off), stored,
        store_failures (of which no_space); of calls: timeouts. And now: available (0/1),
        stuck_calls, resting_rows, pending_stores."""
        return {**self._counts, "available": int(self.available), "stuck_calls": self.stuck,
                "resting_rows": self.rows.resting if self._state == "open" else 0,
                "pending_stores": len(self._pending)}

    # ----------------------------------------------------------------- calls (the loop)
    def remote_key(self, key: bytes) -> str:
        return self.prefix + key.hex()

    async def fetch(self, keys: Sequence[bytes], rows: Sequence[int]) -> list[bytes]:
        """Load each key's value into its row; returns the keys whose checked bytes are now in
        their rows. Every other key is a miss and its row is left as it was."""
        pairs = self._pairs(keys, rows)
        loaded: list[bytes] = []
        start = 0
        while start < len(pairs):
            if (staging := await self._next_rows(len(pairs) - start)) is None:
                break
            chunk, start = pairs[start:start + len(staging)], start + len(staging)
            call = Call(self, staging)
            self._submit(self._get_into, [self.remote_key(key) for key, _ in chunk], staging, call=call)
            codes = await self._answer(call)
            if codes is None:
                continue
            try:
                good = [j for j, code in enumerate(codes) if code == 0]
                if good:
                    self._copier.host(False, [self._row_addr(staging[j]) for j in good], [chunk[j][1] for j in good])
            finally:
                call.release()
            loaded += [chunk[j][0] for j in good]
            self.tally(codes, store=False)
        return loaded

    async def begin_store(self, keys: Sequence[bytes], rows: Sequence[int]) -> StoreJob:
        """Copy the rows into staging rows and start writing them under the keys; returns once
        every row is copied (the caller may then reuse them), with a :class:`StoreJob` whose
        ``wait()`` gives the keys that were not stored. A job nobody waits for still finishes
        (``aclose`` waits for it); its failures are counted all the same."""
        pairs = self._pairs(keys, rows)
        job = StoreJob(self)
        start = 0
        while start < len(pairs):
            if (staging := await self._next_rows(len(pairs) - start)) is None:
                job.failed.update((key, NOT_TRIED) for key, _ in pairs[start:])
                break
            chunk, start = pairs[start:start + len(staging)], start + len(staging)
            call = Call(self, staging)
            call.abandoned = call.stores = True  # nothing is read back: the rows go back when the worker returns
            try:
                self._copier.host(True, [self._row_addr(row) for row in staging], [row for _, row in chunk])
            except BaseException:
                call.outcome = [0] * len(staging)
                call.release()
                raise
            self._submit(self._put_from, [self.remote_key(key) for key, _ in chunk], staging, call=call)
            job.calls.append(([key for key, _ in chunk], call))
            self._pending.add(call.fut)
            call.fut.add_done_callback(self._pending.discard)
        return job

    async def exists(self, keys: Sequence[bytes]) -> list[bool] | None:
        """Which keys the cluster holds now (a hint: a key may go before it is fetched); None
        when Mooncake was not asked or did not answer in time."""
        names = [self.remote_key(key) for key in checked_keys(keys)]
        if not names or not self.available:
            return None
        call = Call(self, [])
        self._submit(self._client.batch_is_exist, names, call=call)
        try:
            found = await wait_for(self.svc, call.fut, self.config.timeout)
        except TimeoutError:
            call.abandon(timed_out=True)
            self._counts["timeouts"] += 1
            self.note_error(f"batch_is_exist timed out after {self.config.timeout:g} s")
            return None
        except BaseException:
            call.abandon(timed_out=False)
            raise
        if not isinstance(found, list) or len(found) != len(names):
            return None
        if any(flag < 0 for flag in found):  # -1: that key's lookup failed (a miss)
            self.note_error("batch_is_exist failed for some keys", back_off=False)
        return [flag == 1 for flag in found]

    # ----------------------------------------------------------------- internals
    async def _next_rows(self, remaining: int) -> list[int] | None:
        """Staging rows for the next chunk, or None: the ``remaining`` keys are not tried (backing
        off, or no row came in time)."""
        if self.available:
            with contextlib.suppress(TimeoutError):
                return await self.rows.acquire(remaining, self.config.timeout)
        self._counts["not_tried"] += remaining
        return None

    async def _answer(self, call: Call) -> list[int] | None:
        """The call's codes, or None when it timed out (its keys are counted) or was cancelled
        (re-raised); either way the rows then go back when the worker returns."""
        try:
            codes: list[int] = await wait_for(self.svc, call.fut, self.config.timeout)
            return codes
        except TimeoutError:
            call.abandon(timed_out=True)
            self._counts["timeouts"] += 1
            self.note_error(f"a call timed out after {self.config.timeout:g} s")
            return None
        except BaseException:
            call.abandon(timed_out=False)
            raise

    def tally(self, codes: Sequence[int], store: bool) -> None:
        counts = self._counts
        for code in codes:
            if store:
                if code == 0:
                    counts["stored"] += 1
                else:
                    counts["store_failures"] += 1
                    counts["no_space"] += code == NO_AVAILABLE_HANDLE
            elif code == 0:
                counts["hits"] += 1
            elif code == OBJECT_NOT_FOUND:
                counts["misses"] += 1
            elif code == BAD_VALUE:
                counts["bad_values"] += 1
            else:
                counts["errors"] += 1
        if unreachable := [code for code in codes if code in UNREACHABLE]:
            self.note_error(f"Mooncake unreachable ({error_name(unreachable[0])})")

    def _submit(self, fn: Callable[..., Any], *args: Any, call: Call | None = None) -> Any:
        """Run ``fn(*args)`` on the worker thread; its outcome settles ``call`` (or a fresh future)."""
        if self._state not in ("open", "opening", "closing") or self._executor is None:
            raise EngineClosedError(f"Mooncake tier is {self._state}")
        svc = self.svc
        fut = call.fut if call is not None else svc.create_future()

        def run() -> None:
            started = time.monotonic()
            try:
                outcome, ok = fn(*args), True
            except BaseException as exc:
                outcome, ok = exc, False
            with contextlib.suppress(RuntimeError):  # the loop is gone: nobody is left to tell
                if call is not None:
                    svc.call_soon_threadsafe(call.settle, ok, outcome, time.monotonic() - started)
                else:
                    svc.call_soon_threadsafe(_settle, fut, ok, outcome)

        self._executor.submit(run)
        return fut

    def _row_addr(self, row: int) -> int:
        assert self._staging is not None
        return self._staging.addr + row * self._stride

    async def client_get_into(self, names: list[str], rows: list[int]) -> list[int]:
        """The Mooncake client's ``batch_get_into`` alone: ``names`` (as :meth:`remote_key` makes
        them) into staging ``rows`` the caller holds (from :attr:`rows`), on the worker thread, with
        no checksum, no copy and no counts; the client's answer (bytes, or a negative error code,
        per name). What the tier adds to the client is measured against it (``uring-kv
        bench-mooncake``)."""
        return list(await self.svc.wait(self._submit(self._client_get_into, names, rows)))

    def _client_get_into(self, names: list[str], rows: list[int]) -> list[int]:
        """(worker) See :meth:`client_get_into`."""
        return list(self._client.batch_get_into(names, [self._row_addr(row) for row in rows],
                                                [self.value_bytes] * len(names)))

    def _get_into(self, names: list[str], staging: list[int]) -> list[int]:
        """(worker) Fetch the values into the rows and check each one."""
        assert self._staging is not None
        got = self._client.batch_get_into(names, [self._row_addr(row) for row in staging],
                                          [self.value_bytes] * len(names))
        codes = []
        for name, row, size in zip(names, staging, got, strict=True):
            if size < 0:
                codes.append(int(size))
            elif size != self.value_bytes or not intact(self._staging.view, row * self._stride, self.block_bytes, name):
                codes.append(BAD_VALUE)
            else:
                codes.append(0)
        return codes

    def _put_from(self, names: list[str], staging: list[int]) -> list[int]:
        """(worker) Seal each row with its trailer and write the values."""
        assert self._staging is not None
        for name, row in zip(names, staging, strict=True):
            seal(self._staging.view, row * self._stride, self.block_bytes, name)
        codes = self._client.batch_put_from(names, [self._row_addr(row) for row in staging],
                                            [self.value_bytes] * len(names))
        return [0 if code == OBJECT_ALREADY_EXISTS else int(code) for code in codes]


    def _pairs(self, keys: Sequence[bytes], rows: Sequence[int]) -> list[tuple[bytes, int]]:
        if self._state != "open":
            raise EngineClosedError(f"Mooncake tier is {self._state}")
        key_list = checked_keys(keys)
        row_list = [int(row) for row in as_list(rows)]
        if len(key_list) != len(row_list):
            raise ValueError(f"keys has {len(key_list)} entries but rows has {len(row_list)}")
        if bad := [row for row in row_list if not 0 <= row < self.num_rows]:
            raise ValueError(f"row {bad[0]} is out of range [0, {self.num_rows})")
        if len(set(row_list)) != len(row_list):
            raise ValueError("a row appears twice in one call")
        return list(zip(key_list, row_list, strict=True))


class StoreJob:
    """The writes one :meth:`MooncakeTier.begin_store` started."""

    def __init__(self, tier: MooncakeTier) -> None:
        self._tier = tier
        self.calls: list[tuple[list[bytes], Call]] = []
        self.failed: dict[bytes, int] = {}  # key → code, for keys not even tried

    async def wait(self) -> dict[bytes, int]:
        """The keys that were not stored, with their codes (a Mooncake ``ErrorCode``, or
        :data:`TIMED_OUT`, :data:`NOT_TRIED`, :data:`CALL_FAILED`)."""
        failed = dict(self.failed)
        for keys, call in self.calls:
            codes = await self._tier._answer(call)
            if codes is None:
                failed.update((key, TIMED_OUT) for key in keys)
                continue
            failed.update((key, code) for key, code in zip(keys, codes, strict=True) if code != 0)
        self.calls = []
        return failed

    def detach(self) -> None:
        """Nobody will wait: each call still releases its rows and counts its keys when it returns."""
        self.calls = []


def _settle(fut: Any, ok: bool, outcome: Any) -> None:
    if fut.done():
        return
    if ok:
        fut.set_result(outcome)
    else:
        fut.set_exception(outcome)


_KEPT: list[HostBuffer] = []  # staging slabs that a transfer may still target: kept mapped until exit
