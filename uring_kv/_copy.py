"""Copies between staging slots and the cache tensors: CUDA streams, or a host thread in CPU mode.

Both copiers enqueue and return an event at once; neither waits. Completion is observed by the
bridge (``_bridge.Bridge``), which calls the engine's handler on the loop. In CPU mode the "device" is
a worker thread doing memcpy, so the same bridge, leases and handlers run in CI without a GPU; its
``delay`` knob holds every copy back to widen race windows in tests.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Sequence
from typing import Any

from uring_kv._bridge import Bridge, Waitable
from uring_kv._native import BlockCopier, cuda_copy_path, load_cuda_driver


class HostEvent:
    """The CPU-mode stand-in for a CUDA event: set by the copier thread once the copy is done.
    A lock held until then (cheaper to make than a threading.Event, which builds a Condition)."""

    __slots__ = ("_held",)

    def __init__(self) -> None:
        self._held = threading.Lock()
        self._held.acquire()

    def synchronize(self) -> None:
        with self._held:
            pass

    def query(self) -> bool:
        return not self._held.locked()

    def set(self) -> None:
        self._held.release()


class HostCopier:
    """CPU mode: copies run on one worker thread, in submission order, after ``delay`` seconds."""

    def __init__(self, blocks: BlockCopier, bridge: Bridge, delay: float = 0.0) -> None:
        self._blocks = blocks
        self._bridge = bridge
        self.delay = delay
        self._queue: queue.SimpleQueue[tuple[bool, list[int], list[int], HostEvent] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="uring-kv-host-copier", daemon=True)
        self._thread.start()

    def copy(self, to_slot: bool, slot_addrs: Sequence[int], gpu_blocks: Sequence[int], after: Any,
             on_done: Any) -> Waitable:
        event = HostEvent()
        self._queue.put((to_slot, list(slot_addrs), list(gpu_blocks), event))
        self._bridge.watch(event, on_done)
        return event

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            to_slot, slot_addrs, gpu_blocks, event = item
            if self.delay:
                time.sleep(self.delay)
            self._blocks.host(to_slot, slot_addrs, gpu_blocks)
            event.set()

    description = "host memcpy thread"

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()


class CudaCopier:
    """GPU mode: H2D on a high-priority load stream, D2H on a store stream, one event per call."""

    def __init__(self, blocks: BlockCopier, bridge: Bridge, device: Any, delay: float = 0.0) -> None:
        import torch

        if not load_cuda_driver():
            raise RuntimeError("uring_kv: cannot load the CUDA driver (libcuda.so.1)")
        self._torch = torch
        self._blocks = blocks
        # URING_KV_CUDA_BATCH=0 turns cuMemcpyBatchAsync off (one driver call per tensor and block).
        self.path = cuda_copy_path(os.environ.get("URING_KV_CUDA_BATCH", "1") != "0")
        self._bridge = bridge
        self.device = device
        self._delay_cycles = int(delay * 1.5e9)  # torch.cuda._sleep counts GPU clock cycles
        with torch.cuda.device(device):
            low, high = torch.cuda.Stream.priority_range()  # type: ignore[call-arg]
            self.load_stream = torch.cuda.Stream(device, priority=high)
            self.store_stream = torch.cuda.Stream(device, priority=low)

    def copy(self, to_slot: bool, slot_addrs: Sequence[int], gpu_blocks: Sequence[int], after: Any,
             on_done: Any) -> Waitable:
        stream = self.store_stream if to_slot else self.load_stream
        with self._torch.cuda.device(self.device):
            if after is not None:
                stream.wait_event(after)
            if self._delay_cycles:
                with self._torch.cuda.stream(stream):
                    self._torch.cuda._sleep(self._delay_cycles)
            self._blocks.cuda(to_slot, slot_addrs, gpu_blocks, stream.cuda_stream)
            event = self._torch.cuda.Event(blocking=True)
            event.record(stream)
        self._bridge.watch(event, on_done)
        return event

    @property
    def description(self) -> str:
        return cuda_copy_path()

    def close(self) -> None:
        self.load_stream.synchronize()
        self.store_stream.synchronize()
