"""uring_kv as vLLM's GPU-side offloading worker (vLLM ≥ 0.34, ``vllm/v1/kv_offload/base.py``).

vLLM 0.34 moves KV blocks between the GPU and an offload medium through an ``OffloadingWorker``:
``submit_store(job_id, device_ptrs, spec)`` / ``submit_load(job_id, spec, device_ptrs)`` return at
once, ``get_finished()`` reports each job once, ``wait(job_ids)`` blocks for some, ``shutdown()``
ends. Its file-system workers (``kv_offload/fs/worker.py``, ``FSOffloadingWorker``) address the
medium by the keys of an ``FSLoadStoreSpec`` and keep a file per key; :class:`UringKVWorker` takes
the same specs and keeps every key's blocks in one file per KV-cache group through a
:class:`uring_kv.BlockStore` in GPU mode: io_uring between the file and pinned staging slots, CUDA
copies between the slots and vLLM's KV tensors, a hard capacity with LRU eviction. What it rests on
is in :mod:`uring_kv.integrations.vllm.rows`.

Build it where vLLM builds its worker (``OffloadingSpec.get_worker(kv_caches)``)::

    UringKVWorker(kv_caches, root_dir="/nvme/kv", capacity_bytes=400 << 30, block_size_factor=factor)

A load of a key that was evicted, or whose store failed, fails its job (``success=False``), as
vLLM's file workers report a missing file: the scheduler's lookups must come from the same
worker's keys (:meth:`UringKVWorker.contains`).
"""

from __future__ import annotations

import collections
from typing import Any

from vllm.v1.kv_offload.base import DevicePointers, LoadStoreSpec, OffloadingWorker, TransferResult
from vllm.v1.kv_offload.fs.worker import FSLoadStoreSpec

from uring_kv.integrations.vllm.rows import Job, KeyedRows


class UringKVWorker(OffloadingWorker):  # type: ignore[misc]
    """vLLM's ``OffloadingWorker`` on uring_kv block stores (see the module docstring).

    ``kv_caches``: vLLM's ``CanonicalKVCaches``; ``root_dir``: the directory of the files (they
    have no name: nothing is left when the worker shuts down), or a list of them, one per drive;
    ``capacity_bytes``: the most they
    hold together; ``block_size_factor``: GPU blocks per key (vLLM's ``blocks_per_chunk``);
    ``num_slots``, ``io_depth``, ``direct``, ``io``: each store's engine's."""

    def __init__(self, kv_caches: Any, root_dir: str | list[str], capacity_bytes: int, block_size_factor: int = 1, *,
                 num_slots: int = 16, io_depth: int | None = None, direct: bool | None = None,
                 io: str | None = None) -> None:
        self._rows = KeyedRows([t.tensor for t in kv_caches.tensors],
                               [[ref.tensor_idx for ref in refs] for refs in kv_caches.group_data_refs],
                               root_dir, capacity_bytes, block_size_factor, num_slots=num_slots,
                               io_depth=io_depth, direct=direct, io=io)
        self._jobs: collections.OrderedDict[int, Job] = collections.OrderedDict()

    def contains(self, key: bytes, position: int = 0) -> bool:
        """Whether GPU block ``position`` of key ``key`` is held (from any thread, no I/O)."""
        return self._rows.contains(key, position)

    def stats(self) -> dict[str, int]:
        """The stores' counts added up (keys are GPU blocks): see :meth:`uring_kv.BlockStore.stats`."""
        return self._rows.stats()

    def submit_store(self, job_id: int, device_ptrs: DevicePointers, dst_spec: LoadStoreSpec) -> bool:
        return self._submit(job_id, True, device_ptrs, dst_spec)

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, device_ptrs: DevicePointers,
                    expedited: bool = False) -> bool:
        return self._submit(job_id, False, device_ptrs, src_spec)

    def _submit(self, job_id: int, store: bool, device_ptrs: DevicePointers, spec: LoadStoreSpec) -> bool:
        if not isinstance(spec, FSLoadStoreSpec):
            raise TypeError(f"UringKVWorker takes FSLoadStoreSpec keys, got {type(spec).__name__}")
        if job_id in self._jobs:
            raise ValueError(f"job {job_id} is already in flight")
        self._jobs[job_id] = self._rows.submit(store, device_ptrs, spec.keys)
        return True

    def get_finished(self) -> list[TransferResult]:
        finished = [job_id for job_id, job in self._jobs.items() if job.done()]
        results = []
        for job_id in finished:
            job = self._jobs.pop(job_id)
            results.append(TransferResult(job_id=job_id, success=job.succeeded(), transfer_size=job.nbytes,
                                          transfer_time=job.seconds()))
        return results

    def wait(self, job_ids: set[int]) -> None:
        self._rows.wait([self._jobs[j] for j in job_ids if j in self._jobs])

    def shutdown(self) -> None:
        """Let the jobs in flight finish (reported by a later ``get_finished``), then close."""
        self._rows.wait(list(self._jobs.values()))
        self._rows.close()
