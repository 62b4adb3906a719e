"""Two serving processes on one machine share a prefix through Mooncake: process A stores it, process
B (a separate Python process with its own local tier) finds it with lookup_shared, loads it through
Mooncake, and its bytes are the ones A stored, checked in B and again here from B's checksums. Then
A goes away, cleanly or SIGKILLed, and what it held becomes misses in B, never wrong blocks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import crc32c
import pytest
import torch
from blocks import block_of, key, make_caches

from uring_kv.integrations.mooncake.local import LocalMaster

pytestmark = pytest.mark.timeout(120)
HERE = Path(__file__).resolve().parent
N = 12


def peer(role: str, master: LocalMaster, directory: Path) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(HERE), "MC_TCP_BIND_ADDRESS": "127.0.0.1"}
    directory.mkdir()
    return subprocess.Popen([sys.executable, "-P", str(HERE / "peer.py"), role, master.master_address,
                             master.metadata_server, str(directory), str(N)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)


def answer(process: subprocess.Popen[str]) -> dict[str, Any]:
    assert process.stdout is not None
    line = process.stdout.readline()
    assert line, f"the peer exited with {process.wait()} before answering"
    return json.loads(line)  # type: ignore[no-any-return]


def load(master: LocalMaster, directory: Path) -> dict[str, Any]:
    process = peer("load", master, directory)
    out, _ = process.communicate(timeout=60)
    assert process.returncode == 0 and out, f"the loading peer exited with {process.returncode}"
    return json.loads(out.splitlines()[0])  # type: ignore[no-any-return]


def expected_sum(k: bytes) -> int:
    return int(crc32c.crc32c(b"".join(part.numpy().tobytes() for part in block_of(k, make_caches(1)))))


@pytest.mark.parametrize("a_ends", ["closes", "is_killed"])
def test_a_second_process_loads_the_prefix_the_first_stored(master: LocalMaster, tmp_path: Path,
                                                              a_ends: str) -> None:
    keys = [key(i, "shared") for i in range(N)]
    with peer("store", master, tmp_path / "a") as writer:
        try:
            stored = answer(writer)["stats"]
            assert stored["remote_stored"] == N and stored["keys"] == N
            b = load(master, tmp_path / "b")
            assert b["lookup_shared"] == N and b["right"]
            assert b["loaded"] == [k.hex() for k in keys]
            assert b["sums"] == {k.hex(): expected_sum(k) for k in keys}  # the bytes A stored, as B holds them
            assert b["stats"]["remote_hits"] == N and b["local_after"] == N  # promoted into B's own tier
        finally:
            if a_ends == "closes":
                assert writer.stdin is not None
                writer.stdin.write("\n")
                writer.stdin.flush()
                assert writer.wait(60) == 0
            else:
                writer.kill()
                writer.wait()
    # A's segment went with it: a third process finds nothing, and loads nothing wrong
    c = load(master, tmp_path / "c")
    assert c["loaded"] == [] and c["right"]
    assert c["stats"]["remote_hits"] == 0
    assert c["stats"]["remote_resting_rows"] == 0  # failures that came at once free their staging rows
    if a_ends == "is_killed":  # until the master notices, reads of A's values fail in transfer
        assert c["stats"]["remote_errors"] + c["stats"]["remote_misses"] == N, c["stats"]


def test_the_blocks_are_a_function_of_the_key() -> None:
    assert torch.equal(block_of(key(1), make_caches(1))[0], block_of(key(1), make_caches(1))[0])
