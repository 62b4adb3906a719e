"""Backend-neutral task helpers, so the core tests run unchanged on asyncio and on trio (anyio).

``Tasks`` is a task group whose tasks can be cancelled one by one and joined, like asyncio tasks:
``task.cancelled`` is True when the call let its cancellation propagate (as a well-behaved
cancelled engine call must), ``join()`` re-raises any other error.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import anyio
import anyio.abc

from uring_kv._loop import HOP_TURNS


class Task:
    def __init__(self) -> None:
        self._scope = anyio.CancelScope()
        self._finished = anyio.Event()
        self.cancelled = False
        self.result: Any = None
        self._error: BaseException | None = None

    def cancel(self) -> None:
        self._scope.cancel()

    def done(self) -> bool:
        return self._finished.is_set()

    async def _run(self, fn: Callable[..., Awaitable[Any]], args: tuple[Any, ...]) -> None:
        try:
            with self._scope:
                self.result = await fn(*args)
            self.cancelled = self._scope.cancelled_caught
        except Exception as exc:  # kept for join(): the group must not tear the other tasks down
            self._error = exc
        finally:
            self._finished.set()

    async def join(self) -> Any:
        await self._finished.wait()
        if self._error is not None:
            raise self._error
        return self.result


class Tasks:
    def __init__(self, group: anyio.abc.TaskGroup) -> None:
        self._group = group

    def spawn(self, fn: Callable[..., Awaitable[Any]], *args: Any) -> Task:
        task = Task()
        self._group.start_soon(task._run, fn, args)
        return task


@asynccontextmanager
async def task_group() -> AsyncIterator[Tasks]:
    async with anyio.create_task_group() as group:
        yield Tasks(group)


async def gather(*calls: tuple[Callable[..., Awaitable[Any]], tuple[Any, ...]]) -> list[Any]:
    """Run the calls concurrently; their results in order (the first error is raised)."""
    async with task_group() as tasks:
        spawned = [tasks.spawn(fn, *args) for fn, args in calls]
    return [await task.join() for task in spawned]


async def run_then_cancel(tasks: Tasks, seconds: float, fn: Callable[..., Awaitable[Any]], *args: Any) -> Task:
    """Spawn ``fn(*args)``, cancel it after ``seconds`` and wait until it has finished."""
    task = tasks.spawn(fn, *args)
    await anyio.sleep(seconds)
    task.cancel()
    await task.join()
    return task


async def settle() -> None:
    """Let every task run until it blocks (a spawned call has registered its batch).

    A batch's start yields bare loop turns (the engine's ``yield_to_io``), during which anyio's
    asyncio check sees its task as running and would sleep 0.1 s before looking again: a few bare
    turns first let those starts reach their first real wait."""
    for _ in range(2 * HOP_TURNS):
        await anyio.sleep(0)
    await anyio.wait_all_tasks_blocked()
