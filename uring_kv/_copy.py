"""Copies between staging slots and the cache tensors: a host copier in CPU mode, a CUDA copier in
GPU mode, both with the interface of :class:`Copier`.

Both copiers enqueue and return at once; neither waits. Completion comes back through a bridge
(``_bridge.py``: the Python bridge thread, or the native copier's eventfd), which calls the engine's
handler on the loop. In CPU mode the "device" is a thread doing memcpy, so the same bridges, leases
and handlers run in CI without a GPU; the ``delay`` knob holds every copy back to widen race windows
in tests. Each copier is told its path at construction, from the engine's plan (``_plan.py``): it
decides nothing. Every CUDA call goes through ``_cuda.py``.
"""

from __future__ import annotations

import contextlib
import functools
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from uring_kv import _cuda
from uring_kv._bridge import Bridge, Collect, NativeLink
from uring_kv._cuda import CudaEvent, PieceCopies, Staging
from uring_kv._native import BlockCopier, CopyJobs

# The copy paths kept, one line each: where measurements show it winning, or why it stays. Figures in
# docs/design.md, or in docs/benchmarks.md of the history ("b.md": `git show 3e52711^:docs/benchmarks.md`).
# - host inline memcpy on the loop: CPU machine, 4 KiB hot loads 39k -> 43-47k blocks/s (design.md, "The bridge").
# - host, native copier thread: CPU machine 2026-12-03, 2 MiB hot loads 6.1 vs 5.2-5.6 GB/s on a Python thread (b.md).
# - host, Python thread + bridge (native=False): no win; CI's run of the Python bridge that per-piece CUDA copies use.
# - CUDA staged on the native copier: H200 2026-12-03, bridge delay p50 34-88 vs 63-120 us on Python lanes (b.md).
# - CUDA staged on Python lanes (native=False): H200 2026-12-02, 128 KiB hot loads 24.7k vs 19.6k per piece (b.md).
# - CUDA per piece, batched (no NVRTC, or staged=False): H200, 32 blocks enqueued in 1.7 vs 2.2 ms a call each (b.md).
# - CUDA per piece, a call each (batch=False): drivers before CUDA 12.8 have no batch call; no win where they do.

# ---- The copiers ------------------------------------------------------------------------------------

class Copier(Protocol):
    """What the batch driver, its pumps and the batches' books use of a copier (loop thread)."""

    @property
    def description(self) -> str:
        """The copy path, in words (``Engine.stats()["copy"]``)."""

    @property
    def pending(self) -> int:
        """Copies queued on the native copier and not yet handled on the loop."""

    @property
    def link(self) -> NativeLink | None:
        """The native copier's loop side, if the copies go through it."""

    def order_after(self, to_slot: bool, event: Any) -> None:
        """Every copy enqueued from now on in this direction waits for ``event`` (GPU mode)."""

    def copy(self, to_slot: bool, slot_addrs: Sequence[int], gpu_blocks: Sequence[int],
             on_done: Callable[[BaseException | None], None]) -> None:
        """Enqueue the copies; ``on_done(error)`` runs on the loop once they are done (error None)."""

    def marker(self, to_slot: bool, then: Callable[[Any], None]) -> None:
        """``then(event)`` runs on the loop; ``event`` fires once every copy enqueued so far is done."""

    def settled_event(self, to_slot: bool) -> Any:
        """An event for a batch whose copies are all done (a native pump's)."""

    def pump_dev_slots(self, slot_addrs: Sequence[int]) -> Any:
        """The device staging slots of pumps' copy jobs, as a C array (None: none)."""

    def stats(self) -> dict[str, Any]:
        """What it shows of itself in ``Engine.stats()``: ``copy`` (its description)."""

    def phases(self, clear: bool = False) -> dict[str, Any]:
        """Diagnostics: the native copier's jobs' phases (see ``Engine.slot_phases``); {} without it."""

    def close(self) -> None: ...


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


class _NativeUser:
    """What both copiers say about the native copier: whether they use it, and its jobs not yet
    handled on the loop (the engine waits for none to be left before it closes)."""

    _link: NativeLink | None = None

    @property
    def native(self) -> bool:
        return self._link is not None

    @property
    def link(self) -> NativeLink | None:
        """The native copier's loop side, if the copies go through it."""
        return self._link

    @property
    def pending(self) -> int:
        return self._link.pending if self._link is not None else 0

    @property
    def description(self) -> str:
        raise NotImplementedError

    def stats(self) -> dict[str, Any]:
        return {"copy": self.description}

    def phases(self, clear: bool = False) -> dict[str, Any]:
        return {"copy_jobs": self._link.jobs.phases(clear)} if self._link is not None else {}


class HostCopier(_NativeUser):
    """CPU mode: calls of up to ``inline_blocks`` blocks run inline on the loop (a memcpy of that
    much takes less than handing it to a thread and back); the others on one worker thread, in
    submission order, after ``delay`` seconds. Either way ``on_done`` runs later, on the loop.
    ``native``: the worker is the native copier's C thread, whose completions reach the loop
    through its eventfd, instead of a Python thread and the bridge (``poll_us``: how long it polls
    for its next job before it sleeps); ``collect`` takes its finished jobs where native pumps
    queue jobs there too (see :class:`NativeLink`)."""

    def __init__(self, blocks: BlockCopier, bridge: Bridge, *, inline_blocks: int, native: bool, delay: float = 0.0,
                 collect: Collect | None = None, poll_us: int = 0) -> None:
        if inline_blocks < 0:
            raise ValueError(f"inline_blocks must be >= 0, got {inline_blocks}")
        self._blocks = blocks
        self._bridge = bridge
        self.delay = delay
        self._inline_blocks = inline_blocks  # how many blocks one inline call may hold (0: none)
        self._queue: queue.SimpleQueue[tuple[bool, list[int], list[int], HostEvent] | None] = queue.SimpleQueue()
        self._link: NativeLink | None = None
        self._in_thread = {False: 0, True: 0}  # copies handed to the native thread, not yet back
        self._thread: threading.Thread | None = None
        if native:
            jobs = CopyJobs(blocks, None, int(delay * 1e9))
            jobs.poll(poll_us * 1000)
            self._link = NativeLink(jobs, bridge, collect)
        else:
            self._thread = threading.Thread(target=self._run, name="uring-kv-host-copier", daemon=True)
            self._thread.start()
        thread = "native thread" if self._link is not None else "thread"
        inline = inline_blocks * blocks.bytes_per_block
        self._description = (f"host memcpy {thread}" if not inline_blocks else
                             f"host memcpy (inline up to {inline_blocks} blocks, {inline >> 10} KiB, per call, "
                             f"else a {thread})")

    @property
    def description(self) -> str:
        return self._description

    @property
    def inline_blocks(self) -> int:
        """How many blocks one copy call may hold and still run inline on the loop (0: none)."""
        return self._inline_blocks

    def order_after(self, to_slot: bool, event: Any) -> None:
        """CPU mode has nothing to order against."""

    def copy(self, to_slot: bool, slot_addrs: Sequence[int], gpu_blocks: Sequence[int],
             on_done: Callable[[BaseException | None], None]) -> None:
        """Enqueue the copies; ``on_done(error)`` runs on the loop once they are done (error None)."""
        if len(slot_addrs) <= self._inline_blocks:
            error: BaseException | None = None
            try:
                self._blocks.host(to_slot, slot_addrs, gpu_blocks)
            except Exception as exc:  # delivered to the engine like a failed thread copy
                error = exc
            self._bridge.call_soon(on_done, error)  # never re-entrant: the caller is mid-update
            return
        if self._link is not None:
            self._in_thread[to_slot] += 1
            self._link.copy(to_slot, slot_addrs, gpu_blocks, functools.partial(self._job_done, to_slot, on_done))
            return
        event = HostEvent()
        self._queue.put((to_slot, list(slot_addrs), list(gpu_blocks), event))
        self._bridge.watch(event, functools.partial(self._fired, event, on_done))

    @staticmethod
    def _fired(event: HostEvent, on_done: Callable[[BaseException | None], None]) -> None:
        on_done(event.error)

    def _job_done(self, to_slot: bool, on_done: Callable[[BaseException | None], None],
                  error: BaseException | None) -> None:
        self._in_thread[to_slot] -= 1
        on_done(error)

    def settled_event(self, to_slot: bool) -> HostEvent:
        """An event for a batch whose copies are all done (a pump's): set already."""
        event = HostEvent()
        event.set()
        return event

    def pump_dev_slots(self, slot_addrs: Sequence[int]) -> Any:
        """Device staging slots for pumps' copy jobs: none in CPU mode."""
        return None

    def marker(self, to_slot: bool, then: Callable[[Any], None]) -> None:
        """``then(event)`` runs on the loop; ``event`` is set once every copy enqueued so far is done."""
        event = HostEvent()
        if self._link is not None:
            # The native thread copies in order: past the marker, every earlier copy is done. With
            # none of this direction's copies there, every copy so far is done already (inline).
            event.set()
            if self._in_thread[to_slot]:
                self._link.mark(to_slot, lambda _error: then(event))
            else:
                self._bridge.call_soon(then, event)
            return
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

    def close(self) -> None:
        if self._link is not None:
            self._link.close()
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()


def staged_kernel_preparer(device: Any, staged: bool) -> Callable[[], None] | None:
    """Called on the loop thread: a function that builds the staged kernel for ``device`` on a
    worker thread (see :func:`_cuda.staged_kernel_preparer`), or None (``staged`` off, or no driver)."""
    return _cuda.staged_kernel_preparer(device) if staged else None


def staged_path(device: Any, blocks: BlockCopier, host_base: int, stride: int, slots: int,
                used_bytes: int, mapped: bool = False) -> tuple[Staging | None, str]:
    """The staged path's device side for the host slab at ``host_base`` (``slots`` slots of
    ``stride`` bytes, ``used_bytes`` used in each): device staging slots (none when ``mapped``: the
    kernel then moves the pinned slots' bytes itself), the tensor table and the compiled kernel
    (:class:`_cuda.Staging`), or None and why it cannot be built here (no NVRTC, no device memory);
    None and '' without a CUDA driver (the copier then refuses to start). Where the mapped form was
    asked for and the slab could not be mapped, the staging has device slots and the reason is
    returned with it."""
    if not _cuda.load_cuda_driver():
        return None, ""
    try:
        staging = Staging(device, blocks, host_base, stride, slots, used_bytes, mapped)
    except Exception as exc:  # reported in the plan and the description; the per-piece path still works
        return None, f"{type(exc).__name__}: {exc}"
    return staging, f"mapped form unavailable: {staging.mapped_error}" if staging.mapped_error else ""


class _Lane:
    """One submit thread and the stream it enqueues on."""

    def __init__(self, stream: Any, to_slot: bool, index: int, target: Callable[[_Lane], None]) -> None:
        self.stream = stream
        self.to_slot = to_slot
        self.queue: queue.SimpleQueue[_CudaWork | None] = queue.SimpleQueue()
        self.thread = threading.Thread(target=target, args=(self,), daemon=True,
                                       name=f"uring-kv-{'d2h' if to_slot else 'h2d'}-submit-{index}")


class CudaCopier(_NativeUser):
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

    The path, from the engine's plan: ``staging`` (the staged path's device side, see
    :func:`staged_path`; None: per piece, ``staging_error`` saying why where it was asked for),
    per-piece copies through cuMemcpyBatchAsync when ``batch``; ``native``: staged copies on the
    native copier (``collect``: see :class:`HostCopier`; ``copier_poll_us``: how long its threads
    poll for work before they sleep); ``lanes`` per direction (one with the native copier:
    its thread uses the first lane's stream).
    """

    def __init__(self, blocks: BlockCopier, bridge: Bridge, device: Any, *, staging: Staging | None, lanes: int,
                 native: bool, batch: bool, staging_error: str = "", delay: float = 0.0, copier_poll_us: int = 0,
                 collect: Collect | None = None) -> None:
        if not _cuda.load_cuda_driver():
            raise RuntimeError("uring_kv: cannot load the CUDA driver (libcuda.so.1 with cuMemcpyAsync and events)")
        self._blocks = blocks
        self._pieces = PieceCopies(blocks, batch)
        self._bridge = bridge
        self.device = device
        self._cuda = _cuda.Device(device)
        self._delay_cycles = int(delay * 1.5e9)  # torch.cuda._sleep counts GPU clock cycles
        # The staged path (one copy per block plus one kernel per call) unless turned off or the
        # kernel cannot be built here (no NVRTC): then one driver copy per tensor and block.
        self._staging = staging
        self.staging_error = staging_error
        # Lanes: one is enough when a block costs two driver calls (staged), and keeps each
        # direction's events in order for the bridge; the per-piece path needs two to keep up.
        count = lanes
        if count < 1:
            raise ValueError(f"copy lanes must be >= 1, got {count}")
        if native and staging is None:
            raise ValueError("the native copier runs staged copies only")
        use_native = native
        self._lanes: dict[bool, list[_Lane]] = {
            to_slot: [_Lane(stream, to_slot, i, self._submit_loop)
                      for i, stream in enumerate(self._cuda.streams(count, high_priority=not to_slot))]
            for to_slot in (False, True)}
        self._marker_streams = {to_slot: self._cuda.stream() for to_slot in (False, True)}
        self._ctx = self._cuda.context()
        self._next = {False: 0, True: 0}
        self._free: list[CudaEvent] = []
        self._events: list[CudaEvent] = []
        # Ordering each batch after the caller's stream: one driver event, recorded there and waited
        # for by the lanes in one C call (a torch.cuda.Event per batch cost ~0.05 ms more of the loop).
        self._order_event = CudaEvent(self._ctx)
        self._events.append(self._order_event)
        self._lane_streams = {to_slot: (_cuda.stream_array([lane.stream.cuda_stream for lane in lanes]), len(lanes))
                              for to_slot, lanes in self._lanes.items()}
        self._link: NativeLink | None = None
        if use_native:
            staging_ = self._staging
            assert staging_ is not None
            # tests: every call's copies wait this long on the GPU first
            spin = _cuda.spin_kernel(device) if self._delay_cycles else 0
            jobs = CopyJobs(blocks, (self._ctx, staging_.func, staging_.table, staging_.used_bytes,
                                     self._lanes[False][0].stream.cuda_stream, self._lanes[True][0].stream.cuda_stream),
                            self._delay_cycles, spin)
            jobs.poll(copier_poll_us * 1000)
            self._link = NativeLink(jobs, bridge, collect)
            return
        for lane in self._all_lanes():
            lane.thread.start()

    def _all_lanes(self) -> list[_Lane]:
        return self._lanes[False] + self._lanes[True]

    def order_after(self, to_slot: bool, event: Any) -> None:
        """Every copy enqueued from now on in this direction waits for ``event`` (a torch.cuda.Event)
        or, given None, for the work enqueued so far on the calling thread's current stream."""
        if event is not None:
            for lane in self._lanes[to_slot]:
                lane.stream.wait_event(event)
            return
        streams, count = self._lane_streams[to_slot]
        _cuda.cuda_order_after(self._ctx, self._cuda.caller_stream(), self._order_event.handle, streams, count)

    def copy(self, to_slot: bool, slot_addrs: Sequence[int], gpu_blocks: Sequence[int],
             on_done: Callable[[BaseException | None], None]) -> None:
        if self._free:
            event = self._free.pop()
        else:
            event = CudaEvent(self._ctx)
            self._events.append(event)
        if self._link is not None:
            assert self._staging is not None
            self._link.copy(to_slot, slot_addrs, gpu_blocks, functools.partial(self._job_done, event, on_done),
                            self._staging.dev_slots(slot_addrs), event.handle)
            return
        event.arm()
        lanes = self._lanes[to_slot]
        index = self._next[to_slot]
        self._next[to_slot] = (index + 1) % len(lanes)
        lanes[index].queue.put((event, slot_addrs, gpu_blocks))
        self._bridge.watch(event, functools.partial(self._fired, event, on_done))

    def _job_done(self, event: CudaEvent, on_done: Callable[[BaseException | None], None],
                  error: BaseException | None) -> None:
        self._free.append(event)  # the native bridge saw it fire (or it failed): nobody holds it
        on_done(error)

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
                    self._cuda.sleep(stream, self._delay_cycles)
                staging = self._staging
                if staging is not None:
                    staging.enqueue(self._ctx, event, to_slot, slot_addrs, gpu_blocks, handle)
                else:
                    self._pieces.enqueue_evented(self._ctx, event, to_slot, slot_addrs, gpu_blocks, handle)
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
        if self._link is not None:
            stream = self._lanes[to_slot][0].stream
            self._link.mark(to_slot, lambda _error: then(self._cuda.record(stream)))
            return
        marker = _Marker(then, len(self._lanes[to_slot]))
        for lane in self._lanes[to_slot]:
            lane.queue.put(marker)

    def settled_event(self, to_slot: bool) -> Any:
        """An event for a batch whose copies are all done (a pump's: the bridge saw their events):
        a torch.cuda.Event recorded now on the direction's stream, for callers to wait on."""
        return self._cuda.record(self._lanes[to_slot][0].stream)

    def pump_dev_slots(self, slot_addrs: Sequence[int]) -> Any:
        """The device staging slot of each of ``slot_addrs`` (the pool's slots in order), as the
        uint64 C array pumps' copy jobs read; None without the staged path."""
        if self._staging is None:
            return None
        return self._staging.dev_slot_array(slot_addrs)

    def _mark(self, marker: _Marker, stream: Any, to_slot: bool) -> None:
        part = self._cuda.record(stream)
        with marker.lock:
            marker.parts.append(part)
            if len(marker.parts) < marker.count:
                return
        event = self._cuda.join(marker.parts, self._marker_streams[to_slot])
        self._bridge.call_soon_threadsafe(marker.then, event)

    @property
    def description(self) -> str:
        if self._staging is not None:
            how = ("mapped: scatter kernel over the bus from the pinned slots" if self._staging.mapped
                   else "staged: one copy per block + scatter kernel")
            return how + (", native copier" if self._link else "")
        return self._pieces.description + (
            f" (staged path unavailable: {self.staging_error})" if self.staging_error else "")

    def close(self) -> None:
        if self._link is not None:
            self._link.close()
        for lane in self._all_lanes():
            if lane.thread.is_alive():
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
