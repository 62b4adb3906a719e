"""``uring-kv bench-mooncake`` runs end to end on a small size: every row present, every byte checked."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.timeout(120)
def test_bench_mooncake_small(tmp_path: Path) -> None:
    pytest.importorskip("mooncake.store", reason="mooncake is not installed")
    out = tmp_path / "bench.json"
    done = subprocess.run([sys.executable, "-P", "-m", "uring_kv", "bench-mooncake", "--block-size", "64K",
                           "--bytes", "2M", "--batch", "8", "--path", str(tmp_path), "--json", str(out)],
                          capture_output=True, text=True, timeout=110)
    assert done.returncode == 0, done.stdout + done.stderr[-2000:]
    rows = json.loads(out.read_text())["results"]
    assert [row["method"] for row in rows] == [
        "put local only", "put write-through", "put write-back", "get remote hit", "mooncake batch_get_into",
        "get remote hit + promote", "get local hit"]
    assert all(row["verified"] and row["gbps"] > 0 for row in rows)
    assert "loopback TCP" in done.stdout
