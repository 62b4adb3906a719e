"""What a user would run instead of uring_kv, for ``uring-kv bench`` (the machine's limits are in
``ceilings``).

Each peer moves the bench's batches between the same file and the same caches as uring_kv, and is
written after its source so that a reader can check the port step by step (docs/performance.md):

* ``vllm-disk``: vLLM's ``DiskBackend`` (``vllm/v1/simple_kv_offload/disk_backend.py``,
  ``DiskBackend._do_load`` / ``_do_store``, with the end-of-call drain of vLLM PR #51667 and the
  packed slot of PR #52678). One thread; two pinned staging slots; per block: wait for the
  slot's previous copy event, one ``preadv`` of the whole block into the slot, one batched
  host-to-device copy of the block (``copy_blocks`` → ``cuMemcpyBatchAsync``; here the engine's
  own batched-copy call, which is the same driver call), one event recorded on the stream; the
  call drains both events before it returns. Stores mirror it: the device-to-host copy into a
  slot, and the slot's ``pwritev`` once its event has fired, two slots in turn, drained at the
  end. The file is opened as vLLM opens it (O_DIRECT for the cold case, the page cache for the hot
  one: its ``use_page_cache``). In CPU mode (vLLM's backend needs CUDA) the copy is one memmove
  per layer in C, on the same thread.
* ``threads<N>``: N threads, each with its own pinned slot: ``preadv`` of the whole block, one
  batched copy, wait for it (how vLLM's file-system tier and most hand-written pools move a
  block, without Python per layer).
* ``kvikio<N>``: KvikIO's ``CuFile`` with N threads: one ``pread`` per block straight into a
  device buffer of the batch (KvikIO splits, bounces and copies on its own pool), then one gather
  per layer on the GPU into the caches; stores gather per layer, then one ``pwrite`` per block.
  Direct I/O through KvikIO's ``auto_direct_io_read`` / ``auto_direct_io_write`` in the cold case.
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
from typing import Any

import torch

from uring_kv._cuda import PieceCopies, cuda_current_context, cuda_use_context, load_cuda_driver
from uring_kv._memory import HostBuffer
from uring_kv._native import BlockCopier


def _layer_copier(caches: list[torch.Tensor], per_layer: int) -> BlockCopier:
    """Copies between one packed slot (layer after layer) and one block of every cache tensor."""
    return BlockCopier([int(t.data_ptr()) for t in caches], [per_layer] * len(caches),
                       [i * per_layer for i in range(len(caches))])


def _full(done: int, want: int, what: str) -> None:
    if done != want:
        raise OSError(f"short {what}: {done} of {want} bytes")


class _Pinned:
    """Page-aligned host memory, registered with CUDA in GPU mode (vLLM's ``pin_tensor``)."""

    def __init__(self, size: int, gpu: bool) -> None:
        self.buffer = HostBuffer(size)
        self.gpu = gpu
        if gpu:
            torch.cuda.cudart().cudaHostRegister(self.buffer.addr, size, 0)

    def close(self) -> None:
        if self.gpu:
            torch.cuda.cudart().cudaHostUnregister(self.buffer.addr)
        self.buffer.close()


class _Copies:
    """One batched copy per block between a slot and the caches: the engine's batched-copy call
    (``cuMemcpyBatchAsync`` where the driver has it) on ``stream``, or one memmove per layer."""

    def __init__(self, caches: list[torch.Tensor], per_layer: int, device: torch.device) -> None:
        self.copier = _layer_copier(caches, per_layer)
        self.pieces = PieceCopies(self.copier)  # batched where the driver can, as vLLM's copy_blocks
        self.gpu = device.type == "cuda"
        self.ctx = 0
        if self.gpu:
            if not load_cuda_driver():
                raise RuntimeError("libcuda.so.1 cannot be loaded")
            with torch.cuda.device(device):
                self.ctx = cuda_current_context()

    def on_this_thread(self) -> None:
        if self.gpu:
            cuda_use_context(self.ctx)

    def copy(self, to_slot: bool, slot_addr: int, gpu_block: int, stream: Any) -> None:
        if self.gpu:
            self.pieces.enqueue(to_slot, [slot_addr], [gpu_block], stream.cuda_stream)
        else:
            self.copier.host(to_slot, [slot_addr], [gpu_block])


class VllmDisk:
    """vLLM's DiskBackend: two pinned slots, serial preadv/pwritev, one batched copy and one event
    per block, drained at the end of each call (see the module docstring for the source)."""

    name = "vllm-disk"
    SLOTS = 2  # DiskBackend's num_buffer_slots default

    def __init__(self, caches: list[torch.Tensor], per_layer: int, device: torch.device, fd: int,
                 stride: int) -> None:
        self.fd, self.stride = fd, stride
        self.gpu = device.type == "cuda"
        self.pinned = _Pinned(self.SLOTS * stride, self.gpu)
        self.copies = _Copies(caches, per_layer, device)
        self.stream = torch.cuda.Stream(device) if self.gpu else None
        self.views = [self.pinned.buffer.view[i * stride:(i + 1) * stride] for i in range(self.SLOTS)]
        self.addrs = [self.pinned.buffer.addr + i * stride for i in range(self.SLOTS)]

    def _event(self) -> Any:
        if not self.gpu:
            return None
        event = torch.cuda.Event()
        event.record(self.stream)
        return event

    def run(self, store: bool, disk_blocks: list[int], gpu_blocks: list[int]) -> None:
        self.copies.on_this_thread()
        if store:
            self._store(gpu_blocks, disk_blocks)
        else:
            self._load(disk_blocks, gpu_blocks)

    def _load(self, disk_blocks: list[int], gpu_blocks: list[int]) -> None:
        events: list[Any] = [None] * self.SLOTS
        for i, (disk_block, gpu_block) in enumerate(zip(disk_blocks, gpu_blocks, strict=True)):
            slot = i % self.SLOTS
            if events[slot] is not None:
                events[slot].synchronize()
            _full(os.preadv(self.fd, [self.views[slot]], disk_block * self.stride), self.stride, "read")
            self.copies.copy(False, self.addrs[slot], gpu_block, self.stream)
            events[slot] = self._event()
        for event in events:  # the drain vLLM added after the slot-reuse race (PR #51667)
            if event is not None:
                event.synchronize()

    def _store(self, gpu_blocks: list[int], disk_blocks: list[int]) -> None:
        pending: list[tuple[Any, int] | None] = [None] * self.SLOTS
        for i, (gpu_block, disk_block) in enumerate(zip(gpu_blocks, disk_blocks, strict=True)):
            slot = i % self.SLOTS
            previous = pending[slot]
            if previous is not None:
                self._write(slot, *previous)
            self.copies.copy(True, self.addrs[slot], gpu_block, self.stream)
            pending[slot] = (self._event(), disk_block)
        for slot, last in enumerate(pending):
            if last is not None:
                self._write(slot, *last)

    def _write(self, slot: int, event: Any, disk_block: int) -> None:
        if event is not None:
            event.synchronize()
        _full(os.pwritev(self.fd, [self.views[slot]], disk_block * self.stride), self.stride, "write")

    def close(self) -> None:
        for view in self.views:
            view.release()
        self.pinned.close()


class ThreadPool:
    """N threads, each with its own pinned slot: one preadv per block, one batched copy, wait."""

    def __init__(self, caches: list[torch.Tensor], per_layer: int, device: torch.device, fd: int, stride: int,
                 threads: int) -> None:
        self.fd, self.stride = fd, stride
        self.name = f"threads{threads}"
        self.gpu = device.type == "cuda"
        self.device = device
        self.copies = _Copies(caches, per_layer, device)
        self.pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="bench-pool")
        self.local = threading.local()
        self.pinned: list[_Pinned] = []
        self.lock = threading.Lock()

    def _state(self) -> tuple[memoryview, int, Any]:
        state = getattr(self.local, "state", None)
        if state is None:
            pinned = _Pinned(self.stride, self.gpu)
            with self.lock:
                self.pinned.append(pinned)
            self.copies.on_this_thread()
            stream = torch.cuda.Stream(self.device) if self.gpu else None
            state = self.local.state = (pinned.buffer.view, pinned.buffer.addr, stream)
        return state

    def _one(self, store: bool, disk_block: int, gpu_block: int) -> None:
        view, addr, stream = self._state()
        offset = disk_block * self.stride
        if not store:
            _full(os.preadv(self.fd, [view], offset), self.stride, "read")
        self.copies.copy(store, addr, gpu_block, stream)
        if stream is not None:
            stream.synchronize()
        if store:
            _full(os.pwritev(self.fd, [view], offset), self.stride, "write")

    def run(self, store: bool, disk_blocks: list[int], gpu_blocks: list[int]) -> None:
        list(self.pool.map(lambda pair: self._one(store, *pair), zip(disk_blocks, gpu_blocks, strict=True)))

    def close(self) -> None:
        self.pool.shutdown()
        for pinned in self.pinned:
            pinned.close()


def kvikio_problem(device: torch.device) -> str | None:
    """Why the KvikIO row cannot run here, or None."""
    if device.type != "cuda":
        return "needs CUDA (KvikIO reads into GPU memory)"
    try:
        import kvikio  # noqa: F401
    except ImportError:
        return "not installed (pip install uring-kv[peers])"
    except Exception as exc:  # a broken install: missing libcufile, a CUDA mismatch
        return f"cannot be imported: {str(exc).splitlines()[0]}"
    return None


class Kvikio:
    """KvikIO's CuFile with N threads: a pread per block into device memory, one gather per layer."""

    def __init__(self, caches: list[torch.Tensor], per_layer: int, device: torch.device, path: str, stride: int,
                 threads: int, batch: int, direct: bool) -> None:
        import kvikio
        import kvikio.defaults

        self.caches = [t.view(torch.uint8).view(t.shape[0], per_layer) for t in caches]
        self.per_layer, self.stride, self.device = per_layer, stride, device
        self.name = f"kvikio{threads}"
        self._settings = kvikio.defaults.set({"num_threads": threads, "auto_direct_io_read": direct,
                                              "auto_direct_io_write": direct})
        self._settings.__enter__()
        self.compat = bool(kvikio.defaults.is_compat_mode_preferred())
        self.file = kvikio.CuFile(path, "r+")
        self.staging = torch.empty(batch, stride, dtype=torch.uint8, device=device)

    @property
    def mode(self) -> str:
        return "POSIX compat" if self.compat else "GDS"

    def run(self, store: bool, disk_blocks: list[int], gpu_blocks: list[int]) -> None:
        n = len(disk_blocks)
        index = torch.tensor(gpu_blocks, device=self.device)
        staging = self.staging[:n]
        if store:
            for layer, cache in enumerate(self.caches):
                staging[:, layer * self.per_layer:(layer + 1) * self.per_layer] = cache.index_select(0, index)
            torch.cuda.synchronize(self.device)
            futures = [self.file.pwrite(staging[i], self.stride, d * self.stride) for i, d in enumerate(disk_blocks)]
            for future in futures:
                _full(future.get(), self.stride, "write")
            return
        futures = [self.file.pread(staging[i], self.stride, d * self.stride) for i, d in enumerate(disk_blocks)]
        for future in futures:
            _full(future.get(), self.stride, "read")
        for layer, cache in enumerate(self.caches):
            cache.index_copy_(0, index, staging[:, layer * self.per_layer:(layer + 1) * self.per_layer])
        torch.cuda.synchronize(self.device)

    def close(self) -> None:
        self.file.close()
        self._settings.__exit__(None, None, None)
        del self.staging
