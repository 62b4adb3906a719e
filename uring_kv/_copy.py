"""Copies between staging slots and the cache tensors: CUDA streams, or a host thread in CPU mode.

Both copiers enqueue and return an event at once; neither waits. Completion is observed by the
bridge (``_bridge.Bridge``), which calls the engine's handler on the loop. In CPU mode the "device" is
a worker thread doing memcpy, so the same bridge, leases and handlers run in CI without a GPU; its
``delay`` knob holds every copy back to widen race windows in tests.
"""

from __future__ import annotations

import contextlib
import functools
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from uring_kv._bridge import Bridge, Waitable
from uring_kv._native import BlockCopier, CudaEvent, cuda_copy_path, cuda_current_context, load_cuda_driver


class HostEvent:
    """The CPU-mode stand-in for a CUDA event: set by the copier thread once the copy is done.
    A lock held until then (cheaper to make than a threading.Event, which builds a Condition)."""

    __slots__ = ("_held", "error")

    def __init__(self) -> None:
        self._held = threading.Lock()
        self._held.acquire()
        self.error: BaseException | None = None

    def synchronize(self) -> None:
        with self._held:
            pass

    def query(self) -> bool:
        return not self._held.locked()

    def set(self) -> None:
        self._held.release()


class _Marker:
    """A point in a direction's copy order: every lane records a part, the last one joins them."""

    __slots__ = ("count", "lock", "parts", "then")

    def __init__(self, then: Callable[[Any], None], count: int = 1) -> None:
        self.then = then
        self.count = count
        self.parts: list[Any] = []
        self.lock = threading.Lock()


_CudaWork = tuple[CudaEvent, Sequence[int], Sequence[int]] | _Marker


class HostCopier:
    """CPU mode: copies run on one worker thread, in submission order, after ``delay`` seconds."""

    def __init__(self, blocks: BlockCopier, bridge: Bridge, delay: float = 0.0) -> None:
        self._blocks = blocks
        self._bridge = bridge
        self.delay = delay
        self._queue: queue.SimpleQueue[tuple[bool, list[int], list[int], HostEvent] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="uring-kv-host-copier", daemon=True)
        self._thread.start()

    def order_after(self, to_slot: bool, event: Any) -> None:
        """CPU mode has nothing to order against."""

    def copy(self, to_slot: bool, slot_addrs: Sequence[int], gpu_blocks: Sequence[int],
             on_done: Callable[[BaseException | None], None]) -> Waitable:
        """Enqueue the copies; ``on_done(error)`` runs on the loop once they are done (error None)."""
        event = HostEvent()
        self._queue.put((to_slot, list(slot_addrs), list(gpu_blocks), event))
        self._bridge.watch(event, functools.partial(self._fired, event, on_done))
        return event

    @staticmethod
    def _fired(event: HostEvent, on_done: Callable[[BaseException | None], None]) -> None:
        on_done(event.error)

    def marker(self, to_slot: bool, then: Callable[[Any], None]) -> None:
        """``then(event)`` runs on the loop; ``event`` is set once every copy enqueued so far is done."""
        event = HostEvent()
        self._queue.put((to_slot, [], [], event))  # the thread copies in order: a no-op copy marks the point
        self._bridge.call_soon_threadsafe(then, event)

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            to_slot, slot_addrs, gpu_blocks, event = item
            try:
                if self.delay:
                    time.sleep(self.delay)
                self._blocks.host(to_slot, slot_addrs, gpu_blocks)
            except Exception as exc:  # delivered to the engine, which fails these blocks
                event.error = exc
            finally:
                event.set()

    description = "host memcpy thread"

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()


class _Lane:
    """One submit thread and the stream it enqueues on."""

    def __init__(self, stream: Any, to_slot: bool, index: int, target: Callable[[_Lane], None]) -> None:
        self.stream = stream
        self.to_slot = to_slot
        self.queue: queue.SimpleQueue[_CudaWork | None] = queue.SimpleQueue()
        self.thread = threading.Thread(target=target, args=(self,), daemon=True,
                                       name=f"uring-kv-{'d2h' if to_slot else 'h2d'}-submit-{index}")


class CudaCopier:
    """GPU mode: H2D on high-priority load streams, D2H on store streams, one driver event per call.

    The CUDA driver spends 1–2 µs of CPU per memcpy descriptor, and a block is one descriptor per
    layer tensor: enqueueing 32 blocks of 32 layers blocks the calling thread for 1–2 ms on the H200
    machine. So the loop never calls the driver for copies: ``copy`` takes a driver event from a free
    list and hands the work to a submit thread ("lane", ``lanes`` per direction, each with its own
    stream, chosen in turn), which makes one C call (context, the batched copies, record the event)
    with the GIL released. The bridge waits for the event only once the lane has recorded it
    (``CudaEvent.recorded``). Ordering against the caller's work (``after``) is put into the
    direction's streams when the batch is called (``order_after``), so every later copy of the batch
    waits for it, whenever and wherever it is enqueued.
    """

    def __init__(self, blocks: BlockCopier, bridge: Bridge, device: Any, delay: float = 0.0,
                 lanes: int | None = None) -> None:
        import torch

        if not load_cuda_driver():
            raise RuntimeError("uring_kv: cannot load the CUDA driver (libcuda.so.1 with cuMemcpyAsync and events)")
        self._torch = torch
        self._blocks = blocks
        # URING_KV_CUDA_BATCH=0 turns cuMemcpyBatchAsync off (one driver call per tensor and block).
        self.path = cuda_copy_path(os.environ.get("URING_KV_CUDA_BATCH", "1") != "0")
        self._bridge = bridge
        self.device = device
        self._delay_cycles = int(delay * 1.5e9)  # torch.cuda._sleep counts GPU clock cycles
        count = lanes if lanes is not None else int(os.environ.get("URING_KV_COPY_LANES", "2"))
        if count < 1:
            raise ValueError(f"copy lanes must be >= 1, got {count}")
        self._lanes: dict[bool, list[_Lane]] = {}
        with torch.cuda.device(device):
            low, high = torch.cuda.Stream.priority_range()  # type: ignore[call-arg]
            for to_slot, priority in ((False, high), (True, low)):
                self._lanes[to_slot] = [_Lane(torch.cuda.Stream(device, priority=priority), to_slot, i,
                                              self._submit_loop) for i in range(count)]
            self._marker_streams = {to_slot: torch.cuda.Stream(device) for to_slot in (False, True)}
            self._ctx = cuda_current_context()  # torch made the device's primary context current
        self.load_stream = self._lanes[False][0].stream
        self.store_stream = self._lanes[True][0].stream
        self._next = {False: 0, True: 0}
        self._free: list[CudaEvent] = []
        self._events: list[CudaEvent] = []
        for lane in self._all_lanes():
            lane.thread.start()

    def _all_lanes(self) -> list[_Lane]:
        return self._lanes[False] + self._lanes[True]

    def order_after(self, to_slot: bool, event: Any) -> None:
        """Every copy enqueued from now on in this direction waits for ``event`` (a torch.cuda.Event)."""
        for lane in self._lanes[to_slot]:
            lane.stream.wait_event(event)

    def copy(self, to_slot: bool, slot_addrs: Sequence[int], gpu_blocks: Sequence[int],
             on_done: Callable[[BaseException | None], None]) -> Waitable:
        if self._free:
            event = self._free.pop()
        else:
            event = CudaEvent(self._ctx)
            self._events.append(event)
        event.arm()
        lanes = self._lanes[to_slot]
        index = self._next[to_slot]
        self._next[to_slot] = (index + 1) % len(lanes)
        lanes[index].queue.put((event, slot_addrs, gpu_blocks))
        self._bridge.watch(event, functools.partial(self._fired, event, on_done))
        return event

    def _submit_loop(self, lane: _Lane) -> None:
        stream, to_slot = lane.stream, lane.to_slot
        handle = stream.cuda_stream
        while (item := lane.queue.get()) is not None:
            if isinstance(item, _Marker):
                self._mark(item, stream, to_slot)
                continue
            event, slot_addrs, gpu_blocks = item
            try:
                if self._delay_cycles:
                    with self._torch.cuda.device(self.device), self._torch.cuda.stream(stream):
                        self._torch.cuda._sleep(self._delay_cycles)
                self._blocks.cuda_evented(self._ctx, 0, event, to_slot, slot_addrs, gpu_blocks, handle)
            except Exception as exc:  # some copies may be enqueued: wait for them, then report
                event.error = exc
                with contextlib.suppress(Exception):
                    stream.synchronize()
            finally:
                event.recorded()

    def _fired(self, event: CudaEvent, on_done: Callable[[BaseException | None], None]) -> None:
        error, event.error = event.error, None
        self._free.append(event)  # the bridge saw it fire: nobody else holds it
        on_done(error)

    def marker(self, to_slot: bool, then: Callable[[Any], None]) -> None:
        """``then(event)`` runs on the loop once every copy enqueued so far in this direction is in
        its stream: ``event`` is a torch.cuda.Event that fires after all of them (the caller's
        handle). Each lane records its part; the last one joins them on the marker stream."""
        marker = _Marker(then, len(self._lanes[to_slot]))
        for lane in self._lanes[to_slot]:
            lane.queue.put(marker)

    def _mark(self, marker: _Marker, stream: Any, to_slot: bool) -> None:
        part = self._torch.cuda.Event()
        with self._torch.cuda.device(self.device):
            part.record(stream)
        with marker.lock:
            marker.parts.append(part)
            if len(marker.parts) < marker.count:
                return
        joined = self._marker_streams[to_slot]
        event = self._torch.cuda.Event()
        with self._torch.cuda.device(self.device):
            for each in marker.parts:
                joined.wait_event(each)
            event.record(joined)
        self._bridge.call_soon_threadsafe(marker.then, event)

    @property
    def description(self) -> str:
        return cuda_copy_path()

    def close(self) -> None:
        for lane in self._all_lanes():
            lane.queue.put(None)
            lane.thread.join()
        for lane in self._all_lanes():
            lane.stream.synchronize()
        for stream in self._marker_streams.values():
            stream.synchronize()
        for event in self._events:
            event.destroy()
        self._events.clear()
        self._free.clear()
