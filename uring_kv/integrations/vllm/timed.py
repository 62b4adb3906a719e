"""A secondary tier that times another one's promotions inside vLLM's engine (for ``bench-serve``).

``uring-kv bench-serve`` compares UringKVTier with vLLM's own file-system tier inside a running
engine, where the tiers live in the engine-core process. :class:`TimedTier` is configured as the
secondary tier and builds the real one from its ``inner`` entry through vLLM's own
``SecondaryTierFactory``, passes every call through unchanged, and appends one JSON line per
promotion job to ``record``: the seconds from vLLM's first lookup, for the job's request, of one of
the job's chunks in this tier (where vLLM learns that the tier has it and starts the promotion; a
tier that answers RETRY first is timed from that call) to the ``get_finished_jobs`` call that
reports the job done,
with the job's chunk count and outcome. Both tiers are timed by the same code at the same two
points of vLLM's interface, so what differs is the tier.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Collection, Iterable
from typing import Any

from vllm.v1.kv_offload.base import (
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadingMetricMetadata,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)
from vllm.v1.kv_offload.tiering.base import JobResult, ParentManager, SecondaryTierManager, TransferJob
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory


class TimedTier(SecondaryTierManager):  # type: ignore[misc]
    """``{"type": "TimedTier", "module_path": "uring_kv.integrations.vllm.timed", "record": PATH,
    "inner": {the real tier's entry}}`` (see the module docstring)."""

    medium = Medium.STORAGE

    def __init__(self, offloading_spec: Any, primary_kv_view: memoryview, tier_type: str,
                 backpressure_detector: Any = None, *, inner: dict[str, Any], record: str) -> None:
        self.inner = SecondaryTierFactory.create_secondary_tier(dict(inner), primary_kv_view, offloading_spec)
        super().__init__(offloading_spec, primary_kv_view, tier_type, self.inner.bp_detector)
        self.locality = self.inner.locality
        self._record = open(record, "a")  # noqa: SIM115 (closed at shutdown)
        # request → chunk → when vLLM first asked for it for that request
        self._first_lookup: dict[str, dict[bytes, float]] = {}
        self._started: dict[int, tuple[float, int]] = {}  # promotion job → (start, chunks)
        self._lock = threading.Lock()

    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, OffloadingMetricMetadata]:
        inner = extra_config["inner"]
        definitions: dict[str, OffloadingMetricMetadata] = \
            SecondaryTierFactory.get_tier_class(inner).build_metric_definitions(inner)
        return definitions

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        asked = time.monotonic()
        result: LookupResult = self.inner.lookup(key, req_context)
        request = self._first_lookup.setdefault(req_context.req_id, {})
        if result is LookupResult.MISS:
            request.pop(bytes(key), None)
        else:
            request.setdefault(bytes(key), asked)
        return result

    def submit_load(self, job_metadata: TransferJob) -> None:
        now = time.monotonic()
        asked = self._first_lookup.get(job_metadata.req_context.req_id, {})
        starts = [asked.pop(bytes(key), now) for key in job_metadata.keys]
        with self._lock:
            self._started[job_metadata.job_id] = (min(starts, default=now), len(starts))
        self.inner.submit_load(job_metadata)

    def get_finished_jobs(self) -> Iterable[JobResult]:
        finished = list(self.inner.get_finished_jobs())
        now = time.monotonic()
        for result in finished:
            with self._lock:
                started = self._started.pop(result.job_id, None)
            if started is not None:
                self._record.write(json.dumps({"seconds": now - started[0], "chunks": started[1],
                                               "success": bool(result.success)}) + "\n")
        if finished:
            self._record.flush()
        return finished

    # ------------------------------------------------------------ passed through
    def submit_store(self, job_metadata: TransferJob) -> None:
        self.inner.submit_store(job_metadata)

    def has_pending_work(self) -> bool:
        return bool(self.inner.has_pending_work())

    def take_events(self) -> Iterable[OffloadingEvent]:
        events: Iterable[OffloadingEvent] = self.inner.take_events()
        return events

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self.inner.touch(keys, req_context)

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        context: RequestOffloadingContext = self.inner.on_new_request(req_context)
        return context

    def on_request_finished(self, req_context: ReqContext) -> None:
        self._first_lookup.pop(req_context.req_id, None)
        self.inner.on_request_finished(req_context)

    def serve_external_requests(self, parent: ParentManager) -> None:
        self.inner.serve_external_requests(parent)

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        self.inner.on_schedule_end(context)

    def drain_jobs(self) -> None:
        self.inner.drain_jobs()

    def get_stats(self) -> Any:
        return self.inner.get_stats()

    def shutdown(self) -> None:
        try:
            self.inner.shutdown()
        finally:
            self._record.close()


__all__ = ["TimedTier"]
