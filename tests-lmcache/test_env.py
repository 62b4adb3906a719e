"""The LMCache test environment (./dev's .venv-lmcache): LMCache's L2 adapter machinery and its
server import on the CPU torch, and uring_kv comes from the installed package without pulling
LMCache in."""

from __future__ import annotations

import subprocess
import sys

import torch


def test_lmcache_l2_adapters_and_server_import() -> None:
    from importlib.metadata import version

    import lmcache.v1.distributed.l2_adapters.plugin_l2_adapter
    import lmcache.v1.multiprocess.http_server  # noqa: F401  (what `lmcache server` runs)

    assert version("lmcache") == "0.5.6"


def test_torch_is_the_cpu_build() -> None:
    assert torch.__version__ == "2.13.0+cpu"
    assert torch.version.cuda is None


def test_uring_kv_does_not_import_lmcache() -> None:
    # a fresh interpreter: LMCache is already imported in this one
    code = (
        "import sys, uring_kv, uring_kv.integrations\n"
        "assert 'site-packages' in uring_kv.__file__, uring_kv.__file__\n"
        "assert not [m for m in sys.modules if m.split('.')[0] == 'lmcache'], 'import uring_kv imported lmcache'\n"
    )
    subprocess.run([sys.executable, "-P", "-c", code], check=True)
