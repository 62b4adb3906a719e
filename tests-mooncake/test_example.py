"""examples/mooncake_shared_prefix.py runs as documented: two processes, a master it starts, the
prefix found and loaded through Mooncake with identical bytes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "mooncake_shared_prefix.py"


@pytest.mark.timeout(120)
def test_the_shared_prefix_example() -> None:
    pytest.importorskip("mooncake.store", reason="mooncake is not installed")
    done = subprocess.run([sys.executable, "-P", str(EXAMPLE)], capture_output=True, text=True, timeout=110)
    assert done.returncode == 0, done.stdout + done.stderr[-2000:]
    assert "found 48/48 blocks" in done.stdout and "bytes identical to its own: True" in done.stdout
