"""uring_kv over Mooncake Store: :class:`TieredStore` and :class:`SyncTieredStore` (``tiered.py``, a
local block store over a shared remote tier), :class:`MooncakeTier` (``remote.py``, with
``staging.py``), :class:`MooncakeConfig` (``config.py``), a master and store nodes on loopback for
tests, examples and the bench (``local.py``: :class:`~uring_kv.integrations.mooncake.local.LocalMaster`)
and the bench (``bench.py``). Mooncake itself is imported only when a tier opens."""

from __future__ import annotations

from typing import TYPE_CHECKING

from uring_kv.integrations import lazy_exports

if TYPE_CHECKING:
    from uring_kv.integrations.mooncake.config import MooncakeConfig, MooncakeError
    from uring_kv.integrations.mooncake.remote import MooncakeTier
    from uring_kv.integrations.mooncake.tiered import WRITE_MODES, SyncTieredStore, TieredStore

__all__ = ["WRITE_MODES", "MooncakeConfig", "MooncakeError", "MooncakeTier", "SyncTieredStore", "TieredStore"]
__getattr__ = lazy_exports(__name__, {"MooncakeConfig": "config", "MooncakeError": "config",
                                      "MooncakeTier": "remote", "WRITE_MODES": "tiered",
                                      "SyncTieredStore": "tiered", "TieredStore": "tiered"})
