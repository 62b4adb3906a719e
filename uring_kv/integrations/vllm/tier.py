"""uring_kv as a secondary tier of vLLM's KV offloading (``vllm/v1/kv_offload/tiering``).

vLLM keeps offloaded KV in a CPU *primary* region (one row per chunk, shared memory) and cascades
rows to secondary tiers, promoting them back on a primary miss. This tier keeps those rows in one
file through a :class:`uring_kv.BlockStore` (CPU mode over the primary region: io_uring reads and
writes straight between the file and the rows), or striped over one file per drive, with a hard
capacity and LRU eviction, and optionally across restarts. Configure it in
``kv_connector_extra_config``::

    "secondary_tiers": [{"type": "UringKVTier", "module_path": "uring_kv.integrations.vllm",
                         "root_dir": "/nvme/kv", "capacity_bytes": 500_000_000_000}]

How it answers vLLM's contract (``SecondaryTierManager``; every call comes from the scheduler's
thread and must not block):

* ``lookup``: the store's index, read on the calling thread (no I/O, no wait): HIT for a key whose
  bytes are in the file, MISS otherwise. A key whose store or load failed is a MISS from then on,
  so a failed promotion is never retried forever (vLLM #49176).
* ``submit_store`` / ``submit_load``: handed to the store's own thread, returning at once; keys
  already held are not written again. A key that was evicted between the lookup and its load fails
  that job for that key only (``successful_keys`` names the others).
* ``get_finished_jobs``: every job that ended since the last call, each exactly once, with the
  time it took and the bytes it moved (what vLLM's backpressure detector weighs).
* ``drain_jobs``: waits until every submitted job has reported. ``shutdown``: finishes the jobs in
  flight, closes the store (its file has no name: nothing is left on disk; a persistent tier's
  file and index stay for the next start) and lets go of the primary region, so vLLM can unmap it.

What it did is counted (``stats()``: lookups and hits, promotions and stores in jobs, keys, bytes
and seconds, the keys that failed) and handed to vLLM's connector metrics (``get_stats``), which
a server exports on ``/metrics`` as ``vllm:uring_kv_tier_*`` (:data:`METRICS`).
"""

from __future__ import annotations

import collections
import gc
import json
import threading
import time
from collections.abc import Iterable
from concurrent.futures import Future
from typing import Any

import numpy as np
import torch
from vllm.v1.kv_offload.base import (
    LookupResult,
    Medium,
    OffloadingCounterMetadata,
    OffloadingGaugeMetadata,
    OffloadingHistogramMetadata,
    OffloadingMetricMetadata,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
)
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob

from uring_kv.errors import EngineClosedError, KeyIOError
from uring_kv.integrations.config import StoreConfig, fingerprint_name, open_store
from uring_kv.sync import SyncBlockStore

# What the tier counts, as vLLM's connector metrics (the name a server's /metrics shows, with
# prometheus-client's ``_total`` after counters): name in stats() -> (metric, help).
_COUNTERS = {
    "lookups": ("vllm:uring_kv_tier_lookups", "Lookups UringKVTier answered (one per chunk asked)."),
    "hits": ("vllm:uring_kv_tier_hits", "Lookups UringKVTier answered HIT."),
    "promotion_jobs": ("vllm:uring_kv_tier_promotion_jobs", "Promotion jobs UringKVTier reported."),
    "promoted_keys": ("vllm:uring_kv_tier_promoted_keys", "Chunks UringKVTier loaded into the primary."),
    "promoted_bytes": ("vllm:uring_kv_tier_promoted_bytes", "Bytes UringKVTier loaded into the primary."),
    "promotion_failed_keys": ("vllm:uring_kv_tier_promotion_failed_keys",
                              "Chunks whose promotion failed (each a miss from then on)."),
    "store_jobs": ("vllm:uring_kv_tier_store_jobs", "Cascade (store) jobs UringKVTier reported."),
    "stored_keys": ("vllm:uring_kv_tier_stored_keys", "Chunks UringKVTier wrote to its file."),
    "stored_bytes": ("vllm:uring_kv_tier_stored_bytes", "Bytes UringKVTier wrote to its file."),
    "store_failed_keys": ("vllm:uring_kv_tier_store_failed_keys", "Chunks whose store failed (misses)."),
}
_PROMOTION_SECONDS = "vllm:uring_kv_tier_promotion_seconds"
_KEYS_HELD = "vllm:uring_kv_tier_keys"
_PROMOTION_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)

#: The tier's metrics as vLLM's connector declares them (``build_metric_definitions``).
METRICS: dict[str, OffloadingMetricMetadata] = {
    **{name: OffloadingCounterMetadata(documentation=text) for name, text in _COUNTERS.values()},
    _PROMOTION_SECONDS: OffloadingHistogramMetadata(
        documentation="Seconds from UringKVTier's submit_load to the job's end, per promotion job.",
        buckets=_PROMOTION_BUCKETS),
    _KEYS_HELD: OffloadingGaugeMetadata(documentation="Chunks UringKVTier holds."),
}


class UringKVTier(SecondaryTierManager):  # type: ignore[misc]
    """A vLLM secondary tier on a uring_kv block store (see the module docstring).

    Configuration keys (beyond vLLM's own ``type``, ``module_path``, ``backpressure``):
    ``root_dir`` (the directory of the file, or a list of directories, one per drive: the rows are
    striped over a file in each), ``capacity_bytes`` (the most the files hold: rows are evicted,
    least recently used first, to stay within it), and optionally ``num_slots`` (staging slots per
    file, default 16), ``io_depth`` (reads and writes in flight per file; default: the slots),
    ``direct`` (None: O_DIRECT where the filesystem takes it), ``io`` ("auto", "uring",
    "threads"), ``persistent`` (keep the rows across restarts; see :func:`run_fingerprint`) and
    ``fsync`` (with ``persistent``: sync before a key becomes visible; default True)."""

    medium = Medium.STORAGE

    def __init__(self, offloading_spec: Any, primary_kv_view: memoryview, tier_type: str,
                 backpressure_detector: Any = None, *, root_dir: str | list[str], capacity_bytes: int,
                 num_slots: int = 16, io_depth: int | None = None, direct: bool | None = None,
                 io: str | None = None, persistent: bool = False, fsync: bool | None = None,
                 locality: str | None = None) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        config = StoreConfig.from_mapping(
            {"root_dir": root_dir, "capacity_bytes": capacity_bytes, "num_slots": num_slots, "io_depth": io_depth,
             "direct": direct, "io": io, "persistent": persistent, "fsync": fsync}, owner="UringKVTier", noun="tier")
        rows = np.asarray(primary_kv_view)
        if rows.ndim != 2 or not rows.flags.c_contiguous:
            raise ValueError(f"UringKVTier: the primary view must be C-contiguous rows, got shape {rows.shape}")
        self._row_bytes = int(rows.strides[0])
        name, fingerprint = "uring-kv-vllm-tier.bin", ""
        if config.persistent:
            # one file per run configuration: another model's rows are in another file, never refused
            fingerprint = run_fingerprint(offloading_spec, self._row_bytes)
            name = fingerprint_name("uring-kv-vllm-tier", fingerprint)
        # The rows as the engine's one cache tensor (dim 0 = chunk), sharing the region's memory.
        self._store: SyncBlockStore | None = open_store({"primary": torch.from_numpy(rows)}, config, name,
                                                        fingerprint=fingerprint)
        del rows
        self._finished: collections.deque[JobResult] = collections.deque()
        self._outstanding = 0
        self._settled = threading.Condition(threading.RLock())  # (get_stats holds it around stats())
        # counts: lookups on vLLM's scheduler thread (the only one that looks up), the rest under
        # _settled as each job is reported; _reported: what get_stats() handed to vLLM so far
        self._lookups = self._hits = 0
        self._counts: dict[str, float] = {key: 0 for key in _COUNTERS if key not in ("lookups", "hits")}
        self._counts.update(promotion_seconds=0.0, promotion_seconds_max=0.0)
        self._reported: dict[str, float] = dict.fromkeys(_COUNTERS, 0)
        self._promotion_times: list[float] = []  # not yet handed to get_stats()

    # ---------------------------------------------------------------- lookups
    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        store = self._store
        self._lookups += 1
        if store is not None and store.contains(key):
            self._hits += 1
            return LookupResult.HIT
        return LookupResult.MISS

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    # ---------------------------------------------------------------- transfers
    def submit_store(self, job: TransferJob) -> None:
        self._submit(job, False)

    def submit_load(self, job: TransferJob) -> None:
        self._submit(job, True)

    def _submit(self, job: TransferJob, load: bool) -> None:
        keys = [bytes(key) for key in job.keys]
        rows = [int(row) for row in job.chunk_ids]
        store = self._store
        with self._settled:
            self._outstanding += 1
        if store is None:
            self._report(job, keys, [], 0, 0)
            return
        # A store writes only the keys neither held nor being written by another job (the put
        # counts them: what the job's bytes are, for vLLM's backpressure); a load takes the keys
        # held when it runs on the store's thread: one evicted since vLLM's lookup fails alone.
        try:
            future: Future[Any] = store.submit_get_present(keys, rows) if load else store.submit_put(keys, rows)
        except EngineClosedError:
            self._report(job, keys, [], 0, 0)
            return
        start = time.monotonic()
        future.add_done_callback(lambda done: self._done(job, keys, done, start))

    def _done(self, job: TransferJob, keys: list[bytes], future: Future[Any], start: float) -> None:
        """On the store's thread (or the caller's, if already done): the keys that made it, then the
        job's result. Never raises: every job must be reported."""
        seconds = time.monotonic() - start
        try:
            written = 0  # (a store's keys written)
            if future.cancelled():
                ok: list[bytes] = []
            elif (error := future.exception()) is None:
                result = future.result()  # the keys loaded (a promotion), or the keys written
                ok, written = (list(result), 0) if job.is_promotion else (keys, int(result))
            elif isinstance(error, KeyIOError):
                ok = [key for key in keys if key not in error.failures]
                written = error.written
            else:
                ok = []
            moved = len(ok) if job.is_promotion else written
        except BaseException:  # a report must go out whatever happened
            ok, moved = [], 0
        self._report(job, keys, ok, seconds, moved)

    def _report(self, job: TransferJob, keys: list[bytes], ok: list[bytes], seconds: float, moved: int) -> None:
        success = len(ok) == len(keys)
        result = JobResult(job_id=job.job_id, success=success, transfer_time=seconds,
                           transfer_bytes=moved * self._row_bytes,
                           successful_keys=None if success or not job.is_promotion else
                           [OffloadKey(key) for key in ok])
        with self._settled:
            counts = self._counts
            if job.is_promotion:
                counts["promotion_jobs"] += 1
                counts["promoted_keys"] += moved
                counts["promoted_bytes"] += moved * self._row_bytes
                counts["promotion_failed_keys"] += len(keys) - len(ok)
                counts["promotion_seconds"] += seconds
                counts["promotion_seconds_max"] = max(counts["promotion_seconds_max"], seconds)
                if len(self._promotion_times) < 100_000:  # (bounded if nothing ever collects them)
                    self._promotion_times.append(seconds)
            else:
                counts["store_jobs"] += 1
                counts["stored_keys"] += moved
                counts["stored_bytes"] += moved * self._row_bytes
                counts["store_failed_keys"] += len(keys) - len(ok)
            self._finished.append(result)
            self._outstanding -= 1
            self._settled.notify_all()

    def get_finished_jobs(self) -> Iterable[JobResult]:
        done = []
        while self._finished:
            done.append(self._finished.popleft())
        return done

    def has_pending_work(self) -> bool:
        return bool(self._outstanding or self._finished)

    def drain_jobs(self) -> None:
        with self._settled:
            self._settled.wait_for(lambda: self._outstanding == 0)

    # ---------------------------------------------------------------- end
    def shutdown(self) -> None:
        store, self._store = self._store, None
        if store is not None:
            store.close()  # the jobs submitted finish (and report) first
            del store
            gc.collect()  # the engine's last references to the rows: vLLM can then unmap its region
        self.drain_jobs()

    def stats(self) -> dict[str, float]:
        """What the tier did since it started: ``lookups`` and ``hits`` (chunks), promotions
        (``promotion_jobs``, ``promoted_keys``, ``promoted_bytes``, ``promotion_failed_keys``,
        ``promotion_seconds`` and ``promotion_seconds_max``: submit_load to the job's end) and
        stores (``store_jobs``, ``stored_keys`` and ``stored_bytes``: written to the file, keys
        already held not counted; ``store_failed_keys``); then the block store's own counts (keys
        held, capacity, evictions, failures; none once shut down). Safe from any thread."""
        with self._settled:
            counts = dict(self._counts)
        store = self._store
        return {"lookups": self._lookups, "hits": self._hits, **counts, **(store.stats() if store is not None else {})}

    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, OffloadingMetricMetadata]:
        return dict(METRICS)

    def get_stats(self) -> Any:
        """vLLM's connector stats (``OffloadingConnectorStats``): the counts since the last call,
        each promotion job's seconds, and the keys held now."""
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats

        with self._settled:  # the counts and the times of the same jobs
            now = self.stats()
            times, self._promotion_times = self._promotion_times, []
        stats = OffloadingConnectorStats()
        for key, (name, _) in _COUNTERS.items():
            if delta := now[key] - self._reported[key]:
                stats.increase_counter(name, delta)
                self._reported[key] = now[key]
        for seconds in times:
            stats.observe_histogram(_PROMOTION_SECONDS, seconds)
        if "keys" in now:
            stats.set_gauge(_KEYS_HELD, now["keys"])
        return stats


def run_fingerprint(offloading_spec: Any, row_bytes: int) -> str:
    """What a persistent tier's rows are valid for: vLLM's own description of the run (the fields
    its fs tier names its directory by: model, KV dtype, tokens per hash, chunk size, parallel
    layout, KV cache groups and layers), this worker's rank and the row size, as JSON. A restart
    with the same configuration reopens the file; any other configuration opens another file."""
    from vllm.v1.kv_offload.file_mapper import FileMapper

    mapper = FileMapper.from_offloading_spec(root_dir="", offloading_spec=offloading_spec,
                                             blocks_per_file=offloading_spec.blocks_per_chunk)
    return json.dumps({"run": mapper.get_run_config(), "rank": mapper.rank, "row_bytes": row_bytes},
                      sort_keys=True)


__all__ = ["METRICS", "UringKVTier", "run_fingerprint"]
