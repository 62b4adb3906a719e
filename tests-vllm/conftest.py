"""The vLLM tests' shared set-up: the main suite's test helpers (tests/: the fault filesystem,
the small tmpfs mounts) importable, and the fault filesystem as a fixture."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


@pytest.fixture
def fault_mount(tmp_path: Path) -> tuple[Path, Any]:
    """An empty directory to mount the main suite's fault filesystem on (tests/faultfs.py) and its
    ``mounted``; skips where it cannot run (it needs root, /dev/fuse and mfusepy)."""
    if os.geteuid() != 0 or not os.path.exists("/dev/fuse"):
        pytest.skip("needs root and /dev/fuse for the fault filesystem")
    pytest.importorskip("mfusepy")
    from faultfs import mounted

    mount = tmp_path / "faulty"
    mount.mkdir()
    return mount, mounted
