"""What the engine asks of the running event loop (:class:`LoopServices`), whatever the loop.

Implemented for asyncio (``_asyncio.py``) and for trio (``_trio.py``); the package's face
(``__init__.py``) picks one for the running loop. Nothing here imports either library.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Coroutine, Generator, Sequence
from typing import Any, TypeVar

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
