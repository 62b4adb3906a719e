"""pytest plugin (registered as ``uring_kv`` through the ``pytest11`` entry point).

Fixtures for testing code that embeds uring_kv (async fixtures need pytest-asyncio):

* ``uring_kv_engine`` — a factory: ``engine = await uring_kv_engine(caches, num_disk_blocks, **options)``
  opens an engine whose file lives in the test's ``tmp_path``. After the test every engine is closed
  and checked: no lease held, nothing in flight, the file removed.
* ``uring_kv_race`` — the same factory with every copy slowed down (``copy_delay``; a sleeping
  kernel on the copy stream in GPU mode), so that code which reuses GPU blocks or staging too early,
  or forgets to await a batch, fails in tests instead of in production.
* ``uring_kv_device`` — ``"cuda"`` if a GPU is visible, else the test is skipped.
* ``uring_kv.testing`` has self-identifying block helpers (``fill``, ``identify``, ``id_caches``).
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from uring_kv import Engine

EngineFactory = Callable[..., Awaitable[Engine]]
RACE_DELAY = 0.005


async def _engines(tmp_path: Path, defaults: dict[str, Any]) -> AsyncIterator[EngineFactory]:
    opened: list[Engine] = []

    async def make(caches: Any, num_disk_blocks: int, **options: Any) -> Engine:
        path = options.pop("path", None) or tmp_path / f"uring-kv-{len(opened)}.bin"
        engine = Engine(caches, path, num_disk_blocks, **{**defaults, **options})
        await engine.open()
        opened.append(engine)
        return engine

    yield make
    problems = []
    for engine in opened:
        if not engine.closed:
            await engine.aclose()
        snapshot = engine.metrics()
        if snapshot["leases_held"] or snapshot["io_inflight"] or snapshot["copies_pending"]:
            problems.append(f"{engine.path}: {snapshot}")
        if os.path.exists(engine.path):
            problems.append(f"{engine.path} was not removed")
    assert not problems, "uring_kv engines left work behind: " + "; ".join(problems)


# The plugin must never break a test run that has no pytest-asyncio: its async fixtures need it.
if importlib.util.find_spec("pytest_asyncio") is not None:
    import pytest_asyncio

    @pytest_asyncio.fixture
    async def uring_kv_engine(tmp_path: Path) -> AsyncIterator[EngineFactory]:
        """Open engines over tmp_path; closed and leak-checked after the test."""
        async for factory in _engines(tmp_path, {}):
            yield factory

    @pytest_asyncio.fixture
    async def uring_kv_race(tmp_path: Path) -> AsyncIterator[EngineFactory]:
        """Like ``uring_kv_engine`` with every copy delayed, to make misuse races show up."""
        async for factory in _engines(tmp_path, {"copy_delay": RACE_DELAY}):
            yield factory


@pytest.fixture
def uring_kv_device() -> str:
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    return "cuda"
