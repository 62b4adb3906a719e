"""The former path of :mod:`uring_kv.integrations.vllm.worker`, for code and configurations that
still name it."""

from uring_kv.integrations.vllm.worker import UringKVWorker

__all__ = ["UringKVWorker"]
