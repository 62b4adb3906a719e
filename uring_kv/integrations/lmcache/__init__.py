"""uring_kv for LMCache: :class:`UringKVL2Adapter` (``adapter.py``, an L2 adapter of LMCache's
server; the plugin's ``module_path`` is this package), its configuration
:class:`UringKVL2AdapterConfig` (``config.py``, found by LMCache's plugin loader by its name) and
its bench (``bench.py``). Nothing here imports LMCache until one of those names is used."""

from __future__ import annotations

from typing import TYPE_CHECKING

from uring_kv.integrations import lazy_exports

if TYPE_CHECKING:
    from uring_kv.integrations.lmcache.adapter import UringKVL2Adapter
    from uring_kv.integrations.lmcache.config import UringKVL2AdapterConfig

__all__ = ["UringKVL2Adapter", "UringKVL2AdapterConfig"]
__getattr__ = lazy_exports(__name__, {"UringKVL2Adapter": "adapter", "UringKVL2AdapterConfig": "config"})
