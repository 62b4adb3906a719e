"""Engine metrics: counters and histograms per direction, gauges for what is held right now.

``engine.metrics()`` returns a plain-dict snapshot; :class:`PrometheusCollector` exposes the same
numbers to prometheus-client (``pip install uring-kv[prometheus]``). Recording costs a few integer
additions per batch and one bisect per slot grant (slot wait): nothing here runs per byte.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol


class HasMetrics(Protocol):
    """What the collector reads: an ``Engine`` (or anything with its ``metrics()`` snapshot)."""

    def metrics(self) -> dict[str, Any]: ...

LATENCY_BUCKETS = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


@dataclass
class Histogram:
    buckets: tuple[float, ...] = LATENCY_BUCKETS
    counts: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS) + 1))
    total: float = 0.0
    count: int = 0

    def observe(self, value: float, times: int = 1) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += times
        self.total += value * times
        self.count += times

    def snapshot(self) -> dict[str, Any]:
        cumulative, running = [], 0
        for bucket_count in self.counts:
            running += bucket_count
            cumulative.append(running)
        return {"buckets": [*self.buckets, float("inf")], "cumulative": cumulative, "sum": self.total,
                "count": self.count}


@dataclass
class DirectionMetrics:
    bytes: int = 0
    blocks: int = 0
    failed_blocks: int = 0
    cancelled_blocks: int = 0
    batches: int = 0
    batch_latency_s: Histogram = field(default_factory=Histogram)
    slot_wait_s: Histogram = field(default_factory=Histogram)

    def batch_done(self, blocks: int, nbytes: int, failed: int, cancelled: int, latency_s: float,
                   unwaited: int) -> None:
        """A batch ended: ``blocks`` (``nbytes``) moved, ``failed`` and ``cancelled`` blocks, its
        latency, and ``unwaited`` blocks that took a slot without waiting (a slot wait of 0 each)."""
        self.batches += 1
        self.blocks += blocks
        self.bytes += nbytes
        self.failed_blocks += failed
        self.cancelled_blocks += cancelled
        self.batch_latency_s.observe(latency_s)
        if unwaited:
            self.slot_wait_s.observe(0.0, unwaited)

    def snapshot(self) -> dict[str, Any]:
        return {"bytes": self.bytes, "blocks": self.blocks, "failed_blocks": self.failed_blocks,
                "cancelled_blocks": self.cancelled_blocks, "batches": self.batches,
                "batch_latency_s": self.batch_latency_s.snapshot(), "slot_wait_s": self.slot_wait_s.snapshot()}


class PrometheusCollector:
    """A prometheus-client collector for one engine: ``REGISTRY.register(PrometheusCollector(engine))``."""

    def __init__(self, engine: HasMetrics, prefix: str = "uring_kv", labels: dict[str, str] | None = None) -> None:
        self.engine = engine
        self.prefix = prefix
        self.labels = dict(labels or {})

    def describe(self) -> list[Any]:
        return []  # collected lazily: the engine may not be open at registration time

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        snap = self.engine.metrics()
        names = [*self.labels, "direction"]
        counters = {"bytes": "bytes moved", "blocks": "blocks moved", "failed_blocks": "blocks that failed",
                    "cancelled_blocks": "blocks not started because their batch was cancelled",
                    "batches": "batches finished"}
        for key, text in counters.items():
            family = CounterMetricFamily(f"{self.prefix}_{key}", text, labels=names)
            for direction in ("load", "store"):
                family.add_metric([*self.labels.values(), direction], snap[direction][key])
            yield family
        for key, text in (("batch_latency_s", "batch latency in seconds"),
                          ("slot_wait_s", "time a block waited for a staging slot, in seconds")):
            histogram = HistogramMetricFamily(f"{self.prefix}_{key.removesuffix('_s')}_seconds", text, labels=names)
            for direction in ("load", "store"):
                data = snap[direction][key]
                edges = [("+Inf" if b == float("inf") else repr(b)) for b in data["buckets"]]
                histogram.add_metric([*self.labels.values(), direction], list(zip(edges, data["cumulative"],
                                     strict=True)), data["sum"])
            yield histogram
        pressure = {"queued_calls": "calls queued (no block started yet)", "queued_bytes": "bytes of the calls queued",
                    "inflight_calls": "calls with a block started, not finished",
                    "inflight_bytes": "bytes of the calls in flight",
                    "rate_bytes_per_second": "bytes per second served over the last second",
                    "budget_bytes": "bytes queued and in flight past which a call is refused (0: no budget)"}
        classes = [*self.labels, "class"]  # load (demand loads), prefetch, store
        for key, text in pressure.items():
            gauge = GaugeMetricFamily(f"{self.prefix}_{key}", text, labels=classes)
            for cls in ("load", "prefetch", "store"):
                gauge.add_metric([*self.labels.values(), cls],
                                 snap[cls]["rate_bytes_s" if key == "rate_bytes_per_second" else key])
            yield gauge
        refused = CounterMetricFamily(f"{self.prefix}_refused_calls", "calls refused by the budget (EBUSY)",
                                      labels=classes)
        for cls in ("load", "prefetch", "store"):
            refused.add_metric([*self.labels.values(), cls], snap[cls]["refused_calls"])
        yield refused
        for key, text in (("leases_held", "staging slots held"), ("copies_pending", "copy events not yet seen"),
                          ("io_inflight", "reads and writes in flight"),
                          ("oldest_lease_age_s", "age of the oldest held slot in seconds (grows if stuck)")):
            gauge = GaugeMetricFamily(f"{self.prefix}_{key}", text, labels=list(self.labels))
            gauge.add_metric(list(self.labels.values()), snap[key])
            yield gauge
