"""``Prefetch``: what makes a load a prefetch, and later a demand load.

A serving engine needs KV back at two urgencies: a request scheduled now waits for its blocks (a
demand load), one that has only arrived may use them soon (a prefetch: worth something only if it
lands first, and never allowed to delay a demand load). A load given a :class:`Prefetch` runs in
the prefetch class, behind every demand load for slots and I/O room and ahead of stores; when its
request is scheduled, :meth:`Prefetch.upgrade` makes it a demand load on the spot, keeping every
block already read. Cancelling the call's task cancels the prefetch, with the lease rule of any
cancelled call: its slots come back once the kernel and the copies are done with them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable


class Prefetch:
    """Pass to ``Engine.load_batch(..., prefetch=p)`` (or a store's ``get``/``get_present``, whose
    engine calls it then covers) to run that load as a prefetch; call :meth:`upgrade`, from any
    thread, when it is needed now."""

    __slots__ = ("_lock", "_on_upgrade", "upgraded")

    def __init__(self) -> None:
        self.upgraded = False
        self._on_upgrade: list[Callable[[], None]] = []
        self._lock = threading.Lock()

    def upgrade(self) -> None:
        """From now on a demand load: each call it covers waits for slots and I/O room with the
        demand loads, ahead of every prefetch and store, keeping the blocks it has read.
        Idempotent; a call made with it afterwards starts as a demand load."""
        with self._lock:
            if self.upgraded:
                return
            self.upgraded = True
            callbacks, self._on_upgrade = self._on_upgrade, []
        for callback in callbacks:
            callback()

    def bind(self, on_upgrade: Callable[[], None]) -> bool:
        """For the engine: ``on_upgrade()`` runs when :meth:`upgrade` is called (on the thread that
        calls it). False, and nothing bound, once upgraded: the call is a demand load already."""
        with self._lock:
            if self.upgraded:
                return False
            self._on_upgrade.append(on_upgrade)
            return True
