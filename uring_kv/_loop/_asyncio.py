"""The loop services on asyncio: its own (C-implemented) futures and callbacks, so the seam adds
nothing to asyncio's per-block cost."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Coroutine, Generator, Sequence
from typing import Any

from uring_kv._loop.base import HOP_TURNS, LoopServices, T


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
