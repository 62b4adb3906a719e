"""Shared fixtures: both I/O backends, CPU and CUDA caches, and a leak check after every engine test."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import platform
import random
import time
import warnings
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
import sniffio
import torch
from faultfs import FaultState, mounted
from tmpfs import mounted_tmpfs

import uring_kv
from uring_kv import Engine
from uring_kv._io import IOBackend, open_backend
from uring_kv._native import LIBURING_VERSION
from uring_kv.testing import fill, identify

# "auto" runs with io_uring_setup failing with EPERM (as under Docker's default seccomp): the
# engine must fall back to the thread pool, warn once, and pass the whole suite.
# "uring-python" is io_uring with native pumps off: CPU mode then runs batches the way GPU mode
# does (a handler per block), which CI has no other way to run.
IO_MODES = [pytest.param("uring", id="uring"), pytest.param("uring-python", id="uring-python"),
            pytest.param("threads", id="threads"), pytest.param("auto", id="eperm-fallback")]


@pytest.fixture
def anyio_backend() -> str:
    """asyncio unless a module asks for more: the core modules run on asyncio and on trio."""
    return "asyncio"


BOTH_BACKENDS = ["asyncio", "trio"]


def pytest_report_header() -> list[str]:
    cuda = torch.version.cuda if torch.cuda.is_available() else "not available"
    return [
        f"uring_kv {uring_kv.__version__} from {Path(uring_kv.__file__).parent}",
        f"kernel {platform.release()}, liburing {LIBURING_VERSION} (static), torch {torch.__version__}, CUDA {cuda}",
    ]


def _refuse_ring(*args: Any, **kwargs: Any) -> Any:
    raise OSError(errno.EPERM, os.strerror(errno.EPERM))


@pytest.fixture(params=IO_MODES)
def io_mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "auto":
        monkeypatch.setattr("uring_kv._io.uring.NativeRing", _refuse_ring)
        monkeypatch.delenv("URING_KV_IO", raising=False)
        # pytest's warning filters for this test are already in place; this one is undone with them
        warnings.filterwarnings("ignore", r"uring_kv: io_uring_setup failed with EPERM.*thread-pool fallback",
                                RuntimeWarning)
    if request.param == "uring-python":
        monkeypatch.setenv("URING_KV_DEBUG_PUMP", "0")
        return "uring"
    return str(request.param)


def pumps_on(io_mode: str) -> bool:
    """Whether engines made now may run batches in native pumps: on io_uring (``io_mode``), with
    ``URING_KV_DEBUG_PUMP`` not 0 (``uring-python`` and some tests set it)."""
    return io_mode == "uring" and os.environ.get("URING_KV_DEBUG_PUMP") != "0"


@pytest.fixture
async def backend(io_mode: str) -> AsyncIterator[IOBackend]:
    io = open_backend(io_mode)
    yield io
    await io.drain()
    io.close()


def _devices() -> list[Any]:
    return ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


@pytest.fixture(params=_devices())
def device(request: pytest.FixtureRequest) -> str:
    if request.param == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    return str(request.param)


EngineFactory = Callable[..., Engine]


@pytest.fixture
async def make_engine(tmp_path: Path, io_mode: str) -> AsyncIterator[EngineFactory]:
    """Engines over tmp_path on the parametrised backend; after the test, each must be closed clean."""
    engines: list[Engine] = []
    with reported_errors() as loop_errors:
        yield _engine_factory(engines, tmp_path, io_mode)
        for engine in engines:
            if engine._state == "open":
                await engine.aclose()
            if not hasattr(engine, "pool"):
                continue  # never opened (a test of bad arguments)
            assert engine.closed
            assert engine.pool.held == 0, "a lease is still held after close"
            assert engine.io.inflight == 0, "an SQE is still in flight after close"
            assert engine.bridge.pending == 0, "a copy event is still pending after close"
            copier = getattr(engine, "copier", None)  # absent when open() failed before it
            assert copier is None or copier.pending == 0, "a native copy job is still pending after close"
            assert not engine.bridge.alive, "the bridge thread is still running"
            assert engine.file.closed, "the block file is still open"
            assert not os.path.exists(engine.path), "a file was left at the engine's path"
    assert not loop_errors, f"a completion handler failed: {loop_errors}"


def _engine_factory(engines: list[Engine], tmp_path: Path, io_mode: str) -> EngineFactory:
    def make(caches: Any, num_disk_blocks: int, num_slots: int = 4, path: Path | None = None,
             **kwargs: Any) -> Engine:
        kwargs.setdefault("io", io_mode)
        path = path or tmp_path / f"kv{len(engines)}.bin"
        engine = Engine(caches, path, num_disk_blocks, num_slots, **kwargs)
        engines.append(engine)
        return engine

    return make


@contextlib.contextmanager
def reported_errors() -> Iterator[list[Any]]:
    """What the loop services reported while inside: asyncio's exception handler, trio's log."""
    errors: list[Any] = []
    collector = _ErrorCollector(errors)
    loop = asyncio.get_running_loop() if sniffio.current_async_library() == "asyncio" else None
    previous = loop.get_exception_handler() if loop is not None else None
    if loop is not None:
        loop.set_exception_handler(lambda loop, context: errors.append(context))
    logger = logging.getLogger("uring_kv")
    outer = [h for h in logger.handlers if isinstance(h, _ErrorCollector)]  # an enclosing collector
    for handler in outer:  # does not see what this one collects (as with asyncio's single handler)
        logger.removeHandler(handler)
    logger.addHandler(collector)
    try:
        yield errors
    finally:
        logger.removeHandler(collector)
        for handler in outer:
            logger.addHandler(handler)
        if loop is not None:
            loop.set_exception_handler(previous)


class _ErrorCollector(logging.Handler):
    def __init__(self, into: list[Any]) -> None:
        super().__init__(logging.ERROR)
        self._into = into

    def emit(self, record: logging.LogRecord) -> None:
        self._into.append(record.getMessage())


def random_caches(device: str, layers: int = 4, blocks: int = 32, shape: tuple[int, ...] = (3, 5),
                  dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {f"layer{i}": torch.randn(blocks, *shape, generator=gen).to(dtype).to(device) for i in range(layers)}


@pytest.fixture
def tiny_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """An 8 MiB tmpfs at ``tmp_path / "tiny"``: room for a test's block file at open, then
    :func:`take_space` leaves it as little as the test wants (ENOSPC after that)."""
    with mounted_tmpfs(tmp_path / "tiny", "size=8m") as mountpoint:
        yield mountpoint


@pytest.fixture
def fault_fs(tmp_path: Path) -> Iterator[tuple[Path, FaultState]]:
    """A FUSE filesystem at tmp_path/fuse whose reads and writes can fail or be slowed (faultfs)."""
    if os.geteuid() != 0 or not os.path.exists("/dev/fuse"):
        pytest.skip("needs root and /dev/fuse")
    try:
        import mfusepy  # noqa: F401  (raises OSError when libfuse3 is missing)
    except (ImportError, OSError) as exc:
        pytest.skip(f"libfuse unavailable: {exc}")
    mountpoint = tmp_path / "fuse"
    mountpoint.mkdir()
    try:
        with mounted(mountpoint) as state:
            yield mountpoint, state
    except RuntimeError as exc:
        pytest.skip(str(exc))

async def seed_race(engine: Engine, caches: dict[str, torch.Tensor], calls: int) -> int:
    """Store 32 identified blocks, then back-to-back small load_batch calls; count wrong blocks."""
    for disk_block in range(32):
        fill(caches, disk_block % 8, disk_block, 1)
        if disk_block % 8 == 7:
            await engine.store_batch(list(range(8)), list(range(disk_block - 7, disk_block + 1)))
    rng = random.Random(7)
    wrong = 0
    for _ in range(calls):
        disk_blocks = rng.sample(range(32), 4)
        gpu_blocks = rng.sample(range(8), 4)
        await engine.load_batch(disk_blocks, gpu_blocks)
        for disk_block, gpu_block in zip(disk_blocks, gpu_blocks, strict=True):
            found, version, intact = identify(caches, gpu_block)
            wrong += (found, version, intact) != (disk_block, 1, True)
    return wrong


def use_python_pump(engine: Engine, on: bool = True) -> None:
    """Make the engine's next calls run in the Python pump (True), as when every native pump is
    busy, or in native pumps again where it has them (False)."""
    driver: Any = engine._driver
    if not hasattr(driver, "native_pumps"):
        driver.native_pumps = driver._native
    driver._native = None if on else driver.native_pumps


def release_on_submit(monkeypatch: pytest.MonkeyPatch) -> None:
    """The bug the seed race exists for: a load's slot freed as soon as its copy is enqueued (in the
    Python pump: batches do not go through native pumps here). The call itself still returns only
    once its copies have run, as it would with the bug; only the slot goes on too early."""
    from uring_kv._pypump import PyPump

    monkeypatch.setenv("URING_KV_DEBUG_PUMP", "0")

    original_enqueue, original_on_copied = PyPump._enqueue_copies, PyPump._on_copied
    original_finished = PyPump.finished
    copying: dict[int, int] = {}  # pump → its copies not yet done

    def enqueue_then_release(self: PyPump) -> None:
        group = list(self._ready)
        original_enqueue(self)
        if not self._write:
            copying[id(self)] = copying.get(id(self), 0) + len(group)
            for index, addr, _ in group:
                self._slot_free(index, addr)  # the bug: the copy may still be reading this slot

    def on_copied(self: PyPump, chunk: list[Any], error: BaseException | None = None) -> None:
        if not self._write:
            copying[id(self)] -= len(chunk)  # (the slots went back already)
            self._schedule()
            return
        original_on_copied(self, chunk, error)

    def finished(self: PyPump) -> bool:
        return bool(original_finished.fget(self)) and not copying.get(id(self))  # type: ignore[attr-defined]

    monkeypatch.setattr(PyPump, "_enqueue_copies", enqueue_then_release)
    monkeypatch.setattr(PyPump, "_on_copied", on_copied)
    monkeypatch.setattr(PyPump, "finished", property(finished))


async def until(condition: Callable[[], object], seconds: float = 5.0) -> None:
    """Yield to the loop until ``condition()`` holds; fail after ``seconds``."""
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "condition never held"
        await anyio.sleep(0.002)
