"""uring_kv for SGLang: :class:`UringKVHiCacheStorage` (``storage.py``, a HiCache storage backend;
SGLang's dynamic backend's ``module_path`` is this package) and its bench (``bench.py``). Nothing
here imports SGLang until one of those names is used."""

from __future__ import annotations

from typing import TYPE_CHECKING

from uring_kv.integrations import lazy_exports

if TYPE_CHECKING:
    from uring_kv.integrations.sglang.storage import UringKVHiCacheStorage, pool_page_views, run_fingerprint

__all__ = ["UringKVHiCacheStorage", "pool_page_views", "run_fingerprint"]
__getattr__ = lazy_exports(__name__, dict.fromkeys(__all__, "storage"))
