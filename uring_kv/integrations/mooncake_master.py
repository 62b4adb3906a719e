"""The former path of :mod:`uring_kv.integrations.mooncake.local`, for code that still imports it."""

from uring_kv.integrations.mooncake.local import LocalMaster, StoreNode, free_port

__all__ = ["LocalMaster", "StoreNode", "free_port"]
