"""A CI-sized soak (the full 10^6-block run is `uring-kv soak`): nothing corrupt, leaked or pending."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
from faultfs import FaultState

from uring_kv.testing import soak


@pytest.mark.parametrize(("slots", "io_depth"), [(3, None), (4, 2)], ids=["depth=slots", "spare-slots"])
async def test_soak_small(tmp_path: Path, io_mode: str, slots: int, io_depth: int | None) -> None:
    """Slowed copies (on io_uring: batches in pumps on the native copier's thread), with and
    without a depth cap below the slots (pumps then park slots that wait for I/O room)."""
    result = await soak(6000, slots=slots, workers=12, cancel_rate=0.15, directory=str(tmp_path), io=io_mode,
                        copy_delay=0.0002, io_depth=io_depth)
    assert result.blocks >= 6000
    assert result.checked > 1000
    assert result.cancelled > 0, "the soak must exercise cancellation"
    assert result.ok, result.summary()


async def test_soak_with_stores_failing_under_loads_of_the_same_blocks(fault_fs: tuple[Path, FaultState],
                                                                        io_mode: str) -> None:
    """Writes to a few random blocks fail with EIO (the failing range moves every millisecond or
    so) while loads of the same blocks run: no load returns a failed store's version or stale
    bytes, every refused block is one whose store failed, nothing leaks."""
    mountpoint, state = fault_fs

    def faults(engine: Any, rng: random.Random) -> None:
        state.clear()
        first = rng.randrange(engine.num_disk_blocks - 4)
        state.fail_writes(engine.file.offset(first), 4 * engine.file.stride)

    result = await soak(3000, slots=4, workers=12, cancel_rate=0.1, disk_blocks=64, directory=str(mountpoint),
                        io=io_mode, faults=faults)
    assert result.failed_stores > 0 and result.refused_loads > 0, result.summary()
    assert result.checked > 1000
    assert result.ok, result.summary()
