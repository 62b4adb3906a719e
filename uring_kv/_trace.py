"""The engine's diagnostic tracer (``Engine.trace``): one cell that the parts hold from their
construction, so a tracer set or cleared at any time reaches them all without touching them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

Tracer = Callable[[str, Any, int], None]  # (event, kind or None, count), on the loop's thread


class Trace:
    """``fn``: the tracer in force, or None (the parts check it before each event)."""

    __slots__ = ("fn",)

    def __init__(self) -> None:
        self.fn: Tracer | None = None
