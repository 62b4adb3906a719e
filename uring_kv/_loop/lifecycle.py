"""Helpers for objects with an async lifecycle on one loop: counting the calls under way so that
``aclose()`` can wait for the last of them (:class:`CallsUnderWay`), and ``async with`` over
``open()``/``aclose()`` (:class:`OpenClose`)."""

from __future__ import annotations

from typing import Any, Self

from uring_kv._loop.base import LoopServices


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
