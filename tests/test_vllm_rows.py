"""KeyedRows (the vLLM-free core of ``UringKVWorker``) driven with vLLM 0.34's worker-side layout,
on the CPU and on a GPU (the CUDA cases skip without one; vLLM itself is not needed).

``device_pointers`` builds what vLLM's ``pointer_utils.resolve_device_pointers`` builds from a
``GPULoadStoreSpec`` over ``CanonicalKVCaches``: int8 tensors of ``num_blocks`` rows, and for each
KV-cache group, for each of its data references, for each of its blocks, ``data_ptr() + block_id *
stride(0)``. ``tests-vllm/test_uring_kv_worker.py`` checks the same behaviour through vLLM's own
classes; here the GPU data path runs (disk → pinned slot → CUDA copy into vLLM's rows)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from uring_kv.integrations.vllm.rows import KeyedRows

PAGE = 16384  # bytes of one block of one tensor
BLOCKS = 48


def kv_tensors(device: str, count: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(-128, 128, (BLOCKS, PAGE), dtype=torch.int8, generator=gen).to(device)
            for _ in range(count)]


def device_pointers(tensors: Sequence[torch.Tensor], groups: Sequence[Sequence[int]], block_ids: Sequence[int],
                    group_sizes: Sequence[int], block_indices: Sequence[int]) -> SimpleNamespace:
    """vLLM 0.34's DevicePointers for these blocks (resolve_device_pointers' canonical order)."""
    ptrs: list[int] = []
    offset = 0
    for size, refs in zip(group_sizes, groups, strict=True):
        for ref in refs:
            tensor = tensors[ref]
            ptrs += [tensor.data_ptr() + b * tensor.stride(0) for b in block_ids[offset:offset + size]]
        offset += size
    return SimpleNamespace(ptrs=np.array(ptrs, dtype=np.uint64), sizes=np.full(len(ptrs), PAGE, dtype=np.uint64),
                           group_block_counts=tuple(group_sizes),
                           group_data_ref_counts=tuple(len(refs) for refs in groups),
                           block_indices=tuple(block_indices))


def key(n: int, group: int = 0) -> bytes:
    return n.to_bytes(8, "big") + group.to_bytes(4, "big")  # vLLM's keys carry their group too


def settle(job: object) -> bool:
    KeyedRows.wait([job])  # type: ignore[list-item]
    return job.succeeded()  # type: ignore[attr-defined,no-any-return]


def test_two_groups_chunks_part_way_round_trip_byte_exact(tmp_path: Path, device: str) -> None:
    """Two groups over shared tensors (a hybrid model's layout), four blocks per key, the first
    group starting part-way into its first chunk: every block comes back, byte for byte, into the
    rows the load's pointers name, also when a load asks for part of a chunk."""
    groups = [[0, 1], [0, 1, 2]]
    tensors = kv_tensors(device, 3, seed=1)
    rows = KeyedRows(tensors, groups, str(tmp_path), capacity_bytes=64 * 3 * PAGE, block_size_factor=4,
                     num_slots=4)
    try:
        stored = [3, 4, 5, 6, 7, 8, 20, 21, 22, 23]  # group 0: logical 2..7 (keys 1, 2); group 1: 0..3 (key 3)
        want = [t[stored].clone() for t in tensors]
        keys = [key(1), key(2), key(3, group=1)]
        job = rows.submit(True, device_pointers(tensors, groups, stored, [6, 4], [2, 0]), keys)
        assert settle(job) and job.nbytes == 6 * 2 * PAGE + 4 * 3 * PAGE
        assert [rows.contains(key(1), p) for p in range(4)] == [False, False, True, True]
        for t in tensors:
            t.zero_()
        target = [30, 31, 32, 33, 34, 35, 40, 41, 42, 43]
        assert settle(rows.submit(False, device_pointers(tensors, groups, target, [6, 4], [2, 0]), keys))
        if device == "cuda":
            torch.cuda.synchronize()
        for t, w in zip(tensors[:2], want[:2], strict=True):  # in both groups
            assert torch.equal(t[target], w)
        assert torch.equal(tensors[2][target[6:]], want[2][6:]), "tensor 2: group 1's blocks"
        assert not tensors[2][target[:6]].any(), "tensor 2 is not group 0's: its rows stay untouched"
        # part of key 2's chunk (logical blocks 5 and 6) into other rows
        assert settle(rows.submit(False, device_pointers(tensors, groups, [44, 45], [2, 0], [5, 0]), [key(2)]))
        if device == "cuda":
            torch.cuda.synchronize()
        assert all(torch.equal(t[[44, 45]], w[3:5]) for t, w in zip(tensors[:2], want[:2], strict=True))
    finally:
        rows.close()
    assert os.listdir(tmp_path) == []


def test_pointers_that_are_not_rows_are_refused(tmp_path: Path, device: str) -> None:
    groups = [[0, 1]]
    tensors = kv_tensors(device, 2, seed=2)
    rows = KeyedRows(tensors, groups, str(tmp_path), capacity_bytes=8 * 2 * PAGE, num_slots=2)
    try:
        other = kv_tensors(device, 2, seed=3)
        with pytest.raises(ValueError, match=r"not rows|below"):
            rows.submit(True, device_pointers(other, groups, [1], [1], [0]), [key(1)])
        skewed = device_pointers(tensors, groups, [1], [1], [0])
        skewed.ptrs[1] += 8  # inside a row, not at its start
        with pytest.raises(ValueError, match="not rows"):
            rows.submit(True, skewed, [key(1)])
        assert not rows.contains(key(1))
    finally:
        rows.close()


UNORDERED = pytest.mark.xfail(strict=True, reason="the mutation: with no event recorded on the caller's side stream "
                                                  "the copies race its writes")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(("side", "ordered"), [(False, True), (True, True), pytest.param(True, False, marks=UNORDERED)])
def test_a_store_copies_after_the_callers_stream_and_a_load_lands_after_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, side: bool, ordered: bool) -> None:
    """vLLM submits from its worker thread with the KV writes still queued on its stream: a store
    must copy the late bytes, and a load's bytes must land after the stream's queued writes. The
    engine's own default (the current stream of the thread that drives it) is not the caller's
    stream: without the event KeyedRows records, both race."""
    if not ordered:
        monkeypatch.setattr(KeyedRows, "_callers_stream_event", lambda self: None)
    groups = [[0, 1]]
    tensors = kv_tensors("cuda", 2, seed=4)
    rows = KeyedRows(tensors, groups, str(tmp_path), capacity_bytes=16 * 2 * PAGE, num_slots=2)
    stream = torch.cuda.Stream() if side else torch.cuda.current_stream()
    try:
        for t in tensors:  # every kernel once first: a first launch may wait for the work in flight
            t[9].fill_(0)
        assert settle(rows.submit(True, device_pointers(tensors, groups, [9], [1], [0]), [key(9)]))
        torch.cuda.synchronize()
        with torch.cuda.stream(stream):
            torch.cuda._sleep(200_000_000)
            for t in tensors:
                t[3].fill_(7)
            assert settle(rows.submit(True, device_pointers(tensors, groups, [3], [1], [0]), [key(3)]))
            torch.cuda._sleep(200_000_000)
            for t in tensors:
                t[5].fill_(1)
            assert settle(rows.submit(False, device_pointers(tensors, groups, [5], [1], [0]), [key(3)]))
        torch.cuda.synchronize()
        assert all(bool((t[5] == 7).all()) for t in tensors)
    finally:
        rows.close()
