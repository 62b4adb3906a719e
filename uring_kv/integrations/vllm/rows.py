"""vLLM's KV cache rows, addressed by offload key, kept on disk through uring_kv's GPU path.

The part of :class:`uring_kv.integrations.vllm.worker.UringKVWorker` that needs no vLLM (a
harness on a machine without vLLM drives it with vLLM's layout). Facts it rests on (vLLM 0.34,
``vllm/v1/kv_offload``):

* vLLM's worker side describes a transfer as ``DevicePointers``: for each KV-cache group, for each
  of the group's data references (layers), for each of the group's blocks, a pointer and a size,
  where ``pointer = tensor.data_ptr() + block_id * row_stride`` of a canonical KV tensor
  (``pointer_utils.resolve_device_pointers``). So every pointer names a row of one of the caches
  this worker was built with, and the rows of one block in every tensor of a group are what the
  engine moves as one block: disk → pinned slot → GPU, one CUDA copy call per several blocks.
  Pointers that are not such rows are refused (ValueError), never copied.
* Keys come one per *chunk* of ``block_size_factor`` GPU blocks (``FSLoadStoreSpec.keys``); a
  group's first chunk may start part-way in (``block_indices[g] % factor``). Each GPU block is kept
  under its chunk's key followed by its position in the chunk (2 bytes, big-endian), so a chunk
  stored by one request and loaded, whole or in part, by another finds the same blocks.
* vLLM's keys already carry the group (``make_offload_key``); the groups' block ids are
  independent, so each group has a store of its own (its file, its share of the capacity in
  proportion to its row bytes), over the tensors its data references name.
* The device data is valid only after the work queued on the caller's stream: a CUDA event is
  recorded there at submission and the copies wait for it on the engine's streams, never on the
  caller's thread. Submission returns at once; each store's thread does the rest.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from concurrent.futures import Future
from concurrent.futures import wait as wait_all
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from uring_kv.integrations.config import StoreConfig, open_store
from uring_kv.sync import SyncBlockStore


@dataclass
class Job:
    """One transfer: the futures of its groups' puts or gets, the bytes it moves, when it started
    and (once every future is done) when it ended."""

    futures: list[Future[Any]]
    nbytes: int
    started: float = field(default_factory=time.perf_counter)
    ended: float | None = None

    def __post_init__(self) -> None:
        for future in self.futures:
            future.add_done_callback(self._on_done)

    def _on_done(self, _: Future[Any]) -> None:
        if self.done():  # the last one (a later call finds ended set: it only moves forward)
            self.ended = time.perf_counter()

    def seconds(self) -> float:
        """From submission to the last future's completion (so far, if some are still running)."""
        return (self.ended if self.ended is not None else time.perf_counter()) - self.started

    def done(self) -> bool:
        return all(f.done() for f in self.futures)

    def succeeded(self) -> bool:
        return all(not f.cancelled() and f.exception() is None for f in self.futures)


class KeyedRows:
    """One :class:`SyncBlockStore` per KV-cache group over that group's tensors (see the module
    docstring). ``tensors``: the canonical KV tensors (``num_blocks`` rows each); ``groups``: per
    group, the indices into ``tensors`` its data references name. ``root_dir``: where the files
    go (unnamed), or a list of directories, one per drive (each group's blocks striped over a file
    in each); ``capacity_bytes``: the most all groups' files hold. The store options are checked
    as every adapter's are (:class:`uring_kv.integrations.config.StoreConfig`)."""

    def __init__(self, tensors: Sequence[torch.Tensor], groups: Sequence[Sequence[int]], root_dir: str | list[str],
                 capacity_bytes: int, block_size_factor: int = 1, *, num_slots: int = 16,
                 io_depth: int | None = None, direct: bool | None = None, io: str | None = None) -> None:
        if block_size_factor < 1:
            raise ValueError(f"block_size_factor must be at least 1, got {block_size_factor}")
        config = StoreConfig.from_mapping(
            {"root_dir": root_dir, "capacity_bytes": capacity_bytes, "num_slots": num_slots, "io_depth": io_depth,
             "direct": direct, "io": io}, owner="UringKVWorker")
        config.check_directories("UringKVWorker")
        self._factor = block_size_factor
        self._tensors = list(tensors)
        self._refs = [list(refs) for refs in groups]
        row_bytes = [sum(self._row_bytes(t) for t in dict.fromkeys(refs)) for refs in self._refs]
        total = sum(row_bytes)
        if not total:
            raise ValueError("no KV-cache group names a tensor")
        self.stores: list[SyncBlockStore | None] = []
        try:
            for g, (refs, nbytes) in enumerate(zip(self._refs, row_bytes, strict=True)):
                if not refs:
                    self.stores.append(None)
                    continue
                caches = {f"t{i}": self._tensors[i] for i in dict.fromkeys(refs)}
                share = dataclasses.replace(config, capacity_bytes=capacity_bytes * nbytes // total)
                # unnamed: nothing stays; several directories: the group's blocks striped over them
                self.stores.append(open_store(caches, share, f"uring-kv-vllm-group{g}.bin"))
        except BaseException:
            self.close()
            raise

    def _row_bytes(self, index: int) -> int:
        tensor = self._tensors[index]
        return int(tensor.stride(0)) * tensor.element_size()

    def contains(self, key: bytes, position: int = 0) -> bool:
        """Whether the GPU block at ``position`` of chunk ``key`` is held (any group's store)."""
        sub = key + position.to_bytes(2, "big")
        return any(store is not None and store.contains(sub) for store in self.stores)

    def stats(self) -> dict[str, int]:
        """Every group's store's :meth:`BlockStore.stats`, added up."""
        total: dict[str, int] = {}
        for block_store in self.stores:
            if block_store is not None:
                for name, value in block_store.stats().items():
                    total[name] = total.get(name, 0) + value
        return total

    def submit(self, store: bool, device_ptrs: Any, keys: Sequence[bytes]) -> Job:
        """Start moving the blocks ``device_ptrs`` names (vLLM's ``DevicePointers``) to (``store``)
        or from the keys; returns at once."""
        started = time.perf_counter()
        ptrs = np.asarray(device_ptrs.ptrs, dtype=np.uint64)
        plans = []  # (group store, sub-keys, rows)
        offset = key_index = nbytes = 0
        for g, (size, nrefs, first) in enumerate(zip(device_ptrs.group_block_counts,
                                                     device_ptrs.group_data_ref_counts,
                                                     device_ptrs.block_indices, strict=True)):
            if not size:
                continue
            if g >= len(self.stores) or self.stores[g] is None or nrefs != len(self._refs[g]):
                raise ValueError(f"group {g}: {nrefs} data references, the worker was built with "
                                 f"{len(self._refs[g]) if g < len(self._refs) else 0}")
            rows = self._rows(g, ptrs[offset:offset + size * nrefs].reshape(nrefs, size))
            offset += size * nrefs
            sub_keys: list[bytes] = []
            position = first % self._factor
            for _ in range(size):
                if key_index >= len(keys):
                    raise ValueError(f"{len(keys)} keys for more chunks than that")
                sub_keys.append(bytes(keys[key_index]) + position.to_bytes(2, "big"))
                position += 1
                if position == self._factor:
                    position, key_index = 0, key_index + 1
            if position:
                key_index += 1  # the group's last chunk, partly covered
            plans.append((self.stores[g], sub_keys, rows))
            nbytes += size * sum(self._row_bytes(i) for i in dict.fromkeys(self._refs[g]))
        if offset != len(ptrs):
            raise ValueError(f"{len(ptrs)} pointers, the groups account for {offset}")
        if key_index != len(keys):
            raise ValueError(f"{len(keys)} keys for {key_index} chunks")
        after = self._callers_stream_event() if plans else None
        futures: list[Future[Any]] = []
        for block_store, sub_keys, rows in plans:
            assert block_store is not None
            submit = block_store.submit_put if store else block_store.submit_get
            futures.append(submit(sub_keys, rows, after=after))
        return Job(futures, nbytes, started)

    def _callers_stream_event(self) -> torch.cuda.Event | None:
        """GPU mode: an event recorded on the calling thread's current stream, which the copies wait
        for (the engine's own default would be its loop thread's current stream, not the caller's)."""
        if not self._tensors[0].is_cuda:
            return None
        event = torch.cuda.Event()
        event.record()
        return event

    def _rows(self, group: int, ptrs: np.ndarray) -> list[int]:
        """The block ids ``ptrs`` (one row per data reference) point at, checked against every
        reference's tensor."""
        rows: np.ndarray | None = None
        for ref, refs_ptrs in zip(self._refs[group], ptrs, strict=True):
            tensor = self._tensors[ref]
            base, stride = np.uint64(tensor.data_ptr()), np.uint64(self._row_bytes(ref))
            if rows is None:
                if (refs_ptrs < base).any():
                    raise ValueError(f"group {group}: a pointer below tensor {ref}")
                rows = (refs_ptrs - base) // stride
            if (rows >= tensor.shape[0]).any() or not np.array_equal(base + rows * stride, refs_ptrs):
                raise ValueError(f"group {group}: pointers that are not rows of tensor {ref}")
        assert rows is not None
        return [int(r) for r in rows]

    @staticmethod
    def wait(jobs: Sequence[Job]) -> None:
        """Until every future of ``jobs`` is done (failures are the jobs' results, not raised)."""
        wait_all([f for job in jobs for f in job.futures])

    def close(self) -> None:
        """Close every store (each waits for its calls in flight); the first error is raised."""
        error: BaseException | None = None
        for block_store in self.stores:
            if block_store is None:
                continue
            try:
                block_store.close()
            except BaseException as exc:  # close the others all the same
                error = error or exc
        self.stores = []
        if error is not None:
            raise error
