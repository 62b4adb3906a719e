"""The SGLang test environment (./dev's .venv-sglang): SGLang's HiCache modules import on the CPU
torch, and uring_kv comes from the installed package without pulling SGLang in."""

from __future__ import annotations

import subprocess
import sys

import torch


def test_sglang_hicache_imports() -> None:
    from importlib.metadata import version

    import sglang.srt.mem_cache.hicache_storage
    import sglang.srt.mem_cache.storage.backend_factory  # noqa: F401

    assert version("sglang") == "0.5.23"


def test_torch_is_the_cpu_build() -> None:
    assert torch.__version__ == "2.13.0+cpu"
    assert torch.version.cuda is None


def test_uring_kv_does_not_import_sglang() -> None:
    # a fresh interpreter: SGLang is already imported in this one
    code = (
        "import sys, uring_kv, uring_kv.integrations\n"
        "assert 'site-packages' in uring_kv.__file__, uring_kv.__file__\n"
        "assert not [m for m in sys.modules if m.split('.')[0] == 'sglang'], 'import uring_kv imported sglang'\n"
    )
    subprocess.run([sys.executable, "-P", "-c", code], check=True)
