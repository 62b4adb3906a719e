"""The few event-loop services the engine uses, for asyncio and for trio (directly or under anyio).

The engine is callback-driven: completions arrive from the ring's eventfd, from the bridge thread and
from worker threads, and handlers run on the loop thread. What it needs from the loop is small:

* a one-shot future (``create_future``) and a way to await one **without cancelling it**
  (``wait``): many awaiters share the same future (a hazard, a batch's completion), so a cancelled
  awaiter must only stop waiting, never cancel the shared result;
* ``wait_through_cancellation``: used by a cancelled call that must still wait for its started
  blocks (``asyncio``: swallow further cancellations until done; trio: a shielded cancel scope);
* ``call_soon`` (loop thread) and ``call_soon_threadsafe`` (any thread);
* ``add_reader`` / ``remove_reader`` for the ring's eventfd (asyncio's selector; under trio a system
  task blocked in ``wait_readable``);
* ``to_thread`` for the blocking file set-up, ``sleep``, and ``report`` for a handler that raised.

asyncio keeps its native, C-implemented futures and callbacks: the seam costs it nothing. Under trio
the futures are :class:`TrioFuture`, whose callbacks are scheduled with ``run_sync_soon`` so that the
ordering matches asyncio's (callbacks run later, in the order they were scheduled, never re-entrantly).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
from abc import ABC, abstractmethod
from collections.abc import Callable, Coroutine, Generator, Sequence
from typing import Any, Self, TypeVar

log = logging.getLogger("uring_kv")
T = TypeVar("T")

HOP_TURNS = 3  # loop turns in yield_to_io: the I/O's callback, then the task it woke, then the caller


class LoopServices(ABC):
    """What the engine asks of the running event loop. All methods but ``call_soon_threadsafe``
    are called on the loop thread."""

    name: str
    cancelled: type[BaseException]  # what a cancelled await raises here

    @abstractmethod
    def create_future(self) -> Any: ...

    @abstractmethod
    def is_current(self) -> bool:
        """Whether the calling code runs in this loop (on its thread, while it runs)."""

    @abstractmethod
    def is_closed(self) -> bool:
        """Whether the loop has finished for good (nothing it was asked to call will run)."""

    @abstractmethod
    async def wait(self, fut: Any) -> Any:
        """``fut``'s result (or exception). Cancelling the waiter leaves ``fut`` untouched."""

    @abstractmethod
    async def wait_through_cancellation(self, fut: Any) -> None:
        """Wait until ``fut`` is done, whatever cancellation arrives meanwhile (its error, if it
        failed, is left for its owner: this only waits)."""

    @abstractmethod
    async def run_to_completion(self, coro: Coroutine[Any, Any, Any]) -> Any:
        """Run ``coro`` to its end even if the caller is cancelled meanwhile; then re-raise the
        cancellation (for clean-up that must not stop half way, like closing the engine)."""

    @abstractmethod
    async def run_steps(self, steps: Generator[None, None, T]) -> T:
        """Run ``steps`` to its end, one step per loop turn (each ``yield`` gives the loop a turn),
        and return its value. A cancellation arriving meanwhile is held until the steps are done,
        then delivered at the caller's next checkpoint: what the steps set up is never left half
        made (the admission of a large batch)."""

    @abstractmethod
    def call_soon(self, fn: Callable[..., Any], *args: Any) -> None: ...

    @abstractmethod
    def call_soon_threadsafe(self, fn: Callable[..., Any], *args: Any) -> None:
        """From any thread. Raises RuntimeError once the loop is gone."""

    @abstractmethod
    def add_reader(self, fd: int, callback: Callable[[], None]) -> None: ...

    @abstractmethod
    def remove_reader(self, fd: int) -> None:
        """Stop watching ``fd``; the caller may close it right after."""

    @abstractmethod
    async def to_thread(self, fn: Callable[..., Any], *args: Any,
                        cleanup: Callable[[Any], None] | None = None) -> Any:
        """Run ``fn`` on a worker thread. A cancelled caller still waits for it to return; if the
        cancellation is raised, ``cleanup`` gets the result that nobody will receive."""

    @abstractmethod
    async def gather(self, coros: Sequence[Coroutine[Any, Any, Any]]) -> list[Any]:
        """Run ``coros`` at once, each to its end; their results in order, or the first error once
        all have ended. Cancelled, it cancels them all and returns (raising) once they have ended."""

    @abstractmethod
    async def sleep(self, seconds: float) -> None: ...

    @abstractmethod
    async def yield_to_io(self) -> None:
        """Give the loop ``HOP_TURNS`` bare turns, so that I/O that became ready meanwhile (a socket,
        a completion) is handled, and the task it wakes runs, before the caller goes on: a long
        synchronous stretch split by this keeps a client waiting for one part of it, not the whole."""

    @abstractmethod
    def report(self, message: str, exc: BaseException) -> None:
        """A completion handler raised: make it visible without stopping the other handlers."""

    def when_all(self, futs: Sequence[Any], callback: Callable[[], None]) -> None:
        """Call ``callback()`` on the loop once every future in ``futs`` is done, however it ended."""
        remaining = len(futs)

        def one_done(_fut: Any) -> None:
            nonlocal remaining
            remaining -= 1
            if remaining == 0:
                callback()

        if not futs:
            self.call_soon(callback)
        for fut in futs:
            fut.add_done_callback(one_done)


class AsyncioServices(LoopServices):
    name = "asyncio"
    cancelled = asyncio.CancelledError

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop

    def create_future(self) -> Any:
        return self.loop.create_future()

    def is_current(self) -> bool:
        return asyncio._get_running_loop() is self.loop

    def is_closed(self) -> bool:
        return self.loop.is_closed()

    async def wait(self, fut: Any) -> Any:
        if fut.done():
            return fut.result()
        return await asyncio.shield(fut)

    async def wait_through_cancellation(self, fut: Any) -> None:
        while not fut.done():
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await asyncio.shield(fut)

    async def run_to_completion(self, coro: Coroutine[Any, Any, Any]) -> Any:
        task = self.loop.create_task(coro)
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            await self.wait_through_cancellation(task)
            raise

    async def run_steps(self, steps: Generator[None, None, T]) -> T:
        held: asyncio.CancelledError | None = None
        try:
            while True:
                try:
                    next(steps)
                except StopIteration as stop:
                    return stop.value  # type: ignore[no-any-return]
                try:
                    await asyncio.sleep(0)
                except asyncio.CancelledError as exc:
                    held = exc
        finally:
            if held is not None:  # deliver it again, with its message (a cancel scope's mark) and
                task = asyncio.current_task()  # the task's cancel count as it was (asyncio.timeout)
                assert task is not None
                task.uncancel()
                task.cancel(held.args[0] if held.args else None)

    def call_soon(self, fn: Callable[..., Any], *args: Any) -> None:
        self.loop.call_soon(fn, *args)

    def call_soon_threadsafe(self, fn: Callable[..., Any], *args: Any) -> None:
        self.loop.call_soon_threadsafe(fn, *args)

    def add_reader(self, fd: int, callback: Callable[[], None]) -> None:
        self.loop.add_reader(fd, callback)

    def remove_reader(self, fd: int) -> None:
        if not self.loop.is_closed():  # a closed loop watches nothing any more
            self.loop.remove_reader(fd)

    async def to_thread(self, fn: Callable[..., Any], *args: Any,
                        cleanup: Callable[[Any], None] | None = None) -> Any:
        # asyncio.to_thread lets a cancelled caller go while the thread still runs (and, say, still
        # opens a file that nobody will close): wait for it, clean up its result, then re-raise.
        fut = self.loop.run_in_executor(None, fn, *args)
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            await self.wait_through_cancellation(fut)
            if cleanup is not None and not fut.cancelled() and fut.exception() is None:
                cleanup(fut.result())
            raise

    async def gather(self, coros: Sequence[Coroutine[Any, Any, Any]]) -> list[Any]:
        tasks = [self.loop.create_task(coro) for coro in coros]
        try:
            await asyncio.wait(tasks)
        except asyncio.CancelledError:
            for task in tasks:
                task.cancel()
            for task in tasks:
                await self.wait_through_cancellation(task)
            raise
        for task in tasks:
            if (error := task.exception()) is not None:
                raise error
        return [task.result() for task in tasks]

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)

    async def yield_to_io(self) -> None:
        # A bare yield puts the task's next step at the head of the next loop turn, ahead of the
        # callbacks of the I/O that turn's select() finds: after the second, those callbacks have
        # run; after the third, so have the tasks they woke (a stream reader, a zmq socket).
        for _ in range(HOP_TURNS):
            await asyncio.sleep(0)

    def report(self, message: str, exc: BaseException) -> None:
        self.loop.call_exception_handler({"message": message, "exception": exc})


_PENDING, _DONE, _CANCELLED = 0, 1, 2


class TrioFuture:
    """A one-shot future for trio with asyncio.Future's callback interface (loop thread only)."""

    __slots__ = ("_callbacks", "_exception", "_result", "_services", "_state")

    def __init__(self, services: TrioServices) -> None:
        self._services = services
        self._state = _PENDING
        self._result: Any = None
        self._exception: BaseException | None = None
        self._callbacks: list[Callable[[TrioFuture], None]] = []

    def done(self) -> bool:
        return self._state != _PENDING

    def cancelled(self) -> bool:
        return self._state == _CANCELLED

    def _finish(self, state: int) -> None:
        if self._state != _PENDING:
            raise RuntimeError("future already done")
        self._state = state
        callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            self._services.call_soon(callback, self)

    def set_result(self, result: Any) -> None:
        self._result = result
        self._finish(_DONE)

    def set_exception(self, exc: BaseException) -> None:
        self._exception = exc
        self._finish(_DONE)

    def cancel(self) -> bool:
        if self._state != _PENDING:
            return False
        self._finish(_CANCELLED)
        return True

    def result(self) -> Any:
        if self._state == _PENDING:
            raise RuntimeError("result is not ready")
        if self._state == _CANCELLED:
            raise self._services.cancelled_error()
        if self._exception is not None:
            raise self._exception
        return self._result

    def exception(self) -> BaseException | None:
        if self._state == _PENDING:
            raise RuntimeError("result is not ready")
        return self._exception

    def add_done_callback(self, callback: Callable[[TrioFuture], None]) -> None:
        if self._state == _PENDING:
            self._callbacks.append(callback)
        else:
            self._services.call_soon(callback, self)


class _FutureCancelled(Exception):
    """What ``TrioFuture.result()`` raises for a cancelled future (trio.Cancelled cannot be made)."""


class TrioServices(LoopServices):
    name = "trio"

    def __init__(self) -> None:
        import trio

        self._trio = trio
        self.cancelled = trio.Cancelled
        self._token = trio.lowlevel.current_trio_token()
        self._readers: dict[int, Any] = {}

    def cancelled_error(self) -> BaseException:
        return _FutureCancelled("the future was cancelled")

    def create_future(self) -> TrioFuture:
        return TrioFuture(self)

    def is_current(self) -> bool:
        try:
            return self._trio.lowlevel.current_trio_token() is self._token
        except RuntimeError:
            return False

    def is_closed(self) -> bool:
        try:
            self._token.run_sync_soon(_nothing)
        except self._trio.RunFinishedError:
            return True
        return False

    async def wait(self, fut: Any) -> Any:
        if not fut.done():
            event = self._trio.Event()
            fut.add_done_callback(lambda _: event.set())
            await event.wait()
        return fut.result()

    async def wait_through_cancellation(self, fut: Any) -> None:
        with self._trio.CancelScope(shield=True), contextlib.suppress(Exception):
            await self.wait(fut)

    def _guarded(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        try:
            fn(*args)
        except Exception as exc:  # an exception escaping run_sync_soon would crash the whole run
            self.report("uring_kv callback failed", exc)

    async def run_steps(self, steps: Generator[None, None, T]) -> T:
        # Shielded: a cancellation of the caller's scope reaches it at its next checkpoint after this.
        with self._trio.CancelScope(shield=True):
            while True:
                try:
                    next(steps)
                except StopIteration as stop:
                    return stop.value  # type: ignore[no-any-return]
                await self._trio.lowlevel.checkpoint()
        raise AssertionError("unreachable")  # a shielded scope does not swallow a return

    def call_soon(self, fn: Callable[..., Any], *args: Any) -> None:
        self._token.run_sync_soon(self._guarded, fn, args)

    def call_soon_threadsafe(self, fn: Callable[..., Any], *args: Any) -> None:
        self._token.run_sync_soon(self._guarded, fn, args)  # RunFinishedError is a RuntimeError

    def add_reader(self, fd: int, callback: Callable[[], None]) -> None:
        scope = self._trio.CancelScope()
        self._readers[fd] = scope
        self._trio.lowlevel.spawn_system_task(self._watch, fd, callback, scope, name=f"uring_kv reader fd {fd}")

    async def _watch(self, fd: int, callback: Callable[[], None], scope: Any) -> None:
        with scope:
            # Checked before every wait: once remove_reader ran, the fd may be closed (or reused),
            # and registering a closed fd with trio's epoll is a fatal error for the whole run.
            while not scope.cancel_called:
                try:
                    await self._trio.lowlevel.wait_readable(fd)
                except self._trio.ClosedResourceError:
                    return
                if not scope.cancel_called:
                    self._guarded(callback, ())

    def remove_reader(self, fd: int) -> None:
        scope = self._readers.pop(fd, None)
        if scope is not None:
            scope.cancel()
            with contextlib.suppress(RuntimeError):  # the run has ended: nothing watches fd
                self._trio.lowlevel.notify_closing(fd)

    async def to_thread(self, fn: Callable[..., Any], *args: Any,
                        cleanup: Callable[[Any], None] | None = None) -> Any:
        # Not abandoned on cancellation: the thread's result arrives, then the cancellation.
        result = await self._trio.to_thread.run_sync(fn, *args)
        try:
            await self._trio.lowlevel.checkpoint_if_cancelled()
        except self._trio.Cancelled:
            if cleanup is not None:
                cleanup(result)
            raise
        return result

    async def run_to_completion(self, coro: Coroutine[Any, Any, Any]) -> Any:
        with self._trio.CancelScope(shield=True):
            result = await coro
        await self._trio.lowlevel.checkpoint_if_cancelled()
        return result

    async def gather(self, coros: Sequence[Coroutine[Any, Any, Any]]) -> list[Any]:
        results: list[Any] = [None] * len(coros)
        errors: list[BaseException | None] = [None] * len(coros)

        async def one(position: int, coro: Coroutine[Any, Any, Any]) -> None:
            try:
                results[position] = await coro
            except Exception as exc:  # kept, so that the nursery does not cancel the others
                errors[position] = exc

        async with self._trio.open_nursery() as nursery:
            for position, coro in enumerate(coros):
                nursery.start_soon(one, position, coro)
        for error in errors:
            if error is not None:
                raise error
        return results

    async def sleep(self, seconds: float) -> None:
        await self._trio.sleep(seconds)

    async def yield_to_io(self) -> None:
        # trio polls for I/O before each batch of runnable tasks and runs a batch in either order:
        # the task woken by the poll has run after the second checkpoint, what it woke after the third.
        for _ in range(HOP_TURNS):
            await self._trio.lowlevel.checkpoint()

    def report(self, message: str, exc: BaseException) -> None:
        log.error("%s", message, exc_info=exc)


def _nothing() -> None:
    pass


class CallsUnderWay:
    """An object's calls under way on its loop, counted so that its ``aclose()`` can wait for the
    last of them to end (``enter()`` before a call's first wait, ``leave()`` in its ``finally``)."""

    def __init__(self) -> None:
        self.count = 0
        self._idle: Any = None  # a future: the count reached zero

    def enter(self) -> None:
        self.count += 1

    def leave(self) -> None:
        self.count -= 1
        if not self.count and self._idle is not None and not self._idle.done():
            self._idle.set_result(None)

    async def none_left(self, svc: LoopServices) -> None:
        """Return once no call is under way, whatever cancellation arrives meanwhile."""
        while self.count:
            self._idle = svc.create_future()
            await svc.wait_through_cancellation(self._idle)


class OpenClose:
    """``async with x`` for a resource with ``await x.open()`` (returning it) and ``await x.aclose()``."""

    async def open(self) -> Self:
        raise NotImplementedError

    async def aclose(self) -> None:
        raise NotImplementedError

    async def __aenter__(self) -> Self:
        return await self.open()

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


def current_services() -> LoopServices:
    """The services of the event loop running in this thread: asyncio, or trio (also under anyio)."""
    library = None
    if "sniffio" in sys.modules or _importable("sniffio"):
        import sniffio

        with contextlib.suppress(sniffio.AsyncLibraryNotFoundError):
            library = sniffio.current_async_library()
    if library in (None, "asyncio"):
        try:
            return AsyncioServices(asyncio.get_running_loop())
        except RuntimeError:
            pass
    if library == "trio":
        return TrioServices()
    raise RuntimeError("uring_kv must be used from a running asyncio event loop or trio run"
                       + (f" (found {library})" if library else ""))


def _importable(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None
