"""The configuration of :class:`uring_kv.integrations.lmcache.UringKVL2Adapter`: its keys in the
adapter JSON of ``lmcache server --l2-adapter``, checked, with defaults."""

from __future__ import annotations

from typing import Any

from lmcache.v1.distributed.l2_adapters.config import L2AdapterConfigBase

ROWS = ("auto", "l1", "staging")
STORE_OPTIONS = ("num_slots", "io_depth", "direct", "io")


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

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> UringKVL2AdapterConfig:
        known = {"type", "root_dir", "capacity_bytes", "block_bytes", "rows", "staging_bytes", "persistent", "fsync",
                 *STORE_OPTIONS}
        if unknown := sorted(set(d) - known):
            raise ValueError(f"unknown uring_kv adapter option(s) {unknown}")
        root_dir: Any = d.get("root_dir")
        listed = isinstance(root_dir, list) and root_dir and all(isinstance(r, str) and r for r in root_dir)
        if not listed and (not isinstance(root_dir, str) or not root_dir):
            raise ValueError("root_dir must be a non-empty string or a list of them (one directory per drive)")
        persistent, fsync = d.get("persistent", False), d.get("fsync")
        if not isinstance(persistent, bool) or (fsync is not None and not isinstance(fsync, bool)):
            raise ValueError(f"persistent and fsync must be true or false, got {persistent!r} and {fsync!r}")
        if fsync is not None and not persistent:
            raise ValueError("fsync applies to a persistent adapter (persistent: true)")
        if persistent and d.get("block_bytes") is None:
            raise ValueError("a persistent adapter needs block_bytes (the chunk size), to open at start")
        ints: dict[str, int | None] = {}
        for name, required in (("capacity_bytes", True), ("block_bytes", False), ("staging_bytes", False),
                               ("num_slots", False), ("io_depth", False)):
            value = d.get(name)
            if value is None and not required:
                ints[name] = None
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
            ints[name] = value
        rows = d.get("rows", "auto")
        if rows not in ROWS:
            raise ValueError(f"rows must be one of {', '.join(ROWS)}, got {rows!r}")
        direct = d.get("direct")
        if direct is not None and not isinstance(direct, bool):
            raise ValueError(f"direct must be true, false or null, got {direct!r}")
        io = d.get("io")
        if io is not None and io not in ("auto", "uring", "threads"):
            raise ValueError(f"io must be auto, uring or threads, got {io!r}")
        return cls(root_dir, ints["capacity_bytes"] or 0, ints["block_bytes"], rows,
                   ints["staging_bytes"] or 64 << 20, ints["num_slots"] or 16, ints["io_depth"], direct, io,
                   persistent, fsync)

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
