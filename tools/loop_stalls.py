"""Which event-loop callbacks take long during `uring-kv bench`: a diagnostic for the loop-lag target.

Runs the bench (same arguments as ``uring-kv bench``) with every asyncio callback timed while a
method is being measured, then prints, per method and callback (task steps by coroutine name), how
many ran, their total and maximum time and how many took over 0.5 and 1 ms.

    python tools/loop_stalls.py --block-size 128K --direct --batches 4
"""

from __future__ import annotations

import asyncio
import asyncio.events
import collections
import sys
import time
from typing import Any

from uring_kv import _bench, cli

stats: dict[tuple[str, str], list[float]] = collections.defaultdict(list)
_original_run = asyncio.events.Handle._run
_original_enter, _original_exit = _bench.LagTicker.__enter__, _bench.LagTicker.__exit__
measuring: list[str] = []  # the method being measured, if any
windows = [0]  # how many measuring windows were opened or closed: a step spanning two is not counted


def _enter(self: _bench.LagTicker) -> _bench.LagTicker:
    measuring.append(str(sys._getframe(1).f_locals.get("name", "?")))  # _measure's loop variable
    windows[0] += 1
    return _original_enter(self)


def _exit(self: _bench.LagTicker, *exc: object) -> None:
    measuring.clear()
    windows[0] += 1
    _original_exit(self, *exc)


def _name(handle: asyncio.events.Handle) -> str:
    callback: Any = handle._callback  # type: ignore[attr-defined]
    owner = getattr(callback, "__self__", None)
    if isinstance(owner, asyncio.Task):
        coro = owner.get_coro()
        return f"task {getattr(coro, '__qualname__', coro)}"
    callback = getattr(callback, "func", callback)  # functools.partial
    return str(getattr(callback, "__qualname__", callback))


def _timed_run(self: asyncio.events.Handle) -> None:
    if not measuring:
        _original_run(self)
        return
    method, window = measuring[0], windows[0]
    start = time.perf_counter()
    try:
        _original_run(self)
    finally:
        if windows[0] == window:  # (the step that ends a measurement runs the bench's own code after it)
            stats[(method, _name(self))].append(time.perf_counter() - start)


def main() -> int:
    asyncio.events.Handle._run = _timed_run  # type: ignore[method-assign]
    _bench.LagTicker.__enter__ = _enter  # type: ignore[method-assign]
    _bench.LagTicker.__exit__ = _exit  # type: ignore[method-assign]
    code = cli.main(["bench", *sys.argv[1:]])
    rows = sorted(stats.items(), key=lambda item: (item[0][0], -max(item[1])))
    print(f"{'method':14} {'callback':50} {'runs':>8} {'total ms':>10} {'max ms':>8} {'>0.5ms':>7} {'>1ms':>6}")
    for (method, name), times in rows:
        if max(times) < 2e-4 and method != "uring_kv":
            continue
        print(f"{method[:14]:14} {name[:50]:50} {len(times):8d} {1e3 * sum(times):10.1f} {1e3 * max(times):8.2f} "
              f"{sum(t > 5e-4 for t in times):7d} {sum(t > 1e-3 for t in times):6d}")
    return code


if __name__ == "__main__":
    raise SystemExit(main())
