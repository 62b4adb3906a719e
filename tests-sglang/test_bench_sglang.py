"""``uring-kv bench-sglang`` on a tiny run: both backends built by SGLang's factory and driven, every
page got back checked, the JSON and the table as documented, nothing left on disk. No timing is
asserted (the machines that run this share their disks)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


def bench(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-P", "-m", "uring_kv", "bench-sglang", *args], capture_output=True,
                          text=True, timeout=300)


def test_bench_sglang_runs_both_backends_on_verified_bytes(tmp_path: Path) -> None:
    out, work = tmp_path / "r.json", tmp_path / "disk"
    work.mkdir()
    done = bench("--path", str(work), "--bytes", "2M", "--page-bytes", "64K", "--request", "4", "--threads", "2",
                 "--json", str(out))
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["config"] == {"path": str(work), "bytes": 2 << 20, "request": 4, "threads": 2,
                                "tokens_per_page": 64, "batch": 128}
    results = report["results"]
    assert [(r["backend"], r["op"]) for r in results] == [("uring_kv", "set"), ("uring_kv", "get"),
                                                          ("file", "set"), ("file", "get")]
    # 32 pages of 64 KiB in requests of 4: 8 calls per operation, every page checked
    assert all(r["verified"] and r["gbps"] > 0 and r["calls"] == 8 and r["page_bytes"] == 64 << 10
               for r in results)
    assert {r["direct"] for r in results if r["backend"] == "file"} == {None}
    assert all(isinstance(r["direct"], bool) for r in results if r["backend"] == "uring_kv")
    assert sum("× the GB/s" in line for line in done.stdout.splitlines()) == 2
    assert list(work.iterdir()) == []


@pytest.mark.parametrize(("args", "says"), [
    (["--page-bytes", "5000"], "--page-bytes 5000: a page of the host pool is read and written whole"),
    (["--request", "0"], "--request: must be >= 1, got 0"),
    (["--threads", "0"], "--threads: must be >= 1, got 0"),
    (["--backend", "hf3fs"], "--backend: invalid choice: 'hf3fs'"),
    (["--path", "{missing}"], "--path: {missing} does not exist"),
])
def test_bad_options_are_one_line_and_exit_2(tmp_path: Path, args: list[str], says: str) -> None:
    missing = str(tmp_path / "nowhere")
    done = bench(*(a.format(missing=missing) for a in args))
    said = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(said) == 1, done.stderr
    assert said[0].startswith("uring-kv bench-sglang: ") and says.format(missing=missing) in said[0], said[0]
    assert list(tmp_path.iterdir()) == []


def test_without_sglang_it_says_so_in_one_line_and_exits_2(tmp_path: Path) -> None:
    code = ("import sys\n"
            "sys.modules['sglang'] = None  # as if SGLang were not installed\n"
            "from uring_kv.cli import main\n"
            f"sys.exit(main(['bench-sglang', '--path', {str(tmp_path)!r}]))\n")
    done = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, timeout=120)
    said = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(said) == 1, done.stderr
    assert said[0].startswith("uring-kv bench-sglang: SGLang's HiCache is not importable here"), said[0]
    assert list(tmp_path.iterdir()) == []
