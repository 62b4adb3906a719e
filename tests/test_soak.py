"""A CI-sized soak (the full 10^6-block run is `uring-kv soak`): nothing corrupt, leaked or pending."""

from __future__ import annotations

from pathlib import Path

from uring_kv.testing import soak


async def test_soak_small(tmp_path: Path, io_mode: str) -> None:
    result = await soak(6000, slots=3, workers=12, cancel_rate=0.15, directory=str(tmp_path), io=io_mode,
                        copy_delay=0.0002)
    assert result.blocks >= 6000
    assert result.checked > 1000
    assert result.cancelled > 0, "the soak must exercise cancellation"
    assert result.ok, result.summary()
