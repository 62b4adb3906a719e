"""uring_kv: offload KV-cache blocks between GPU (or CPU) tensors and a file through io_uring."""

from uring_kv._engine import Engine, TransferHandle
from uring_kv._layout import CacheLayout
from uring_kv._prefetch import Prefetch
from uring_kv._tuning import Tuning
from uring_kv.errors import (
    BlockIOError,
    EngineBusyError,
    EngineClosedError,
    GeometryMismatchError,
    KeyIOError,
    KeyMissingError,
    UringKVError,
    UringUnavailable,
)
from uring_kv.keystore import KeyStore
from uring_kv.store import BlockStore
from uring_kv.striped import StripedBlockStore
from uring_kv.sync import SyncBlockStore, SyncStore

__all__ = ["BlockIOError", "BlockStore", "CacheLayout", "Engine", "EngineBusyError", "EngineClosedError",
           "GeometryMismatchError", "KeyIOError", "KeyMissingError", "KeyStore", "Prefetch", "StripedBlockStore",
           "SyncBlockStore", "SyncStore", "TransferHandle", "Tuning", "UringKVError", "UringUnavailable"]
__version__ = "0.1.0"
