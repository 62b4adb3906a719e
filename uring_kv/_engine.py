"""The engine: validation, per-disk-block hazards and batches. Orchestration only.

It never calls the kernel or CUDA itself: reads and writes go through an ``IOBackend``, copies through a
copier, completions come back through handlers, and leases move only in those handlers (see
``_staging``). A batch coroutine does three things: wait for the hazards of each block, acquire a
slot, submit. Everything after submission is driven by completions, so cancelling the coroutine
stops *new* submissions but never frees a slot that the kernel or the DMA engine still uses.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import operator
import os
import time
import warnings
from collections import deque
from collections.abc import Callable, Generator, Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from uring_kv._bridge import Bridge
from uring_kv._copy import CudaCopier, HostCopier, staged_kernel_preparer
from uring_kv._file import BlockFile
from uring_kv._io import IOBackend, Op, PumpRing, open_backend
from uring_kv._loop import LoopServices, current_services
from uring_kv._memory import view_of
from uring_kv._native import (
    STAGED_MAX,
    BlockCopier,
    NativePump,
    PumpCopies,
    PumpsBusy,
    bitmap,
    block_array,
    check_blocks,
    copy_blocks,
    first_unset,
    mark,
)
from uring_kv._staging import Kind, Lease, LeaseState, SlotPool
from uring_kv._tuning import Tuning
from uring_kv.errors import BlockIOError, EngineClosedError
from uring_kv.metrics import DirectionMetrics


@dataclass(eq=False, slots=True)
class _Block:
    disk_block: int
    gpu_block: int
    batch: _Batch
    deps: list[Any]  # futures: the hazards to clear first
    phase_done: Any  # future; load: its read finished; store: its write finished
    lease: Lease | None = None
    crc: int | None = None  # checksum=True: store → sum of the bytes written; load → sum expected


@dataclass(eq=False)
class _Batch:
    kind: Kind
    remaining: int
    done: Any  # future: every block finished
    enqueued: Any  # future: every copy enqueued
    to_enqueue: int
    failures: dict[int, int] = field(default_factory=dict)
    ready: list[_Block] = field(default_factory=list)
    last_event: Any = None  # for the caller: fires once every copy of the batch is done
    copied: bool = False  # some copy of this batch was enqueued
    marking: bool = False  # the copier was asked for the batch's event
    size: int = 0
    skipped: int = 0  # blocks never started (the batch was cancelled)
    created: float = field(default_factory=time.monotonic)


class _Args(NamedTuple):
    """A call's validated arguments; the block indices also as C int64 arrays."""
    disk: list[int]
    gpu: list[int]
    after: Any
    disk_c: Any
    gpu_c: Any


@dataclass(eq=False)
class _Pumped:
    """A batch carried by a native pump: the blocks start, complete and are copied (or their copy
    jobs queued and collected) in C, with no Python object, future or handler per block. Hazards
    are per batch: ``phase_done`` stands for every block's read (load) or write (store), and
    ``deps`` are the hazards of all its blocks, cleared before the first one starts."""

    batch: _Batch
    disk: list[int]
    deps: list[Any]
    phase_done: Any
    pump: NativePump
    disk_c: Any  # the disk blocks as a C int64 array
    wake: Any = None  # the driver waits on it while the pump holds slots
    waits: int = 0  # slot waits observed by the driver
    finished: bool = False
    handle_event: bool = True  # the caller gets a handle whose event must be made (not load/store_batch)


START_HOP = True  # a pumped batch yields the loop between set-up and hand-over (_drive_pumped); False: A/B only
# Most blocks of one call checked or registered per loop callback (a few hundred µs of Python at
# most); a larger call is admitted over several loop turns (see Engine._admit).
ADMIT_BLOCKS = 512
COPY_CALL_PIECES = 128  # most tensor×block pieces per copy call (see _enqueue_copy)
PUMP_SCATTER_MAX_TENSORS = 1024  # IOV_MAX: the most iovecs one readv takes


class TransferHandle:
    """A batch whose copies are enqueued. ``event`` (GPU mode) fires when every block has arrived
    on the device (load) or in the staging slots (store); ``await handle`` waits until the batch is
    complete (resident on the device, or written to the file) and raises its I/O errors."""

    def __init__(self, batch: _Batch, event: Any, services: LoopServices) -> None:
        self._batch = batch
        self._svc = services
        self.event = event

    def wait_on(self, stream: Any) -> None:
        """Make ``stream`` wait for this batch's copies (GPU mode)."""
        if self.event is not None:
            stream.wait_event(self.event)

    def __await__(self) -> Any:
        # Through wait(): a cancelled awaiter must not cancel the batch's own future, which the
        # engine still needs to see finish.
        return self._svc.wait(self._batch.done).__await__()


def _block_indices(values: Iterable[Any], what: str, limit: int) -> Generator[None, None, tuple[list[int], Any]]:
    """The entries as a list and as a C int64 array, each checked to be an integer in [0, limit);
    ADMIT_BLOCKS entries per step."""
    if isinstance(values, (str, bytes)):
        raise TypeError(f"{what} must be a sequence of integers, got {type(values).__name__}")
    try:
        items = list(values.tolist() if hasattr(values, "tolist") else values)
    except TypeError:
        raise TypeError(f"{what} must be a sequence of integers, got {type(values).__name__}") from None
    n = len(items)
    if n <= ADMIT_BLOCKS:
        return _checked_indices(items, what, limit, 0)
    out, array = [], block_array(n)
    for lo in range(0, n, ADMIT_BLOCKS):
        yield
        checked, piece = _checked_indices(items[lo:lo + ADMIT_BLOCKS], what, limit, lo)
        out += checked
        copy_blocks(array, lo, piece, len(checked))
    return out, array


def _checked_indices(items: list[Any], what: str, limit: int, start: int) -> tuple[list[int], Any]:
    """``items`` (entries ``start``... of ``what``) as a list of ints and a C int64 array."""
    # The common case (plain ints) is converted and range-checked in C; anything else goes through
    # the loop below, which names the first bad entry.
    if set(map(type, items)) <= {int}:
        with contextlib.suppress(OverflowError):  # beyond int64: the loop says which is out of range
            array = block_array(items)
            if check_blocks(array, len(items), limit) < 0:
                return items, array
    out = []
    for position, value in enumerate(items, start):
        if isinstance(value, bool):
            raise TypeError(f"{what}[{position}] is a bool, not a block index")
        try:
            index = operator.index(value)
        except TypeError:
            raise TypeError(f"{what}[{position}] must be an integer, got {type(value).__name__}") from None
        if not 0 <= index < limit:
            raise ValueError(f"{what}[{position}] = {index} is out of range [0, {limit})")
        out.append(index)
    return out, block_array(out)


def _normalise_caches(caches: Any) -> tuple[list[str], list[Any]]:
    import torch

    if isinstance(caches, torch.Tensor):
        raise TypeError("caches must be a mapping name → tensor or a sequence of tensors, not one tensor")
    if isinstance(caches, Mapping):
        names, tensors = [str(k) for k in caches], list(caches.values())
    elif isinstance(caches, Sequence):
        tensors = list(caches)
        names = [str(i) for i in range(len(tensors))]
    else:
        raise TypeError(f"caches must be a mapping or a sequence of tensors, got {type(caches).__name__}")
    if not tensors:
        raise ValueError("caches is empty: at least one tensor is needed")
    for name, t in zip(names, tensors, strict=True):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"cache {name!r} is a {type(t).__name__}, not a torch.Tensor")
        if t.dim() < 1 or t.shape[0] == 0 or t.numel() == 0:
            raise ValueError(f"cache {name!r} has no blocks (shape {tuple(t.shape)})")
        if not t.is_contiguous():  # (a view whose blocks are not one run each, or overlap: as_strided, a slice
            # of an inner dim, an expanded dim): its block bytes would reach memory it does not own
            raise ValueError(f"cache {name!r} is not contiguous (shape {tuple(t.shape)}, strides {t.stride()}): "
                             "each block (dim 0) must be one contiguous run of its own bytes")
        if t.device != tensors[0].device:
            raise ValueError(f"cache {name!r} is on {t.device}, cache {names[0]!r} on {tensors[0].device}: "
                             "all caches must be on one device")
        if t.shape[0] != tensors[0].shape[0]:
            raise ValueError(f"cache {name!r} has {t.shape[0]} blocks, cache {names[0]!r} has "
                             f"{tensors[0].shape[0]}: every cache needs the same number of blocks")
        if t.device.type not in ("cpu", "cuda"):
            raise ValueError(f"cache {name!r} is on {t.device}; only CUDA and CPU tensors are supported")
    return names, tensors


class Engine:
    """Loads and stores KV-cache blocks between ``caches`` and a private file beside ``path``.

    ``path``: where the block file lives. The file never takes this name (or any): it is made
    unnamed in ``path``'s directory (resolved once, at construction), mode 0600, so no other
    process can open it and none of its bytes outlive the process, even under SIGKILL. Whatever
    exists at ``path`` is left alone.
    ``caches``: mapping name → tensor (or a sequence of tensors), all on one device, dim 0 the block
    index, each block one contiguous run of its tensor's own bytes. A disk block holds one block
    of every tensor, padded to the I/O alignment.
    ``num_disk_blocks``: the file's size in blocks. Loading a block that was never stored, or
    whose last store failed, fails that block (``ENODATA``, or the store's errno).
    Use as ``async with Engine(...) as engine`` (or ``await engine.open()`` … ``await engine.aclose()``),
    under asyncio or trio (directly or through anyio): ``open()`` binds the engine to the loop it runs on.

    ``num_slots``: staging slots (pinned host memory = num_slots × padded block size).
    ``io_depth``: at most this many reads and writes in flight (default: ``num_slots``). Fewer than
    the slots leaves spare slots for blocks between their I/O and the end of their copy, so a slot's
    turnaround through the copy does not take an I/O out of flight (GPU mode). In CPU mode with
    O_DIRECT and small blocks (memcpys in the reap), spare slots let a reap submit the next reads
    before it copies the blocks that just completed (``num_slots = 2 × io_depth`` while the slots
    hold at most 1 MiB).
    ``direct``: True requires O_DIRECT, False never uses it, None (default) probes and falls back.
    ``io``: 'auto' (default, or ``$URING_KV_IO``), 'uring' or 'threads'.
    ``copy_delay``: for tests: hold every copy back about this many seconds (a host sleep in CPU
    mode, a sleeping kernel on the copy stream in GPU mode), to widen race windows.
    ``tuning``: a :class:`Tuning` (default: ``Tuning.from_env()``, read here, once).
    ``checksum``: keep a crc32c of every block written and verify it on load; a mismatch fails the
    block with ``EBADMSG``. Sums live in memory, like the file itself, for the engine's lifetime.
    """

    def __init__(self, caches: Any, path: str | os.PathLike[str], num_disk_blocks: int, num_slots: int = 16,
                 *, direct: bool | None = None, io: str | None = None, copy_delay: float = 0.0,
                 checksum: bool = False, io_depth: int | None = None, tuning: Tuning | None = None) -> None:
        if isinstance(num_disk_blocks, bool) or not isinstance(num_disk_blocks, int) or num_disk_blocks < 1:
            raise ValueError(f"num_disk_blocks must be a positive integer, got {num_disk_blocks!r}")
        if isinstance(num_slots, bool) or not isinstance(num_slots, int) or num_slots < 1:
            raise ValueError(f"num_slots must be a positive integer, got {num_slots!r}")
        if copy_delay < 0:
            raise ValueError(f"copy_delay must be >= 0, got {copy_delay}")
        if io_depth is not None and (isinstance(io_depth, bool) or not isinstance(io_depth, int) or io_depth < 1):
            raise ValueError(f"io_depth must be a positive integer or None, got {io_depth!r}")
        self.io_depth = min(io_depth, num_slots) if io_depth is not None else num_slots
        if tuning is not None and not isinstance(tuning, Tuning):
            raise TypeError(f"tuning must be a uring_kv.Tuning, got {type(tuning).__name__}")
        self.tuning = tuning if tuning is not None else Tuning.from_env()
        self.names, self._tensors = _normalise_caches(caches)
        self.device = self._tensors[0].device
        self.gpu = self.device.type == "cuda"
        self.num_gpu_blocks = int(self._tensors[0].shape[0])
        self._seen_gpu = bitmap(self.num_gpu_blocks)  # scratch for the repeat checks of a call
        # Bytes of one block of each tensor, from its shape: stride(0) overstates it for a tensor of
        # one block that is a slice (its stride still spans the whole parent's block).
        self._tensor_block_bytes = [t.numel() // t.shape[0] * t.element_size() for t in self._tensors]
        offsets, total = [], 0
        for nbytes in self._tensor_block_bytes:
            offsets.append(total)
            total += nbytes
        self._slot_offsets = offsets
        self.block_bytes = total
        # Resolved once: a later chdir must not change which directory the file is made in.
        self.path = os.path.abspath(os.fspath(path))
        _check_disk_size(num_disk_blocks, total)
        try:
            # stored: disk blocks whose last store succeeded (a load of any other fails, naming it);
            # seen: scratch for the repeat check of a store's disk blocks
            self._stored, self._seen_disk = bitmap(num_disk_blocks), bitmap(num_disk_blocks)
        except MemoryError:
            raise ValueError(f"num_disk_blocks={num_disk_blocks}: no memory for its index "
                             f"({_index_bytes(num_disk_blocks)} bytes)") from None
        self.num_disk_blocks = num_disk_blocks
        self.num_slots = num_slots
        self._direct = direct
        self._io_mode = io
        self._copy_delay = copy_delay
        if checksum:
            try:
                import crc32c  # noqa: F401
            except ImportError as exc:
                raise ImportError("checksum=True needs the crc32c package (pip install crc32c)") from exc
        self.checksum = checksum
        self._sums: dict[int, int] = {}  # disk block → crc32c of its padded bytes, as last written
        self._sum_pool: ThreadPoolExecutor | None = None
        self._state = "new"
        self._open_done: Any = None  # futures: open() finished (however), the closing finished
        self._close_done: Any = None
        self._active: set[_Batch] = set()
        self._last_store: dict[int, Any] = {}  # disk block → phase_done of its latest store
        self._loads_reading: dict[int, list[Any]] = {}  # disk block → phase_done of reads in flight
        self._batch_reads: dict[Any, set[int]] = {}  # phase_done of a pumped load → the blocks it reads
        self._admitting: deque[Any] = deque()  # futures: the calls being admitted, in call order
        self._invalid: dict[int, int] = {}  # disk block → errno of its last store, which failed
        self._flush_scheduled = False
        self._ready_batches: list[_Batch] = []
        self._metrics = {Kind.LOAD: DirectionMetrics(), Kind.STORE: DirectionMetrics()}
        self._pumped_count = 0

    # ----------------------------------------------------------------- lifecycle
    async def open(self) -> Engine:
        if self._state != "new":
            raise RuntimeError(f"engine is {self._state}; open() is called once")
        svc = current_services()
        self._svc = svc
        self._state = "opening"
        self._open_done = svc.create_future()  # an aclose() meanwhile waits for it, then closes
        try:
            prepare = staged_kernel_preparer(self.device) if self.gpu else None
            self.file = await svc.to_thread(self._open_file, prepare, cleanup=_close_file)
        except BaseException:
            self._state = "closed"
            self._open_done.set_result(None)
            raise
        try:
            self._open_rest()
        except BaseException:
            self._release()  # nothing was submitted yet
            raise
        else:
            self._state = "open"
        finally:
            self._open_done.set_result(None)
        return self

    def _open_file(self, prepare: Callable[[], None] | None) -> BlockFile:
        """On a worker thread: create the file and, in GPU mode, build the staged-copy kernel (the
        NVRTC compile would otherwise stall the loop the first time an engine opens on a device)."""
        file = BlockFile(self.path, self.block_bytes, self.num_disk_blocks, self._direct)
        if prepare is not None:
            with contextlib.suppress(Exception):  # tried again by the copier, which says what failed
                prepare()
        return file

    def _open_rest(self) -> None:
        tuning, stride = self.tuning, self.file.stride
        few_slots = tuning.copies_inline(self.num_slots, stride)
        async_io, async_writes = tuning.sqe_flags(self.gpu, self.file.direct, self.num_slots, stride)
        self._pump_inline = tuning.pump_inline(self.num_slots, stride)
        capped = self.io_depth < self.num_slots
        self.io: IOBackend = open_backend(self._io_mode or tuning.io, services=self._svc, async_io=async_io,
                                          async_writes=async_writes, depth=self.io_depth if capped else None,
                                          tuning=tuning)
        self.pool = SlotPool(self.num_slots, self.file.stride, self._svc)
        self._host_registered = False
        if self.gpu:
            import torch

            rc = torch.cuda.cudart().cudaHostRegister(self.pool.slab.addr, self.pool.slab.size, 0)
            if int(rc) != 0:
                raise RuntimeError(f"cudaHostRegister of {self.pool.slab.size} staging bytes failed ({rc})")
            self._host_registered = True
        self.io.register_buffers([(lease.addr, self.file.stride) for lease in self.pool.leases])
        self.io.register_file(self.file.fd)
        self.bridge = Bridge(self._svc)
        blocks = BlockCopier([t.data_ptr() for t in self._tensors], self._tensor_block_bytes, self._slot_offsets)
        self._blocks = blocks
        self.copier: HostCopier | CudaCopier
        if self.gpu:
            self.copier = CudaCopier(blocks, self.bridge, self.device, self._copy_delay,
                                     staging=(self.pool.slab.addr, self.file.stride, self.num_slots, self.block_bytes))
        else:
            self.copier = HostCopier(blocks, self.bridge, self._copy_delay)
        staged = isinstance(self.copier, CudaCopier) and self.copier.staged
        self._copy_call_blocks = STAGED_MAX if staged else max(1, COPY_CALL_PIECES // len(self._tensors))
        # Batches on io_uring run in native pumps unless something per block needs Python
        # (checksums). Their copies are memcpys in the reap when a block's copy may run on the loop
        # (CPU mode's inline copies; under a depth below the slot count the spare slots park, and a
        # reap refills through them before it copies) and all slots together hold at most PUMP_INLINE_PASS_BYTES
        # (a pump's start, and a reap pass over a full CQ, copy every slot's block on the loop:
        # 32 × 128 KiB took 1.3 ms on the CPU machine); else jobs for the native copier (GPU
        # mode, large or slowed host copies, many slots), whose finished jobs the ring then collects
        # (their slots move on in C).
        ring = self.io.pump_ring() if tuning.pumps else None
        inline = isinstance(self.copier, HostCopier) and self.copier.inline_blocks >= 1 and few_slots
        link = self.copier.link
        self._pump_copies: PumpCopies | None = None
        self._pumped_batches = ring is not None and not self.checksum and (inline or link is not None)
        self._ring: PumpRing | None = ring  # the ring pumps run on (None: this backend has none)
        if ring is not None and self._pumped_batches and not inline and link is not None:
            dev_slots = self.copier.pump_dev_slots([lease.addr for lease in self.pool.leases])
            self._pump_copies = PumpCopies(link.jobs, self._copy_call_blocks, dev_slots)
            link.take = functools.partial(ring.copies_done, link.jobs)
        # Pumped loads read straight into the cache tensors in CPU mode: from a buffered file, or with
        # O_DIRECT where every piece of every block starts and ends on the file's alignment (rows of
        # page-aligned memory, as vLLM's and SGLang's host pools are); IOV_MAX bounds the pieces.
        align = self.file.alignment
        aligned = all(int(t.data_ptr()) % align == 0 and nbytes % align == 0
                      for t, nbytes in zip(self._tensors, self._tensor_block_bytes, strict=True))
        self._pump_scatter = (not self.gpu and (not self.file.direct or aligned)
                              and len(self._tensors) <= PUMP_SCATTER_MAX_TENSORS
                              and tuning.pump_scatter)

    def _release(self) -> None:
        """Free whatever open() set up, last part first, each part even if an earlier one failed
        (the first failure is raised after). Nothing may be in flight any more. On the loop's
        thread, or anywhere once the loop is closed."""
        self._state = "closed"
        steps: list[Callable[[], Any]] = []
        for name in ("copier", "bridge", "io"):
            part = getattr(self, name, None)
            if part is not None:
                steps.append(part.stop if name == "bridge" else part.close)
        if getattr(self, "_host_registered", False):
            import torch

            self._host_registered = False
            steps.append(functools.partial(torch.cuda.cudart().cudaHostUnregister, self.pool.slab.addr))
        if self._sum_pool is not None:
            steps.append(self._sum_pool.shutdown)
        if getattr(self, "pool", None) is not None:
            steps.append(self.pool.close)
        if getattr(self, "file", None) is not None:
            steps.append(self.file.close)
        failure: BaseException | None = None
        for step in steps:
            try:
                step()
            except BaseException as exc:
                failure = failure or exc
        if failure is not None:
            raise failure

    async def __aenter__(self) -> Engine:
        return await self.open()

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Stop accepting work, let in-flight batches finish, wait for every I/O and copy, free all.
        Every call returns only once the engine is closed (a second one waits for the first; one
        made while ``open()`` runs waits for it, then closes). Cancelling it does not stop it half
        way: it finishes closing, then raises the cancellation. Called on another thread or event
        loop than ``open()``'s, it raises RuntimeError, unless that loop has ended and nothing is
        in flight: then it frees everything at once."""
        if self._state == "new":
            self._state = "closed"
        if self._state == "closed":
            return
        svc = self._svc
        if not svc.is_current():
            if svc.is_closed() and not self._in_flight():
                self._release()
                return
            raise RuntimeError(self._foreign("aclose()"))
        if self._state == "opening":
            await svc.wait_through_cancellation(self._open_done)
            if self._state != "open":  # open() failed, or another aclose() already began
                await self.aclose()
                return
        if self._state == "closing":
            await svc.wait_through_cancellation(self._close_done)
            return
        self._state = "closing"
        self._close_done = svc.create_future()
        try:
            await svc.run_to_completion(self._close())
        finally:
            self._close_done.set_result(None)

    async def _close(self) -> None:
        try:
            for batch in list(self._active):
                await self._svc.wait_through_cancellation(batch.done)
            await self.io.drain()
            while self.bridge.pending or self.copier.pending:
                await self._svc.sleep(0.001)
        finally:
            if not self._in_flight():
                self._release()

    def _in_flight(self) -> int:
        """I/O ops, copies and completions the kernel, the copiers or the bridge still owe."""
        io, bridge, copier = (getattr(self, name, None) for name in ("io", "bridge", "copier"))
        return ((io.inflight if io is not None else 0) + (bridge.pending if bridge is not None else 0)
                + (copier.pending if copier is not None else 0))

    def _foreign(self, what: str) -> str:
        return (f"uring_kv Engine for {self.path}: {what} called outside the event loop (and thread) that "
                "opened it; call it from there")

    def __del__(self) -> None:
        """An engine dropped open: free what can be freed without its loop (threads, ring, slab,
        file); with transfers still in flight, their memory and file must stay until they end."""
        if getattr(self, "_state", "closed") not in ("open", "closing"):
            return
        owed = self._in_flight()
        if owed:
            warnings.warn(f"uring_kv Engine for {self.path} was not closed, with {owed} transfers in flight: "
                          "its staging memory, ring, threads and file stay until the process exits",
                          ResourceWarning, stacklevel=1)
            return
        warnings.warn(f"uring_kv Engine for {self.path} was not closed; its threads, ring, staging memory and "
                      "file were released", ResourceWarning, stacklevel=1)
        svc = self._svc
        if svc.is_current() or svc.is_closed():
            self._release_quietly()
        else:  # another thread: the loop's watchers are removed on the loop's thread
            try:
                svc.call_soon_threadsafe(self._release_quietly)
            except RuntimeError:  # the loop has just ended
                self._release_quietly()

    def _release_quietly(self) -> None:
        try:
            self._release()
        except Exception as exc:
            warnings.warn(f"uring_kv Engine for {self.path}: releasing it failed: {exc}", ResourceWarning,
                          stacklevel=1)

    @property
    def closed(self) -> bool:
        return self._state == "closed"

    def _gauges(self) -> dict[str, Any]:
        """What is held or in flight right now (all zero once closed)."""
        is_open = hasattr(self, "pool") and self._state != "closed"
        return {"leases_held": self.pool.held if is_open else 0,
                "io_inflight": self.io.inflight if is_open else 0,
                "copies_pending": self.bridge.pending + self.copier.pending if is_open else 0,
                "oldest_lease_age_s": self.pool.oldest_age() if is_open else 0.0}

    def metrics(self) -> dict[str, Any]:
        """A snapshot: per direction (``load``, ``store``) bytes, blocks, failures, cancelled blocks,
        batches and histograms of batch latency and slot wait; gauges for leases held, copies
        pending, I/O in flight and the oldest lease's age."""
        snapshot: dict[str, Any] = {kind.name.lower(): m.snapshot() for kind, m in self._metrics.items()}
        snapshot.update(self._gauges())
        return snapshot

    def stats(self) -> dict[str, Any]:
        """The gauges of :meth:`metrics`, the number of active batches, how many batches ran in
        native pumps, and what the engine chose here: I/O path, copy path, O_DIRECT, how the file is
        kept unnamed, fixed buffers, pinned bytes, event loop, and whether pumped loads read straight
        into the caches (``loads_into_caches``: CPU mode, buffered or with every piece aligned), and the
        :class:`Tuning` in force (``tuning``, a dict)."""
        return {
            **self._gauges(),
            "active_batches": len(self._active),
            "pumped_batches": self._pumped_count,
            "io": self.io.description,
            "copy": self.copier.description,
            "direct": self.file.direct,
            "file": self.file.naming,
            "fixed_buffers": self.io.fixed_buffers,
            "pinned_bytes": self.pool.slab.size,
            "io_depth": self.io_depth,
            "loop": self._svc.name,
            "loads_into_caches": self._pumped_batches and self._pump_scatter,
            "tuning": self.tuning.as_dict(),
        }

    # ----------------------------------------------------------------- public API
    async def load_batch(self, disk_blocks: Sequence[int], gpu_blocks: Sequence[int], after: Any = None) -> None:
        """Read ``disk_blocks`` into ``gpu_blocks``; returns once the bytes are on the device.

        GPU mode: the copies into ``gpu_blocks`` run after ``after`` (a ``torch.cuda.Event``, e.g.
        recorded after the blocks' last use), or by default after the work queued so far on the
        caller's current stream.

        If cancelled, no further block is started, and the call returns (raising CancelledError)
        only once the blocks already started have finished: after it, the engine no longer touches
        ``gpu_blocks``."""
        batch, blocks = await self._admit(Kind.LOAD, disk_blocks, gpu_blocks, after, True)
        await self._run(batch, blocks, wait=True)

    async def store_batch(self, gpu_blocks: Sequence[int], disk_blocks: Sequence[int], after: Any = None) -> None:
        """Write ``gpu_blocks`` to ``disk_blocks``; returns once the bytes are in the file.

        GPU mode: the copies out of ``gpu_blocks`` run after ``after`` (a ``torch.cuda.Event``
        recorded once the blocks are written), or by default after the work queued so far on the
        caller's current stream.

        Cancellation works as for :meth:`load_batch`: the blocks already started are written (their
        GPU bytes were already copied out) before the CancelledError propagates."""
        batch, blocks = await self._admit(Kind.STORE, disk_blocks, gpu_blocks, after, True)
        await self._run(batch, blocks, wait=True)

    async def load_batch_async(self, disk_blocks: Sequence[int], gpu_blocks: Sequence[int],
                               after: Any = None) -> TransferHandle:
        """Like :meth:`load_batch` but returns once every copy is enqueued (see :class:`TransferHandle`)."""
        # In GPU mode not in a pump: a pumped batch is enqueued only once it is complete, and this
        # form exists to return as soon as the copies are on their stream.
        return await self._run(*await self._admit(Kind.LOAD, disk_blocks, gpu_blocks, after, not self.gpu),
                               wait=False)

    async def store_batch_async(self, gpu_blocks: Sequence[int], disk_blocks: Sequence[int],
                                after: Any = None) -> TransferHandle:
        """Like :meth:`store_batch` but returns once every D2H copy is enqueued; awaiting the handle
        waits for the writes."""
        return await self._run(*await self._admit(Kind.STORE, disk_blocks, gpu_blocks, after, not self.gpu),
                               wait=False)

    # ----------------------------------------------------------------- admission
    # A call's hazards are registered in call order, all of them before any later call's: a load
    # sees exactly the stores called before it. A batch of more than ADMIT_BLOCKS blocks is checked
    # and registered ADMIT_BLOCKS at a time, one piece per loop turn, so no single callback does
    # Python work for a whole huge batch; calls made meanwhile queue behind it (``_admitting``).
    async def _admit(self, kind: Kind, disk_blocks: Any, gpu_blocks: Any, after: Any,
                     pump: bool) -> tuple[_Batch, list[_Block] | _Pumped]:
        if self._state == "new":  # not opened: there is no loop to compare with yet
            raise EngineClosedError("engine is new")
        if not self._svc.is_current():  # before anything is taken: a slot, a hazard, a turn
            raise RuntimeError(self._foreign("load_batch()" if kind is Kind.LOAD else "store_batch()"))
        steps = self._admission(kind, disk_blocks, gpu_blocks, after, pump)
        queue, turn = self._admitting, None
        if queue:  # earlier calls are still being admitted: wait for them, in order
            turn = self._svc.create_future()
            queue.append(turn)
            try:
                while queue[0] is not turn:
                    await self._svc.wait(queue[0])
            except BaseException:
                self._end_turn(turn)
                raise
        try:
            next(steps)  # the common case: a small batch is admitted in this one step
        except StopIteration as stop:
            self._end_turn(turn)
            return stop.value  # type: ignore[no-any-return]
        except BaseException:
            self._end_turn(turn)
            raise
        if turn is None:
            turn = self._svc.create_future()
            queue.appendleft(turn)
        try:
            return await self._svc.run_steps(steps)
        finally:
            self._end_turn(turn)

    def _end_turn(self, turn: Any) -> None:
        if turn is not None:
            self._admitting.remove(turn)
            turn.set_result(None)

    def _admission(self, kind: Kind, disk_blocks: Any, gpu_blocks: Any, after: Any,
                   pump: bool) -> Generator[None, None, tuple[_Batch, list[_Block] | _Pumped]]:
        """Check the call, then register its hazards (yielding between pieces of a large batch)."""
        args = yield from self._validate(disk_blocks, gpu_blocks, after, kind)
        if self._state != "open":  # closed while a large call was being checked
            raise EngineClosedError(f"engine is {self._state}")
        if pump and self._pumped_batches and args.disk:
            run = yield from self._pumped(kind, args)
            if run is not None:
                return run.batch, run
        disk, gpu, n = args.disk, args.gpu, len(args.disk)
        batch = self._new_batch(kind, args.after, n)
        blocks: list[_Block] = []
        last_store, reading, create = self._last_store, self._loads_reading, self._svc.create_future
        for lo in range(0, n, ADMIT_BLOCKS):
            if lo:
                yield
            hi = lo + ADMIT_BLOCKS
            if kind is Kind.LOAD:
                for d, g in zip(disk[lo:hi], gpu[lo:hi], strict=True):
                    store = last_store.get(d)
                    block = _Block(d, g, batch, [store] if store is not None else [], create())
                    reading.setdefault(d, []).append(block.phase_done)
                    blocks.append(block)
            else:
                batch_reads = self._batch_reads
                for d, g in zip(disk[lo:hi], gpu[lo:hi], strict=True):
                    deps = list(reading.get(d, ()))
                    if batch_reads:
                        deps.extend(fut for fut, reads in batch_reads.items() if d in reads)
                    if (store := last_store.get(d)) is not None:
                        deps.append(store)
                    block = _Block(d, g, batch, deps, create())
                    last_store[d] = block.phase_done
                    blocks.append(block)
        return batch, blocks

    def _pumped(self, kind: Kind, args: _Args) -> Generator[None, None, _Pumped | None]:
        """A batch for a native pump, its hazards registered per batch; None when no pump is free."""
        ring = self._ring
        assert ring is not None  # only called when batches are pumped
        holder: list[_Pumped] = []
        disk, n = args.disk, len(args.disk)
        try:
            pump = ring.pump(kind is Kind.STORE, self.file.fd, self.file.stride, self._blocks,
                                self.file.offsets(args.disk_c, n), args.gpu_c, n, self.pool.waiting, self.num_slots,
                                lambda: self._pump_progress(holder[0]), inline=self._pump_inline,
                                scatter=kind is Kind.LOAD and self._pump_scatter, copies=self._pump_copies)
        except PumpsBusy:
            return None
        phase_done = self._svc.create_future()
        deps: dict[int, Any] = {}
        last_store, reading = self._last_store, self._loads_reading
        batch = self._new_batch(kind, args.after, len(disk))
        self._pumped_count += 1
        # One entry for the whole batch: a store looks for its blocks in each pumped load's set.
        reads: set[int] = set()
        if kind is Kind.LOAD:
            self._batch_reads[phase_done] = reads
        for lo in range(0, n, ADMIT_BLOCKS):
            if lo:
                yield
            piece = disk[lo:lo + ADMIT_BLOCKS]
            if kind is Kind.LOAD:
                if last_store:  # some store is in flight
                    for d in piece:
                        if (store := last_store.get(d)) is not None:
                            deps[id(store)] = store
                reads.update(piece)
            else:
                for d in piece:
                    for fut in reading.get(d, ()):
                        deps[id(fut)] = fut
                    if (store := last_store.get(d)) is not None:
                        deps[id(store)] = store
                    last_store[d] = phase_done
                for fut, batch_reads in self._batch_reads.items():
                    if not batch_reads.isdisjoint(piece):
                        deps[id(fut)] = fut
        run = _Pumped(batch, disk, list(deps.values()), phase_done, pump, args.disk_c)
        holder.append(run)
        return run

    async def _drive_pumped(self, run: _Pumped) -> TransferHandle:
        """Wait for the batch's hazards, then keep its pump supplied with slots: a pump refills its
        slots itself; it needs the driver only to queue for a slot when it holds none (at the
        start, or after handing every slot to other waiting batches). Cancelling this stops the
        pump from starting blocks; those in flight finish."""
        batch, pump, kind = run.batch, run.pump, run.batch.kind
        try:
            if START_HOP:
                await self._svc.yield_to_io()
            for dep in run.deps:
                if not dep.done():
                    await self._svc.wait(dep)
            if kind is Kind.LOAD and first_unset(run.disk_c, len(run.disk), self._stored) >= 0:
                # checked now: the stores it waited for may have failed
                await self._svc.run_steps(self._drop_unstored(run))
            while pump.started < pump.nblocks:
                if pump.slots == 0:
                    waited = time.monotonic()
                    lease = await self.pool.acquire(kind)
                    self._metrics[kind].slot_wait_s.observe(time.monotonic() - waited)
                    run.waits += 1
                    lease.hand_to_pump()
                    leases = [lease]  # and whatever else is free for the blocks left, in one hand-over
                    if (left := pump.nblocks - pump.started - 1) > 0 and self.pool.free:
                        leases += self.pool.take_for_pump(kind, left)
                    self._pump_grow(run, leases)
                else:
                    run.wake = self._svc.create_future()
                    await self._svc.wait(run.wake)
        finally:
            pump.stop()
            self._pump_progress(run)
        await self._svc.wait(batch.enqueued)
        return TransferHandle(batch, batch.last_event, self._svc)

    def _drop_unstored(self, run: _Pumped) -> Generator[None, None, None]:
        """Before its first block starts: fail the blocks of a pumped load that hold no stored
        bytes (never stored, or their last store failed), and leave the pump the others."""
        stored, failures = self._stored, run.batch.failures
        keep = []
        for position, d in enumerate(run.disk):
            if position and not position % ADMIT_BLOCKS:
                yield
            if stored[d >> 6] >> (d & 63) & 1:
                keep.append(position)
            else:
                failures[d] = self._invalid.get(d, errno.ENODATA)
        run.pump.keep_only(keep)
        run.disk = [run.disk[position] for position in keep]

    def _pump_grow(self, run: _Pumped, leases: list[Lease]) -> None:
        """Give the pump ``leases`` (PUMPING already): their slots are its until it hands them back."""
        indices, addrs = [], []
        for lease in leases:
            indices.append(lease.index)
            addrs.append(lease.addr)
        assert self._ring is not None
        self._ring.pump_slots(run.pump, indices, addrs)
        self._pump_progress(run)

    def _pump_progress(self, run: _Pumped) -> None:
        """After the pump moved: release the slots it handed back, offer it free slots, finish."""
        if run.finished:
            return
        pump = run.pump
        released = pump.take_released()
        if released:
            assert self._ring is not None
            self._ring.pump_returned(len(released))
            leases, release = self.pool.leases, self.pool.release
            for index in released:
                release(leases[index])  # PUMPING → FREE: the pump's last I/O and memcpy in it are done
        left = pump.nblocks - pump.started - pump.unstarted_slots  # blocks no slot is meant for yet
        if left > 0 and pump.slots and self.pool.free and not pump.stopped:
            more = self.pool.take_for_pump(run.batch.kind, left)
            if more:
                self._pump_grow(run, more)
                return
        if pump.finished:
            self._pump_finish(run)
        elif pump.slots == 0 and run.wake is not None and not run.wake.done():
            run.wake.set_result(None)

    def _pump_finish(self, run: _Pumped) -> None:
        run.finished = True
        assert self._ring is not None
        self._ring.pump_done(run.pump)
        batch, disk, started = run.batch, run.disk, run.pump.started
        failures = {disk[position]: code for position, code in run.pump.failures()}
        batch.failures.update(failures)
        batch.skipped = len(disk) - started
        if batch.kind is Kind.STORE:
            stored = self._stored
            mark(run.disk_c, started, stored, True)
            if invalid := self._invalid:  # its entries hold for blocks whose bit is clear: drop the rest
                for d in [d for d in invalid if stored[d >> 6] >> (d & 63) & 1]:
                    del invalid[d]
            for d in failures:  # a failed write leaves no bytes to trust
                self._unstore(d, failures[d])
        pending = [dep for dep in run.deps if not dep.done()]
        if pending:  # cancelled before its hazards cleared: a later batch may rely on this order
            self._svc.when_all(pending, _bind(self._pump_phase_finished, run))
        else:
            self._pump_phase_finished(run)
        self._metrics[batch.kind].slot_wait_s.observe(0.0, max(0, started - run.waits))
        if started and run.handle_event:  # every copy is done: an event that has fired (GPU: once recorded)
            batch.last_event = self.copier.settled_event(batch.kind is Kind.STORE)
        batch.remaining = batch.to_enqueue = 0
        batch.enqueued.set_result(batch.last_event)
        if run.wake is not None and not run.wake.done():
            run.wake.set_result(None)
        self._check_batch(batch)

    def _pump_phase_finished(self, run: _Pumped) -> None:
        run.phase_done.set_result(None)
        if run.batch.kind is Kind.LOAD:
            del self._batch_reads[run.phase_done]
        else:
            self._stores_cleared(run.disk, run.phase_done, 0)

    def _stores_cleared(self, disk: list[int], fut: Any, start: int) -> None:
        """Drop ``fut`` (done), the write of a pumped store, from ``_last_store``, ADMIT_BLOCKS entries
        per loop callback: until then a call finds it done, which costs it nothing."""
        end = start + ADMIT_BLOCKS
        self._hazards_cleared(Kind.STORE, disk[start:end], fut)
        if end < len(disk):
            self._svc.call_soon(self._stores_cleared, disk, fut, end)

    async def _run(self, batch: _Batch, blocks: list[_Block] | _Pumped, wait: bool) -> TransferHandle:
        try:
            if isinstance(blocks, _Pumped):
                blocks.handle_event = not wait  # awaited whole, the handle never reaches the caller
                handle = await self._drive_pumped(blocks)
            else:
                handle = await self._drive(batch, blocks)
            if wait:
                await handle
            return handle
        except self._svc.cancelled:
            # _drive stopped starting blocks. Those already handed to the kernel or the DMA engine
            # still read or write the caller's GPU blocks: give control back only once they are done.
            await self._svc.wait_through_cancellation(batch.done)
            raise

    # ----------------------------------------------------------------- internals
    def _validate(self, disk_blocks: Any, gpu_blocks: Any, after: Any, kind: Kind) -> Generator[None, None, _Args]:
        if self._state != "open":
            raise EngineClosedError(f"engine is {self._state}")
        disk, disk_c = yield from _block_indices(disk_blocks, "disk_blocks", self.num_disk_blocks)
        gpu, gpu_c = yield from _block_indices(gpu_blocks, "gpu_blocks", self.num_gpu_blocks)
        if len(disk) != len(gpu):
            raise ValueError(f"disk_blocks has {len(disk)} entries but gpu_blocks has {len(gpu)}")
        if (dup := check_blocks(gpu_c, len(gpu), self.num_gpu_blocks, self._seen_gpu)) >= 0:
            raise ValueError(f"gpu block {gpu[dup]} appears twice in one batch")
        if kind is Kind.STORE and (dup := check_blocks(disk_c, len(disk), self.num_disk_blocks,
                                                       self._seen_disk)) >= 0:
            raise ValueError(f"disk block {disk[dup]} appears twice in one store batch")
        if after is not None:
            if not self.gpu:
                raise TypeError("after= takes a torch.cuda.Event and only applies to CUDA caches")
            import torch

            if not isinstance(after, torch.cuda.Event):
                raise TypeError(f"after must be a torch.cuda.Event, got {type(after).__name__}")
        return _Args(disk, gpu, after, disk_c, gpu_c)

    def _new_batch(self, kind: Kind, after: Any, count: int) -> _Batch:
        batch = _Batch(kind, count, self._svc.create_future(), self._svc.create_future(), count,
                       size=count)
        if self.gpu and (after is not None or count):
            # Every copy of this batch, whenever enqueued, runs after the caller's work: ``after``,
            # or by default whatever the caller's current stream holds now.
            self.copier.order_after(kind is Kind.STORE, after)
        self._active.add(batch)
        if count == 0:
            self._check_batch(batch)
        return batch

    async def _drive(self, batch: _Batch, blocks: list[_Block]) -> TransferHandle:
        """Wait hazards, take slots, submit. Cancelling this stops new submissions only."""
        started = 0
        try:
            while started < len(blocks):
                block = blocks[started]
                for dep in block.deps:
                    if not dep.done():
                        await self._svc.wait(dep)
                waited = time.monotonic()
                block.lease = await self.pool.acquire(batch.kind)
                self._metrics[batch.kind].slot_wait_s.observe(time.monotonic() - waited)
                group = [block]
                started += 1
                # Take more free slots now for the following blocks whose hazards are clear (looking
                # no further ahead than there are free slots: a batch of n blocks would rescan O(n²)).
                clear, stop = started, min(len(blocks), started + self.pool.free)
                while clear < stop and _all_done(blocks[clear].deps):
                    clear += 1
                if clear > started:
                    more = self.pool.try_acquire(batch.kind, clear - started)
                    for lease in more:
                        blocks[started].lease = lease
                        group.append(blocks[started])
                        started += 1
                if len(group) > 1:
                    self._metrics[batch.kind].slot_wait_s.observe(0.0, len(group) - 1)
                self._start(batch, group)
        finally:
            if started < len(blocks):
                self._skip(batch, blocks, started)
        await self._svc.wait(batch.enqueued)
        return TransferHandle(batch, batch.last_event, self._svc)

    def _skip(self, batch: _Batch, blocks: list[_Block], start: int) -> None:
        """``blocks[start:]`` will never start (the batch was cancelled): unblock whoever waits on
        them, ADMIT_BLOCKS per loop callback, then finish the batch."""
        end = start + ADMIT_BLOCKS
        for block in blocks[start:end]:  # each only once its own hazards cleared: a later load may
            pending = [dep for dep in block.deps if not dep.done()]  # rely on this store waiting
            if pending:  # for the one before
                self._svc.when_all(pending, _bind(self._phase_finished, block))
            else:
                self._phase_finished(block)
            if block.lease is not None:
                self.pool.release_unused(block.lease)
                block.lease = None
            batch.remaining -= 1
            batch.to_enqueue -= 1
            batch.skipped += 1
        if end < len(blocks):
            self._svc.call_soon(self._skip, batch, blocks, end)
        else:
            self._check_batch(batch)

    def _start(self, batch: _Batch, group: list[_Block]) -> None:
        if batch.kind is Kind.LOAD:
            ops = []
            fd, stride, offset = self.file.fd, self.file.stride, self.file.offset
            stored, on_read = self._stored, self._on_read
            for block in group:
                lease = block.lease
                assert lease is not None
                lease.advance(LeaseState.RESERVED)
                d = block.disk_block
                if not stored[d >> 6] >> (d & 63) & 1:  # never stored, or its last store failed: no bytes
                    self._svc.call_soon(on_read, block, -self._invalid.get(d, errno.ENODATA))  # to trust
                    continue
                ops.append(Op(False, fd, lease.addr, stride, offset(block.disk_block), _bind(on_read, block),
                              lease.index))
            if ops:
                self.io.submit(ops)
        else:
            for block in group:
                assert block.lease is not None
                block.lease.advance(LeaseState.RESERVED)
            self._enqueue_copy(batch, group)

    def _enqueue_copy(self, batch: _Batch, group: list[_Block]) -> None:
        # Copy calls of at most ~COPY_CALL_PIECES pieces (one per tensor and block), each with its own
        # event: the driver takes 1-2 µs of CPU per piece, so one call for 32 blocks of 32 layers
        # would hold all 32 slots until the last piece is enqueued and copied; smaller calls hand
        # slots back as they go, and reads and copies overlap instead of taking turns. Staged copies
        # cost one driver copy per block whatever the layer count: a call then takes as many blocks
        # as one kernel launch moves (fewer calls per burst of completions for the submit thread).
        step = self._copy_call_blocks
        for first in range(0, len(group), step):
            chunk = group[first:first + step]
            slot_addrs = [b.lease.addr for b in chunk if b.lease is not None]
            self.copier.copy(batch.kind is Kind.STORE, slot_addrs, [b.gpu_block for b in chunk],
                             _bind(self._on_copied, chunk))
        batch.copied = True
        batch.to_enqueue -= len(group)
        self._check_enqueued(batch)

    # Completion handlers: the only places a submitted lease moves on.
    def _on_read(self, block: _Block, res: int) -> None:
        # The expected sum is taken now, before the hazard lets a later store to this block run.
        expected = self._sums.get(block.disk_block) if self.checksum else None
        self._phase_finished(block)
        assert block.lease is not None
        if res != self.file.stride:
            self._load_failed(block, -res if res < 0 else errno.EIO)
            return
        if expected is not None:  # the lease stays READING while the verifier reads the slot
            block.crc = expected
            self._sum_then(block.lease.addr, _bind(self._on_verified, block))
            return
        self._ready_to_copy(block)

    def _sum_then(self, addr: int, then: Callable[[int | None], None]) -> None:
        """crc32c of one slot on a worker thread; ``then(crc)`` runs on the loop afterwards."""
        if self._sum_pool is None:
            self._sum_pool = ThreadPoolExecutor(2, thread_name_prefix="uring-kv-crc")
        summing = self._sum_pool.submit(_crc32c, addr, self.file.stride)
        summing.add_done_callback(lambda done: self._svc.call_soon_threadsafe(self._summed, done, then))

    def _summed(self, done: Future[int], then: Callable[[int | None], None]) -> None:
        """On the loop: hand on the sum, or None when summing raised (reported; the block must not
        wait for a sum that never comes)."""
        exc = done.exception()
        if exc is not None:
            self._svc.report("uring_kv: summing a slot (checksum=True) failed", exc)
        then(None if exc is not None else done.result())

    def _on_verified(self, block: _Block, crc: int | None) -> None:
        if crc is None:  # could not be summed: the bytes are unverified, not known bad
            self._load_failed(block, errno.EIO)
        elif crc != block.crc:
            self._load_failed(block, errno.EBADMSG)
        else:
            self._ready_to_copy(block)

    def _load_failed(self, block: _Block, code: int) -> None:
        lease, batch = block.lease, block.batch
        assert lease is not None
        batch.failures[block.disk_block] = code
        block.lease = None
        self.pool.release(lease)  # READING → FREE: the kernel (and verifier) are done, no copy was issued
        batch.to_enqueue -= 1
        self._check_enqueued(batch)
        self._batch_block_done(batch)

    def _ready_to_copy(self, block: _Block) -> None:
        lease, batch = block.lease, block.batch
        assert lease is not None
        lease.advance(LeaseState.READING)
        batch.ready.append(block)
        if not batch.ready[1:]:
            self._ready_batches.append(batch)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self._svc.call_soon(self._flush_ready)

    def _flush_ready(self) -> None:
        """One copy call per batch for all reads that completed in this loop iteration."""
        self._flush_scheduled = False
        batches, self._ready_batches = self._ready_batches, []
        for batch in batches:
            group, batch.ready = batch.ready, []
            self._enqueue_copy(batch, group)

    def _on_copied(self, group: list[_Block], error: BaseException | None = None) -> None:
        batch = group[0].batch
        if error is not None:
            self._copy_failed(group, error)
            return
        if batch.kind is Kind.LOAD:
            for block in group:
                assert block.lease is not None
                self.pool.release(block.lease)  # COPYING → FREE: the H2D copy has finished
                block.lease = None
                self._batch_block_done(batch)
            return
        if not self.checksum:
            self._write(group)
            return
        # Sum the staged bytes off the loop; the leases stay COPYING meanwhile (still being read).
        unsummed = [len(group)]

        def summed(block: _Block, crc: int | None) -> None:
            block.crc = crc  # None (summing failed, reported): written unsummed, so never verified
            unsummed[0] -= 1
            if unsummed[0] == 0:
                self._write(group)

        for block in group:
            assert block.lease is not None
            self._sum_then(block.lease.addr, _bind(summed, block))

    def _write(self, group: list[_Block]) -> None:
        ops = []
        fd, stride, offset, on_written = self.file.fd, self.file.stride, self.file.offset, self._on_written
        for block in group:
            lease = block.lease
            assert lease is not None
            lease.advance(LeaseState.COPYING)
            ops.append(Op(True, fd, lease.addr, stride, offset(block.disk_block), _bind(on_written, block),
                          lease.index))
        self.io.submit(ops)

    def _on_written(self, block: _Block, res: int) -> None:
        lease = block.lease
        assert lease is not None
        block.lease = None
        self.pool.release(lease)  # WRITING → FREE: the write CQE says the kernel is done
        d = block.disk_block
        if res != self.file.stride:
            code = -res if res < 0 else errno.EIO
            block.batch.failures[d] = code
            self._unstore(d, code)
        else:
            self._invalid.pop(d, None)
            self._stored[d >> 6] |= 1 << (d & 63)
            if block.crc is not None:
                self._sums[block.disk_block] = block.crc
            else:
                self._sums.pop(block.disk_block, None)  # written unsummed: nothing to verify against
        self._phase_finished(block)
        self._batch_block_done(block.batch)

    def _unstore(self, disk_block: int, code: int) -> None:
        """A store to ``disk_block`` failed with ``code``: its bytes are not to be trusted any more."""
        self._stored[disk_block >> 6] &= ~(1 << (disk_block & 63))
        self._invalid[disk_block] = code
        self._sums.pop(disk_block, None)

    def _phase_finished(self, block: _Block) -> None:
        fut = block.phase_done
        if fut.done():
            return
        fut.set_result(None)
        self._hazards_cleared(block.batch.kind, (block.disk_block,), fut)

    def _hazards_cleared(self, kind: Kind, disk_blocks: Sequence[int], fut: Any) -> None:
        """``fut`` (done) no longer stands for a read (load) or write (store) of each entry of
        ``disk_blocks`` (registered once per entry, so removed once per entry)."""
        if kind is Kind.LOAD:
            reading = self._loads_reading
            for d in disk_blocks:
                readers = reading.get(d)
                if readers is not None:
                    readers.remove(fut)
                    if not readers:
                        del reading[d]
        else:
            last_store = self._last_store
            for d in disk_blocks:
                if last_store.get(d) is fut:
                    del last_store[d]

    def _copy_failed(self, group: list[_Block], error: BaseException) -> None:
        """The copier could not enqueue these copies (it waited for whatever it did enqueue): the
        blocks fail with EIO; a store's disk block keeps no trustworthy bytes."""
        self._svc.report("uring_kv copy failed", error)
        batch = group[0].batch
        for block in group:
            lease = block.lease
            assert lease is not None
            block.lease = None
            batch.failures[block.disk_block] = errno.EIO
            self.pool.release(lease)  # load COPYING / store COPYING → FREE: nothing uses the slot now
            if batch.kind is Kind.STORE:
                self._unstore(block.disk_block, errno.EIO)
                self._phase_finished(block)
            self._batch_block_done(batch)

    def _check_enqueued(self, batch: _Batch) -> None:
        if batch.to_enqueue == 0 and not batch.marking and not batch.enqueued.done():
            if batch.copied:  # one event for the caller, recorded after the batch's last copy
                batch.marking = True
                self.copier.marker(batch.kind is Kind.STORE, _bind(self._marked, batch))
            else:
                batch.enqueued.set_result(None)

    def _marked(self, batch: _Batch, event: Any) -> None:
        batch.last_event = event
        if not batch.enqueued.done():
            batch.enqueued.set_result(event)

    def _batch_block_done(self, batch: _Batch) -> None:
        batch.remaining -= 1
        self._check_batch(batch)

    def _check_batch(self, batch: _Batch) -> None:
        self._check_enqueued(batch)
        if batch.remaining > 0 or batch.done.done():
            return
        self._active.discard(batch)
        stats = self._metrics[batch.kind]
        moved = batch.size - len(batch.failures) - batch.skipped
        stats.batches += 1
        stats.blocks += moved
        stats.bytes += moved * self.block_bytes
        stats.failed_blocks += len(batch.failures)
        stats.cancelled_blocks += batch.skipped
        stats.batch_latency_s.observe(time.monotonic() - batch.created)
        if batch.failures:
            batch.done.set_exception(BlockIOError("load" if batch.kind is Kind.LOAD else "store", batch.failures))
        else:
            batch.done.set_result(None)
        if batch.failures and not batch.done.cancelled():
            batch.done.exception()  # mark retrieved: a cancelled caller may never look at it


def _all_done(futures: list[Any]) -> bool:
    for fut in futures:  # noqa: SIM110 - no generator per block on the hot path
        if not fut.done():
            return False
    return True


def _index_bytes(num_disk_blocks: int) -> int:
    """Memory of the per-disk-block index: two bitmaps (stored; a store's repeat check)."""
    return 2 * 8 * ((num_disk_blocks + 63) // 64)


def _check_disk_size(num_disk_blocks: int, block_bytes: int) -> None:
    """Refuse, naming the argument, a disk the index's memory or a file offset cannot hold. No
    syscall on the filesystem here (this runs on the caller's loop): a file larger than the
    filesystem allows is refused by open(), from its ftruncate."""
    memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if (need := _index_bytes(num_disk_blocks)) > memory // 4:
        raise ValueError(f"num_disk_blocks={num_disk_blocks} needs {need / 2**30:.1f} GiB of index memory "
                         f"(2 bits per block), over a quarter of this machine's {memory / 2**30:.1f} GiB")
    file_bytes = num_disk_blocks * -(-block_bytes // 512) * 512  # at least: blocks pad to >= 512 bytes
    if file_bytes > 2**63 - 1:
        raise ValueError(f"num_disk_blocks={num_disk_blocks}: a file of {file_bytes} bytes is beyond any file "
                         "offset (2**63 - 1)")


def _close_file(file: BlockFile) -> None:
    file.close()


def _crc32c(addr: int, length: int) -> int:
    import crc32c

    view = view_of(addr, length)
    try:
        return int(crc32c.crc32c(view))
    finally:
        view.release()


_bind = functools.partial  # handler(arg, *completion args): a C-level call, no Python frame of its own
