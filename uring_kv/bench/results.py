"""A bench result's rows: one :class:`Row` per method, operation, case and block size, the ratios
between them, and the loop's lag pooled over a run."""

from __future__ import annotations

import dataclasses
import json
import resource
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Self


@dataclass
class Row:
    op: str
    case: str
    block_bytes: int
    method: str
    kind: str  # "uring_kv", "peer" or "ceiling"
    gbps: float
    blocks_per_s: float
    p50_ms: float
    p99_ms: float
    cpu_s: float  # the process's CPU time (every thread) over the measured batches
    lag_max_ms: float
    lag_p99_ms: float
    verified: bool
    timer_lag_max_ms: float = 0.0
    timer_lag_p99_ms: float = 0.0
    batch_ms: list[float] = field(default_factory=list)  # every measured batch, in order
    ratios: dict[str, float] = field(default_factory=dict)
    lag_samples: int = 0  # probe samples behind lag_max_ms / lag_p99_ms (1 per ms of the row's batches)
    core_s_per_gb: float = 0.0  # cpu_s per GB moved (0: not measured in this process, e.g. fio)
    # GB/s ÷ the lowest of the ring, copy and rows ceilings on the same operation, case and block size: the
    # share of what this machine allows (None: a ceiling's own row, or no ceiling measured)
    of_limit: float | None = None
    lag_ms: list[float] = field(default_factory=list, repr=False)  # those samples (pooled per run, not in the JSON)


@dataclass
class BatchRow:
    """A row of the side benches (striping, Mooncake): a method's GB/s over its measured batches,
    their p50 and p99 times, and whether its bytes checked."""
    method: str
    block_bytes: int
    gbps: float
    p50_ms: float
    p99_ms: float
    batches: int
    verified: bool

    @classmethod
    def of(cls, method: str, block_bytes: int, times: list[float], blocks: int, verified: bool = True,
           **extra: Any) -> Self:
        """The row of ``blocks`` blocks moved in batches that took ``times`` seconds."""
        total = sum(times)
        return cls(method, block_bytes, blocks * block_bytes / total / 1e9 if total else 0.0,
                   percentile(times, 0.5) * 1e3, percentile(times, 0.99) * 1e3, len(times), verified, **extra)


CEILINGS = ("ring ceiling", "copy ceiling", "rows ceiling", "fio", "pcie ceiling")
# a load or store cannot beat the lowest of these (the copy ceiling where the engine copies, the rows
# ceiling where it moves the cache rows itself: never both on one operation, and the rows ceiling
# only for uring_kv's own row, see ratios())
LIMIT_CEILINGS = ("ring ceiling", "copy ceiling", "rows ceiling")


def process_cpu_seconds() -> float:
    """User and system CPU seconds of the whole process so far (every thread)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def kind_of(method: str) -> str:
    """"uring_kv", "peer" or "ceiling"."""
    if method.startswith("uring_kv"):
        return "uring_kv"
    return "ceiling" if method in CEILINGS else "peer"


def ratios(rows: list[Row]) -> None:
    """``ratios[X]`` of a uring_kv row: its GB/s ÷ X's on the same operation, case and block size
    (the PCIe ceiling: on the same operation). Above 1: uring_kv moved the bytes faster; for a
    ceiling, the fraction of that limit uring_kv reached. ``of_limit`` of every method's row: its
    GB/s ÷ the lowest of the ring, copy and rows ceilings there; the rows ceiling bounds uring_kv's
    own row alone (its path: the peers, and uring_kv with checksums, read into a buffer and copy)."""
    for row in rows:
        limits = [other.gbps for other in rows if other.method in LIMIT_CEILINGS and other.gbps
                  and (other.method != "rows ceiling" or row.method == "uring_kv")
                  and (other.op, other.case, other.block_bytes) == (row.op, row.case, row.block_bytes)]
        if limits and kind_of(row.method) != "ceiling":
            row.of_limit = row.gbps / min(limits)
        if row.method != "uring_kv":
            continue
        for other in rows:
            same = (other.op, other.case, other.block_bytes) == (row.op, row.case, row.block_bytes)
            if other is not row and (same or (other.method == "pcie ceiling" and other.op == row.op)):
                row.ratios[other.method] = row.gbps / other.gbps if other.gbps else float("inf")


def pooled_lag(rows: list[Row], method: str = "uring_kv") -> dict[str, float | int]:
    """The loop's lag over the whole run while ``method`` moved blocks: every probe sample of
    every one of its rows together. A row of short batches holds few samples (a 128 KiB batch
    takes a few milliseconds, so its p99 is its maximum); pooled, the p99 rests on thousands."""
    lag = [x for row in rows if row.method == method for x in row.lag_ms]
    return {"samples": len(lag), "max_ms": round(max(lag, default=0.0), 3),
            "p99_ms": round(percentile(lag, 0.99), 3), "p50_ms": round(percentile(lag, 0.5), 3)}


def framework_report(title: str, lines: list[str], json_path: str | None, config: dict[str, Any],
                     results: list[Any]) -> int:
    """The end of a framework bench (``bench-vllm``, ``bench-lmcache``, ``bench-sglang``): the title
    and table on stdout, the JSON (config, each result row as a dict) where asked; exit status 0 when
    every row's bytes checked, else 1."""
    print(title)
    for line in lines:
        print(line)
    if json_path:
        with open(json_path, "w") as out:
            json.dump({"config": config, "results": [dataclasses.asdict(r) for r in results]}, out, indent=2)
    return 0 if all(r.verified for r in results) else 1


def progress_printer(command: str) -> Callable[[str], None]:
    """A progress line on stderr for ``command`` (``bench-vllm: ...``)."""

    def progress(message: str) -> None:
        print(f"{command}: {message}", file=sys.stderr, flush=True)

    return progress
