"""Watching the ring's backlog (ops beyond the depth wait there): whether the flush submits an op
ahead of ops queued before it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from uring_kv._io import UringBackend


def overtakes(monkeypatch: pytest.MonkeyPatch, goes_first: Callable[[Any], bool],
              waits: Callable[[Any], bool]) -> list[bool]:
    """Patch every ``UringBackend`` so that the ops it is given are numbered in submission order
    and, each time a flush puts in flight an op for which ``goes_first(op)``, record whether an op
    for which ``waits`` holds, numbered before it, is still in the backlog. Returns that record,
    filled as the test runs."""
    seq: dict[int, int] = {}
    kept: list[Any] = []  # numbered ops stay alive, so their ids are not reused
    jumped: list[bool] = []
    submit, flush = UringBackend.submit, UringBackend._flush

    def numbered_submit(self: UringBackend, ops: list[Any]) -> None:
        for op in ops:
            seq[id(op)] = len(kept)
            kept.append(op)
        submit(self, ops)

    def watching_flush(self: UringBackend) -> None:
        before = set(self._pending)
        flush(self)
        for user_data in self._pending.keys() - before:
            op = self._pending[user_data]
            if goes_first(op):
                jumped.append(any(seq[id(other)] < seq[id(op)]
                                  for queue in self._backlog for other in queue if waits(other)))

    monkeypatch.setattr(UringBackend, "submit", numbered_submit)
    monkeypatch.setattr(UringBackend, "_flush", watching_flush)
    return jumped
