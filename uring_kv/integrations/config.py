"""The store options every framework adapter takes, parsed and refused in one place, and the store
they describe.

Each adapter reads its options from what its framework hands it (vLLM's tier entry, SGLang's extra
config, LMCache's adapter JSON), and the ones that describe the store are the same everywhere:
``root_dir`` (one directory, or a list of them, one per drive: the rows are striped over a file in
each), ``capacity_bytes``, ``persistent`` and ``fsync``, and the engine's ``num_slots``,
``io_depth``, ``direct`` and ``io``. :meth:`StoreConfig.from_mapping` checks them and refuses a bad
one with the same one-line message in every adapter (prefixed by the adapter's name); the adapter
checks only its own keys. :func:`open_store` makes the store: one file or striped, persistent or
not, on its own loop thread (:class:`uring_kv.SyncBlockStore`, for frameworks that call from
threads) or not (for an adapter that runs its own loop). What the file is called stays the
adapter's choice: a persistent store's name is part of what finds its rows after a restart.

Never imports a framework.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, overload

from uring_kv.store import BlockStore
from uring_kv.striped import StripedBlockStore
from uring_kv.sync import SyncBlockStore

#: The keys :meth:`StoreConfig.from_mapping` reads (an adapter refuses the ones it does not know).
STORE_KEYS = ("root_dir", "capacity_bytes", "persistent", "fsync", "num_slots", "io_depth", "direct", "io")
IO_CHOICES = ("auto", "uring", "threads")
DEFAULT_SLOTS = 16


@dataclass(frozen=True)
class StoreConfig:
    """A checked description of an adapter's store (see the module docstring).

    ``root_dirs``: one directory per file (one: a :class:`uring_kv.BlockStore`; several: a
    :class:`uring_kv.StripedBlockStore`). ``fsync`` is None for the store's default (sync), and set
    only with ``persistent``. ``io_depth``, ``direct`` and ``io`` are None for the engine's
    defaults."""

    root_dirs: tuple[str, ...]
    capacity_bytes: int
    persistent: bool = False
    fsync: bool | None = None
    num_slots: int = DEFAULT_SLOTS
    io_depth: int | None = None
    direct: bool | None = None
    io: str | None = None

    @classmethod
    def from_mapping(cls, options: Mapping[str, Any], *, owner: str, noun: str = "store") -> StoreConfig:
        """The store options in ``options`` (other keys are left to the adapter), or ValueError
        naming the first bad one, prefixed by ``owner`` (the adapter's name); ``noun`` is what the
        adapter's documentation calls its store ("tier", "adapter")."""
        missing = [key for key in ("root_dir", "capacity_bytes") if options.get(key) is None]
        if missing:
            raise ValueError(f"{owner}: the configuration lacks {missing}")
        root = options["root_dir"]
        roots = [root] if isinstance(root, str) else list(root) if isinstance(root, (list, tuple)) else []
        if not roots or not all(isinstance(directory, str) and directory for directory in roots):
            raise ValueError(f"{owner}: root_dir must be a directory or a list of them (one per drive), "
                             f"got {root!r}")
        counts: dict[str, int | None] = {}
        for key in ("capacity_bytes", "num_slots", "io_depth"):
            value = options.get(key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{owner}: {key} must be a positive integer, got {value!r}")
            counts[key] = value
        persistent, fsync = options.get("persistent", False), options.get("fsync")
        if not isinstance(persistent, bool) or (fsync is not None and not isinstance(fsync, bool)):
            raise ValueError(f"{owner}: persistent and fsync must be true or false, got {persistent!r} and {fsync!r}")
        if fsync is not None and not persistent:
            raise ValueError(f"{owner}: fsync applies to a persistent {noun} (persistent: true)")
        direct = options.get("direct")
        if direct is not None and not isinstance(direct, bool):
            raise ValueError(f"{owner}: direct must be true, false or null, got {direct!r}")
        io = options.get("io")
        if io is not None and io not in IO_CHOICES:
            raise ValueError(f"{owner}: io must be {', '.join(IO_CHOICES[:-1])} or {IO_CHOICES[-1]}, got {io!r}")
        return cls(tuple(roots), counts["capacity_bytes"] or 0, persistent, fsync,
                   counts["num_slots"] or DEFAULT_SLOTS, counts["io_depth"], direct, io)

    def check_directories(self, owner: str) -> None:
        """ValueError naming the first root directory that does not exist (for an adapter that
        refuses at start-up what the store would refuse only when it opens)."""
        for directory in self.root_dirs:
            if not os.path.isdir(directory):
                raise ValueError(f"{owner}: root_dir {directory!r} is not a directory")

    def engine_options(self) -> dict[str, Any]:
        """The engine's options that are set (``num_slots`` always; the others where not None)."""
        options: dict[str, Any] = {"num_slots": self.num_slots}
        options.update((key, value) for key, value in
                       (("io_depth", self.io_depth), ("direct", self.direct), ("io", self.io)) if value is not None)
        return options

    def paths(self, name: str) -> list[str]:
        """The store's files: ``name`` in each of :attr:`root_dirs`."""
        return [os.path.join(directory, name) for directory in self.root_dirs]


def fingerprint_name(prefix: str, fingerprint: str) -> str:
    """A persistent store's file name for a run configuration: another configuration's rows are in
    another file, never refused."""
    return f"{prefix}-{hashlib.sha256(fingerprint.encode()).hexdigest()[:12]}.bin"


@overload
def open_store(caches: Any, config: StoreConfig, name: str, *, fingerprint: str = ...,
               threaded: Literal[True] = ...) -> SyncBlockStore: ...


@overload
def open_store(caches: Any, config: StoreConfig, name: str, *, fingerprint: str = ...,
               threaded: Literal[False]) -> BlockStore | StripedBlockStore: ...


def open_store(caches: Any, config: StoreConfig, name: str, *, fingerprint: str = "",
               threaded: bool = True) -> SyncBlockStore | BlockStore | StripedBlockStore:
    """The store ``config`` describes over ``caches`` (as :class:`uring_kv.BlockStore` takes them),
    in the file ``name`` of each root directory; ``fingerprint`` is what a persistent store's index
    must match to be kept (ignored otherwise). ``threaded``: a :class:`uring_kv.SyncBlockStore`,
    open and running on its own loop thread; else the asyncio store, not yet opened."""
    options = config.engine_options()
    if config.persistent:
        options.update(persistent=True, fingerprint=fingerprint, fsync=config.fsync)
    paths = config.paths(name)
    if threaded:
        return SyncBlockStore(caches, paths[0] if len(paths) == 1 else paths, capacity_bytes=config.capacity_bytes,
                              **options)
    if len(paths) > 1:
        return StripedBlockStore(caches, paths, capacity_bytes=config.capacity_bytes, **options)
    return BlockStore(caches, paths[0], capacity_bytes=config.capacity_bytes, **options)
