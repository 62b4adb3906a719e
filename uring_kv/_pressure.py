"""Back-pressure: what each class of calls has queued and in flight, how fast the engine serves it,
and the budget past which a call of that class is refused at once instead of queueing.

A class is a call's urgency (:class:`~uring_kv._staging.IOClass`, named as callers name it: "load"
for demand loads, "prefetch", "store"). A call is *queued* from the moment it is made until its
first block starts (waiting for its turn at admission, for the hazards before it, or for a slot),
then *in flight* until its batch ends; its bytes are its blocks × the block's bytes. A prefetch
made a demand load moves to that class's books. The service rate is the bytes of the calls that
ended in the last ``WINDOW_S`` seconds, per second. A framework's scheduler reads these
(``Engine.metrics()``) before it submits more: stores that keep queueing while loads wait are what
it should hold back.

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

from uring_kv._staging import IOClass
from uring_kv.errors import EngineBusyError

WINDOW_S = 1.0  # the service rate's window
CLASS_NAMES = {IOClass.DEMAND: "load", IOClass.PREFETCH: "prefetch", IOClass.STORE: "store"}


def class_budgets(budgets: Mapping[str, int] | None) -> dict[IOClass, int]:
    """``Engine(budgets=...)`` checked: class name ("load", "prefetch", "store") → bytes, each positive."""
    if budgets is None:
        return {}
    if not isinstance(budgets, Mapping):
        raise TypeError(f"budgets must be a mapping of class name to bytes, got {type(budgets).__name__}")
    names = {name: cls for cls, name in CLASS_NAMES.items()}
    checked: dict[IOClass, int] = {}
    for name, limit in budgets.items():
        if name not in names:
            raise ValueError(f"budgets: unknown class {name!r} (classes: {', '.join(names)})")
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise ValueError(f"budgets[{name!r}] must be a positive number of bytes, got {limit!r}")
        checked[names[name]] = limit
    return checked


class Ticket:
    """One call's place in its class's books, from the call to its batch's end."""

    __slots__ = ("cls", "ended", "nbytes", "started")

    def __init__(self, cls: IOClass, nbytes: int) -> None:
        self.cls, self.nbytes = cls, nbytes
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

    def __init__(self, budgets: Mapping[IOClass, int], clock: Callable[[], float] = time.monotonic) -> None:
        self.classes = {cls: ClassPressure(budgets.get(cls), clock) for cls in IOClass}

    def enter(self, cls: IOClass, nbytes: int) -> Ticket:
        """A call of ``cls`` moving ``nbytes``, queued; EngineBusyError past its class's budget."""
        books = self.classes[cls]
        pending = books.pending_bytes
        if books.budget is not None and pending and pending + nbytes > books.budget:
            books.refused_calls += 1
            raise EngineBusyError(CLASS_NAMES[cls], nbytes, pending, books.budget)
        books.queued_calls += 1
        books.queued_bytes += nbytes
        return Ticket(cls, nbytes)

    def _move(self, ticket: Ticket, sign: int) -> None:
        books = self.classes[ticket.cls]
        if ticket.started:
            books.inflight_calls += sign
            books.inflight_bytes += sign * ticket.nbytes
        else:
            books.queued_calls += sign
            books.queued_bytes += sign * ticket.nbytes

    def start(self, ticket: Ticket) -> None:
        """The call's first block started: queued → in flight (once)."""
        if ticket.started or ticket.ended:
            return
        self._move(ticket, -1)
        ticket.started = True
        self._move(ticket, +1)

    def reclass(self, ticket: Ticket, cls: IOClass) -> None:
        """The call is of ``cls`` from now on (a prefetch made a demand load): its books move."""
        if not ticket.ended:
            self._move(ticket, -1)
        ticket.cls = cls
        if not ticket.ended:
            self._move(ticket, +1)

    def end(self, ticket: Ticket, moved_bytes: int = 0) -> None:
        """The call is over (its batch ended, or it was refused before it had one); ``moved_bytes``
        count towards the class's service rate. Once per ticket."""
        if ticket.ended:
            return
        self._move(ticket, -1)
        ticket.ended = True
        if moved_bytes:
            self.classes[ticket.cls].served(moved_bytes)

    def snapshot(self, cls: IOClass) -> dict[str, Any]:
        return self.classes[cls].snapshot()
