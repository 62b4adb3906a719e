"""Which event-loop callbacks take long during `uring-kv bench`: a diagnostic for the loop-lag target.

Runs the bench (the options below, as ``uring-kv bench`` takes them) with every asyncio callback
timed while a method is being measured, then prints the bench's table and, per method and callback
(task steps by coroutine name), how many ran, their total and maximum time and how many took over
0.5 and 1 ms. Then, for uring_kv's callbacks that took over 0.5 ms (``URING_KV_STALL_MS``), where
their time went, from the engine's diagnostic hook (``Engine.trace``): reaping the ring (C, native
pumps' refills included), submitting SQEs (``io_uring_enter``: O_DIRECT submissions can wait there
for the device queue), queueing copies (the Python pump's; native pumps queue theirs inside the
reap), collecting the native copier's finished jobs (C, pumps' slots moved on included), and the
rest (Python handlers), with how many completions each reaped (native pumps' included). Then, per
method, the probe samples later than ``URING_KV_LATE_MS`` (the bench's lag probe, through its
``watch`` hook) and the callbacks that ran while they waited.

Timing each callback and each turn's ``select()`` wraps asyncio's internals (``Handle._run``, the
loop's ``_selector``; a handle's ``_callback`` names it): asyncio has no public hook for either.
Nothing of uring_kv is wrapped.

    python lab/loop_stalls.py --block-size 128K --direct --batches 4 [--size 1G] [--peers ceiling] [--device cpu]
"""

from __future__ import annotations

import argparse
import asyncio
import asyncio.events
import collections
import os
import sys
import time
from typing import Any

from rich.console import Console

from uring_kv.bench.config import PEERS, BenchConfig
from uring_kv.bench.report import render
from uring_kv.bench.run import run_bench

stats: dict[tuple[str, str], list[float]] = collections.defaultdict(list)
measuring: list[str] = []  # the method being measured, if any
windows = [0]  # how many measuring windows were opened or closed: a step spanning two is not counted


# Late probe samples: where the time between the probe's write and its callback went.
LATE_S = float(os.environ.get("URING_KV_LATE_MS", "0.15")) / 1e3
loop_turn: dict[str, Any] = {"t0": 0.0, "t1": 0.0, "ran": [], "before": []}  # this turn of the loop
# (method, lag, busy, wake, ahead, callbacks that ran while the sample waited: (name, seconds of it after the write))
late: list[tuple[str, float, float, float, float, list[tuple[str, float]]]] = []
samples_seen: collections.Counter[str] = collections.Counter()


def lag_watch(event: str, method: str, sent: list[float], now: float) -> None:
    """The bench's lag probe (LagTicker's ``watch``): the method measured between "enter" and
    "exit"; and each probe sample later than LATE_S, split: busy (the loop was running callbacks
    when the probe wrote, until it next called select), wake (from the write, or that call, to
    select's return: the loop thread waking up and being scheduled) and ahead (callbacks run in
    this turn before the probe's)."""
    if event == "enter":
        measuring.append(method)
        windows[0] += 1
        return
    if event == "exit":
        measuring.clear()
        windows[0] += 1
        return
    if not measuring:
        return
    method = measuring[0]
    t0, t1 = loop_turn["t0"], loop_turn["t1"]
    for written in sent:
        samples_seen[method] += 1
        if now - written <= LATE_S:
            continue
        busy = max(0.0, t0 - written)  # written while callbacks ran: until the next select()
        wake = max(0.0, t1 - max(written, t0))  # 0: written after select() returned, read in this turn
        during = [(name, start + took - max(start, written)) for name, start, took in
                  loop_turn["before"] + loop_turn["ran"] if start + took > written]  # the time each ran after the write
        late.append((method, now - written, busy, wake, now - max(t1, written), during))


def _print_late() -> None:
    for method in sorted(samples_seen):
        mine = [x for x in late if x[0] == method]
        if not mine:
            continue
        n = len(mine)
        print(f"\n{method}: {n} of {samples_seen[method]} probe samples later than {LATE_S * 1e3:g} ms; mean ms: "
              f"lag {1e3 * sum(x[1] for x in mine) / n:.3f} = busy {1e3 * sum(x[2] for x in mine) / n:.3f} "
              f"+ wake {1e3 * sum(x[3] for x in mine) / n:.3f} + ahead {1e3 * sum(x[4] for x in mine) / n:.3f}")
        by_name: dict[str, list[float]] = collections.defaultdict(list)
        for x in mine:
            for name, took in x[5]:
                by_name[name].append(took)
        for name, times in sorted(by_name.items(), key=lambda item: -sum(item[1]))[:6]:
            mean = sum(times) / len(times)
            print(f"  ran while they waited: {name[:50]:50} {len(times):6d} x, mean {1e3 * mean:.3f} ms,"
                  f" max {1e3 * max(times):.3f} ms")


SLOW_S = float(os.environ.get("URING_KV_STALL_MS", "0.5")) / 1e3  # callbacks broken down by phase

# Time spent inside the traced spans during the callback now running: phase → seconds, and how
# many completions its reaps returned.
phases: dict[str, float] = collections.defaultdict(float)
reaped = [0]
# (seconds, method, callback, phases, reaped, seconds the loop thread ran on a CPU meanwhile)
slow: list[tuple[float, str, str, dict[str, float], int, float]] = []


_PHASE_ENDS = {"reaped": "reap", "submitted": "submit", "copy_queued": "copy", "collected": "collect"}
opened: dict[str, float] = {}


def tracer(event: str, kind: Any, count: int) -> None:
    """The engine's diagnostic hook: the time inside each reap, submission, queueing of copies and
    collection of the callback now running, and the completions its reaps found."""
    now = time.perf_counter()
    if event in ("reap", "submit", "copy", "collect"):
        opened[event] = now
    elif event in _PHASE_ENDS:
        start = opened.pop(_PHASE_ENDS[event], None)
        if start is not None:
            phases[_PHASE_ENDS[event]] += now - start
        if event == "reaped":
            reaped[0] += count


# asyncio's internals: it has no public hook to time each callback or each turn's select(), so
# these wrap Handle._run and the loop's private _selector, and name a handle by its _callback
# (nothing else here reaches inside asyncio).
_original_run = asyncio.events.Handle._run


def _time_asyncio(loop: asyncio.AbstractEventLoop) -> None:
    """Time every callback (``Handle._run``) and each turn's select(); keep the callbacks run in this
    turn and the one before."""
    asyncio.events.Handle._run = _timed_run  # type: ignore[method-assign]
    selector = loop._selector  # type: ignore[attr-defined]
    select = selector.select

    def timed(timeout: float | None = None) -> Any:
        loop_turn["before"], loop_turn["ran"] = loop_turn["ran"], []
        loop_turn["t0"] = time.monotonic()
        try:
            return select(timeout)
        finally:
            loop_turn["t1"] = time.monotonic()

    selector.select = timed


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
    phases.clear()
    reaped[0] = 0
    start, start_cpu = time.monotonic(), time.thread_time()
    try:
        _original_run(self)
    finally:
        took = time.monotonic() - start
        ran = time.thread_time() - start_cpu
        name = _name(self)
        loop_turn["ran"].append((name, start, took))
        if windows[0] == window:  # (the step that ends a measurement runs the bench's own code after it)
            stats[(method, name)].append(took)
            if took > SLOW_S and method == "uring_kv":
                slow.append((took, method, name, dict(phases), reaped[0], ran))


def _print_phases() -> None:
    if not slow:
        return
    names = ("reap", "submit", "copy", "collect")
    print(f"\nuring_kv callbacks over {SLOW_S * 1e3:g} ms ({len(slow)}): where their time went, ms")
    print("(on CPU: how much of the callback the loop thread ran; the rest it waited, off CPU: for the"
          " GIL, a lock, a core)")
    print(f"{'callback':40} {'total':>7} " + " ".join(f"{n:>7}" for n in names) + f" {'other':>7} {'reaped':>7}"
          f" {'on CPU':>7}")
    for took, _, name, spent, count, ran in sorted(slow, reverse=True)[:15]:
        other = took - sum(spent.get(n, 0.0) for n in names)
        print(f"{name[:40]:40} {1e3 * took:7.2f} " + " ".join(f"{1e3 * spent.get(n, 0.0):7.2f}" for n in names)
              + f" {1e3 * other:7.2f} {count:7d} {1e3 * ran:7.2f}")
    total = sum(s[0] for s in slow)
    shares = {n: sum(s[3].get(n, 0.0) for s in slow) / total for n in names}
    print("share of their time: " + ", ".join(f"{n} {100 * v:.0f}%" for n, v in shares.items())
          + f", other {100 * (1 - sum(shares.values())):.0f}%; on CPU {100 * sum(s[5] for s in slow) / total:.0f}%")


def size(text: str) -> int:
    """Bytes, as 4096, 128K, 2M or 1G."""
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    unit = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return int(float(text[:-1] if unit > 1 else text) * unit)


def peers(text: str) -> tuple[str, ...]:
    names = {name.strip() for name in text.split(",") if name.strip()}
    if names == {"none"}:
        return ()
    if not names or names - set(PEERS):
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of {', '.join(PEERS)} or none")
    return tuple(name for name in PEERS if name in names)


async def bench(config: BenchConfig) -> dict[str, Any]:
    _time_asyncio(asyncio.get_running_loop())
    return await run_bench(config, lambda message: print(f"bench: {message}", file=sys.stderr, flush=True))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--block-size", type=size, action="append", help="bytes per block (repeatable; "
                        "default 128K and 2M)")
    parser.add_argument("--direct", action="store_true", default=None, help="cold (O_DIRECT) only "
                        "(default: cold and hot)")
    parser.add_argument("--batches", type=int, default=None, help="measured batches per method")
    parser.add_argument("--size", type=size, default=1 << 30, help="file size per block size")
    parser.add_argument("--peers", type=peers, default=PEERS, help="methods beside uring_kv, comma-separated, "
                        "or none")
    parser.add_argument("--device", default="auto", help="cuda, cuda:N or cpu (auto: cuda if available)")
    parser.add_argument("--path", help="directory for the block file (default: the temp directory)")
    args = parser.parse_args()
    config = BenchConfig(path=args.path, size=args.size, block_sizes=args.block_size or BenchConfig().block_sizes,
                         batches=args.batches, direct=args.direct, device=args.device, peers=args.peers,
                         tracer=tracer, lag_watch=lag_watch)
    result = asyncio.run(bench(config))
    screen = Console(highlight=False)
    if not screen.is_terminal and "COLUMNS" not in os.environ:
        screen = Console(highlight=False, width=100)  # a file or a pipe: the width the bench's table is made for
    render(result, screen)
    print(f"verified: {'all' if result['all_verified'] else 'NOT ALL'}")
    rows = sorted(stats.items(), key=lambda item: (item[0][0], -max(item[1])))
    print(f"{'method':14} {'callback':50} {'runs':>8} {'total ms':>10} {'max ms':>8} {'>0.5ms':>7} {'>1ms':>6}")
    for (method, name), times in rows:
        if max(times) < 2e-4 and method != "uring_kv":
            continue
        print(f"{method[:14]:14} {name[:50]:50} {len(times):8d} {1e3 * sum(times):10.1f} {1e3 * max(times):8.2f} "
              f"{sum(t > 5e-4 for t in times):7d} {sum(t > 1e-3 for t in times):6d}")
    _print_phases()
    _print_late()
    return 0 if result["all_verified"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
