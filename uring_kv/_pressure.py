"""Back-pressure: what each class of calls has queued and in flight, how fast the engine serves it,
and the budget past which a call of that class is refused at once instead of queueing.

A class is a call's kind (loads, stores). A call is *queued* from the moment it is made until its
first block starts (waiting for its turn at admission, for the hazards before it, or for a slot),
then *in flight* until its batch ends; its bytes are its blocks × the block's bytes. The service
rate is the bytes of the calls that ended in the last ``WINDOW_S`` seconds, per second. A framework's
scheduler reads these (``Engine.metrics()``) before it submits more: stores that keep queueing
while loads wait are what it should hold back.

A budget (``Engine(budgets={"store": bytes, ...})``) bounds a class's queued and in-flight bytes:
a call that would pass it fails at once with :class:`~uring_kv.errors.EngineBusyError` (EBUSY),
having taken nothing. A call finding its class with nothing pending is always admitted, so a call
larger than the budget is served alone rather than refused for ever.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

from uring_kv._staging import Kind
from uring_kv.errors import EngineBusyError

WINDOW_S = 1.0  # the service rate's window


def class_budgets(budgets: Mapping[str, int] | None) -> dict[Kind, int]:
    """``Engine(budgets=...)`` checked: class name ("load", "store") → bytes, each positive."""
    if budgets is None:
        return {}
    if not isinstance(budgets, Mapping):
        raise TypeError(f"budgets must be a mapping of class name to bytes, got {type(budgets).__name__}")
    names = {kind.name.lower(): kind for kind in Kind}
    checked: dict[Kind, int] = {}
    for name, limit in budgets.items():
        if name not in names:
            raise ValueError(f"budgets: unknown class {name!r} (classes: {', '.join(names)})")
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise ValueError(f"budgets[{name!r}] must be a positive number of bytes, got {limit!r}")
        checked[names[name]] = limit
    return checked


class Ticket:
    """One call's place in its class's books, from the call to its batch's end."""

    __slots__ = ("ended", "kind", "nbytes", "started")

    def __init__(self, kind: Kind, nbytes: int) -> None:
        self.kind, self.nbytes = kind, nbytes
        self.started = self.ended = False


class ClassPressure:
    """One class's queued and in-flight calls and bytes, its recent service and its refusals."""

    __slots__ = (
        "_clock",
        "_served",
        "_served_bytes",
        "budget",
        "inflight_bytes",
        "inflight_calls",
        "queued_bytes",
        "queued_calls",
        "refused_calls",
    )

    def __init__(self, budget: int | None, clock: Callable[[], float]) -> None:
        self.budget, self._clock = budget, clock
        self.queued_calls = self.queued_bytes = self.inflight_calls = self.inflight_bytes = 0
        self.refused_calls = 0
        self._served: deque[tuple[float, int]] = deque()  # (when, bytes) of the calls ended lately
        self._served_bytes = 0

    @property
    def pending_bytes(self) -> int:
        return self.queued_bytes + self.inflight_bytes

    def _trim(self, now: float) -> None:
        served = self._served
        while served and served[0][0] <= now - WINDOW_S:
            self._served_bytes -= served.popleft()[1]

    def served(self, nbytes: int) -> None:
        now = self._clock()
        self._served.append((now, nbytes))
        self._served_bytes += nbytes
        self._trim(now)

    def rate(self) -> float:
        """Bytes per second served over the last ``WINDOW_S`` seconds."""
        self._trim(self._clock())
        return self._served_bytes / WINDOW_S

    def snapshot(self) -> dict[str, Any]:
        return {"queued_calls": self.queued_calls, "queued_bytes": self.queued_bytes,
                "inflight_calls": self.inflight_calls, "inflight_bytes": self.inflight_bytes,
                "rate_bytes_s": self.rate(), "refused_calls": self.refused_calls,
                "budget_bytes": self.budget or 0}


class Pressure:
    """An engine's books per class (see the module docstring), on the loop's thread only."""

    def __init__(self, budgets: Mapping[Kind, int], clock: Callable[[], float] = time.monotonic) -> None:
        self.classes = {kind: ClassPressure(budgets.get(kind), clock) for kind in Kind}

    def enter(self, kind: Kind, nbytes: int) -> Ticket:
        """A call of ``kind`` moving ``nbytes``, queued; EngineBusyError past its class's budget."""
        books = self.classes[kind]
        pending = books.pending_bytes
        if books.budget is not None and pending and pending + nbytes > books.budget:
            books.refused_calls += 1
            raise EngineBusyError(kind.name.lower(), nbytes, pending, books.budget)
        books.queued_calls += 1
        books.queued_bytes += nbytes
        return Ticket(kind, nbytes)

    def start(self, ticket: Ticket) -> None:
        """The call's first block started: queued → in flight (once)."""
        if ticket.started or ticket.ended:
            return
        ticket.started = True
        books = self.classes[ticket.kind]
        books.queued_calls -= 1
        books.queued_bytes -= ticket.nbytes
        books.inflight_calls += 1
        books.inflight_bytes += ticket.nbytes

    def end(self, ticket: Ticket, moved_bytes: int = 0) -> None:
        """The call is over (its batch ended, or it was refused before it had one); ``moved_bytes``
        count towards the class's service rate. Once per ticket."""
        if ticket.ended:
            return
        ticket.ended = True
        books = self.classes[ticket.kind]
        if ticket.started:
            books.inflight_calls -= 1
            books.inflight_bytes -= ticket.nbytes
        else:
            books.queued_calls -= 1
            books.queued_bytes -= ticket.nbytes
        if moved_bytes:
            books.served(moved_bytes)

    def snapshot(self, kind: Kind) -> dict[str, Any]:
        return self.classes[kind].snapshot()
