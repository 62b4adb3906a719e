"""The CUDA calls of the copies and their staging: the driver (``csrc/cuda.c``), torch.cuda, NVRTC.

The driver is loaded at run time (``libcuda.so.1``), never linked. Its calls go through the compiled
module's ``ffi``/``lib``: this module is their second user after ``_native.py``, for the CUDA
functions only. What it owns: errors as ``CudaError``, contexts, driver events, ordering copy
streams after the caller's, the block copies themselves (per piece, or staged: one copy per block
and a kernel built with NVRTC), the device staging, and the torch-level pieces the copiers use
(streams, torch events, pinning host memory). It never decides which path a copy takes: the
copiers in ``_copy.py`` do. torch is imported inside the functions that need it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from uring_kv._native import STAGED_MAX
from uring_kv._native_c import ffi, lib

if TYPE_CHECKING:
    from uring_kv._native import BlockCopier

_lib: Any = lib

_CUDA_ERROR_NOT_READY = 600


class CudaError(RuntimeError):
    """A CUDA driver call failed (the CUresult is in ``code``)."""

    def __init__(self, code: int, what: str) -> None:
        super().__init__(f"{what} failed with CUresult {code}")
        self.code = code


def load_cuda_driver() -> bool:
    return bool(_lib.ukv_cuda_load() == 0)


def cuda_copy_path() -> str:
    """The driver path per-piece block copies take here unless told otherwise (``uring-kv info``)."""
    return _path_name(True, 0)


def _path_name(batch: bool, error: int) -> str:
    mode = _lib.ukv_cuda_batch_mode() if batch and not error else 0
    if mode == 2:
        return "cuMemcpyBatchAsync_v2"
    if mode == 1:
        return "cuMemcpyBatchAsync"
    return f"per-copy cuMemcpy*Async (batch call failed with CUresult {error})" if error else "per-copy cuMemcpy*Async"


# ---- Contexts, ordering and events ---------------------------------------------------------------

def cuda_current_context() -> int:
    """The CUcontext current on this thread (0 if none)."""
    ctx = ffi.new("uint64_t *")
    rc = _lib.ukv_cuda_ctx_current(ctx)
    if rc:
        raise CudaError(int(rc), "cuCtxGetCurrent")
    return int(ctx[0])


def cuda_use_context(ctx: int) -> None:
    """Make ``ctx`` current on this thread."""
    rc = _lib.ukv_cuda_ctx_use(ctx)
    if rc:
        raise CudaError(int(rc), "cuCtxSetCurrent")


def stream_array(handles: Sequence[int]) -> Any:
    """CUstream handles as the C uint64 array :func:`cuda_order_after` takes."""
    return ffi.new("uint64_t[]", list(handles))


def cuda_order_after(ctx: int, caller: int, event: int, streams: Any, nstreams: int) -> None:
    """Make ``nstreams`` streams (a :func:`stream_array`) wait for the work enqueued so far on the
    stream ``caller``: ``event`` is recorded there, and they wait for it. The calling thread's
    current context is the same afterwards."""
    rc = _lib.ukv_cuda_order_after(ctx, caller, event, streams, nstreams)
    if rc:
        raise CudaError(int(rc), "cuEventRecord/cuStreamWaitEvent")


class CudaEvent:
    """A driver event (blocking sync, no timing) in context ``ctx``: the bridge waits on it with the
    GIL released (cffi drops it around every C call)."""

    __slots__ = ("_unrecorded", "ctx", "error", "handle")

    def __init__(self, ctx: int) -> None:
        out = ffi.new("uint64_t *")
        rc = _lib.ukv_cuda_event_new(ctx, out)
        if rc:
            raise CudaError(int(rc), "cuEventCreate")
        self.ctx = ctx
        self.handle = int(out[0])
        self.error: BaseException | None = None  # the enqueue failed (set before recorded())
        self._unrecorded = threading.Lock()  # held from arm() until the submit thread has recorded it

    def arm(self) -> None:
        """About to be handed to a submit thread: waiters must wait for ``recorded()`` first."""
        self._unrecorded.acquire()

    def recorded(self) -> None:
        self._unrecorded.release()

    def synchronize(self) -> None:
        with self._unrecorded:  # an event never recorded would count as fired at once
            pass
        if self.error is not None:
            return  # nothing more to wait for: the submit thread synchronized the stream
        rc = _lib.ukv_cuda_event_sync(self.ctx, self.handle)
        if rc:
            raise CudaError(int(rc), "cuEventSynchronize")

    def query(self) -> bool:
        if self._unrecorded.locked():
            return False
        if self.error is not None:
            return True
        rc = _lib.ukv_cuda_event_query(self.handle)
        if rc == _CUDA_ERROR_NOT_READY:
            return False
        if rc:
            raise CudaError(int(rc), "cuEventQuery")
        return True

    def destroy(self) -> None:
        if self.handle:
            _lib.ukv_cuda_event_free(self.ctx, self.handle)
            self.handle = 0


# ---- Block copies ---------------------------------------------------------------------------------

class PieceCopies:
    """One copier's per-piece path: a driver copy per tensor and block (a piece), all of a call's
    pieces in one ``cuMemcpyBatchAsync`` when ``batch`` and the driver has it, else one call each.
    The choice is this object's (nothing global): a batch call the driver refuses turns this
    object's copies to one call each from then on (it may have enqueued some: redoing them all
    moves the same bytes again)."""

    def __init__(self, blocks: BlockCopier, batch: bool = True) -> None:
        self._blocks = blocks
        self._path = ffi.new("struct ukv_cuda_path *")
        self._path.batch = int(batch)

    @property
    def description(self) -> str:
        return _path_name(bool(self._path.batch), int(self._path.batch_error))

    def enqueue(self, to_slot: bool, slot_addrs: Sequence[int], gpu_blocks: Sequence[int], stream: int) -> None:
        """Enqueue the copies on ``stream`` (a CUstream handle); the current context must own the tensors."""
        n, bases, block_bytes, slot_offsets = self._blocks.c_table()
        rc = _lib.ukv_cuda_copy(self._path, n, bases, block_bytes, slot_offsets, int(to_slot), len(slot_addrs),
                                ffi.new("uint64_t[]", list(slot_addrs)), ffi.new("int64_t[]", list(gpu_blocks)),
                                stream)
        if rc:
            raise CudaError(int(rc), "cuMemcpyAsync")

    def enqueue_evented(self, ctx: int, done: CudaEvent, to_slot: bool, slot_addrs: Sequence[int],
                        gpu_blocks: Sequence[int], stream: int) -> None:
        """One C call: make ``ctx`` current, enqueue the copies on ``stream``, record ``done`` after them."""
        n, bases, block_bytes, slot_offsets = self._blocks.c_table()
        rc = _lib.ukv_cuda_copy_evented(self._path, ctx, done.handle, n, bases, block_bytes, slot_offsets,
                                        int(to_slot), len(slot_addrs), ffi.new("uint64_t[]", slot_addrs),
                                        ffi.new("int64_t[]", gpu_blocks), stream)
        if rc:
            raise CudaError(int(rc), "enqueueing block copies")


# The staged path's kernel: one thread block per (tensor, block) piece, moving it between the
# block's staging slot (on the device, or the pinned host slot itself on the mapped path) and the
# tensor. UKV_STAGED_MAX is csrc/ukv.h's (through cffi); the
# struct matches csrc/cuda.c's struct ukv_blocks.
_SCATTER_SOURCE = f"\n#define UKV_STAGED_MAX {STAGED_MAX}" + r"""
struct UkvBlocks { unsigned long long staging[UKV_STAGED_MAX]; long long gpu[UKV_STAGED_MAX]; };
extern "C" __global__ void ukv_scatter(const unsigned long long* table, UkvBlocks b, int to_slot) {
    const unsigned long long base = table[3 * blockIdx.x], n = table[3 * blockIdx.x + 1],
                             off = table[3 * blockIdx.x + 2];
    char* dev = (char*)(base + (unsigned long long)b.gpu[blockIdx.y] * n);
    char* stage = (char*)(b.staging[blockIdx.y] + off);
    char* dst = to_slot ? stage : dev;
    const char* src = to_slot ? dev : stage;
    if ((((unsigned long long)dst | (unsigned long long)src | n) & 15ULL) == 0) {
        uint4* __restrict__ d = (uint4*)dst;
        const uint4* __restrict__ s = (const uint4*)src;
        // Four loads in flight per thread before their stores: on the mapped path each load crosses
        // the bus (a microsecond or so), and one at a time would leave the link idle.
        const unsigned long long words = n / 16, step = blockDim.x;
        unsigned long long k = threadIdx.x;
        for (; k + 3 * step < words; k += 4 * step) {
            const uint4 v0 = s[k], v1 = s[k + step], v2 = s[k + 2 * step], v3 = s[k + 3 * step];
            d[k] = v0; d[k + step] = v1; d[k + 2 * step] = v2; d[k + 3 * step] = v3;
        }
        for (; k < words; k += step) d[k] = s[k];
    } else {
        for (unsigned long long k = threadIdx.x; k < n; k += blockDim.x) dst[k] = src[k];
    }
}
"""


# A kernel that only waits: slowed copies for tests (``copy_delay``) on the native copier, which
# launches it before each call's copies as the Python lanes do with torch.cuda._sleep.
_SPIN_SOURCE = r"""
extern "C" __global__ void ukv_spin(long long cycles) {
    const long long start = clock64();
    while (clock64() - start < cycles) {}
}
"""

_KERNELS: dict[tuple[str, int], Any] = {}
_KERNELS_LOCK = threading.Lock()


def _kernel(source: str, name: str, device: Any) -> Any:
    """Kernel ``name`` of ``source`` for ``device``, compiled with NVRTC once per device and process."""
    import torch

    index = torch.device(device).index
    key = (name, torch.cuda.current_device() if index is None else index)
    with _KERNELS_LOCK:
        if key not in _KERNELS:
            with torch.cuda.device(key[1]):
                _KERNELS[key] = torch.cuda._compile_kernel(source, name)  # NVRTC through torch: no public call
        return _KERNELS[key]


def spin_kernel(device: Any) -> int:
    """The waiting kernel's function handle for ``device`` (tests only)."""
    import torch

    with torch.cuda.device(device):
        return int(_kernel(_SPIN_SOURCE, "ukv_spin", device).func.value)


def staged_kernel(device: Any) -> Any:
    """The scatter/gather kernel for ``device``, compiled with NVRTC on first use (tens to hundreds
    of ms: once per device and process). ``Engine.open`` has it built on a worker thread (see
    :func:`staged_kernel_preparer`), so the loop never waits for the compiler; an error is raised
    again where the staging is built."""
    return _kernel(_SCATTER_SOURCE, "ukv_scatter", device)


def staged_kernel_preparer(device: Any) -> Callable[[], None] | None:
    """Called on the loop thread: a function that builds the staged kernel for ``device`` on a
    worker thread, or None (no driver). A fresh thread has no current CUDA context, and torch does
    not make one current when the thread's device index already matches, so the function first
    makes this thread's context for ``device`` current there."""
    if not load_cuda_driver():
        return None
    import torch

    with torch.cuda.device(device):
        ctx = cuda_current_context()

    def prepare() -> None:
        if ctx:
            cuda_use_context(ctx)
        staged_kernel(device)

    return prepare


def host_device_pointer(ctx: int, host: int) -> int:
    """The device's address of the pinned (mapped) host memory at ``host``."""
    dev = ffi.new("uint64_t *")
    rc = _lib.ukv_cuda_host_device_pointer(ctx, host, dev)
    if rc:
        raise CudaError(int(rc), "cuMemHostGetDevicePointer")
    return int(dev[0])


class Staging:
    """The kernel copy path: the tensor table on the device and the compiled scatter/gather
    kernel, which moves each block's pieces between its staging slot and the cache tensors, one
    launch per ``STAGED_MAX`` blocks. The staging slot is

    - ``mapped``: the pinned host slot itself, which the kernel reads and writes over the bus
      (``used_bytes`` is then 0: no driver copy per block);
    - else one device slot per host slot, filled (emptied) by one driver copy per block.

    The mapped form is asked for with ``mapped``; where the driver cannot map the host slab, the
    device slots are built and ``mapped_error`` says why."""

    def __init__(self, device: Any, blocks: BlockCopier, host_base: int, stride: int, slots: int,
                 used_bytes: int, mapped: bool = False) -> None:
        import torch

        self.mapped_error = ""
        with torch.cuda.device(device):
            self.kernel = staged_kernel(device)
            self.func = int(self.kernel.func.value)
            self.table_tensor = torch.tensor([v for row in blocks.table for v in row], dtype=torch.int64,
                                             device=device)
            self.table = int(self.table_tensor.data_ptr())
            self.slots_tensor: Any = None
            if mapped:
                try:
                    self.dev_base = host_device_pointer(cuda_current_context(), host_base)
                except CudaError as exc:
                    self.mapped_error = str(exc)
            if not mapped or self.mapped_error:
                self.slots_tensor = torch.empty(slots * stride, dtype=torch.uint8, device=device)
                self.dev_base = int(self.slots_tensor.data_ptr())
        self.mapped = self.slots_tensor is None
        self.host_base, self.used_bytes = host_base, 0 if self.mapped else used_bytes
        self.ntensors = len(blocks.table)

    def dev_slots(self, slot_addrs: Sequence[int]) -> list[int]:
        return [self.dev_base + (addr - self.host_base) for addr in slot_addrs]

    def dev_slot_array(self, slot_addrs: Sequence[int]) -> Any:
        """:meth:`dev_slots` as the uint64 C array pumps' copy jobs read."""
        return ffi.new("uint64_t[]", self.dev_slots(slot_addrs))

    def enqueue(self, ctx: int, done: CudaEvent, to_slot: bool, slot_addrs: Sequence[int],
                gpu_blocks: Sequence[int], stream: int) -> None:
        """One C call: per block one copy between the host slot and its device staging slot (none
        when mapped), and one kernel moving the pieces to or from the caches; then record ``done``."""
        rc = _lib.ukv_cuda_copy_staged(
            ctx, self.func, self.table, self.ntensors, self.used_bytes, int(to_slot), len(slot_addrs),
            ffi.new("uint64_t[]", slot_addrs), ffi.new("uint64_t[]", self.dev_slots(slot_addrs)),
            ffi.new("int64_t[]", gpu_blocks), stream, done.handle,
        )
        if rc:
            raise CudaError(int(rc), "enqueueing staged block copies")


# ---- torch.cuda: the device, its streams and torch events ------------------------------------------

class Device:
    """One CUDA device as the copiers use it through torch: streams, torch events recorded on them,
    the calling thread's current stream, and the primary context (current once torch used the
    device)."""

    def __init__(self, device: Any) -> None:
        import torch

        self._torch = torch
        self.device = device
        self._raw_stream: Callable[[int], int] | None = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        self.index = -1

    def streams(self, count: int, high_priority: bool) -> list[Any]:
        """``count`` new streams of the highest (or lowest) priority."""
        torch = self._torch
        with torch.cuda.device(self.device):
            low, high = torch.cuda.Stream.priority_range()
            return [torch.cuda.Stream(self.device, priority=high if high_priority else low) for _ in range(count)]

    def stream(self) -> Any:
        """A new stream of the default priority."""
        with self._torch.cuda.device(self.device):
            return self._torch.cuda.Stream(self.device)

    def context(self) -> int:
        """The device's context (torch made its primary context current); also notes its index."""
        with self._torch.cuda.device(self.device):
            self.index = self._torch.cuda.current_device()
            return cuda_current_context()

    def caller_stream(self) -> int:
        """The handle of the calling thread's current stream on this device."""
        if self._raw_stream is not None:
            return int(self._raw_stream(self.index))
        return int(self._torch.cuda.current_stream(self.device).cuda_stream)

    def record(self, stream: Any) -> Any:
        """A torch event recorded now on ``stream``: after every copy enqueued on it so far."""
        event = self._torch.cuda.Event()
        with self._torch.cuda.device(self.device):
            event.record(stream)
        return event

    def join(self, parts: Sequence[Any], stream: Any) -> Any:
        """A torch event on ``stream`` that fires after every event in ``parts``."""
        event = self._torch.cuda.Event()
        with self._torch.cuda.device(self.device):
            for each in parts:
                stream.wait_event(each)
            event.record(stream)
        return event

    def sleep(self, stream: Any, cycles: int) -> None:
        """Hold ``stream`` for about ``cycles`` GPU clock cycles (tests' slowed copies)."""
        torch = self._torch
        with torch.cuda.device(self.device), torch.cuda.stream(stream):
            torch.cuda._sleep(cycles)  # torch's own test kernel: no public call holds a stream


# ---- Pinned host memory ---------------------------------------------------------------------------

def host_register(addr: int, size: int) -> None:
    """Pin ``size`` bytes of host memory at ``addr`` for CUDA copies (``cudaHostRegister``);
    RuntimeError if the runtime refuses."""
    import torch

    rc = torch.cuda.cudart().cudaHostRegister(addr, size, 0)
    if int(rc) != 0:
        raise RuntimeError(f"cudaHostRegister of {size} staging bytes failed ({rc})")


def host_unregister(addr: int) -> None:
    """Undo :func:`host_register` (``cudaHostUnregister``)."""
    import torch

    torch.cuda.cudart().cudaHostUnregister(addr)
