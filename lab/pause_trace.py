"""What a pause before a load batch changes inside it: the loop's sleeps and wake-ups, the reaps.

On the H200 machine a 128 KiB load batch that follows a pause took 1-2 ms longer than one right
after another (H200 machine, 2026-12-03). This loads random 256-block batches
through one engine (O_DIRECT, 32 layers, 48 slots at depth 32 as the bench sets up on a GPU, or ``--slots``),
alternating runs of batches back to back with runs where each batch follows ``--idle-ms`` of
sleep, and times inside each batch: the loop's ``select()`` calls (how long it slept), the ring's
wake-ups (completions found per reap, reads in flight before and after it, how long after
``select()`` returned it ran), the copier's collections, the reads in flight over the batch
(time-weighted), how long the first completion took and how long the batch ran after the last.
All but the sleeps come from the engine's diagnostic hook (``Engine.trace``); the sleeps, from a
wrapper of asyncio's selector. "In flight" counts every read from submission until its completion
is reaped (a read the disk has finished stays counted until the loop reaps it), native pumps'
included; the trace gives it before each reap and submission, and after a reap it is taken from
the next of those (see ``_in_flight_after``).

    python lab/pause_trace.py [--block-size 131072] [--rounds 6] [--per-round 4] [--idle-ms 100] [--slots 48]
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import os
import random
import statistics
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import torch

from uring_kv import Engine


@dataclass
class Span:
    """A traced span on the loop: a reap, a collection of copier jobs, a pump given slots or an
    SQE submission, with the reads in flight (submitted, not yet reaped) where the trace tells them."""

    kind: str  # "reap", "collect", "grow" or "submit"
    t: float
    end: float
    before: int | None = None
    found: int = 0  # reap: completions found; collect: jobs taken
    after: int | None = None


trace: dict[str, list[Any]] = defaultdict(list)
live = [False]
sqes = [0]
_CLOSES = {"reaped": "reap", "collected": "collect", "grown": "grow"}


def _tracer(event: str, kind: Any, count: int) -> None:
    """The engine's diagnostic hook: reaps (in flight before, completions found), collections (jobs
    taken), the pump's slots (its first reads submitted at the first ``grown``) and SQE submissions."""
    if not live[0]:
        return
    now = time.perf_counter()
    spans: list[Span] = trace["spans"]
    if event in ("reap", "collect", "grow"):
        spans.append(Span(event, now, now, count if event == "reap" else None))
    elif event in _CLOSES:
        span = next((s for s in reversed(spans) if s.kind == _CLOSES[event]), None)
        if span is None:  # opened before this batch was traced
            return
        span.end = now
        if event != "grown":
            span.found = count
        elif not trace["submitted"]:
            trace["submitted"].append(now)
    elif event == "submit":
        sqes[0] = count
    elif event == "submitted":
        spans.append(Span("submit", now, now, count - sqes[0], after=count))


def _time_selects(loop: asyncio.AbstractEventLoop) -> None:
    """How long the loop sleeps: asyncio offers no public hook for its selector's ``select()``, so
    this wraps the private ``loop._selector`` (the one part of this script outside the engine's hooks)."""
    selector = loop._selector  # type: ignore[attr-defined]
    select = selector.select

    def traced_select(timeout: float | None = None) -> Any:
        start = time.perf_counter()
        ready = select(timeout)
        if live[0]:
            trace["select"].append((start, time.perf_counter()))
        return ready

    selector.select = traced_select


def _in_flight_after(spans: list[Span]) -> list[int]:
    """Reads in flight after each span. They change only inside the spans (submitted in a submission,
    a pump's start, or refills in a reap or a collection; gone in a reap), so a span's after is the
    next one's before where the trace tells it (a reap's, a submission's; a collection that took no
    job passes its own on). Where it does not, a reap is taken as having refilled nothing."""
    after = [0] * len(spans)
    next_before: int | None = None
    for i in range(len(spans) - 1, -1, -1):
        span = spans[i]
        if span.after is not None:
            after[i] = span.after
        elif next_before is not None:
            after[i] = next_before
        elif span.kind == "reap" and span.before is not None:
            after[i] = span.before - span.found
        else:
            after[i] = after[i + 1] if i + 1 < len(spans) else 0
        idle = span.kind == "collect" and span.found == 0
        next_before = span.before if span.before is not None else after[i] if idle else None
    return after


def _q(values: list[float]) -> str:
    if not values:
        return "-"
    ordered = sorted(values)
    return f"p50 {statistics.median(ordered):8.1f}  p90 {ordered[9 * len(ordered) // 10]:8.1f}"


def _summary(batches: list[dict[str, Any]]) -> dict[str, str]:
    sleeps = [s for b in batches for s in b["sleeps"]]
    reaps = [r for b in batches for r in b["reaps"]]
    out = {
        "batch ms": _q([b["ms"] for b in batches]),
        "call -> first reads submitted, us": _q([b["start_us"] for b in batches]),
        "loop asleep in select(), % of the batch": _q([b["asleep"] * 100 for b in batches]),
        "select() sleeps, us": _q([s * 1e6 for s in sleeps]),
        "ring wake-ups per batch": _q([float(len(b["reaps"])) for b in batches]),
        "completions found per wake-up": _q([float(r[2]) for r in reaps]),
        "reads in flight before a reap": _q([float(r[3]) for r in reaps]),
        "select() return -> reap, us": _q([r[4] * 1e6 for r in reaps if r[4] is not None]),
        "reap callback, us": _q([(r[1] - r[0]) * 1e6 for r in reaps]),
        "collections per batch": _q([float(b["collections"]) for b in batches]),
        "reads in flight (until reaped), time-weighted": _q([b["inflight_mean"] for b in batches]),
        "reads in flight after a reap": _q([float(r[5]) for b in batches for r in b["reaps"] if r[5] is not None]),
        "first reads submitted -> first completion, us": _q([b["first_us"] for b in batches]),
        "last completion reaped -> batch done, us": _q([b["tail_us"] for b in batches]),
    }
    return out


async def main(args: argparse.Namespace) -> None:
    _time_selects(asyncio.get_running_loop())
    layers, block = 32, args.block_size
    blocks = (1 << 30) // block
    caches = [torch.zeros(256, block // layers // 2, dtype=torch.float16, device=args.device) for _ in range(layers)]
    path = os.path.join(tempfile.gettempdir(), f"uring-kv-pause-trace-{os.getpid()}.bin")
    results: dict[str, list[dict[str, Any]]] = {"back to back": [], f"after {args.idle_ms:g} ms idle": []}
    async with Engine(caches, path, blocks, args.slots, direct=True, io_depth=32) as engine:
        for first in range(0, blocks, 256):
            await engine.store_batch(list(range(256)), list(range(first, first + 256)))
        engine.trace(_tracer)
        rng = random.Random(7)
        for round_index in range(args.rounds + 1):  # the first round is not measured
            conditions = list(results) if round_index % 2 else list(results)[::-1]
            for condition in conditions:
                for _ in range(args.per_round):
                    if condition != "back to back":
                        await asyncio.sleep(args.idle_ms / 1e3)
                    disk, gpu = rng.sample(range(blocks), 256), rng.sample(range(256), 256)
                    trace.clear()
                    live[0] = True
                    start = time.perf_counter()
                    await engine.load_batch(disk, gpu)
                    end = time.perf_counter()
                    live[0] = False
                    if round_index:
                        results[condition].append(_batch(start, end))
    print(f"{args.device}, {block >> 10} KiB, {args.slots} slots at depth 32, "
          f"{args.rounds} rounds x {args.per_round} batches per condition")
    summaries = {condition: _summary(batches) for condition, batches in results.items()}
    names = list(summaries)
    print(f"{'':46} {names[0]:>26} {names[1]:>26}")
    for key in summaries[names[0]]:
        print(f"{key:46} {summaries[names[0]][key]:>26} {summaries[names[1]][key]:>26}")


def _batch(start: float, end: float) -> dict[str, Any]:
    selects = [s for s in trace["select"] if start <= s[0] < end]
    returns = [s[1] for s in selects]
    spans: list[Span] = trace["spans"]
    after = _in_flight_after(spans)
    reaps = []
    for span, held in zip(spans, after, strict=True):
        if span.kind == "reap":
            i = bisect.bisect_right(returns, span.t) - 1
            reaps.append((span.t, span.end, span.found, span.before, span.t - returns[i] if i >= 0 else None, held))
    submitted = trace["submitted"][0] if trace["submitted"] else start
    found = [r for r in reaps if r[2] > 0]
    # Reads in flight between spans, weighted by how long each count held, from the first submission.
    steps = sorted((span.end, held) for span, held in zip(spans, after, strict=True) if submitted <= span.end <= end)
    weighted = sum(n * (nxt[0] - t) for (t, n), nxt in zip(steps, [*steps[1:], (end, 0)], strict=True))
    return {
        "ms": (end - start) * 1e3,
        "start_us": (trace["submitted"][0] - start) * 1e6 if trace["submitted"] else float("nan"),
        "asleep": sum(s[1] - s[0] for s in selects) / (end - start),
        "sleeps": [s[1] - s[0] for s in selects],
        "reaps": reaps,
        "collections": sum(span.kind == "collect" for span in spans),
        "inflight_mean": weighted / (end - submitted),
        "first_us": (found[0][1] - submitted) * 1e6 if found else float("nan"),
        "tail_us": (end - found[-1][1]) * 1e6 if found else float("nan"),
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--block-size", type=int, default=128 << 10)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--per-round", type=int, default=4, help="batches per condition and round")
    parser.add_argument("--idle-ms", type=float, default=100.0)
    parser.add_argument("--slots", type=int, default=48, help="staging slots (the I/O depth stays 32)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    asyncio.run(main(parser.parse_args()))
