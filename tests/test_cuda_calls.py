"""The CUDA driver calls made on the caller's thread, checked on any machine against a stand-in
``libcuda.so.1`` (``tests/data/fake_cuda.c``, built here) that logs every call with the thread's
current context: a batch ordered after the caller's stream in one call, and the engine's context
borrowed for the call only, so that the caller's current device never moves. The stand-in's events
can also be held until the test fires them, which checks the native copier's bridge: a job is
collected only once its own event has fired. Its copies are logged too, which checks that the
per-piece copy path is each copier's own."""

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
from uring_kv import _cuda
assert _cuda.load_cuda_driver(), "the stand-in driver was not loaded"
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
_cuda.cuda_use_context(0xc0)  # the caller's context, e.g. another device's
_cuda.cuda_order_after(0xc1, 0, 0xe7, _cuda.stream_array([0x51, 0x52]), 2)
assert _cuda.cuda_current_context() == 0xc0
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
_cuda.cuda_use_context(0xc1)
_cuda.cuda_order_after(0xc1, 0x5c, 0xe7, _cuda.stream_array([0x51]), 1)
""")
    assert calls == ["set 0xc1 0 ctx=0", "record 0xe7 0x5c ctx=0xc1", "wait 0x51 0xe7 ctx=0xc1"]


def test_a_failed_record_raises_waits_for_nothing_and_gives_the_context_back(fake_driver: Driver) -> None:
    calls = fake_driver("""
_cuda.cuda_use_context(0xc0)
try:
    _cuda.cuda_order_after(0xc1, 0xbad, 0xe7, _cuda.stream_array([0x51]), 1)
except _cuda.CudaError as exc:
    assert exc.code == 719, exc
else:
    raise AssertionError("no CudaError")
assert _cuda.cuda_current_context() == 0xc0
""")
    assert calls == ["set 0xc0 0 ctx=0", "set 0xc1 0 ctx=0xc0", "record 0xe7 0xbad ctx=0xc1", "set 0xc0 0 ctx=0xc1"]


def test_events_made_and_freed_on_the_callers_thread_borrow_the_context(fake_driver: Driver) -> None:
    calls = fake_driver("""
_cuda.cuda_use_context(0xc0)
event = _cuda.CudaEvent(0xc1)
event.destroy()
assert _cuda.cuda_current_context() == 0xc0
""")
    assert calls == [
        "set 0xc0 0 ctx=0",
        "set 0xc1 0 ctx=0xc0", "create 0xe0 0x3 ctx=0xc1", "set 0xc0 0 ctx=0xc1",
        "set 0xc1 0 ctx=0xc0", "destroy 0xe0 0 ctx=0xc1", "set 0xc0 0 ctx=0xc1",
    ]


def test_the_bridge_hands_over_a_job_only_once_its_event_has_fired(fake_driver: Driver) -> None:
    """The native copier in CUDA mode: the bridge waits for the oldest job's event, sweeps the later
    ones that have fired, and keeps the rest, in order, for later; nothing unfired is collected."""
    calls = fake_driver("""
import ctypes, select, time
from uring_kv._native import BlockCopier, CopyJobs

driver = ctypes.CDLL("libcuda.so.1")
jobs = CopyJobs(BlockCopier([0x1000], [64], [0]), (0xc1, 0xf0, 0x7a, 64, 0x11, 0x22))

def put(token, event):
    jobs.put(token, False, [0x5000 + token], [token], dev_slots=[0x6000 + token], event=event)

def collected(expect_some):
    if expect_some:
        assert select.select([jobs.fd], [], [], 10)[0], "the loop was not woken"
    else:
        time.sleep(0.2)
    done = jobs.done()
    assert all(rc == 0 for _, rc, _, _ in done), done
    return [token for token, _, _, _ in done]

put(1, 0x1001); put(2, 0x1002); put(3, 0x1003)
assert collected(False) == []
driver.fake_fire(ctypes.c_uint64(0x1002)); driver.fake_fire(ctypes.c_uint64(0x1003))
assert collected(False) == []  # later events fired, the oldest has not: the bridge waits for it
driver.fake_fire(ctypes.c_uint64(0x1001))
assert collected(True) == [1, 2, 3]  # swept together
put(4, 0x1004); put(5, 0x1005)
driver.fake_fire(ctypes.c_uint64(0x1004))
assert collected(True) == [4]  # 5 has not fired: kept
put(6, 0x1006)
driver.fake_fire(ctypes.c_uint64(0x1006))
assert collected(False) == []  # 6 has fired, but 5 is older
driver.fake_fire(ctypes.c_uint64(0x1005))
assert collected(True) == [5, 6]
jobs.close()
""")
    records = [line for line in calls if line.startswith("record")]
    assert [line.split()[1] for line in records] == [hex(0x1000 + token) for token in range(1, 7)]
    assert all(line.endswith("ctx=0xc1") for line in records)  # the submit thread runs in the engine's context


def test_each_copier_keeps_its_own_per_piece_path(fake_driver: Driver) -> None:
    """Whether per-piece copies are batched is each copier's own choice, nothing process-wide: one
    batches while another beside it copies piece by piece, and a batch call the driver refuses
    turns only that copier's copies to one call each (redone that way at once)."""
    calls = fake_driver("""
from uring_kv._native import BlockCopier

blocks = BlockCopier([0x100000, 0x200000], [64, 32], [0, 64])
batched, single = _cuda.PieceCopies(blocks), _cuda.PieceCopies(blocks, batch=False)
assert batched.description == _cuda.cuda_copy_path() == "cuMemcpyBatchAsync_v2", batched.description
assert single.description == "per-copy cuMemcpy*Async", single.description
batched.enqueue(False, [0x9000], [3], 0x51)
single.enqueue(False, [0x9000], [3], 0x52)
batched.enqueue(True, [0x9000], [3], 0xba7)
assert batched.description == "per-copy cuMemcpy*Async (batch call failed with CUresult 1)", batched.description
batched.enqueue(False, [0x9000], [3], 0x53)
assert _cuda.PieceCopies(blocks).description == "cuMemcpyBatchAsync_v2"
""")
    assert calls == [
        "batch 0x2 0x51 ctx=0",
        "htod 0x1000c0 0x52 ctx=0", "htod 0x200060 0x52 ctx=0",
        "batch 0x2 0xba7 ctx=0", "dtoh 0x1000c0 0xba7 ctx=0", "dtoh 0x200060 0xba7 ctx=0",
        "htod 0x1000c0 0x53 ctx=0", "htod 0x200060 0x53 ctx=0",
    ]
