"""The pytest plugin, as a user would run it: a separate pytest run over a user's test file."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from importlib.metadata import entry_points
from pathlib import Path

USER_TESTS = '''
import asyncio
import pytest
from uring_kv.testing import fill, id_caches, identify


async def reload(engine, disk_blocks, gpu_blocks):
    await engine.load_batch(disk_blocks, gpu_blocks)


async def reload_without_waiting(engine, disk_blocks, gpu_blocks):
    asyncio.get_running_loop().create_task(engine.load_batch(disk_blocks, gpu_blocks))  # the bug


async def test_correct_code_passes(uring_kv_race):
    caches = id_caches("cpu", blocks=4)
    engine = await uring_kv_race(caches, 8, num_slots=2)
    fill(caches, 0, 5, 1)
    await engine.store_batch([0], [5])
    await reload(engine, [5], [1])
    assert identify(caches, 1) == (5, 1, True)


@pytest.mark.xfail(strict=True, reason="the race injector must expose the missing await")
async def test_buggy_code_is_caught(uring_kv_race):
    caches = id_caches("cpu", blocks=4)
    engine = await uring_kv_race(caches, 8, num_slots=2)
    fill(caches, 0, 5, 1)
    await engine.store_batch([0], [5])
    await reload_without_waiting(engine, [5], [1])
    await asyncio.sleep(0)
    assert identify(caches, 1) == (5, 1, True)


async def test_plain_engine_fixture(uring_kv_engine, tmp_path):
    engine = await uring_kv_engine(id_caches("cpu", blocks=4), 4)
    assert str(engine.path).startswith(str(tmp_path))


def test_device_fixture_skips_without_gpu(uring_kv_device):
    assert uring_kv_device == "cuda"
'''


def test_plugin_fixtures_in_a_users_test_run(tmp_path: Path) -> None:
    (tmp_path / "test_user.py").write_text(textwrap.dedent(USER_TESTS))
    (tmp_path / "pytest.ini").write_text("[pytest]\nasyncio_mode = auto\n")
    installed = any(ep.name == "uring_kv" for ep in entry_points(group="pytest11"))
    plugin = [] if installed else ["-p", "uring_kv.pytest_plugin"]  # a source checkout has no entry point
    command = [sys.executable, "-P", "-m", "pytest", "-q", "-p", "no:cacheprovider", *plugin, str(tmp_path)]
    done = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path, timeout=120)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    import torch

    expected = "3 passed, 1 xfailed" if torch.cuda.is_available() else "2 passed, 1 skipped, 1 xfailed"
    assert expected in out, out
