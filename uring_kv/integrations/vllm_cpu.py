"""The former path of :mod:`uring_kv.integrations.vllm.cpu`, for vLLM configurations that still
name it (``"spec_module_path": "uring_kv.integrations.vllm_cpu"``)."""

from uring_kv.integrations.vllm.cpu import CPUTieringOffloadingSpec, HostCopyWorker

__all__ = ["CPUTieringOffloadingSpec", "HostCopyWorker"]
