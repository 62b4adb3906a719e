"""The loop services on trio (directly or under anyio): :class:`TrioFuture`, a one-shot future
with asyncio.Future's callback interface whose callbacks go through ``run_sync_soon`` (later, in
the order they were scheduled, never re-entrantly: asyncio's order), and the eventfd watched by a
system task. trio is imported when the services are made, never at import."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Coroutine, Generator, Sequence
from typing import Any

from uring_kv._loop.base import HOP_TURNS, LoopServices, T

log = logging.getLogger("uring_kv")

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
