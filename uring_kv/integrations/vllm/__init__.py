"""uring_kv for vLLM: :class:`UringKVTier` (``tier.py``, a secondary tier of vLLM's KV offloading;
vLLM's ``module_path`` is this package), :class:`CPUTieringOffloadingSpec` (``cpu.py``, vLLM on a
CPU server), :class:`UringKVWorker` (``worker.py``, GPU-direct, on ``rows.py``), the benches
(``bench.py``, ``serve_bench.py``) and what they use (``model.py``, ``timed.py``). Nothing here
imports vLLM until one of those names is used."""

from __future__ import annotations

from typing import TYPE_CHECKING

from uring_kv.integrations import lazy_exports

if TYPE_CHECKING:
    from uring_kv.integrations.vllm.cpu import CPUTieringOffloadingSpec, HostCopyWorker
    from uring_kv.integrations.vllm.tier import METRICS, UringKVTier, run_fingerprint
    from uring_kv.integrations.vllm.worker import UringKVWorker

__all__ = ["METRICS", "CPUTieringOffloadingSpec", "HostCopyWorker", "UringKVTier", "UringKVWorker",
           "run_fingerprint"]
__getattr__ = lazy_exports(__name__, {"UringKVTier": "tier", "METRICS": "tier", "run_fingerprint": "tier",
                                      "CPUTieringOffloadingSpec": "cpu", "HostCopyWorker": "cpu",
                                      "UringKVWorker": "worker"})
