"""The native copier (``CopyJobs``): C submit threads and bridge, completions through an eventfd.

These drive it directly in host mode (memcpy), which runs the same queues, markers, done list,
eventfd and shutdown as CUDA mode; the engine-level tests run through it by default."""

from __future__ import annotations

import os
import select
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from uring_kv import Engine
from uring_kv._memory import HostBuffer
from uring_kv._native import FAIL_ENQUEUE, BlockCopier, CopyJobs
from uring_kv.testing import id_caches, identify, store_identity

LAYERS, BLOCKS, WORDS = 2, 600, 16  # 64 bytes per tensor and block: a slot is 128 bytes


class Rig:
    """Two cache tensors, one host slot per block, and a host-mode copier between them."""

    def __init__(self, delay_ns: int = 0) -> None:
        self.caches = [torch.zeros(BLOCKS, WORDS, dtype=torch.int32) for _ in range(LAYERS)]
        per = WORDS * 4
        self.stride = per * LAYERS
        self.slab = HostBuffer(BLOCKS * self.stride)
        self.blocks = BlockCopier([c.data_ptr() for c in self.caches], [per] * LAYERS,
                                  [layer * per for layer in range(LAYERS)])
        self.jobs = CopyJobs(self.blocks, None, delay_ns)

    def slot(self, i: int) -> int:
        return self.slab.addr + i * self.stride

    def fill_slots(self) -> None:
        words = torch.frombuffer(self.slab.view_at(self.slab.addr, BLOCKS * self.stride), dtype=torch.int32)
        words.copy_(torch.arange(words.numel(), dtype=torch.int32) ^ 0x5A5A)

    def slot_words(self, i: int) -> torch.Tensor:
        return torch.frombuffer(self.slab.view_at(self.slot(i), self.stride), dtype=torch.int32)

    def collect(self, want: int, timeout: float = 10.0) -> list[tuple[int, int, int, int]]:
        """Wait on the eventfd as the loop does and take what is done until ``want`` jobs are back."""
        got: list[tuple[int, int, int, int]] = []
        deadline = time.monotonic() + timeout
        while len(got) < want:
            left = deadline - time.monotonic()
            assert left > 0, f"only {len(got)} of {want} jobs came back"
            readable, _, _ = select.select([self.jobs.fd], [], [], left)
            if readable:
                got.extend(self.jobs.done())
        return got

    def close(self) -> None:
        self.jobs.close()
        self.slab.close()


@pytest.fixture
def rig() -> Iterator[Rig]:
    made = Rig()
    yield made
    made.close()


def test_every_job_comes_back_once_with_its_bytes_moved(rig: Rig) -> None:
    """More jobs than one ``done`` call returns finish before the loop looks: the copier wakes the
    loop again for the rest. Mutation tried: not re-arming the eventfd when jobs are left over
    (the collection timed out with 256 of 600)."""
    rig.fill_slots()
    for b in range(BLOCKS):  # one job per block, all queued before any is collected
        rig.jobs.put(b, False, [rig.slot(b)], [BLOCKS - 1 - b])
    time.sleep(0.2)  # let them all finish: the done list outgrows one collection
    got = rig.collect(BLOCKS)
    assert sorted(token for token, *_ in got) == list(range(BLOCKS))
    assert all(rc == 0 and where == 0 for _, rc, where, _ in got)
    for b in range(BLOCKS):
        expect = rig.slot_words(b)
        got_block = torch.cat([c[BLOCKS - 1 - b] for c in rig.caches])
        assert torch.equal(got_block, expect), f"block {b} was not copied"
    assert select.select([rig.jobs.fd], [], [], 0.05)[0] == [] or rig.jobs.done() == []


def test_a_marker_comes_back_after_every_earlier_copy_of_its_direction() -> None:
    """Slowed copies: the marker queued behind them must not be reported before they are."""
    rig = Rig(delay_ns=20_000_000)
    try:
        for b in range(3):
            rig.jobs.put(b, True, [rig.slot(b)], [b])
        rig.jobs.mark(100, True)
        order = [token for token, *_ in rig.collect(4)]
        assert order.index(100) == 3, order
    finally:
        rig.close()


def test_close_runs_what_is_queued_before_stopping() -> None:
    """Stopping is not abandoning: copies queued before close still happen (a slot's bytes must
    not be left half-moved). Mutation tried: submit threads exiting as soon as they see the stop
    flag (the caches kept zeros)."""
    rig = Rig(delay_ns=5_000_000)
    rig.fill_slots()
    for b in range(8):
        rig.jobs.put(b, False, [rig.slot(b)], [b])
    rig.jobs.close()
    for b in range(8):
        assert torch.equal(torch.cat([c[b] for c in rig.caches]), rig.slot_words(b))
    with pytest.raises(RuntimeError, match="closed"):
        rig.jobs.put(9, False, [rig.slot(9)], [9])  # closed: no copier left to queue to
    rig.slab.close()


def test_an_injected_failure_reports_on_the_next_copy_only(rig: Rig) -> None:
    rig.jobs.fail_next(999, FAIL_ENQUEUE)
    rig.jobs.mark(0, False)  # markers do no copy: the failure waits for one
    rig.jobs.put(1, False, [rig.slot(1)], [1])
    rig.jobs.put(2, False, [rig.slot(2)], [2])
    results = {token: (rc, where) for token, rc, where, _ in rig.collect(3)}
    assert results == {0: (0, 0), 1: (999, FAIL_ENQUEUE), 2: (0, 0)}


def _thread_ticks(prefix: str) -> dict[str, int]:
    ticks = {}
    for tid in os.listdir("/proc/self/task"):
        task = Path("/proc/self/task") / tid
        try:
            name = (task / "comm").read_text().strip()
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if name.startswith(prefix):
            ticks[f"{name}/{tid}"] = int(fields[11]) + int(fields[12])  # utime + stime
    return ticks


async def test_the_copier_threads_sleep_while_idle(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """After a batch through the native copier, its threads use no CPU while nothing is queued.
    Mutation tried: polling the queue instead of waiting on the condition variable (tens of ticks)."""
    monkeypatch.setenv("URING_KV_HOST_INLINE_BYTES", "0")
    monkeypatch.setenv("URING_KV_DEBUG_PUMP", "0")
    caches = id_caches("cpu", blocks=8)
    async with Engine(caches, tmp_path / "kv.bin", 8, 2) as engine:
        assert getattr(engine.copier, "native", False)
        await store_identity(engine, caches, 4)
        await engine.load_batch([1, 2], [5, 6])
        assert identify(caches, 5) == (1, 1, True)
        before = _thread_ticks("ukv-copy")
        assert len(before) == 2, before
        time.sleep(0.5)
        after = _thread_ticks("ukv-copy")
    spent = {name: after[name] - before[name] for name in before}
    assert all(t <= 1 for t in spent.values()), spent
