"""An engine's life from the caller's side: opening and closing raced against each other and
against transfers, engines dropped without closing, calls from the wrong thread, the file's
lifetime (unnamed: nothing survives the process, even SIGKILL), sizes refused up front, blocks
never stored, and cache layouts whose blocks are not what ``stride(0)`` says."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import gc
import os
import signal
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
from aio import settle, task_group
from conftest import BOTH_BACKENDS, EngineFactory

from uring_kv import BlockIOError, Engine
from uring_kv.testing import fill, id_caches, identify, store_identity


@pytest.fixture(params=BOTH_BACKENDS)
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


async def test_concurrent_acloses_each_return_only_once_closed(make_engine: EngineFactory) -> None:
    """Two aclose() while a slow store is in flight: neither returns before the engine is closed
    (the second used to return at once, the engine still open)."""
    caches = id_caches("cpu", blocks=8)
    engine = make_engine(caches, 8, num_slots=1, copy_delay=0.01)
    await engine.open()
    for gpu_block in range(8):
        fill(caches, gpu_block, gpu_block, 1)
    seen: list[bool] = []

    async def close() -> None:
        await engine.aclose()
        seen.append(engine.closed and engine.file.closed)

    async with task_group() as tasks:
        store = tasks.spawn(engine.store_batch, list(range(8)), list(range(8)))
        await settle()
        first, second = tasks.spawn(close), tasks.spawn(close)
        await first.join()
        await second.join()
        await store.join()
    assert seen == [True, True]
    assert engine.metrics()["store"]["blocks"] == 8


async def test_aclose_during_open_waits_for_it_then_closes(make_engine: EngineFactory) -> None:
    """aclose() called while open() creates the file: no error from either, and the engine ends
    closed (it used to raise AttributeError, then open() left the engine open)."""
    engine = make_engine(id_caches("cpu", blocks=2), 2, num_slots=1)
    async with task_group() as tasks:
        opening = tasks.spawn(engine.open)
        while engine._state == "new":
            await anyio.sleep(0)
        assert engine._state == "opening"
        await engine.aclose()
        assert engine.closed and engine.file.closed
        await opening.join()
    assert engine.closed


def test_aclose_in_a_later_event_loop_frees_everything(tmp_path: Path) -> None:
    """Opened in one asyncio.run, closed in another (the first loop is gone, nothing in flight):
    aclose() frees the engine instead of failing and leaving it half-closed."""
    engine = Engine(id_caches("cpu", blocks=4), tmp_path / "kv.bin", 4, num_slots=1)

    async def open_and_store() -> None:
        await engine.open()
        await store_identity(engine, id_caches("cpu", blocks=4), 2)

    asyncio.run(open_and_store())
    asyncio.run(engine.aclose())
    assert engine.closed and engine.file.closed and engine.pool.held == 0
    assert not engine.bridge.alive
    assert os.listdir(tmp_path) == []
    asyncio.run(engine.aclose())  # again: nothing to do


async def test_aclose_from_another_running_loop_is_refused(make_engine: EngineFactory) -> None:
    engine = make_engine(id_caches("cpu", blocks=4), 4, num_slots=1)
    await engine.open()
    failure: list[BaseException] = []

    def other_thread() -> None:
        try:
            asyncio.run(engine.aclose())
        except BaseException as exc:
            failure.append(exc)

    await anyio.to_thread.run_sync(other_thread)
    assert len(failure) == 1 and isinstance(failure[0], RuntimeError)
    assert "outside the event loop" in str(failure[0])
    assert not engine.closed


@pytest.mark.parametrize("call", ["load", "store"])
async def test_a_call_from_another_thread_takes_nothing_and_changes_nothing(make_engine: EngineFactory,
                                                                           call: str) -> None:
    """With one slot, a call from a thread running its own loop is refused before it takes the
    slot: the owner's next call and aclose() still go, and the refused call moved no bytes."""
    caches = id_caches("cpu", blocks=8)
    engine = make_engine(caches, 8, num_slots=1)
    await engine.open()
    await store_identity(engine, caches, 4)
    snapshot = {name: t.clone() for name, t in caches.items()}
    failure: list[BaseException] = []

    def other_thread() -> None:
        try:
            if call == "load":
                asyncio.run(engine.load_batch([0, 1], [6, 7]))
            else:
                asyncio.run(engine.store_batch([2, 3], [0, 1]))
        except BaseException as exc:
            failure.append(exc)

    await anyio.to_thread.run_sync(other_thread)
    assert len(failure) == 1 and isinstance(failure[0], RuntimeError), failure
    assert "outside the event loop" in str(failure[0])
    assert engine.pool.held == 0 and engine.stats()["active_batches"] == 0
    await anyio.sleep(0.05)  # time for any I/O a refused call might still have started
    assert all(torch.equal(caches[name], snapshot[name]) for name in caches)
    with anyio.fail_after(10):
        await engine.load_batch([0, 1], [6, 7])
        assert [identify(caches, g) for g in (6, 7)] == [(0, 1, True), (1, 1, True)]
        await engine.aclose()


def _process_resources() -> set[str]:
    """This process's fds (with what each points at) and threads. Compared as sets: a leftover
    of an earlier test that the collector closes meanwhile is not a leak of this one."""
    found = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(FileNotFoundError):  # the listing's own fd, closed by now
            found.add(f"fd {fd} -> {os.readlink(f'/proc/self/fd/{fd}')}")
    return found | {f"thread {tid}" for tid in os.listdir("/proc/self/task")}


def _mapped(addr: int) -> bool:
    for line in Path("/proc/self/maps").read_text().splitlines():
        start, end = (int(x, 16) for x in line.split()[0].split("-"))
        if start <= addr < end:
            return True
    return False


@pytest.mark.parametrize("io", ["uring", "threads"])
async def test_a_dropped_engine_releases_its_threads_fds_and_memory(tmp_path: Path, io: str) -> None:
    """Dropped open (no aclose), nothing in flight: its threads, fds (file, ring, eventfd) and
    staging slab go with it, and the warning says so."""
    caches = id_caches("cpu", blocks=4)
    async with Engine(caches, tmp_path / "kv.bin", 4, num_slots=2, io=io):
        pass  # the loop's own worker threads (open() uses one) are up from here on
    gc.collect()
    before = _process_resources()
    engine = Engine(caches, tmp_path / "kv.bin", 4, num_slots=2, io=io)
    await engine.open()
    await store_identity(engine, caches, 2)
    slab = engine.pool.slab.addr
    assert _mapped(slab)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        del engine
        gc.collect()
        for _ in range(20):
            await anyio.sleep(0.01)
            if _process_resources() <= before:
                break
    messages = [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)]
    assert any("was not closed" in m and "released" in m for m in messages), messages
    outlived = _process_resources() - before
    assert not outlived, f"threads or fds outlived the dropped engine: {sorted(outlived)}"
    assert not _mapped(slab), "the staging slab is still mapped"
    assert os.listdir(tmp_path) == []


async def test_a_relative_path_is_resolved_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                make_engine: EngineFactory) -> None:
    """Opened as "kv.bin", then the process changes directory: nothing is ever left in either."""
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    second.mkdir()
    monkeypatch.chdir(first)
    caches = id_caches("cpu", blocks=4)
    engine = make_engine(caches, 4, num_slots=1, path=Path("kv.bin"))
    assert engine.path == str(first / "kv.bin")
    await engine.open()
    os.chdir(second)
    await store_identity(engine, caches, 2)
    await engine.aclose()
    assert os.listdir(first) == [] and os.listdir(second) == []


def test_sizes_beyond_memory_or_offsets_are_refused_naming_the_argument(tmp_path: Path) -> None:
    caches = id_caches("cpu", blocks=2)
    for blocks in (2**40, 2**62):
        with pytest.raises(ValueError, match=f"num_disk_blocks={blocks}"):
            Engine(caches, tmp_path / "kv.bin", blocks)
    assert os.listdir(tmp_path) == []


async def test_a_file_larger_than_the_filesystem_allows_is_refused_at_open(tmp_path: Path) -> None:
    """2**31 blocks of 4 MiB (8 PiB) fit the index's memory but no ext4/xfs/tmpfs-on-this-box file."""
    caches = {"layer": torch.zeros(2, 1 << 20)}
    engine = Engine(caches, tmp_path / "kv.bin", 2**31, num_slots=1)
    with pytest.raises(ValueError, match=f"num_disk_blocks={2**31}: .* larger than the filesystem"):
        await engine.open()
    assert engine.closed and os.listdir(tmp_path) == []


async def test_loading_a_block_never_stored_names_it(make_engine: EngineFactory) -> None:
    """ENODATA for the blocks never stored; the stored ones of the same batch still arrive."""
    caches = id_caches("cpu", blocks=8)
    async with make_engine(caches, 8, num_slots=2) as engine:
        await store_identity(engine, caches, 2)
        with pytest.raises(BlockIOError, match=r"disk block\(s\) 5 \(ENODATA") as info:
            await engine.load_batch([0, 5, 1], [4, 5, 6])
        assert info.value.failures == {5: errno.ENODATA}
        assert identify(caches, 4) == (0, 1, True) and identify(caches, 6) == (1, 1, True)
        assert identify(caches, 5) == (-1, -1, False)  # untouched
        assert engine.stats()["leases_held"] == 0


async def test_a_sliced_cache_moves_only_its_own_bytes(make_engine: EngineFactory) -> None:
    """A one-block cache that is a slice of a wider tensor (contiguous as far as torch says, but
    stride(0) spans the parent's block): loads write only the slice, stores read only it."""
    parent = torch.full((1, 16, 128), 7, dtype=torch.int32)
    view = parent[:, :8]
    assert view.is_contiguous() and view.stride(0) == 16 * 128
    view.copy_(torch.arange(8 * 128, dtype=torch.int32).view(1, 8, 128))
    expected = view.clone()
    async with make_engine({"k": view}, 2, num_slots=1) as engine:
        assert engine.block_bytes == 8 * 128 * 4
        await engine.store_batch([0], [1])
        view.zero_()
        parent[:, 8:] = 9
        await engine.load_batch([1], [0])
    assert torch.equal(view, expected)
    assert bool((parent[:, 8:] == 9).all()), "a load wrote outside the slice"


_CHILD = textwrap.dedent("""
    import asyncio, sys, time
    from uring_kv import Engine
    from uring_kv.testing import id_caches, store_identity

    async def main():
        caches = id_caches("cpu", blocks=4)
        engine = Engine(caches, sys.argv[1], 4, num_slots=1)
        await engine.open()
        await store_identity(engine, caches, 4)
        print("ready", flush=True)
        time.sleep(60)

    asyncio.run(main())
""")


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
async def test_no_byte_outlives_a_killed_process(tmp_path: Path, sig: signal.Signals) -> None:
    """The block file never has a name: while the owner runs its directory is empty, after a kill
    nothing is left, and a restart at the same path opens."""
    path = tmp_path / "kv.bin"
    with subprocess.Popen([sys.executable, "-P", "-c", _CHILD, str(path)], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True) as child:
        try:
            assert child.stdout is not None and child.stderr is not None
            line = await anyio.to_thread.run_sync(child.stdout.readline)
            assert line.strip() == "ready", child.stderr.read()
            assert os.listdir(tmp_path) == []
            child.send_signal(sig)
            await anyio.to_thread.run_sync(child.wait)
        finally:
            child.kill()
    assert child.returncode == -sig
    assert os.listdir(tmp_path) == []
    caches = id_caches("cpu", blocks=4)
    async with Engine(caches, path, 4, num_slots=1) as engine:
        await store_identity(engine, caches, 1)


async def test_without_o_tmpfile_the_file_is_unlinked_at_creation(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the filesystem refuses O_TMPFILE, the file is made under a random name and unlinked
    before any block is written."""
    real_open = os.open

    def no_tmpfile(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if flags & os.O_TMPFILE == os.O_TMPFILE:
            raise OSError(errno.EOPNOTSUPP, os.strerror(errno.EOPNOTSUPP))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", no_tmpfile)
    caches = id_caches("cpu", blocks=4)
    async with Engine(caches, tmp_path / "kv.bin", 4, num_slots=1) as engine:
        assert engine.stats()["file"].startswith("unlinked at creation")
        assert os.listdir(tmp_path) == []
        assert os.fstat(engine.file.fd).st_nlink == 0
        assert os.fstat(engine.file.fd).st_mode & 0o777 == 0o600
        await store_identity(engine, caches, 2)
        await engine.load_batch([0, 1], [2, 3])
        assert [identify(caches, g) for g in (2, 3)] == [(0, 1, True), (1, 1, True)]


async def test_the_file_is_private_and_nameless(tmp_path: Path) -> None:
    caches = id_caches("cpu", blocks=4)
    async with Engine(caches, tmp_path / "kv.bin", 4, num_slots=1) as engine:
        st = os.fstat(engine.file.fd)
        assert st.st_nlink == 0 and st.st_mode & 0o777 == 0o600
        assert os.listdir(tmp_path) == []
        assert engine.stats()["file"] == "unnamed (O_TMPFILE)"

