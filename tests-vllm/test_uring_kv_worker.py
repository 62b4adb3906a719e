"""UringKVWorker against vLLM 0.34's worker-side interface (``OffloadingWorker``, ``FSLoadStoreSpec``).

The transfers are described by vLLM itself: ``resolve_device_pointers`` turns a
``GPULoadStoreSpec`` over ``CanonicalKVCaches`` into the ``DevicePointers`` its connector hands a
worker. Here the KV tensors are CPU tensors (vLLM's CPU build); the same code moves CUDA tensors
on a GPU (``tests/test_gpu.py`` runs the vLLM-free part there with vLLM's layout). Every loaded
block is compared byte for byte with what was stored.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch

worker_module = pytest.importorskip(
    "vllm.v1.kv_offload.fs.worker", reason="this vLLM has no worker-side FS interface (it came in 0.34)")

from vllm.v1.kv_offload.base import (  # noqa: E402
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    GPULoadStoreSpec,
    make_offload_key,
)
from vllm.v1.kv_offload.pointer_utils import resolve_device_pointers  # noqa: E402

from uring_kv.integrations.vllm.worker import UringKVWorker  # noqa: E402

FSLoadStoreSpec = worker_module.FSLoadStoreSpec
PAGE = 8192  # bytes of one block of one tensor
BLOCKS = 64


def caches(ntensors: int = 2, groups: list[list[int]] | None = None) -> CanonicalKVCaches:
    tensors = [CanonicalKVCacheTensor(tensor=torch.zeros(BLOCKS, PAGE, dtype=torch.int8), page_size_bytes=PAGE)
               for _ in range(ntensors)]
    groups = groups if groups is not None else [list(range(ntensors))]
    return CanonicalKVCaches(tensors=tensors, group_data_refs=[
        [CanonicalKVCacheRef(tensor_idx=i, page_size_bytes=PAGE) for i in refs] for refs in groups])


def fill(kv: CanonicalKVCaches, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for t in kv.tensors:
        t.tensor.copy_(torch.randint(-128, 128, t.tensor.shape, dtype=torch.int8, generator=g))


def keys(*numbers: int, group: int = 0) -> list[bytes]:
    return [make_offload_key(n.to_bytes(8, "big"), group) for n in numbers]


def pointers(kv: CanonicalKVCaches, block_ids: list[int], group_sizes: list[int] | None = None,
             block_indices: list[int] | None = None) -> object:
    sizes = group_sizes or [len(block_ids)]
    return resolve_device_pointers(GPULoadStoreSpec(block_ids, sizes, block_indices or [0] * len(sizes)), kv)


def finish(worker: UringKVWorker, job_id: int, timeout: float = 30.0) -> bool:
    """Poll get_finished, as vLLM's connector does each step, until the job reports; its success."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for result in worker.get_finished():
            assert result.job_id == job_id, f"job {result.job_id} reported, waiting for {job_id}"
            return bool(result.success)
        time.sleep(0.001)
    raise AssertionError(f"job {job_id} never finished")


def rows(kv: CanonicalKVCaches, block_ids: list[int]) -> list[torch.Tensor]:
    return [t.tensor[block_ids].clone() for t in kv.tensors]


@pytest.fixture
def kv() -> CanonicalKVCaches:
    k = caches()
    fill(k, 1)
    return k


def test_stored_blocks_load_back_identical_into_other_rows(tmp_path: Path, kv: CanonicalKVCaches) -> None:
    worker = UringKVWorker(kv, str(tmp_path), capacity_bytes=32 * 2 * PAGE)
    try:
        stored = [3, 7, 11, 20]
        expected = rows(kv, stored)
        assert worker.submit_store(1, pointers(kv, stored), FSLoadStoreSpec(keys(1, 2, 3, 4)))
        assert finish(worker, 1)
        assert all(worker.contains(k) for k in keys(1, 2, 3, 4))
        fill(kv, 2)
        target = [40, 41, 60, 0]
        assert worker.submit_load(2, FSLoadStoreSpec(keys(1, 2, 3, 4)), pointers(kv, target))
        assert finish(worker, 2)
        for got, want in zip(rows(kv, target), expected, strict=True):
            assert torch.equal(got, want)
    finally:
        worker.shutdown()
    assert os.listdir(tmp_path) == [], "the files have no name: nothing stays"


def test_chunks_of_several_blocks_start_part_way_and_load_in_part(tmp_path: Path, kv: CanonicalKVCaches) -> None:
    """block_size_factor 4: a group starting at logical block 2 covers the second half of its first
    key's chunk; a later load of that chunk's blocks alone finds the same bytes."""
    worker = UringKVWorker(kv, str(tmp_path), capacity_bytes=32 * 2 * PAGE, block_size_factor=4)
    try:
        stored = [5, 6, 7, 8, 9, 10]  # logical blocks 2..7: key A holds 2-3, key B holds 4-7
        expected = rows(kv, stored)
        worker.submit_store(1, pointers(kv, stored, block_indices=[2]), FSLoadStoreSpec(keys(10, 11)))
        assert finish(worker, 1)
        assert [worker.contains(keys(10)[0], p) for p in range(4)] == [False, False, True, True]
        fill(kv, 3)
        target = [30, 31]  # logical blocks 4 and 5: key B's first two
        worker.submit_load(2, FSLoadStoreSpec(keys(11)), pointers(kv, target, block_indices=[4]))
        assert finish(worker, 2)
        for got, want in zip(rows(kv, target), expected, strict=True):
            assert torch.equal(got, want[2:4])
        with pytest.raises(ValueError, match="keys"):  # 6 blocks from logical block 2 need 2 keys
            worker.submit_store(3, pointers(kv, stored, block_indices=[2]), FSLoadStoreSpec(keys(10)))
    finally:
        worker.shutdown()


def test_groups_have_their_own_blocks_over_shared_tensors(tmp_path: Path) -> None:
    """Two KV-cache groups over the same tensors (vLLM's hybrid layout): each group's blocks come
    back into the rows its own pointers name."""
    kv = caches(2, groups=[[0, 1], [0, 1]])
    fill(kv, 4)
    worker = UringKVWorker(kv, str(tmp_path), capacity_bytes=64 * 2 * PAGE)
    try:
        expected = rows(kv, [1, 2, 3])
        spec = FSLoadStoreSpec(keys(1, 2, group=0) + keys(1, group=1))
        worker.submit_store(1, pointers(kv, [1, 2, 3], group_sizes=[2, 1]), spec)
        assert finish(worker, 1)
        fill(kv, 5)
        worker.submit_load(2, spec, pointers(kv, [50, 51, 52], group_sizes=[2, 1]))
        assert finish(worker, 2)
        for got, want in zip(rows(kv, [50, 51, 52]), expected, strict=True):
            assert torch.equal(got, want)
    finally:
        worker.shutdown()


def test_evicted_or_unknown_keys_fail_their_load_and_capacity_holds(tmp_path: Path, kv: CanonicalKVCaches) -> None:
    capacity_blocks = 8
    worker = UringKVWorker(kv, str(tmp_path), capacity_bytes=capacity_blocks * 2 * PAGE)
    try:
        for job in range(3):  # 12 blocks into room for 8: the first 4 go
            first = 4 * job
            worker.submit_store(job, pointers(kv, list(range(first, first + 4))),
                                FSLoadStoreSpec(keys(*range(first, first + 4))))
            assert finish(worker, job)
        held = [worker.contains(k) for k in keys(*range(12))]
        assert held == [False] * 4 + [True] * 8
        stats = worker.stats()
        assert stats["keys"] == stats["capacity_blocks"] == capacity_blocks and stats["evictions"] == 4, stats
        worker.submit_load(10, FSLoadStoreSpec(keys(0)), pointers(kv, [63]))
        assert not finish(worker, 10), "an evicted key's load fails its job"
        worker.submit_load(11, FSLoadStoreSpec(keys(99)), pointers(kv, [63]))
        assert not finish(worker, 11)
    finally:
        worker.shutdown()


def test_pointers_outside_the_caches_are_refused(tmp_path: Path, kv: CanonicalKVCaches) -> None:
    worker = UringKVWorker(kv, str(tmp_path), capacity_bytes=8 * 2 * PAGE)
    try:
        other = caches()
        with pytest.raises(ValueError, match=r"not rows|below"):
            worker.submit_store(1, pointers(other, [1]), FSLoadStoreSpec(keys(1)))
        assert worker.get_finished() == []
    finally:
        worker.shutdown()


def test_shutdown_with_jobs_in_flight_lets_them_finish(tmp_path: Path, kv: CanonicalKVCaches) -> None:
    worker = UringKVWorker(kv, str(tmp_path), capacity_bytes=64 * 2 * PAGE)
    expected = rows(kv, list(range(32)))
    for job in range(4):
        worker.submit_store(job, pointers(kv, list(range(8 * job, 8 * job + 8))),
                            FSLoadStoreSpec(keys(*range(8 * job, 8 * job + 8))))
    worker.shutdown()
    results = worker.get_finished()
    assert sorted(r.job_id for r in results) == [0, 1, 2, 3] and all(r.success for r in results)
    assert all(r.transfer_size == 8 * 2 * PAGE for r in results)
    assert os.listdir(tmp_path) == []
    assert all(torch.equal(a, b) for a, b in zip(rows(kv, list(range(32))), expected, strict=True))
