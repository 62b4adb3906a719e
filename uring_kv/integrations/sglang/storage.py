"""uring_kv as an SGLang HiCache storage backend (the L3 tier under SGLang's host memory pool).

SGLang's hierarchical cache keeps KV pages in a host memory pool (L2) and backs them up to a
storage backend (L3), prefetching them back into the pool on a later hit. This backend keeps
those pages in one file (or striped over one per drive) through a :class:`uring_kv.SyncBlockStore`
(CPU mode over the host pool: io_uring reads straight from the file into the pool's pages; writes
go through one memcpy into a staging slot), with a hard capacity and LRU eviction, and optionally
across restarts. Load it with SGLang's dynamic backend::

    --hicache-storage-backend dynamic --hicache-storage-backend-extra-config '{
        "backend_name": "uring_kv", "module_path": "uring_kv.integrations.sglang",
        "class_name": "UringKVHiCacheStorage", "interface_v1": 1,
        "root_dir": "/nvme/kv", "capacity_bytes": 500000000000}'

How it answers SGLang's contract (``HiCacheStorage``; every call blocks, from SGLang's prefetch
and backup threads):

* ``batch_get_v1`` runs in the prefetch class (``uring_kv.Prefetch``: behind demand loads, ahead of
  the backup thread's writes): SGLang reads its storage only from its prefetch thread, for requests
  not yet scheduled, and never tells the storage when a request it prefetches for is scheduled
  (its ``prefetch_stop_policy`` waits for, or ends, the prefetch instead), so nothing upgrades one.
* ``batch_exists``: the number of leading keys whose pages are in the file, from the store's
  index on the calling thread (no I/O).
* ``batch_set_v1`` / ``batch_get_v1`` (zero-copy): ``host_indices`` are token slots of the pool,
  ``page_size`` per key; each key's page is written from, or read into, the pool's page in place.
  One ``bool`` per key; a key already held is not written again.
* A failed write leaves its key a miss; a failed read returns False for the key and drops it from
  the index, so the next ``batch_exists`` stops before it and SGLang recomputes instead of
  prefetching it again. A key evicted between ``batch_exists`` and its read is a False alone.
* ``close`` (SGLang's detach): finishes what is in flight, closes the store (its file has no name:
  nothing is left on disk; a persistent store's file and index stay) and joins its thread.
"""

from __future__ import annotations

import gc
import itertools
import json
import logging
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage

from uring_kv._prefetch import Prefetch
from uring_kv.errors import KeyIOError
from uring_kv.integrations.config import StoreConfig, fingerprint_name, open_store
from uring_kv.sync import SyncBlockStore

logger = logging.getLogger(__name__)

# SGLang's host layouts by the axis that indexes its buffer (after the K/V and layer axes, if any):
# token slots (a page is page_size consecutive slots) or pages.
_TOKEN_AXIS_LAYOUTS = ("page_first", "layer_first")
_PAGE_AXIS_LAYOUTS = ("page_first_direct", "page_head", "page_unified")


def pool_page_views(pool: Any) -> dict[str, torch.Tensor]:
    """The host pool's KV buffer(s) as tensors with dim 0 = page, sharing the pool's memory.

    Each of SGLang's host layouts keeps a page as one contiguous run once the axes before its token
    (or page) axis are fixed: ``page_first`` MHA ``(2, tokens, layers, heads, dim)`` gives two
    views (K and V), MLA ``page_first`` ``(tokens, layers, 1, dim)`` one, ``layer_first`` one per
    layer and component, ``page_first_direct`` / ``page_head`` / ``page_unified`` (page axis) one
    or two. A block of the store is the page's run in every view. Other layouts are refused."""
    buffers = pool.kv_buffer if isinstance(pool.kv_buffer, (list, tuple)) else [pool.kv_buffer]
    pages = int(pool.page_num)
    if pool.layout in _TOKEN_AXIS_LAYOUTS:
        axis_len, what = int(pool.size), "token"
    elif pool.layout in _PAGE_AXIS_LAYOUTS:
        axis_len, what = pages, "page"
    else:
        raise ValueError(f"UringKVHiCacheStorage: host layout {pool.layout!r} is not supported "
                         f"(supported: {', '.join(_TOKEN_AXIS_LAYOUTS + _PAGE_AXIS_LAYOUTS)})")
    views: dict[str, torch.Tensor] = {}
    for b, buf in enumerate(buffers):
        lead = next((axis for axis, n in enumerate(buf.shape) if n == axis_len), None)
        if lead is None:
            raise ValueError(f"UringKVHiCacheStorage: no {what} axis ({axis_len}) in the host pool's buffer of "
                             f"shape {tuple(buf.shape)} (layout {pool.layout!r})")
        for idx in itertools.product(*(range(n) for n in buf.shape[:lead])):
            part = buf[idx] if idx else buf
            if not part.is_contiguous():
                raise ValueError(f"UringKVHiCacheStorage: layout {pool.layout!r} does not keep a page contiguous")
            views[".".join(map(str, (b, *idx)))] = part.view(torch.uint8).view(pages, -1)
    per_token = getattr(pool, "size_per_token", None)
    page_bytes = sum(v.shape[1] for v in views.values())
    if per_token is not None and page_bytes != int(per_token) * int(pool.page_size):
        raise ValueError(f"UringKVHiCacheStorage: the pool's views give {page_bytes} bytes a page, expected "
                         f"{int(per_token) * int(pool.page_size)} (layout {pool.layout!r})")
    return views


class UringKVHiCacheStorage(HiCacheStorage):  # type: ignore[misc]
    """An SGLang HiCache storage backend on a uring_kv block store (see the module docstring).

    Built by SGLang's ``StorageBackendFactory`` as ``cls(storage_config, kwargs)``; the options are
    keys of ``--hicache-storage-backend-extra-config`` (``storage_config.extra_config``):
    ``root_dir`` (the directory of the file, or a list of directories, one per drive: the pages are
    striped over a file in each), ``capacity_bytes`` (the most the files hold: pages are evicted,
    least recently used first, to stay within it), ``interface_v1`` (must be 1: the zero-copy
    calls), and optionally ``num_slots`` (staging slots per file, default 16), ``io_depth`` (reads
    and writes in flight per file; default: the slots), ``direct`` (None: O_DIRECT where the
    filesystem takes it), ``io`` ("auto", "uring", "threads"), ``persistent`` (keep the pages
    across restarts, in a file named after :func:`run_fingerprint`) and ``fsync`` (with
    ``persistent``: sync before a key becomes visible; default true). The store opens when SGLang
    registers its host pool (``register_mem_pool_host``)."""

    def __init__(self, storage_config: Any, kwargs: dict[str, Any] | None = None) -> None:
        extra = dict(getattr(storage_config, "extra_config", None) or {})
        self._config = StoreConfig.from_mapping(extra, owner="UringKVHiCacheStorage")
        if not int(extra.get("interface_v1", 0)):
            raise ValueError('UringKVHiCacheStorage needs "interface_v1": 1 in the extra config (zero-copy calls)')
        if getattr(storage_config, "is_mla_model", False) and int(getattr(storage_config, "tp_size", 1)) > 1:
            # SGLang writes rank-replicated (MLA) KV from one rank and asks every rank for hits;
            # each rank's file is private, so the other ranks would never hit.
            raise ValueError("UringKVHiCacheStorage: MLA models with tp_size > 1 are not supported (one file a rank)")
        if int(getattr(storage_config, "dcp_size", 1)) > 1:
            raise ValueError("UringKVHiCacheStorage: decode context parallelism (dcp_size > 1) is not supported")
        self.storage_config = storage_config
        self._store: SyncBlockStore | None = None
        self._page_size = 1

    # ---------------------------------------------------------------- set-up
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        self._close_store()
        if int(getattr(mem_pool_host, "dcp_size", 1)) > 1:
            raise ValueError("UringKVHiCacheStorage: decode context parallelism (dcp_size > 1) is not supported")
        views = pool_page_views(mem_pool_host)
        self._page_size = int(mem_pool_host.page_size)
        if self._config.persistent:
            # one file per run configuration and rank: another model's pages are in another file
            fingerprint = run_fingerprint(self.storage_config, self._page_size)
            name = fingerprint_name("uring-kv-sglang", fingerprint)
        else:
            fingerprint, name = "", f"uring-kv-sglang-{getattr(self.storage_config, 'tp_rank', 0)}.bin"
        self._store = open_store(views, self._config, name, fingerprint=fingerprint)
        del views

    def _pages(self, keys: list[str], host_indices: torch.Tensor) -> list[int] | None:
        """The pool page of each key: its first token slot / page_size (None, logged, if malformed)."""
        ps = self._page_size
        slots = host_indices.tolist()
        if len(slots) != len(keys) * ps or any(s % ps for s in slots[::ps]):
            logger.error("UringKVHiCacheStorage: %d host indices for %d keys of %d-token pages, or unaligned",
                         len(slots), len(keys), ps)
            return None
        return [s // ps for s in slots[::ps]]

    # ---------------------------------------------------------------- zero-copy (interface v1)
    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None) -> list[bool]:
        store, pages = self._store, self._pages(keys, host_indices)
        if store is None or pages is None:
            return [False] * len(keys)
        first: dict[bytes, int] = {}  # a key twice in one call is written once
        for key, page in zip(keys, pages, strict=True):
            first.setdefault(key.encode(), page)
        failed: set[bytes] = set()
        try:
            store.put(list(first), list(first.values()))
        except KeyIOError as error:  # EIO, ENOSPC, EBUSY (no room): those keys stay misses
            failed = set(error.failures)
        except Exception:
            logger.exception("UringKVHiCacheStorage: a backup of %d pages failed", len(first))
            return [False] * len(keys)
        return [key.encode() not in failed for key in keys]

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None) -> list[bool]:
        store, pages = self._store, self._pages(keys, host_indices)
        if store is None or pages is None:
            return [False] * len(keys)
        encoded = [key.encode() for key in keys]
        try:  # every (key, page) pair, a key asked twice included; those held when it runs
            loaded = set(store.get_present(encoded, list(pages), prefetch=Prefetch()))
        except Exception:
            logger.exception("UringKVHiCacheStorage: a prefetch of %d pages failed", len(keys))
            return [False] * len(keys)
        return [key in loaded for key in encoded]

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        store = self._store
        return 0 if store is None else store.lookup(key.encode() for key in keys)

    def exists(self, key: str) -> bool:
        store = self._store
        return store is not None and store.contains(key.encode())

    # ---------------------------------------------------------------- copying interface: not served
    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        raise NotImplementedError('UringKVHiCacheStorage serves the zero-copy calls only ("interface_v1": 1)')

    def batch_get(self, keys: list[str], target_locations: Any = None, target_sizes: Any = None) -> Any:
        raise NotImplementedError('UringKVHiCacheStorage serves the zero-copy calls only ("interface_v1": 1)')

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        raise NotImplementedError('UringKVHiCacheStorage serves the zero-copy calls only ("interface_v1": 1)')

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        raise NotImplementedError('UringKVHiCacheStorage serves the zero-copy calls only ("interface_v1": 1)')

    # ---------------------------------------------------------------- end
    @property
    def store(self) -> SyncBlockStore | None:
        """The block store (its engine's stats say whether it got O_DIRECT); None until SGLang
        registers its host pool, and after :meth:`close`."""
        return self._store

    def stats(self) -> dict[str, int]:
        """The block store's counters (keys held, capacity, evictions, failures). (SGLang's own
        ``get_stats`` expects its ``StorageMetrics``; it keeps the base class's None.)"""
        store = self._store
        return store.stats() if store is not None else {}

    def close(self) -> None:
        """Finish what is in flight, close the store (nothing is left on disk, unless persistent: its
        file and index stay for the next start), join its thread."""
        self._close_store()

    def _close_store(self) -> None:
        store, self._store = self._store, None
        if store is not None:
            store.close()
            del store
            gc.collect()  # the engine's last references to the pool's pages


def run_fingerprint(storage_config: Any, page_size: int) -> str:
    """What a persistent store's pages are valid for, as JSON: the model and this rank's place in
    the parallel layout (the fields SGLang's own HiCacheFile names its keys by), the MLA flag and
    the page size in tokens. The pages' byte geometry (layers, bytes, dtype) the store checks
    itself. A restart with the same values reopens the file; any other opens another one."""
    fields = ("model_name", "tp_rank", "tp_size", "pp_rank", "pp_size", "attn_cp_rank", "attn_cp_size",
              "dp_rank", "is_mla_model", "dcp_rank", "dcp_size")
    run = {name: getattr(storage_config, name, None) for name in fields}
    return json.dumps({"sglang": run, "page_size": page_size}, sort_keys=True)


__all__ = ["UringKVHiCacheStorage", "pool_page_views", "run_fingerprint"]
