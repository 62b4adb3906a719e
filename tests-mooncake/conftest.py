"""The Mooncake tests' set-up: a real ``mooncake_master`` on 127.0.0.1 (free ports) per test that asks
for one, and the Mooncake client bound to loopback (its transfer engine's RPC otherwise listens on
the public interface)."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator

import pytest

os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")

HAVE_MOONCAKE = importlib.util.find_spec("mooncake") is not None


def pytest_report_header() -> str:
    if not HAVE_MOONCAKE:
        return "mooncake: not installed (the tests that need a master skip)"
    from importlib.metadata import version

    return f"mooncake-transfer-engine-non-cuda: {version('mooncake-transfer-engine-non-cuda')}"


@pytest.fixture
def master() -> Iterator[object]:
    """A running ``mooncake_master`` (a :class:`uring_kv.integrations.mooncake.local.LocalMaster`),
    stopped after the test."""
    if not HAVE_MOONCAKE:
        pytest.skip("mooncake is not installed (./dev test sets up .venv-mooncake with it)")
    from uring_kv.integrations.mooncake.local import LocalMaster

    with LocalMaster() as running:
        yield running
