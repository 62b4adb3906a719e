"""Key stores for threaded callers: any :class:`uring_kv.KeyStore` on a private event loop on its own
thread, callable from any thread (:class:`SyncStore`, the one wrapper; :class:`SyncBlockStore` is it
over a ``BlockStore``, the Mooncake ``SyncTieredStore`` over a ``TieredStore``).

Serving frameworks call their KV tiers from their own threads, often under a lock they hold for the
whole call, and poll for completions. So nothing here waits for I/O unless asked to:

* ``submit_put`` / ``submit_get`` hand the call to the store's loop and return a
  ``concurrent.futures.Future`` at once (a thread-safe wake-up of the loop, no more); the blocking
  ``put`` / ``get`` are those plus ``.result()``;
* ``contains`` / ``lookup`` / ``stats`` read the store's index from the caller's thread, with no
  trip through the loop: each key is one dict membership test, atomic under the GIL, and the loop
  changes the index only once a key's bytes are written (see ``uring_kv.store``).

Calls submitted from one thread start on the loop in submission order, so a get submitted after a
put's future completed sees that put's keys (unless evicted since).

Asyncio users who do not use it pay nothing: importing it starts nothing, and no thread exists
until a :class:`LoopThread` is made.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import threading
import weakref
from collections.abc import Callable, Coroutine, Iterable, Sequence
from concurrent.futures import CancelledError, Future
from typing import Any, Generic, Self, TypeVar

from uring_kv._args import as_list
from uring_kv._prefetch import Prefetch
from uring_kv.errors import EngineClosedError
from uring_kv.keystore import KeyStore
from uring_kv.store import BlockStore
from uring_kv.striped import StripedBlockStore

T = TypeVar("T")
S = TypeVar("S", bound=KeyStore)


class LoopThread:
    """An asyncio event loop running on a thread of its own until :meth:`close`.

    The thread runs ``asyncio.run``, so closing it also cancels any task left, shuts down async
    generators and joins the loop's executor threads: nothing of it outlives ``close()``."""

    def __init__(self, name: str = "uring-kv-loop") -> None:
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._failure: BaseException | None = None
        self._tasks: set[asyncio.Future[Any]] = set()  # calls under way (see submit)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._failure is not None:
            self._thread.join()
            raise self._failure

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as exc:  # only before it was ready: afterwards _main just returns
            self._failure = exc
            self._ready.set()

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        self._ready.set()
        await self._stop.wait()

    @property
    def thread(self) -> threading.Thread:
        return self._thread

    def in_thread(self) -> bool:
        """Whether the caller runs on the loop's own thread (where waiting for it would deadlock)."""
        return threading.current_thread() is self._thread

    def submit(self, coro: Coroutine[Any, Any, T]) -> Future[T]:
        """Run ``coro`` on the loop; returns at once. Its result or exception goes to the future.
        Coroutines submitted from one thread start in submission order.

        The future is running from the start, so ``cancel()`` returns False and changes nothing:
        a call on the loop owns the memory it was given until it ends, and a future that ended
        before it (as ``asyncio.run_coroutine_threadsafe``'s does when cancelled) would hand that
        memory back while the call may still write to it. If the loop stops first, the future
        gets ``concurrent.futures.CancelledError`` as its exception."""
        assert self._loop is not None
        future: Future[T] = Future()
        future.set_running_or_notify_cancel()

        def start() -> None:
            task = asyncio.ensure_future(coro)
            self._tasks.add(task)  # (the loop keeps only a weak reference to a task)
            task.add_done_callback(self._tasks.discard)
            task.add_done_callback(functools.partial(_settle, future))

        try:
            self._loop.call_soon_threadsafe(start)
        except RuntimeError:  # the loop has ended
            coro.close()
            raise
        return future

    def finish_soon(self, coro: Coroutine[Any, Any, Any]) -> None:
        """From the loop's own thread, where nothing may wait for the loop: run ``coro`` on the
        loop (its errors dropped), then stop the loop; the thread then ends by itself."""
        assert self._loop is not None and self._stop is not None
        stop = self._stop

        async def last() -> None:
            try:
                with contextlib.suppress(Exception):
                    await coro
            finally:
                stop.set()

        # (threadsafe: it wakes the loop, which a finalizer run inside the loop's own step may
        # otherwise leave waiting in its selector; the future is not needed: the loop ends with it)
        self._loop.call_soon_threadsafe(self.submit, last())

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the loop and wait for its result (never from the loop's own thread)."""
        if self.in_thread():
            coro.close()
            raise RuntimeError("LoopThread.run() called on the loop's own thread: it would wait for itself")
        return self.submit(coro).result()

    def close(self) -> None:
        """Stop the loop (cancelling whatever still runs on it) and join the thread. Idempotent."""
        if self.in_thread():
            raise RuntimeError("LoopThread.close() called on the loop's own thread: it would wait for itself")
        if self._loop is not None and self._stop is not None:
            with contextlib.suppress(RuntimeError):  # the loop has already ended
                self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join()


class SyncStore(Generic[S]):
    """Any :class:`uring_kv.KeyStore` (``store``, not yet opened) on a private event-loop thread,
    callable from any thread.

    It opens the store on its thread before returning (raising what ``open()`` raised, with no
    thread left behind; TypeError if ``store`` is not a ``KeyStore``). ``submit_put`` /
    ``submit_get`` / ``submit_get_present`` never block: they return a
    ``concurrent.futures.Future`` whose result is the store call's (the keys written, None, the
    keys loaded) or whose exception is the one it raised (:class:`KeyMissingError`,
    :class:`KeyIOError`, ...). Its callbacks run on the store's thread and must not block.
    ``contains`` / ``lookup`` / ``stats`` answer from the caller's thread without waiting for the
    loop. The cache rows a call names must stay untouched (and alive) until its future completes;
    the future refuses ``cancel()`` (see :meth:`LoopThread.submit`), so that moment is always the
    call's end.

    ``close()`` (or leaving ``with``) refuses new calls, lets every call submitted before it finish
    (each future gets its result, or an error saying the store closed), closes the store and joins
    the thread. Dropped without ``close()``, it is closed all the same (what is in flight finishes
    first). One thread per store. :class:`SyncBlockStore` and the Mooncake ``SyncTieredStore``
    are this over the stores they build."""

    def __init__(self, store: S, *, thread_name: str = "uring-kv-store") -> None:
        if not isinstance(store, KeyStore):
            raise TypeError(f"SyncStore takes a uring_kv.KeyStore, got {type(store).__name__}")
        self.store: S = store
        self._lock = threading.Lock()  # held only to check-and-submit, never across a wait
        self._closing = False
        self._close_lock = threading.Lock()  # held through close(): a second close() waits for the first
        self._loop = LoopThread(name=thread_name)
        try:
            self._loop.run(store.open())
        except BaseException:
            with contextlib.suppress(Exception):
                self._loop.run(store.aclose())
            self._loop.close()
            raise
        # Dropped without close(): close it then (what is in flight finishes first), so that no
        # thread, fd or reference to the caller's cache memory outlives the object.
        self._finalizer = weakref.finalize(self, _close_abandoned, self._loop, store)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def thread(self) -> threading.Thread:
        """The thread the store's loop runs on."""
        return self._loop.thread

    @property
    def closed(self) -> bool:
        """Whether ``close()`` was called: new calls are refused."""
        return self._closing

    # ----------------------------------------------------------------- no round trip
    def contains(self, key: bytes) -> bool:
        """Whether ``key`` is in the store now (see :meth:`BlockStore.contains`); never waits."""
        return self.store.contains(key)

    def lookup(self, keys: Iterable[bytes]) -> int:
        """How many of ``keys``, from the first, are in the store now; never waits."""
        return self.store.lookup(keys)

    def stats(self) -> dict[str, int]:
        """The store's ``stats()``; never waits."""
        return self.store.stats()

    # ----------------------------------------------------------------- submitted to the loop
    def submit_put(self, keys: Iterable[bytes], rows: Iterable[int], after: Any = None) -> Future[int]:
        """The store's ``put`` on its loop; returns its future (the keys written) at once."""
        return self._submit(self.store.put, keys, rows, after)

    def submit_get(self, keys: Iterable[bytes], rows: Iterable[int], after: Any = None, *,
                   prefetch: Prefetch | None = None) -> Future[None]:
        """The store's ``get`` on its loop; returns its future at once. ``prefetch``: run it as a
        prefetch until ``prefetch.upgrade()`` (from any thread)."""
        return self._submit(functools.partial(self.store.get, prefetch=prefetch), keys, rows, after)

    def submit_get_present(self, keys: Iterable[bytes], rows: Iterable[int], after: Any = None, *,
                           prefetch: Prefetch | None = None) -> Future[list[bytes]]:
        """The store's ``get_present`` on its loop; returns its future (the keys loaded) at once.
        ``prefetch``: as for :meth:`submit_get`."""
        return self._submit(functools.partial(self.store.get_present, prefetch=prefetch), keys, rows, after)

    def put(self, keys: Iterable[bytes], rows: Iterable[int], after: Any = None, timeout: float | None = None) -> int:
        """``submit_put(...).result(timeout)``: waits for the keys to be written (not from the
        store's own thread) and returns how many this put wrote. A timeout leaves the put running."""
        self._check_waitable()
        return self.submit_put(keys, rows, after).result(timeout)

    def get(self, keys: Iterable[bytes], rows: Iterable[int], after: Any = None, timeout: float | None = None, *,
            prefetch: Prefetch | None = None) -> None:
        """``submit_get(...).result(timeout)``: waits for the rows to be loaded (not from the
        store's own thread). A timeout leaves the get running: its rows stay in use until it ends."""
        self._check_waitable()
        self.submit_get(keys, rows, after, prefetch=prefetch).result(timeout)

    def get_present(self, keys: Iterable[bytes], rows: Iterable[int], after: Any = None,
                    timeout: float | None = None, *, prefetch: Prefetch | None = None) -> list[bytes]:
        """``submit_get_present(...).result(timeout)``: the keys loaded (not from the store's own thread)."""
        self._check_waitable()
        return self.submit_get_present(keys, rows, after, prefetch=prefetch).result(timeout)

    def close(self) -> None:
        """Refuse new calls, finish those submitted, close the store, join its thread. Returns only
        once all that is done (a second call waits for the first). Not from the store's thread."""
        self._check_waitable()
        self._finalizer.detach()
        with self._close_lock:
            with self._lock:
                if self._closing and not self._loop.thread.is_alive():
                    return
                self._closing = True
            try:
                self._loop.run(self.store.aclose())  # queued behind every call submitted before
            finally:
                self._loop.close()

    def _submit(self, call: Callable[..., Coroutine[Any, Any, T]], keys: Iterable[bytes], *args: Any) -> Future[T]:
        """``call(keys, *args)`` on the loop (keys as a list; rows, the second of a transfer's
        arguments, as they are now: the caller may reuse its list), unless closed."""
        if args:
            args = (as_list(args[0]), *args[1:])
        with self._lock:
            self._check_open()
            return self._loop.submit(call(list(keys), *args))

    def _wait(self, call: Callable[..., Coroutine[Any, Any, T]], keys: Iterable[bytes], *args: Any) -> T:
        """``_submit(...)``, waited for (not from the store's own thread)."""
        self._check_waitable()
        return self._submit(call, keys, *args).result()

    def _check_open(self) -> None:
        if self._closing:
            raise EngineClosedError(f"{type(self).__name__} is closed")

    def _check_waitable(self) -> None:
        if self._loop.in_thread():
            raise RuntimeError(f"a blocking {type(self).__name__} call on the store's own thread would wait for "
                               "itself; use submit_put/submit_get there")


class SyncBlockStore(SyncStore[BlockStore | StripedBlockStore]):
    """A :class:`uring_kv.BlockStore` on a private event-loop thread, callable from any thread: a
    :class:`SyncStore` (its calls, futures, lookups and closing) over the store it builds.

    Takes the arguments of :class:`BlockStore` (``path`` a list or tuple of paths: a
    :class:`uring_kv.StripedBlockStore` over those files, one per drive) and opens it before
    returning (raising what ``open()`` raised, with no thread left behind). ``close()`` closes the
    store, and the file goes with it. One thread per store."""

    def __init__(self, caches: Any, path: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
                 capacity_blocks: int | None = None, num_slots: int = 16, *, capacity_bytes: int | None = None,
                 **engine_options: Any) -> None:
        store: BlockStore | StripedBlockStore
        if isinstance(path, (list, tuple)):
            store = StripedBlockStore(caches, path, capacity_blocks, num_slots, capacity_bytes=capacity_bytes,
                                      **engine_options)
        else:
            store = BlockStore(caches, path, capacity_blocks, num_slots,  # type: ignore[arg-type]
                               capacity_bytes=capacity_bytes, **engine_options)
        super().__init__(store, thread_name="uring-kv-store")


def _close_abandoned(loop: LoopThread, store: KeyStore) -> None:
    """A SyncStore's finalizer: close its store and its thread. On that thread (the last
    reference went in a callback there) it cannot wait: the loop closes the store next, then stops."""
    if loop.in_thread():
        loop.finish_soon(store.aclose())
        return
    with contextlib.suppress(Exception):
        loop.run(store.aclose())
    loop.close()


def _settle(future: Future[Any], task: asyncio.Future[Any]) -> None:
    """A loop call's outcome, to the future :meth:`LoopThread.submit` gave out."""
    if task.cancelled():
        future.set_exception(CancelledError())
    elif (error := task.exception()) is not None:
        future.set_exception(error)
    else:
        future.set_result(task.result())
