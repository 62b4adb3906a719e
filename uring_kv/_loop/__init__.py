"""The event-loop seam: the few services the engine uses, for asyncio and for trio (directly or
under anyio), chosen for the loop that runs when an engine opens (:func:`current_services`).

The engine is callback-driven: completions arrive from the ring's eventfd, from the bridge thread and
from worker threads, and handlers run on the loop thread. What it needs from the loop is small:

* a one-shot future (``create_future``) and a way to await one **without cancelling it**
  (``wait``): many awaiters share the same future (a hazard, a batch's completion), so a cancelled
  awaiter must only stop waiting, never cancel the shared result;
* ``wait_through_cancellation``: used by a cancelled call that must still wait for its started
  blocks (``asyncio``: swallow further cancellations until done; trio: a shielded cancel scope);
* ``call_soon`` (loop thread) and ``call_soon_threadsafe`` (any thread);
* ``add_reader`` / ``remove_reader`` for the ring's eventfd (asyncio's selector; under trio a system
  task blocked in ``wait_readable``);
* ``to_thread`` for the blocking file set-up, ``sleep``, and ``report`` for a handler that raised.

Laid out as anyio lays out its backends: the interface (``base.py``), one module per library
(``_asyncio.py``, ``_trio.py``), and lifecycle helpers for objects that live on one loop
(``lifecycle.py``). asyncio keeps its native, C-implemented futures and callbacks: the seam costs
it nothing. Under trio the futures are ``TrioFuture``, whose callbacks are scheduled with
``run_sync_soon`` so that the ordering matches asyncio's (callbacks run later, in the order they
were scheduled, never re-entrantly).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import sys

from uring_kv._loop._asyncio import AsyncioServices
from uring_kv._loop._trio import TrioServices
from uring_kv._loop.base import HOP_TURNS, LoopServices
from uring_kv._loop.lifecycle import CallsUnderWay, OpenClose

__all__ = ["HOP_TURNS", "CallsUnderWay", "LoopServices", "OpenClose", "current_services"]


def current_services() -> LoopServices:
    """The services of the event loop running in this thread: asyncio, or trio (also under anyio)."""
    library = None
    if "sniffio" in sys.modules or importlib.util.find_spec("sniffio") is not None:
        import sniffio

        with contextlib.suppress(sniffio.AsyncLibraryNotFoundError):
            library = sniffio.current_async_library()
    if library in (None, "asyncio"):
        try:
            return AsyncioServices(asyncio.get_running_loop())
        except RuntimeError:
            pass
    if library == "trio":
        return TrioServices()
    raise RuntimeError("uring_kv must be used from a running asyncio event loop or trio run"
                       + (f" (found {library})" if library else ""))
