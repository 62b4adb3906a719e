"""uring_kv: offload KV-cache blocks between GPU (or CPU) tensors and a file through io_uring."""

from uring_kv._engine import Engine, TransferHandle
from uring_kv.errors import BlockIOError, EngineClosedError, UringKVError, UringUnavailable

__all__ = ["BlockIOError", "Engine", "EngineClosedError", "TransferHandle", "UringKVError", "UringUnavailable"]
__version__ = "0.1.0"
