"""The configuration of :class:`uring_kv.integrations.lmcache.UringKVL2Adapter`: its keys in the
adapter JSON of ``lmcache server --l2-adapter``, checked, with defaults."""

from __future__ import annotations

from typing import Any

from lmcache.v1.distributed.l2_adapters.config import L2AdapterConfigBase

from uring_kv.integrations.config import STORE_KEYS, StoreConfig

ROWS = ("auto", "l1", "staging")


class UringKVL2AdapterConfig(L2AdapterConfigBase):  # type: ignore[misc]
    """The adapter's options, from ``adapter_params`` (LMCache's plugin loader finds this class by
    its name and builds it with :meth:`from_dict`):

    * ``root_dir`` (required): the directory of the block file (an unnamed file: nothing of it
      outlives the server, unless ``persistent``), or a list of directories, one per drive: the
      blocks are striped over a file in each;
    * ``capacity_bytes`` (required): the most the file holds; blocks are evicted, least recently
      used first, to stay within it (each block counted padded to 4 KiB);
    * ``block_bytes``: the block size (default: the first chunk's size);
    * ``rows``: ``"auto"`` (default: the L1 arena when LMCache gives one, else staging rows),
      ``"l1"`` (the arena only: a chunk outside its slots is a failed store and a miss) or
      ``"staging"`` (always copy through the adapter's rows);
    * ``staging_bytes``: memory of the staging rows (default 64 MiB, at least one block);
    * ``num_slots``, ``io_depth``, ``direct``, ``io``: the store's engine options (see
      :class:`uring_kv.Engine`), per file;
    * ``persistent``: keep the blocks across restarts (a file per block size, its index beside
      it; LMCache's keys name the model and rank themselves; needs ``block_bytes``, since the store
      opens at start, so that the kept keys are hits at once); ``fsync`` (with ``persistent``,
      default true): a key is visible only once its bytes and index entry are synced."""

    def __init__(self, root_dir: str | list[str], capacity_bytes: int, block_bytes: int | None = None,
                 rows: str = "auto", staging_bytes: int = 64 << 20, num_slots: int = 16, io_depth: int | None = None,
                 direct: bool | None = None, io: str | None = None, persistent: bool = False,
                 fsync: bool | None = None) -> None:
        self.root_dir = root_dir
        self.root_dirs = [root_dir] if isinstance(root_dir, str) else list(root_dir)
        self.persistent = persistent
        self.fsync = fsync
        self.capacity_bytes = capacity_bytes
        self.block_bytes = block_bytes
        self.rows = rows
        self.staging_bytes = staging_bytes
        self.num_slots = num_slots
        self.io_depth = io_depth
        self.direct = direct
        self.io = io

    @property
    def store(self) -> StoreConfig:
        """The options that describe the block store (what every adapter of uring_kv shares)."""
        return StoreConfig(tuple(self.root_dirs), self.capacity_bytes, self.persistent, self.fsync, self.num_slots,
                           self.io_depth, self.direct, self.io)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> UringKVL2AdapterConfig:
        if unknown := sorted(set(d) - {"type", "block_bytes", "rows", "staging_bytes", *STORE_KEYS}):
            raise ValueError(f"unknown uring_kv adapter option(s) {unknown}")
        store = StoreConfig.from_mapping(d, owner="UringKVL2Adapter", noun="adapter")
        if store.persistent and d.get("block_bytes") is None:
            raise ValueError("UringKVL2Adapter: a persistent adapter needs block_bytes (the chunk size), to open at "
                             "start")
        sizes: dict[str, int | None] = {}
        for name in ("block_bytes", "staging_bytes"):
            value = d.get(name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"UringKVL2Adapter: {name} must be a positive integer, got {value!r}")
            sizes[name] = value
        rows = d.get("rows", "auto")
        if rows not in ROWS:
            raise ValueError(f"UringKVL2Adapter: rows must be one of {', '.join(ROWS)}, got {rows!r}")
        return cls(d["root_dir"], store.capacity_bytes, sizes["block_bytes"], rows, sizes["staging_bytes"] or 64 << 20,
                   store.num_slots, store.io_depth, store.direct, store.io, store.persistent, store.fsync)

    @classmethod
    def help(cls) -> str:
        return ("uring_kv L2 adapter (plugin) adapter_params:\n"
                "- root_dir (str or list, required): directory of the block file, or one per drive\n"
                "- capacity_bytes (int, required): the most the file holds (LRU eviction)\n"
                "- block_bytes (int): block size (default: the first chunk's)\n"
                "- rows (str): auto | l1 | staging (default auto)\n"
                "- staging_bytes (int): memory of the staging rows (default 64 MiB)\n"
                "- num_slots, io_depth (int), direct (bool), io (auto|uring|threads): engine options\n"
                "- persistent (bool): keep the blocks across restarts; fsync (bool, default true)")
