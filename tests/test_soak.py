"""A CI-sized soak (the full 10^6-block run is `uring-kv soak`): nothing corrupt, leaked or pending."""

from __future__ import annotations

from pathlib import Path

import pytest

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
