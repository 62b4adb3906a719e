"""The I/O backends: the same suite over the io_uring ring and the thread-pool fallback."""

from __future__ import annotations

import errno
import functools
import gc
import os
import threading
import weakref
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import anyio
import pytest
from aio import gather, settle, task_group
from conftest import BOTH_BACKENDS, reported_errors

from uring_kv import Tuning, UringUnavailable
from uring_kv._io import IOBackend, Op, ThreadBackend, UringBackend, open_backend
from uring_kv._memory import HostBuffer
from uring_kv._native import Opcode, SetupFlag, SqeFlag


@pytest.fixture(params=BOTH_BACKENDS)
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def data_file(tmp_path: Path) -> Iterator[int]:
    fd = os.open(tmp_path / "data.bin", os.O_RDWR | os.O_CREAT, 0o600)
    yield fd
    os.close(fd)


def pattern(seed: int, length: int) -> bytes:
    return bytes(((seed * 131 + i * 7) ^ (i >> 8)) & 0xFF for i in range(length))


async def submit_all(io: IOBackend, ops: list[Op]) -> None:
    io.submit(ops)
    await io.drain()


@pytest.mark.parametrize("fixed", [False, True], ids=["plain", "fixed"])
@pytest.mark.parametrize(("count", "size"), [(300, 4096), (199, int(1.3 * 4096)), (7, 1)])
async def test_many_writes_then_reads_in_flight(backend: IOBackend, data_file: int, fixed: bool,
                                                count: int, size: int) -> None:
    buf = HostBuffer(count * size * 2)
    registered = backend.register_buffers([(buf.addr, buf.size)]) if fixed else False
    index = 0 if registered else -1
    results: dict[int, int] = {}
    for i in range(count):
        buf.view[i * size:(i + 1) * size] = pattern(i, size)
    writes = [Op(True, data_file, buf.addr + i * size, size, (count - 1 - i) * size,
                 functools.partial(results.__setitem__, i), index) for i in range(count)]
    await submit_all(backend, writes)
    assert results == {i: size for i in range(count)}
    results.clear()
    base = count * size
    reads = [Op(False, data_file, buf.addr + base + i * size, size, (count - 1 - i) * size,
                functools.partial(results.__setitem__, i), index) for i in range(count)]
    await submit_all(backend, reads)
    assert results == {i: size for i in range(count)}
    for i in range(count):
        assert buf.view[base + i * size: base + (i + 1) * size] == pattern(i, size), f"read {i} wrong bytes"
    assert backend.inflight == 0
    buf.close()


async def test_slot_numbers_past_16_bits_pass_when_buffers_are_not_registered(backend: IOBackend,
                                                                                data_file: int) -> None:
    """An engine's ops carry their slot's index, which names a registered buffer only when the
    slots are registered (the kernel takes at most 16384). With more slots than an SQE's 16-bit
    buffer field holds, and none registered, the ops still complete (once, slot 65536 broke the
    submission: the ops were never sent, and the batch, its cancellation and aclose() hung)."""
    size, count = 4096, 3
    buf = HostBuffer(2 * count * size)
    done: dict[tuple[bool, int], int] = {}
    with anyio.fail_after(10):
        for write, base in ((True, 0), (False, count * size)):
            if write:
                for i in range(count):
                    buf.view[i * size:(i + 1) * size] = pattern(i, size)
            await submit_all(backend, [Op(write, data_file, buf.addr + base + i * size, size, i * size,
                                          functools.partial(done.__setitem__, (write, i)), (1 << 16) + i)
                                       for i in range(count)])
    assert done == {(write, i): size for write in (True, False) for i in range(count)}
    assert all(buf.view[(count + i) * size:(count + i + 1) * size] == pattern(i, size) for i in range(count))
    buf.close()


async def test_short_read_raises_with_offset(backend: IOBackend, data_file: int) -> None:
    os.pwrite(data_file, b"x" * 6000, 0)
    buf = HostBuffer(8192)
    with pytest.raises(OSError, match=r"at offset 4096: short transfer \(1904 of 4096") as info:
        await backend.transfer(False, data_file, buf.addr, 4096, 4096)
    assert info.value.errno == errno.EIO
    buf.close()


async def test_bad_fd_raises_ebadf(backend: IOBackend) -> None:
    buf = HostBuffer(4096)
    fd = os.open("/dev/null", os.O_RDONLY)
    os.close(fd)  # now certainly not open
    with pytest.raises(OSError) as info:
        await backend.transfer(False, fd, buf.addr, 4096, 0)
    assert info.value.errno == errno.EBADF
    buf.close()


async def test_write_to_read_only_fd_raises(backend: IOBackend, tmp_path: Path) -> None:
    (tmp_path / "ro").write_bytes(b"\0" * 4096)
    fd = os.open(tmp_path / "ro", os.O_RDONLY)
    buf = HostBuffer(4096)
    with pytest.raises(OSError) as info:
        await backend.transfer(True, fd, buf.addr, 4096, 0)
    assert info.value.errno == errno.EBADF
    os.close(fd)
    buf.close()


async def test_ring_drains_many_cqes_per_wakeup(data_file: int) -> None:
    ring = UringBackend()
    os.pwrite(data_file, b"y" * 4096 * 256, 0)
    buf = HostBuffer(4096 * 256)
    done: list[int] = []
    ring.submit([Op(False, data_file, buf.addr + i * 4096, 4096, i * 4096, done.append) for i in range(256)])
    await ring.drain()
    assert done == [4096] * 256
    assert ring.wakeups < 256 // 4, f"{ring.wakeups} eventfd wake-ups for 256 CQEs: the CQ is not drained per tick"
    ring.close()
    buf.close()


async def test_a_reap_scheduled_for_a_later_turn_is_harmless_after_close() -> None:
    """A reap that ran out of its budget schedules another for the next loop turn; if the ring is
    closed in between, that reap must do nothing (the ring's memory is gone). Mutation tried: no
    check in the scheduled reap (it read the closed eventfd: EBADF, reported by the loop)."""
    with reported_errors() as errors:
        ring = UringBackend()
        ring._reap_again = True
        ring._svc.call_soon(ring._reap_later)  # as _on_wakeup does when the reap reports `more`
        ring.close()
        await settle()
    assert not ring._reap_again, "the scheduled reap did not run"
    assert not errors, f"the scheduled reap failed after close: {errors}"


async def test_completions_per_callback_caps_each_callback(data_file: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """URING_KV_COMPLETIONS_PER_CALLBACK=4: no loop callback runs more than 4 completion handlers,
    and every op still completes exactly once."""
    monkeypatch.setenv("URING_KV_COMPLETIONS_PER_CALLBACK", "4")
    ring = UringBackend(tuning=Tuning.from_env())
    os.pwrite(data_file, b"w" * 4096 * 64, 0)
    buf = HostBuffer(4096 * 64)
    per_callback: list[int] = []
    done: list[int] = []
    real_run = ring._run_completions

    def counting_run() -> None:
        before = len(done)
        real_run()
        per_callback.append(len(done) - before)

    monkeypatch.setattr(ring, "_run_completions", counting_run)
    ring.submit([Op(False, data_file, buf.addr + i * 4096, 4096, i * 4096, done.append) for i in range(64)])
    await ring.drain()
    assert done == [4096] * 64
    assert max(per_callback) == 4 and sum(per_callback) == 64
    ring.close()
    buf.close()
    for bad in ("-1", "all"):
        monkeypatch.setenv("URING_KV_COMPLETIONS_PER_CALLBACK", bad)
        with pytest.raises(ValueError, match=f"must be a count >= 0, got '{bad}'"):
            UringBackend(tuning=Tuning.from_env())


async def test_ring_caps_inflight_at_cq_size_and_backlogs_the_rest(data_file: int) -> None:
    ring = UringBackend(entries=8)
    os.pwrite(data_file, b"z" * 512 * 100, 0)
    buf = HostBuffer(512 * 100)
    done: list[int] = []
    ring.submit([Op(False, data_file, buf.addr + i * 512, 512, i * 512, done.append) for i in range(100)])
    assert len(ring._pending) <= 32  # cq_entries = 4 × 8
    await ring.drain()
    assert done == [512] * 100
    ring.close()
    buf.close()


async def test_cancelled_awaiter_leaves_read_owned_until_its_cqe(backend: IOBackend, data_file: int,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Cancelling the task awaiting a read must not end the read: the buffer stays with the op until
    the completion arrives, and the completion is still consumed (in-flight count back to 0)."""
    gate = threading.Event()
    buf = HostBuffer(4096)
    if isinstance(backend, UringBackend):
        read_fd, write_fd = os.pipe()  # a pipe read stays in flight until we write
        offset = 0
    else:
        real_preadv = os.preadv

        def gated_preadv(fd: int, buffers: Any, off: int) -> int:
            gate.wait(10)
            return real_preadv(fd, buffers, off)

        monkeypatch.setattr(os, "preadv", gated_preadv)
        os.pwrite(data_file, b"late" * 1024, 0)
        read_fd, write_fd, offset = data_file, -1, 0

    class Keep:
        pass

    keep = Keep()
    alive = weakref.ref(keep)
    async with task_group() as tasks:
        task = tasks.spawn(backend.transfer, False, read_fd, buf.addr, 4096, offset, -1, keep)
        await anyio.sleep(0.05)
        del keep
        assert backend.inflight == 1
        task.cancel()
        await task.join()
        assert task.cancelled
    await anyio.sleep(0.05)
    assert backend.inflight == 1, "the op must stay in flight after its awaiter is cancelled"
    assert alive() is not None, "the op's buffer owner was dropped before its completion"
    if write_fd >= 0:
        os.write(write_fd, b"late" * 1024)
    gate.set()
    await backend.drain()
    assert backend.inflight == 0, "the completion was not consumed"
    await anyio.sleep(0.05)  # a pool worker may still be returning from the op's frame
    gc.collect()
    assert alive() is None
    assert bytes(buf.view[:8]) == b"latelate", "the read landed in the buffer after the cancellation"
    if write_fd >= 0:
        os.close(read_fd)
        os.close(write_fd)
    buf.close()


async def test_flag_ladder_falls_back_on_einval() -> None:
    impossible = SetupFlag.DEFER_TASKRUN  # DEFER_TASKRUN without SINGLE_ISSUER is always EINVAL
    ring = UringBackend(flags=(impossible, SetupFlag.NONE))
    assert ring.setup_flags & SetupFlag.DEFER_TASKRUN == 0
    assert "none" in ring.description
    ring.close()


async def test_default_ring_reports_its_flags() -> None:
    ring = UringBackend()
    assert ring.description.startswith("io_uring (")
    assert "SUBMIT_ALL" in ring.description
    ring.close()


async def test_async_flag_is_reported_and_reads_still_work(data_file: int) -> None:
    ring = UringBackend(async_io=True)
    assert "IOSQE_ASYNC" in ring.description
    os.pwrite(data_file, b"q" * 4096, 0)
    buf = HostBuffer(4096)
    assert await ring.transfer(False, data_file, buf.addr, 4096, 0) == 4096
    assert bytes(buf.view[:4]) == b"qqqq"
    ring.close()
    buf.close()


@pytest.mark.parametrize("async_writes", [None, False])
async def test_writes_can_go_without_the_async_flag(data_file: int, async_writes: bool | None) -> None:
    """``async_writes=False``: read SQEs carry IOSQE_ASYNC, write SQEs do not (buffered writes
    handed to io-wq cost ~9x the CPU on the H200); the description says which. Default: both."""
    ring = UringBackend(async_io=True, async_writes=async_writes)
    sent: list[tuple[int, int]] = []  # (opcode, sqe flags)
    submit = ring._ring.submit

    def spy(sqes: Sequence[tuple[int, int, int, int, int, int, int, int]]) -> None:
        sent.extend((sqe[0], sqe[1]) for sqe in sqes)
        submit(sqes)

    ring._ring.submit = spy  # type: ignore[method-assign]
    buf = HostBuffer(4096)
    buf.view[:] = b"z" * 4096
    try:
        assert await ring.transfer(True, data_file, buf.addr, 4096, 0) == 4096
        buf.view[:] = b"-" * 4096
        assert await ring.transfer(False, data_file, buf.addr, 4096, 0) == 4096
        assert bytes(buf.view) == b"z" * 4096
    finally:
        ring.close()
        buf.close()
    reads = {flags & SqeFlag.ASYNC for opcode, flags in sent if opcode in (Opcode.READ, Opcode.READ_FIXED)}
    writes = {flags & SqeFlag.ASYNC for opcode, flags in sent if opcode in (Opcode.WRITE, Opcode.WRITE_FIXED)}
    assert reads == {SqeFlag.ASYNC}
    assert writes == ({0} if async_writes is False else {SqeFlag.ASYNC})
    assert ring.description.endswith("IOSQE_ASYNC on reads)" if async_writes is False else "IOSQE_ASYNC)")


async def test_iowq_worker_cap_is_set_from_the_environment(data_file: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """URING_KV_IOWQ_WORKERS caps the io-wq workers (read back from the kernel) and is reported;
    IOSQE_ASYNC reads still work under the cap. (The kernel keeps one io-wq per thread, shared by
    its rings: the test puts the thread's cap back.)"""
    probe = UringBackend()
    before = probe._ring.iowq_max_workers(0)[0]
    assert "io-wq" not in probe.description
    probe.close()
    monkeypatch.setenv("URING_KV_IOWQ_WORKERS", str(before + 3))
    ring = UringBackend(async_io=True, tuning=Tuning.from_env())
    try:
        assert ring._ring.iowq_max_workers(0)[0] == before + 3
        assert f"io-wq <= {before + 3}" in ring.description
        os.pwrite(data_file, b"w" * 8192, 0)
        buf = HostBuffer(8192)
        assert await task_group_transfers(ring, data_file, buf.addr) == [4096, 4096]
        assert bytes(buf.view) == b"w" * 8192
        buf.close()
    finally:
        ring._ring.iowq_max_workers(before)
        ring.close()


async def task_group_transfers(ring: UringBackend, fd: int, addr: int) -> list[int]:
    got: list[int] = []

    async def one(offset: int) -> None:
        got.append(await ring.transfer(False, fd, addr + offset, 4096, offset))

    async with task_group() as tasks:
        tasks.spawn(one, 0)
        tasks.spawn(one, 4096)
    return got


def _refuse_setup(errno_value: int) -> Any:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise OSError(errno_value, os.strerror(errno_value))
    return refuse


@pytest.mark.parametrize(("code", "hint"), [(errno.EPERM, "seccomp"), (errno.ENOSYS, "gVisor")])
async def test_setup_refused_falls_back_to_threads_with_one_warning(monkeypatch: pytest.MonkeyPatch,
                                                                     code: int, hint: str) -> None:
    monkeypatch.setattr("uring_kv._io.uring.NativeRing", _refuse_setup(code))
    monkeypatch.delenv("URING_KV_IO", raising=False)
    with pytest.warns(RuntimeWarning, match=hint) as record:
        io = open_backend()
    assert len(record) == 1
    assert isinstance(io, ThreadBackend)
    assert errno.errorcode[code] in io.description
    io.close()


async def test_forced_uring_raises_instead_of_falling_back(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("uring_kv._io.uring.NativeRing", _refuse_setup(errno.EPERM))
    monkeypatch.setenv("URING_KV_IO", "uring")
    with pytest.raises(UringUnavailable, match="EPERM"):
        open_backend(Tuning.from_env().io)


async def test_env_forces_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("URING_KV_IO", "threads")
    io = open_backend(Tuning.from_env().io)
    assert isinstance(io, ThreadBackend)
    assert "io='threads'" in io.description
    io.close()


async def test_unknown_io_mode_is_rejected() -> None:
    with pytest.raises(ValueError, match="'auto', 'uring' or 'threads'"):
        open_backend("fast")


async def test_close_refuses_while_ops_are_in_flight() -> None:
    ring = UringBackend()
    read_fd, write_fd = os.pipe()
    buf = HostBuffer(4096)
    ring.submit([Op(False, read_fd, buf.addr, 4, 0, lambda res: None)])
    with pytest.raises(RuntimeError, match="in flight"):
        ring.close()
    os.write(write_fd, b"done")
    await ring.drain()
    ring.close()
    assert bytes(buf.view[:4]) == b"done"
    os.close(read_fd)
    os.close(write_fd)
    buf.close()


async def test_a_failing_handler_is_reported_and_the_others_still_run(backend: IOBackend, data_file: int) -> None:
    """One completion handler raising must neither lose the other completions of the same wake-up
    nor leave the op counted in flight; the error reaches the loop's handler (asyncio) or the
    ``uring_kv`` log (trio)."""
    buf = HostBuffer(8 * 4096)
    done: list[int] = []

    def bad(res: int) -> None:
        raise ValueError("handler bug")

    ops = [Op(True, data_file, buf.addr + i * 4096, 4096, i * 4096, bad if i == 3 else done.append)
           for i in range(8)]
    with reported_errors() as errors:
        await submit_all(backend, ops)
        await anyio.sleep(0.01)
    assert done == [4096] * 7
    assert backend.inflight == 0
    assert len(errors) == 1 and "completion handler failed" in str(errors[0])
    buf.close()


async def test_a_thread_pool_worker_outlives_an_op_that_raises_and_a_closed_pool_refuses_ops(
        data_file: int) -> None:
    """An op whose call raises something other than OSError fails with EIO (reported on the loop)
    and every worker stays: more ops than workers still complete. After close(), submit() raises
    instead of queueing ops that no worker would run."""
    io = ThreadBackend(workers=2)
    buf = HostBuffer(4096)
    os.pwrite(data_file, b"x" * 4096, 0)
    try:
        with reported_errors() as reported:
            with pytest.raises(OSError) as failed:
                await io.transfer(False, data_file, buf.addr, 4096, 1 << 64)  # an offset preadv cannot take
            await settle()
        assert failed.value.errno == errno.EIO and reported
        for _ in range(2):  # every worker still takes ops
            calls = [(io.transfer, (False, data_file, buf.addr, 4096, 0)) for _ in range(4)]
            assert await gather(*calls) == [4096] * 4
    finally:
        io.close()
        buf.close()
    with pytest.raises(RuntimeError, match="closed"):
        io.submit([Op(False, data_file, buf.addr, 4096, 0, lambda res: None)])
