"""The CUDA driver calls made on the caller's thread, checked on any machine against a stand-in
``libcuda.so.1`` (``tests/data/fake_cuda.c``, built here) that logs every call with the thread's
current context: a batch ordered after the caller's stream in one call, and the engine's context
borrowed for the call only, so that the caller's current device never moves."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

CC = shutil.which("cc") or shutil.which("gcc")
pytestmark = pytest.mark.skipif(CC is None, reason="needs a C compiler for the stand-in driver")

PRELUDE = """
from uring_kv import _native
assert _native.load_cuda_driver(), "the stand-in driver was not loaded"
"""

Driver = Callable[[str], list[str]]


@pytest.fixture
def fake_driver(tmp_path: Path) -> Driver:
    """Runs a snippet in a fresh interpreter whose ``libcuda.so.1`` is the stand-in; returns the
    driver calls it made, one line each: ``name arg arg ctx=<current context>``."""
    assert CC is not None
    source = Path(__file__).parent / "data" / "fake_cuda.c"
    subprocess.run([CC, "-shared", "-fPIC", "-O1", "-o", str(tmp_path / "libcuda.so.1"), str(source)], check=True)
    log = tmp_path / "calls.log"

    def run(code: str) -> list[str]:
        log.unlink(missing_ok=True)
        env = {**os.environ, "FAKE_CUDA_LOG": str(log),
               "LD_LIBRARY_PATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("LD_LIBRARY_PATH")]))}
        # cwd: not the checkout, whose uring_kv (unbuilt in a fresh clone) would shadow the installed one
        done = subprocess.run([sys.executable, "-c", PRELUDE + code], env=env, cwd=tmp_path, capture_output=True,
                              text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        return log.read_text().splitlines() if log.exists() else []

    return run


def test_a_batch_is_ordered_after_the_callers_stream_in_the_engines_context(fake_driver: Driver) -> None:
    """Record on the caller's stream (0: the legacy default stream, which is why the context
    matters), every lane waits for that record, and the thread gets its own context back."""
    calls = fake_driver("""
_native.cuda_use_context(0xc0)  # the caller's context, e.g. another device's
_native.cuda_order_after(0xc1, 0, 0xe7, _native.u64_array([0x51, 0x52]), 2)
assert _native.cuda_current_context() == 0xc0
""")
    assert calls == [
        "set 0xc0 0 ctx=0",
        "set 0xc1 0 ctx=0xc0",
        "record 0xe7 0 ctx=0xc1",
        "wait 0x51 0xe7 ctx=0xc1",
        "wait 0x52 0xe7 ctx=0xc1",
        "set 0xc0 0 ctx=0xc1",
    ]


def test_ordering_in_the_current_context_switches_nothing(fake_driver: Driver) -> None:
    calls = fake_driver("""
_native.cuda_use_context(0xc1)
_native.cuda_order_after(0xc1, 0x5c, 0xe7, _native.u64_array([0x51]), 1)
""")
    assert calls == ["set 0xc1 0 ctx=0", "record 0xe7 0x5c ctx=0xc1", "wait 0x51 0xe7 ctx=0xc1"]


def test_a_failed_record_raises_waits_for_nothing_and_gives_the_context_back(fake_driver: Driver) -> None:
    calls = fake_driver("""
_native.cuda_use_context(0xc0)
try:
    _native.cuda_order_after(0xc1, 0xbad, 0xe7, _native.u64_array([0x51]), 1)
except _native.CudaError as exc:
    assert exc.code == 719, exc
else:
    raise AssertionError("no CudaError")
assert _native.cuda_current_context() == 0xc0
""")
    assert calls == ["set 0xc0 0 ctx=0", "set 0xc1 0 ctx=0xc0", "record 0xe7 0xbad ctx=0xc1", "set 0xc0 0 ctx=0xc1"]


def test_events_made_and_freed_on_the_callers_thread_borrow_the_context(fake_driver: Driver) -> None:
    calls = fake_driver("""
_native.cuda_use_context(0xc0)
event = _native.CudaEvent(0xc1)
event.destroy()
assert _native.cuda_current_context() == 0xc0
""")
    assert calls == [
        "set 0xc0 0 ctx=0",
        "set 0xc1 0 ctx=0xc0", "create 0xe0 0x3 ctx=0xc1", "set 0xc0 0 ctx=0xc1",
        "set 0xc1 0 ctx=0xc0", "destroy 0xe0 0 ctx=0xc1", "set 0xc0 0 ctx=0xc1",
    ]
