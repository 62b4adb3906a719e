"""Typed wrappers for the compiled module (``ffi``/``lib``, built from ``csrc/``), less its CUDA part.

It owns: ring setup, batched submit and reap, buffer/file/eventfd registration, the statx DIO
alignment query, the C disk-ceiling loop, host block copies, pumps and the native copier. The
CUDA driver's functions are wrapped in ``_cuda.py``, the only other module that touches ``ffi``/
``lib``. Everything else in the package sees typed Python functions. It never decides policy
(which flags, when to fall back): callers do, from the feature values it reports.
"""

from __future__ import annotations

import enum
import os
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from uring_kv._native_c import ffi, lib

_lib: Any = lib

LIBURING_VERSION = (ffi.string(_lib.ukv_liburing_version()).decode()
                    or (f"{_lib.IO_URING_VERSION_MAJOR}.{_lib.IO_URING_VERSION_MINOR}" if _lib.IO_URING_VERSION_MAJOR
                        else "unknown (older than 2.4, no pkg-config file)"))


class Opcode(enum.IntEnum):
    READ = _lib.UKV_OP_READ
    READ_FIXED = _lib.UKV_OP_READ_FIXED
    WRITE = _lib.UKV_OP_WRITE
    WRITE_FIXED = _lib.UKV_OP_WRITE_FIXED
    READV = _lib.UKV_OP_READV
    WRITEV = _lib.UKV_OP_WRITEV
    NOP = _lib.UKV_OP_NOP


class SetupFlag(enum.IntFlag):
    NONE = 0
    SUBMIT_ALL = _lib.IORING_SETUP_SUBMIT_ALL
    COOP_TASKRUN = _lib.IORING_SETUP_COOP_TASKRUN
    SINGLE_ISSUER = _lib.IORING_SETUP_SINGLE_ISSUER
    DEFER_TASKRUN = _lib.IORING_SETUP_DEFER_TASKRUN


class Feature(enum.IntFlag):
    NODROP = _lib.IORING_FEAT_NODROP
    FAST_POLL = _lib.IORING_FEAT_FAST_POLL
    EXT_ARG = _lib.IORING_FEAT_EXT_ARG
    NATIVE_WORKERS = _lib.IORING_FEAT_NATIVE_WORKERS


class SqeFlag(enum.IntFlag):
    NONE = 0
    FIXED_FILE = _lib.IOSQE_FIXED_FILE
    ASYNC = _lib.IOSQE_ASYNC


def os_error(negative_errno: int, what: str = "") -> OSError:
    """The one place a negative kernel result becomes an exception."""
    code = -negative_errno
    message = os.strerror(code)
    return OSError(code, f"{what}: {message}" if what else message)


def _check(ret: int, what: str) -> int:
    if ret < 0:
        raise os_error(ret, what)
    return ret


# One SQE's worth of request: (opcode, sqe_flags, buf_index, fd, addr, len, offset, user_data).
SqeTuple = tuple[int, int, int, int, int, int, int, int]


class NativeRing:
    """One io_uring instance, and the handling of its completions for pumps: :meth:`reap` (the
    CQEs) and :meth:`collect` (the native copier's finished pump jobs) each move the pumps in one
    C call, then run the progress handler of each pump that moved (``report``: where a handler
    that raised, or a failed submission of the pumps' next I/Os, is reported; the other handlers
    still run). Every method must be called on the thread that created it.

    ``thread``: the ring is for the ring thread (csrc/ringthread.c), started with
    :meth:`start_thread`: from then on that C thread reaps the CQ and moves the pumps (and, given
    :meth:`watch_copier`, collects the copier's pump jobs), and :meth:`reap` takes what it left
    for the loop: the completions of other ops and the pumps that moved."""

    def __init__(self, entries: int, cq_entries: int, flags: SetupFlag,
                 report: Callable[[str, BaseException], None], thread: bool = False) -> None:
        out = ffi.new("struct ukv_ring **")
        _check(_lib.ukv_ring_open(entries, cq_entries, int(flags), out), "io_uring_setup")
        self._ring = out[0]
        info = ffi.new("unsigned[3]")
        self.sq_entries = int(_lib.ukv_ring_info(self._ring, info, info + 1, info + 2))
        self.flags = int(info[0])
        self.features = int(info[1])
        self.cq_entries = int(info[2])
        self._reap_cap = 1024
        self._reap_ud = ffi.new("uint64_t[]", self._reap_cap)
        self._reap_res = ffi.new("int32_t[]", self._reap_cap)
        self._touched = ffi.new("int32_t[]", int(_lib.UKV_MAX_PUMPS))
        self._ntouched = ffi.new("unsigned *")
        self._submit_error = ffi.new("int *")
        self._more = ffi.new("int *")
        self._jobs = _JobsOut()  # what collect() takes
        self._reap_budget_ns = 0  # see reap_budget()
        self.pumps: dict[int, NativePump] = {}  # attached pumps by id
        self._report = report
        self.more = False  # the last reap ran out of its budget with completions left
        self.thread = thread  # made for the ring thread
        self.threaded = False  # the ring thread runs

    def close(self) -> None:
        if self._ring != ffi.NULL:
            _lib.ukv_ring_close(self._ring)
            self._ring = ffi.NULL

    @property
    def handle(self) -> Any:
        """The C ring (``struct ukv_ring *``), for the pumps attached to it."""
        return self._ring

    def start_thread(self, notify_fd: int) -> None:
        """Start the ring thread (a ring made with ``thread``); ``notify_fd`` (an eventfd) is
        written when :meth:`reap` has something to take. Once the ring's buffers and files are
        registered: its polls are in flight from now on."""
        _check(_lib.ukv_ring_thread_start(self._ring, notify_fd), "starting the ring thread")
        self.threaded = True

    def watch_copier(self, jobs: CopyJobs) -> None:
        """The ring thread collects the pumps' jobs of ``jobs`` (the loop's collection then sees
        only the others), until ``jobs`` closes."""
        _check(_lib.ukv_ring_watch_copier(self._ring, jobs.handle), "routing the copier's pump jobs")
        jobs.before_close.append(self.unwatch_copier)

    def unwatch_copier(self) -> None:
        if self._ring != ffi.NULL:
            _lib.ukv_ring_unwatch_copier(self._ring)

    def job_fails(self) -> list[tuple[int, int]]:
        """(CUresult, where it failed) of each pump copy job the ring thread found failed since
        the last call (their blocks failed with EIO; the loop reports why)."""
        out = self._jobs  # (its arrays hold CopyJobs.BATCH entries, more than UKV_JOB_FAILS)
        n = _lib.ukv_ring_take_job_fails(self._ring, out.rcs, out.wheres)
        return list(zip(ffi.unpack(out.rcs, n), ffi.unpack(out.wheres, n), strict=True))

    def thread_wakeups(self) -> tuple[int, int]:
        """(the ring thread's wake-ups, how many of them woke the loop)."""
        notifies = ffi.new("uint64_t *")
        wakeups = _lib.ukv_ring_thread_wakeups(self._ring, notifies)
        return int(wakeups), int(notifies[0])

    def attach(self, pump: NativePump, raw: Any) -> int:
        """Attach ``pump`` (whose C pump is ``raw``) under a free id; PumpsBusy when none is left."""
        pump_id = int(_lib.ukv_pump_attach(self._ring, raw))
        if pump_id < 0:
            raise PumpsBusy(f"all {int(_lib.UKV_MAX_PUMPS)} pumps of the ring are in use")
        self.pumps[pump_id] = pump
        return pump_id

    def detach(self, pump_id: int, raw: Any) -> None:
        self.pumps.pop(pump_id, None)
        _lib.ukv_pump_detach(self._ring, raw)

    def register_eventfd(self, fd: int) -> None:
        _check(_lib.ukv_register_eventfd(self._ring, fd), "io_uring_register_eventfd")

    def register_buffers(self, regions: Sequence[tuple[int, int]]) -> None:
        addrs = ffi.new("uint64_t[]", [a for a, _ in regions])
        lens = ffi.new("uint64_t[]", [n for _, n in regions])
        _check(_lib.ukv_register_buffers(self._ring, addrs, lens, len(regions)), "io_uring_register_buffers")

    def unregister_buffers(self) -> None:
        _check(_lib.ukv_unregister_buffers(self._ring), "io_uring_unregister_buffers")

    def register_files(self, fds: Sequence[int]) -> None:
        _check(_lib.ukv_register_files(self._ring, ffi.new("int[]", list(fds)), len(fds)), "io_uring_register_files")

    def iowq_max_workers(self, bounded: int, unbounded: int = 0) -> tuple[int, int]:
        """Cap the ring's io-wq workers (0 keeps a cap as it is); returns the previous caps."""
        values = ffi.new("unsigned[2]", [bounded, unbounded])
        _check(_lib.ukv_iowq_max_workers(self._ring, values, values + 1), "io_uring_register_iowq_max_workers")
        return int(values[0]), int(values[1])

    def unregister_files(self) -> None:
        _check(_lib.ukv_unregister_files(self._ring), "io_uring_unregister_files")

    def submit(self, sqes: Sequence[SqeTuple]) -> None:
        # One struct.pack per op into one buffer that C reads as struct ukv_op[]: much cheaper than
        # setting eight cdata fields per op.
        packed = b"".join([_OP_LAYOUT.pack(*sqe) for sqe in sqes])
        _check(_lib.ukv_submit(self._ring, ffi.from_buffer("struct ukv_op[]", packed), len(sqes)), "io_uring_submit")

    def reap_budget(self, ns: int) -> None:
        """How long one :meth:`reap` may go on refilling pumps whose I/O completes inline (0: one pass)."""
        self._reap_budget_ns = ns

    def pump_depth(self, cap: int, store_aging_s: float, prefetch_cap: int) -> None:
        """At most ``cap`` pump I/Os in flight at once (0: no limit); pumps' slots wait for room, a
        store's whose pump started no I/O for ``store_aging_s`` (0: no aging) before any load's; while
        a demand load's pump runs, prefetches' I/Os start only below ``prefetch_cap`` (0: no cap)."""
        _lib.ukv_ring_pump_depth(self._ring, cap, int(store_aging_s * 1e9), prefetch_cap)

    def pump_io(self) -> tuple[int, int]:
        """(pump I/Os in flight now, the most there ever were at once)."""
        peak = ffi.new("unsigned *")
        now = _lib.ukv_ring_pump_io(self._ring, peak)
        return int(now), int(peak[0])

    def phases(self, reset: bool = False) -> dict[str, Any]:
        """Where the pumps' slots spent their time since the last reset: ``io`` (submitted →
        completed) and ``copy`` (copy due → its job collected: copier pumps only), each
        ``{"count", "mean_us"}``."""
        out = ffi.new("int64_t[4]")
        _lib.ukv_ring_phases(self._ring, int(reset), out)
        return {name: {"count": int(out[i]), "mean_us": round(out[i + 1] / out[i] / 1e3, 1) if out[i] else None}
                for name, i in (("io", 0), ("copy", 2))}

    @property
    def pump_done(self) -> int:
        """Pump I/Os completed so far (their completions handled in C)."""
        return int(_lib.ukv_ring_pump_done(self._ring))

    @property
    def copied_late(self) -> int:
        """Loads' memcpys that reaps did after submitting the refills of the same pass: a parked
        slot took each completion's room first (pumps holding more slots than the ring's cap)."""
        return int(_lib.ukv_ring_copied_late(self._ring))

    def _moved(self, moved: list[NativePump]) -> list[NativePump]:
        """Add the pumps the last C call moved to ``moved`` (a pump twice if two calls moved it),
        and report why submitting their next I/Os failed, if it did (they stay queued)."""
        if self._submit_error[0]:
            self._report("uring_kv could not submit pump refills",
                         os_error(self._submit_error[0], "io_uring_submit (pump refills)"))
        if self._ntouched[0]:
            pumps = self.pumps
            moved.extend(pumps[i] for i in ffi.unpack(self._touched, self._ntouched[0]))
        return moved

    def _progress(self, moved: list[NativePump]) -> None:
        """Run the progress handler of each pump that moved and is still attached (an earlier
        handler may have finished it)."""
        pumps = self.pumps
        for pump in moved:
            if pumps.get(pump.id) is not pump:
                continue
            try:
                pump.on_progress()
            except Exception as exc:  # one bad handler must not stop the others
                self._report("uring_kv pump handler failed", exc)

    def reap(self) -> list[tuple[int, int]]:
        """Every completion the CQ holds now, as (user_data, res), but those of pump ops: those are
        handled in C (see :class:`NativePump`), and the pumps that moved have had their progress
        handlers run when it returns.

        Pump refills that the kernel completes inside their submission (page-cache hits without
        IOSQE_ASYNC) are handled in further passes for up to the reap budget, which also ends a
        pass early (checked after each pump completion: each may have copied a block); ``more``
        is True when the budget ran out with completions left: the caller reaps again on a later
        loop turn (nothing else would wake it for them)."""
        done: list[tuple[int, int]] = []
        moved: list[NativePump] = []
        self.more = False
        while True:
            if self.threaded:  # what the ring thread left: its pumps have moved already
                got = _lib.ukv_ring_take(self._ring, self._reap_ud, self._reap_res, self._reap_cap, self._touched,
                                         self._ntouched, self._submit_error)
            else:
                got = _lib.ukv_reap_pumped(self._ring, self._reap_ud, self._reap_res, self._reap_cap,
                                           self._touched, self._ntouched, self._submit_error, self._reap_budget_ns,
                                           self._more)
            self._moved(moved)
            if got:
                done.extend(zip(ffi.unpack(self._reap_ud, got), ffi.unpack(self._reap_res, got), strict=True))
            if got < self._reap_cap:
                self.more = not self.threaded and bool(self._more[0])
                if moved:
                    self._progress(moved)
                return done

    def collect(self, jobs: CopyJobs) -> list[tuple[int, int, int, int]]:
        """The native copier's finished jobs, as :meth:`CopyJobs.done` returns them, taken in one C
        call that also handles this ring's pumps' jobs among them: their slots move on (the next
        block's I/O or copy, or back to Python), and the pumps that moved have had their progress
        handlers run when it returns."""
        out = self._jobs
        n = _lib.ukv_ring_collect(self._ring, jobs.handle, CopyJobs.BATCH, out.tokens, out.rcs, out.wheres,
                                  out.done_ns, self._touched, self._ntouched, self._submit_error)
        if self._ntouched[0] or self._submit_error[0]:
            self._progress(self._moved([]))
        return out.taken(n)


class PumpsBusy(RuntimeError):
    """Every pump id of the ring is in use (the caller runs the batch the Python way)."""


@dataclass(frozen=True)
class PumpCopies:
    """Where a pump's copies go instead of memcpys in the reap: ``jobs`` (the native copier), at
    most ``blocks`` blocks per job; ``dev_slots`` (CUDA staged copies, else None) is a uint64 C
    array of every pool slot's device staging slot."""

    jobs: CopyJobs
    blocks: int
    dev_slots: Any = None


class NativePump:
    """A batch run in C on ``ring``: see ``struct ukv_pump`` in csrc/pump.c.

    Blocks ``i`` go between file offset ``offsets[i]`` and cache block ``cache_blocks[i]`` of every
    tensor of ``blocks``; ``waiting`` (an int32[3] from :func:`counters`) are the slot pool's waiter
    counts, read by C before it reuses a slot. ``on_progress()`` runs on the ring's thread after
    each reap or collection in which the pump moved (see :class:`NativeRing`). Call on the ring's
    thread only; :meth:`detach` once :attr:`finished`."""

    __slots__ = ("_keep", "_out", "_p", "_r", "_ring", "id", "nblocks", "on_progress")

    def __init__(self, ring: NativeRing, write: bool, fd: int, sqe_flags: int, fixed_buffers: bool,
                 stride: int, blocks: BlockCopier, offsets: Any, cache_blocks: Any, nblocks: int,
                 waiting: Any, max_slots: int, scatter: bool, copies: PumpCopies | None,
                 on_progress: Callable[[], None]) -> None:
        """``offsets`` (uint64) and ``cache_blocks`` (int64) are C arrays of ``nblocks`` entries
        (see :func:`block_array` and :func:`scaled`). ``scatter``: read (write) each block straight
        into (from) its pieces of the cache tensors, an iovec each, instead of through the slot.
        ``copies``: the copies are jobs for the native copier (whose finished jobs must then be
        collected with this ring, see :meth:`CopyJobs.done`)."""
        ntensors, bases, block_bytes, slot_offsets = blocks.c_table()
        copier = copies.jobs.handle if copies is not None else ffi.NULL
        dev_slots = copies.dev_slots if copies is not None and copies.dev_slots is not None else ffi.NULL
        raw = _lib.ukv_pump_new(int(write), fd, sqe_flags, int(fixed_buffers), stride, ntensors, bases, block_bytes,
                                slot_offsets, nblocks, offsets, cache_blocks, waiting, max_slots, int(scatter),
                                copier, dev_slots, copies.blocks if copies is not None else 1)
        if raw == ffi.NULL:
            raise MemoryError("no memory for a pump")
        p = ffi.gc(raw, _lib.ukv_pump_free)
        self._p, self._ring, self.nblocks, self.on_progress = p, ring, nblocks, on_progress
        self._r = ring.handle
        self._out = ffi.new("uint32_t[]", max(5, max_slots))  # state, or slots handed back
        self._keep = (offsets, cache_blocks, blocks, waiting, copies)
        self.id = ring.attach(self, p)  # (-1 once detached)

    # Its state is read under the ring's lock (the ring thread may be moving it): one C call each.
    def _state(self) -> Any:
        _lib.ukv_pump_state(self._r, self._p, self._out)
        return self._out

    @property
    def started(self) -> int:
        return int(self._state()[0])

    @property
    def slots(self) -> int:
        """Slots the pump holds now (each carries a block, or waits for I/O room to start one)."""
        return int(self._state()[1])

    @property
    def unstarted_slots(self) -> int:
        """Slots it holds that wait for I/O room to start their next block (under a depth cap)."""
        return int(self._state()[2])

    @property
    def finished(self) -> bool:
        """Nothing in flight, nothing more will start, and every slot it handed back was taken."""
        state = self._state()
        return not state[1] and not state[4] and bool(state[3] or state[0] >= self.nblocks)

    @property
    def stopped(self) -> bool:
        return bool(self._state()[3])

    def stop(self) -> None:
        """Start no further block (those in flight finish)."""
        _lib.ukv_pump_stop(self._r, self._p)

    def set_class(self, cls: int) -> None:
        """Its class from now on (0 demand load, 1 prefetch, 2 store): which waiters it hands its
        slots to, and its turn for I/O room (see ``klass`` in csrc/ukv.h)."""
        _lib.ukv_pump_set_class(self._r, self._p, int(cls))

    def add_slots(self, slots: Sequence[int], addrs: Sequence[int], buf_indices: Sequence[int]) -> None:
        """Hand the pump more slots, named by their pool index (below ``max_slots``); it starts a
        block in each, or hands it straight back."""
        _check(_lib.ukv_pump_add_slots(self._ring.handle, self._p, len(slots), ffi.new("uint32_t[]", slots),
                                       ffi.new("uint64_t[]", addrs), ffi.new("int32_t[]", buf_indices)),
               "io_uring_submit (pump)")

    def keep_only(self, positions: Sequence[int]) -> None:
        """Before any block started: carry only the blocks at ``positions`` (ascending), which
        become positions 0, 1, ... (of :meth:`failures` too)."""
        p = self._p
        if p.next:
            raise RuntimeError("keep_only() after a block started")
        offsets, cache_blocks = self._keep[0], self._keep[1]
        for new, old in enumerate(positions):
            offsets[new], cache_blocks[new] = offsets[old], cache_blocks[old]
        p.nblocks = self.nblocks = len(positions)

    def take_released(self) -> list[int]:
        """Pool indices of the slots handed back since the last call."""
        n = _lib.ukv_pump_take_released(self._r, self._p, self._out)
        return ffi.unpack(self._out, n) if n else []

    def failures(self) -> list[tuple[int, int]]:
        """(block position, errno) of every block that failed."""
        p = self._p
        return list(zip(ffi.unpack(p.failed, p.nfailed), ffi.unpack(p.fail_errno, p.nfailed), strict=True))

    def detach(self) -> None:
        if self.id >= 0:
            self._ring.detach(self.id, self._p)
            self.id = -1


def block_array(values: list[int] | int) -> Any:
    """``values`` as a C int64 array (TypeError for a non-integer, OverflowError beyond int64);
    given a count, a zeroed array of that many."""
    return ffi.new("int64_t[]", values)


def copy_blocks(array: Any, start: int, piece: Any, n: int) -> None:
    """Copy the ``n`` entries of the C int64 array ``piece`` into ``array`` from ``start`` on."""
    ffi.memmove(array + start, piece, 8 * n)


def check_blocks(array: Any, n: int, limit: int, seen: Any = None) -> int:
    """-1 when the ``n`` entries of ``array`` all lie in [0, limit) and, given ``seen`` (a
    :func:`bitmap` of at least ``limit`` bits), none repeats; else the first position that does not."""
    return int(_lib.ukv_check_blocks(array, n, limit, ffi.NULL if seen is None else seen))


def bitmap(bits: int) -> Any:
    """A zeroed bitmap for :func:`check_blocks`."""
    return ffi.new("uint64_t[]", max(1, (bits + 63) // 64))


def first_unset(array: Any, n: int, bits: Any) -> int:
    """-1 when the bit of each of the ``n`` entries of ``array`` is set in ``bits`` (a
    :func:`bitmap`); else the first position whose bit is clear."""
    return int(_lib.ukv_first_unset(array, n, bits))


def mark(array: Any, n: int, bits: Any, value: bool) -> None:
    """Set (or clear) the bit of each of the ``n`` entries of ``array`` in ``bits``."""
    _lib.ukv_mark(array, n, bits, int(value))


def check_identity(addr: int, rows: int, row_words: int, numbers: Sequence[int], scrub: bool) -> bool:
    """Whether ``rows`` rows of ``row_words`` int64 words at ``addr`` hold the identity pattern of
    keys ``numbers`` (word w of row i: ``numbers[i] << 32 | w``); with ``scrub``, every word set to
    all ones afterwards, in the same pass (csrc/identity.c; the GIL is released)."""
    keys = ffi.new("int64_t[]", list(numbers)) if rows else ffi.NULL
    return bool(_lib.ukv_check_identity(ffi.cast("uint64_t *", addr), rows, row_words, keys, int(scrub)))


def scaled(array: Any, n: int, factor: int) -> Any:
    """A C uint64 array of ``array[i] * factor``."""
    out = ffi.new("uint64_t[]", max(n, 1))
    _lib.ukv_scale(array, n, factor, out)
    return out


def counters(n: int) -> Any:
    """``n`` int32 counters that C code can read (indexable like a list)."""
    return ffi.new("int32_t[]", n)


# struct ukv_op as Python packs it: opcode, sqe_flags, buf_index, fd, addr, len, offset, user_data
_OP_LAYOUT = struct.Struct("=BBHiQI4xQQ")
_OP_OFFSETS = {"fd": 4, "addr": 8, "len": 16, "offset": 24, "user_data": 32}
if _OP_LAYOUT.size != ffi.sizeof("struct ukv_op") or any(
        ffi.offsetof("struct ukv_op", name) != at for name, at in _OP_OFFSETS.items()):  # pragma: no cover
    raise ImportError("struct ukv_op's layout is not the one NativeRing.submit packs")


def dio_alignment(fd: int) -> tuple[int, int] | None:
    """(memory alignment, offset alignment) for O_DIRECT from statx, or None if not reported."""
    mem = ffi.new("uint32_t *")
    off = ffi.new("uint32_t *")
    ret = _check(_lib.ukv_dio_align(fd, mem, off), "statx")
    return (int(mem[0]), int(off[0])) if ret == 1 else None


def ring_loop(
    fd: int, write: bool, depth: int, block_bytes: int, offsets: Sequence[int], buf_addr: int, fixed: bool,
    async_io: bool = False, rows: tuple[BlockCopier, Sequence[int]] | None = None,
) -> int:
    """Run the C ceiling loop; returns elapsed nanoseconds. ``buf_addr`` holds depth × block_bytes;
    ``async_io``: IOSQE_ASYNC on every SQE (the kernel's io-wq workers do the I/O). ``rows``: (the
    caches' table, a cache block per offset): each I/O moves that cache block's rows instead, a readv
    (writev) of one iovec per tensor, as the engine's pumps do (``block_bytes``, ``buf_addr`` and
    ``fixed`` are then unused)."""
    arr = ffi.new("uint64_t[]", list(offsets))
    ntensors, bases, row_bytes, cache = 0, ffi.NULL, ffi.NULL, ffi.NULL
    if rows is not None:
        table, cache_blocks = rows
        if len(cache_blocks) != len(offsets):
            raise ValueError(f"{len(cache_blocks)} cache blocks for {len(offsets)} offsets")
        ntensors, bases, row_bytes, _ = table.c_table()
        block_bytes, buf_addr, fixed = table.bytes_per_block, 0, False
        cache = ffi.new("int64_t[]", list(cache_blocks))
    return _check(
        _lib.ukv_ring_loop(fd, int(write), depth, block_bytes, arr, len(offsets), buf_addr, int(fixed),
                           int(async_io), ntensors, bases, row_bytes, cache),
        "ring ceiling loop",
    )


def fs_store_blocks(tmp_paths: Sequence[str], dest_paths: Sequence[str], addrs: Sequence[int], size: int,
                    o_direct: bool) -> None:
    """vLLM's fs tier's batch store (csrc/fsfiles.c), the GIL released for the whole batch: block i,
    ``size`` bytes at ``addrs[i]``, written to ``tmp_paths[i]`` and renamed to ``dest_paths[i]``
    unless that exists. OSError naming the first block's file that failed."""
    _fs_blocks(True, dest_paths, addrs, size, o_direct, tmp_paths)


def fs_load_blocks(paths: Sequence[str], addrs: Sequence[int], size: int, o_direct: bool) -> None:
    """vLLM's fs tier's batch load (csrc/fsfiles.c), the GIL released for the whole batch: file
    ``paths[i]`` read whole into ``size`` bytes at ``addrs[i]``. OSError naming the first file that
    failed (a short read removes the file, as vLLM's does)."""
    _fs_blocks(False, paths, addrs, size, o_direct)


def _fs_blocks(store: bool, paths: Sequence[str], addrs: Sequence[int], size: int, o_direct: bool,
               tmp_paths: Sequence[str] = ()) -> None:
    names = [ffi.new("char[]", os.fsencode(path)) for path in paths]  # alive until the call returns
    path_array = ffi.new("const char *[]", names)
    bufs = ffi.new("uint64_t[]", list(addrs))
    err = ffi.new("int *")
    if store:
        tmp_names = [ffi.new("char[]", os.fsencode(path)) for path in tmp_paths]
        done = _lib.ukv_fs_store_blocks(ffi.new("const char *[]", tmp_names), path_array, bufs, len(names), size,
                                        int(o_direct), err)
    else:
        done = _lib.ukv_fs_load_blocks(path_array, bufs, len(names), size, int(o_direct), err)
    if err[0]:
        raise OSError(err[0], os.strerror(err[0]), paths[done])


# Blocks one launch of the staged CUDA path's kernel moves (csrc/ukv.h; _cuda.py's kernel source and
# the engine's copy calls are sized by it).
STAGED_MAX = int(_lib.UKV_STAGED_MAX)


class BlockCopier:
    """Moves whole blocks between staging slots and every cache tensor, many blocks per C call: with
    memcpy here (:meth:`host`); its C table also serves pumps, the native copier and the CUDA
    copies (``_cuda.py``).

    ``bases[t]`` is tensor t's data pointer, ``block_bytes[t]`` its bytes per block and
    ``slot_offsets[t]`` where its part sits inside a slot. The caller keeps the tensors alive.
    """

    def __init__(self, bases: Sequence[int], block_bytes: Sequence[int], slot_offsets: Sequence[int]) -> None:
        self._n = len(bases)
        self.table = [(int(a), int(n), int(o)) for a, n, o in zip(bases, block_bytes, slot_offsets, strict=True)]
        self._bases = ffi.new("uint64_t[]", list(bases))
        self._block_bytes = ffi.new("uint64_t[]", list(block_bytes))
        self._slot_offsets = ffi.new("uint64_t[]", list(slot_offsets))
        self.bytes_per_block = sum(int(n) for n in block_bytes)

    def c_table(self) -> tuple[int, Any, Any, Any]:
        """(tensor count, bases, bytes per block, slot offsets) as C arrays, for the C side."""
        return self._n, self._bases, self._block_bytes, self._slot_offsets

    def host(self, to_slot: bool, slot_addrs: Sequence[int], gpu_blocks: Sequence[int]) -> None:
        """Copy with memcpy on the calling thread (the GIL is released meanwhile)."""
        _lib.ukv_host_copy(
            self._n, self._bases, self._block_bytes, self._slot_offsets, int(to_slot), len(slot_addrs),
            ffi.new("uint64_t[]", list(slot_addrs)), ffi.new("int64_t[]", list(gpu_blocks)),
        )


class CopyJobs:
    """The native copier (``csrc/copier.c``): one submit thread per direction running copy jobs, and in
    CUDA mode a bridge thread waiting for their events, all in C. Finished jobs are collected on
    the loop with :meth:`done` when :attr:`fd` (an eventfd) is readable.

    ``cuda`` is ``(ctx, kernel function, tensor table, used bytes, h2d stream, d2h stream)`` for
    staged CUDA copies, or None for host memcpys. ``delay`` holds every copy back (tests): in host
    mode nanoseconds of sleep, in CUDA mode GPU clock cycles of ``spin_func`` before the copies."""

    BATCH = 256

    def __init__(self, blocks: BlockCopier, cuda: tuple[int, int, int, int, int, int] | None,
                 delay: int = 0, spin_func: int = 0) -> None:
        out = ffi.new("struct ukv_copier **")
        n, bases, block_bytes, slot_offsets = blocks.c_table()
        ctx, func, table, used, h2d, d2h = cuda if cuda is not None else (0, 0, 0, 0, 0, 0)
        rc = _lib.ukv_copier_new(int(cuda is not None), n, bases, block_bytes, slot_offsets, ctx, func, table,
                                 used, h2d, d2h, delay, spin_func, out)
        if rc:
            raise OSError(-rc, f"starting the native copier: {os.strerror(-rc)}")
        self._c: Any = out[0]
        self.fd = int(_lib.ukv_copier_fd(self._c))
        self._out = _JobsOut()
        self.before_close: list[Callable[[], None]] = []  # run before it is freed (a ring thread lets go)

    def put(self, token: int, to_slot: bool, slot_addrs: Sequence[int], gpu_blocks: Sequence[int],
            dev_slots: Sequence[int] | None = None, event: int = 0) -> None:
        """Queue a copy of these blocks (``event`` recorded after it, CUDA mode)."""
        self._put("a copy", token, _lib.UKV_JOB_COPY, to_slot, len(slot_addrs), ffi.new("uint64_t[]", slot_addrs),
                  ffi.new("uint64_t[]", dev_slots) if dev_slots is not None else ffi.NULL,
                  ffi.new("int64_t[]", gpu_blocks), event)

    def mark(self, token: int, to_slot: bool) -> None:
        """Queue a marker: done once every copy queued before it in this direction is enqueued
        on its stream (CUDA) or finished (host)."""
        self._put("a marker", token, _lib.UKV_JOB_MARK, to_slot, 0, ffi.NULL, ffi.NULL, ffi.NULL, 0)

    def _put(self, what: str, token: int, kind: int, to_slot: bool, n: int, slot_addrs: Any, dev_slots: Any,
             gpu_blocks: Any, event: int) -> None:
        if self._c is None:
            raise RuntimeError("uring_kv: the native copier is closed")
        rc = _lib.ukv_copier_put(self._c, token, kind, int(to_slot), n, slot_addrs, dev_slots, gpu_blocks, event)
        if rc:
            raise OSError(-rc, f"queueing {what}: {os.strerror(-rc)}")

    def poll(self, ns: int) -> None:
        """Its threads poll for up to ``ns`` before they sleep: a submit thread for its next job,
        the bridge (CUDA) for the oldest event to fire."""
        _lib.ukv_copier_poll(self.handle, ns)

    def fail_next(self, rc: int, where: int) -> None:
        """Fault injection (tests): the next copy job runs, then is reported failed with ``rc``."""
        _lib.ukv_copier_fail_next(self._c, rc, where)

    @property
    def handle(self) -> Any:
        if self._c is None:
            raise RuntimeError("uring_kv: the native copier is closed")
        return self._c

    @property
    def pump_jobs(self) -> int:
        """Pumps' copy jobs (owned jobs) queued and not yet collected."""
        return int(_lib.ukv_copier_owned_jobs(self._c)) if self._c is not None else 0

    def phases(self, reset: bool = False) -> dict[str, Any]:
        """The copy jobs' phases since the last reset, per direction (``load``: to the caches,
        ``store``: to the slots): ``jobs``, ``blocks`` and the mean µs per job ``queued`` (put →
        taken by its submit thread), ``enqueue`` (the driver calls, or host memcpys), ``run``
        (enqueued → seen done: the GPU and the bridge), ``handover`` (done → taken by the loop or
        the ring thread)."""
        if self._c is None:
            return {}
        out = ffi.new("int64_t[]", _lib.UKV_PHASES)
        _lib.ukv_copier_phases(self._c, int(reset), out)
        result: dict[str, Any] = {}
        for d, name in ((0, "load"), (1, "store")):
            jobs = int(out[6 * d])
            result[name] = {"jobs": jobs, "blocks": int(out[6 * d + 1]), **{
                phase: round(out[6 * d + i] / jobs / 1e3, 1) if jobs else None
                for i, phase in ((2, "queued_us"), (3, "enqueue_us"), (4, "run_us"), (5, "handover_us"))}}
        return result

    def done(self) -> list[tuple[int, int, int, int]]:
        """Finished jobs, oldest first: (token, CUresult or 0, where it failed, CLOCK_MONOTONIC ns).
        With pumps' jobs among them (``token & PUMP_TAG``), collect with their ring instead
        (:meth:`NativeRing.collect`)."""
        out = self._out
        return out.taken(_lib.ukv_copier_done(self._c, self.BATCH, out.tokens, out.rcs, out.wheres, out.done_ns))

    def close(self) -> None:
        """Run what is queued, wait for every recorded event, stop the threads, free (blocking)."""
        if self._c is not None:
            for let_go in self.before_close:
                let_go()
            self.before_close.clear()
            _lib.ukv_copier_free(self._c)
            self._c = None


class _JobsOut:
    """C arrays that a collection of finished copy jobs fills: BATCH jobs at most per call."""

    __slots__ = ("done_ns", "rcs", "tokens", "wheres")

    def __init__(self) -> None:
        self.tokens = ffi.new("uint64_t[]", CopyJobs.BATCH)
        self.rcs = ffi.new("int32_t[]", CopyJobs.BATCH)
        self.wheres = ffi.new("int32_t[]", CopyJobs.BATCH)
        self.done_ns = ffi.new("int64_t[]", CopyJobs.BATCH)

    def taken(self, n: int) -> list[tuple[int, int, int, int]]:
        """The first ``n`` jobs: (token, CUresult or 0, where it failed, CLOCK_MONOTONIC ns)."""
        tokens, rcs, wheres, done_ns = self.tokens, self.rcs, self.wheres, self.done_ns
        return [(int(tokens[i]), int(rcs[i]), int(wheres[i]), int(done_ns[i])) for i in range(n)]


PUMP_TAG = int(_lib.UKV_PUMP_TAG)  # the tag bit of pumps' user_data and copy job tokens
FAIL_ENQUEUE = int(_lib.UKV_FAIL_ENQUEUE)
FAIL_WAIT = int(_lib.UKV_FAIL_WAIT)
# NativeRing.job_fails reads into _JobsOut's arrays
if int(_lib.UKV_JOB_FAILS) > CopyJobs.BATCH:  # pragma: no cover
    raise ImportError("CopyJobs.BATCH is below UKV_JOB_FAILS")
