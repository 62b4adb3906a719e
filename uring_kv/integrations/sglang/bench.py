"""``uring-kv bench-sglang``: UringKVHiCacheStorage against SGLang's own HiCacheFile, same disk.

Both backends are built by SGLang's storage backend factory, as its cache controller attaches one
(``StorageBackendFactory.create_backend(name, storage_config, host_pool)`` then
``register_mem_pool_host``): ``dynamic`` with the documented extra-config JSON for
UringKVHiCacheStorage (by module path: this module does not import it), ``file`` for HiCacheFile
(its ``file_storage_path`` under ``--path``). Both get the same host pool, the same pages and the
same keys (SGLang's: hex SHA-256 page hashes), in one run.

The host pool is a stand-in laid out as SGLang's ``MLATokenToKVPoolHost`` with layout
``page_first`` allocates it: ``(token slots, layers, 1, kv_cache_dim)`` bf16, so dim 0 is the
token slot and a page (``page_size`` = 64 consecutive slots) is one contiguous run; the buffer is
page-aligned, as SGLang's pinned host pools are. Its ``get_data_page`` /
``get_dummy_flat_data_page`` / ``set_from_flat_data_page`` are SGLang's for that layout.
(SGLang's own class lives in ``sglang.srt.mem_cache.pool_host``, whose imports reach torchvision,
which does not import on the CPU torch.)

Each backend is driven as SGLang 0.5.23's ``HiCacheController`` drives it from its backup and
prefetch threads (``managers/cache_controller.py``), with blocking calls from ``--threads``
threads at once, each taking requests of ``--request`` pages off a shared queue:

* backup (``_page_backup``): calls of at most ``STORAGE_BATCH_SIZE`` (128) pages through the
  controller's page-set function: for a ``dynamic`` backend with ``interface_v1`` the zero-copy
  ``batch_set_v1(keys, host_indices, extra_info)`` (``_page_set_zero_copy``); for ``file`` the
  generic ``batch_set(keys, [host_pool.get_data_page(slot) ...])`` (``_generic_page_set``), since
  HiCacheFile has no v1 calls;
* prefetch: the hit query (``_storage_hit_query``: ``batch_exists`` per 128 keys), then calls of
  at most 128 pages through the page-get function: ``batch_get_v1`` for ours
  (``_page_get_zero_copy``), for ``file`` ``batch_get(keys, dummy pages)`` then
  ``set_from_flat_data_page`` into the pool (``_generic_page_get``). SGLang runs the hit query on
  one thread and the transfers on another; here a request does both in turn.

Every key is backed up once, then every request is prefetched, in another order (the requests
shuffled, the pages of a request in order), into a zeroed pool; afterwards every page is compared
with the bytes backed up. Reported per backend and operation: GB/s (the phase's pages over its
wall time), p50/p99 per page-set / page-get call, and uring_kv ÷ HiCacheFile.

Cold gets: before the prefetches HiCacheFile's files are synced and dropped from the page cache
(``posix_fadvise(DONTNEED)`` on each); UringKVHiCacheStorage's file is O_DIRECT where the
filesystem takes it (``direct`` in the results). HiCacheFile writes through the page cache
(``tofile`` then ``rename``), and its backups end before their bytes reach the disk.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from uring_kv.bench.args import (
    Defaults,
    at_least,
    byte_size,
    check_free_space,
    check_multiples,
    usable_directory,
)
from uring_kv.bench.results import framework_report, percentile, progress_printer

if TYPE_CHECKING:  # (torch is imported where a run needs it: the command's parser costs nothing)
    import torch

BACKENDS = ("uring_kv", "file")
TOKENS_PER_PAGE = 64  # the host pool's page_size
LAYERS = 8
BATCH = 128  # SGLang's STORAGE_BATCH_SIZE: pages per storage call at most (checked against SGLang's)


@dataclass
class Result:
    backend: str
    page_bytes: int
    op: str  # "set" (backup) or "get" (prefetch)
    gbps: float
    p50_ms: float
    p99_ms: float
    calls: int
    verified: bool
    direct: bool | None  # O_DIRECT for uring_kv's file; None for HiCacheFile (the page cache)


class HostPool:
    """SGLang's ``MLATokenToKVPoolHost`` with layout ``page_first``, as the backends see it."""

    layout = "page_first"
    dcp_size = 1
    device = "cpu"
    pin_memory = False

    def __init__(self, pages: int, page_bytes: int) -> None:
        import torch

        self.dtype = torch.bfloat16
        self.page_size, self.page_num, self.size = TOKENS_PER_PAGE, pages, pages * TOKENS_PER_PAGE
        self.layer_num = LAYERS
        self.kv_cache_dim = page_bytes // (TOKENS_PER_PAGE * LAYERS * self.dtype.itemsize)
        self.size_per_token = self.kv_cache_dim * self.dtype.itemsize * LAYERS
        raw = np.empty(pages * page_bytes + 4096, dtype=np.uint8)  # page-aligned, as pinned memory is
        start = -raw.ctypes.data % 4096
        flat = torch.from_numpy(raw[start:start + pages * page_bytes])
        self.kv_buffer = flat.view(self.dtype).view(self.size, LAYERS, 1, self.kv_cache_dim)
        self.words = flat.view(torch.int64).view(pages, -1)  # page p's bytes as int64 words

    def get_data_page(self, index: Any, flat: bool = True) -> torch.Tensor:
        page = self.kv_buffer[index:index + self.page_size, :, :, :]
        return page.flatten() if flat else page

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        import torch

        return torch.zeros((self.layer_num, self.page_size, 1, self.kv_cache_dim), dtype=self.dtype,
                           device=self.device, pin_memory=self.pin_memory).flatten()

    def set_from_flat_data_page(self, index: Any, data_page: torch.Tensor) -> None:
        self.kv_buffer[index:index + self.page_size, :, :, :] = data_page.reshape(
            self.page_size, self.layer_num, 1, self.kv_cache_dim)

    def stamp(self) -> None:
        """Page ``n``: the bench's identity pattern, every 8-byte word ``n << 32 | word``."""
        from uring_kv.bench.workload import stamp_identity

        stamp_identity(self.words.numpy(), list(range(self.page_num)))

    def stamped(self) -> bool:
        """Whether every page holds its identity pattern (checked 64 pages at a time: bounded temporaries)."""
        from uring_kv.bench.workload import holds_identity

        words = self.words.numpy()
        return all(holds_identity(words[first:first + 64], list(range(first, min(first + 64, self.page_num))))
                   for first in range(0, self.page_num, 64))


def _key(n: int) -> str:
    return hashlib.sha256(n.to_bytes(8, "big")).hexdigest()


def _backend(name: str, root: str, pool: HostPool, capacity: int) -> Any:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
    from sglang.srt.mem_cache.storage import StorageBackendFactory

    if name == "uring_kv":  # docs/sglang.md's extra config
        factory_name, extra = "dynamic", {
            "backend_name": "uring_kv", "module_path": "uring_kv.integrations.sglang",
            "class_name": "UringKVHiCacheStorage", "interface_v1": 1, "root_dir": root, "capacity_bytes": capacity}
    else:
        factory_name, extra = "file", {"file_storage_path": root}
    config = HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                                  is_mla_model=True, enable_storage_metrics=False, is_page_first_layout=True,
                                  model_name="uring-kv-bench", extra_config=extra)
    backend = StorageBackendFactory.create_backend(factory_name, config, pool)
    backend.register_mem_pool_host(pool)
    if name == "file" and os.path.realpath(backend.file_path) != os.path.realpath(root):
        raise RuntimeError(f"HiCacheFile writes to {backend.file_path}, not {root} "
                           "(SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR is set): unset it")
    return backend


class _Controller:
    """The page-set and page-get functions of SGLang's cache controller for one backend."""

    def __init__(self, backend: Any, zero_copy: bool, pool: HostPool) -> None:
        from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo

        self.backend, self.zero_copy, self.pool = backend, zero_copy, pool
        self.extra_info = HiCacheStorageExtraInfo
        self.page_size = pool.page_size

    def page_set(self, keys: list[str], host_indices: torch.Tensor) -> bool:
        extra_info = self.extra_info(prefix_keys=None)
        if self.zero_copy:  # _page_set_zero_copy
            return all(self.backend.batch_set_v1(keys, host_indices, extra_info))
        data = [self.pool.get_data_page(host_indices[i * self.page_size]) for i in range(len(keys))]
        return bool(self.backend.batch_set(keys, data))  # _generic_page_set

    def hit_query(self, keys: list[str]) -> int:  # _storage_hit_query
        hits = 0
        for start in range(0, len(keys), BATCH):
            batch = keys[start:start + BATCH]
            found = int(self.backend.batch_exists(batch, self.extra_info(prefix_keys=None)))
            hits += found
            if found < len(batch):
                break
        return hits

    def page_get(self, keys: list[str], host_indices: torch.Tensor) -> int:
        extra_info = self.extra_info(prefix_keys=None)
        if self.zero_copy:  # _page_get_zero_copy
            results = self.backend.batch_get_v1(keys, host_indices, extra_info)
            return next((i for i, ok in enumerate(results) if not ok), len(keys))
        dummy = [self.pool.get_dummy_flat_data_page() for _ in keys]  # _generic_page_get
        page_data = self.backend.batch_get(keys, dummy)
        if page_data is None:
            return 0
        count = 0
        for i in range(len(keys)):
            if page_data[i] is None:
                break
            self.pool.set_from_flat_data_page(host_indices[i * self.page_size], page_data[i])
            count += 1
        return count


def _drive(controller: _Controller, requests: list[list[int]], threads: int, get: bool,
           ) -> tuple[float, list[float], bool]:
    """Back up (or prefetch) every request's pages from ``threads`` threads: seconds, call
    latencies, and whether every call succeeded for every page."""
    import torch

    ps = controller.page_size
    latencies: list[list[float]] = [[] for _ in range(threads)]
    failed = threading.Event()
    lock = threading.Lock()
    queue = iter(requests)

    def work(mine: list[float]) -> None:
        while True:
            with lock:
                pages = next(queue, None)
            if pages is None:
                return
            keys = [_key(n) for n in pages]
            if get and controller.hit_query(keys) != len(keys):
                failed.set()
                continue
            for start in range(0, len(pages), BATCH):
                batch = pages[start:start + BATCH]
                slots = torch.cat([torch.arange(p * ps, (p + 1) * ps, dtype=torch.int64) for p in batch])
                began = time.perf_counter()
                if get:
                    ok = controller.page_get(keys[start:start + BATCH], slots) == len(batch)
                else:
                    ok = controller.page_set(keys[start:start + BATCH], slots)
                mine.append(time.perf_counter() - began)
                if not ok:
                    failed.set()

    workers = [threading.Thread(target=work, args=(latencies[i],), name=f"bench-sglang-{i}") for i in range(threads)]
    start = time.perf_counter()
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    return time.perf_counter() - start, [t for mine in latencies for t in mine], not failed.is_set()


def _drop_cache(root: str) -> None:
    for folder, _, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(folder, name), os.O_RDONLY)
            try:
                os.fdatasync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def run(directory: str, page_sizes: list[int], total: int, request: int, threads: int,
        backends: list[str] | None = None, progress: Any = None) -> list[Result]:
    from sglang.srt.mem_cache import hicache_storage

    if hicache_storage.STORAGE_BATCH_SIZE != BATCH:
        raise RuntimeError(f"SGLang's STORAGE_BATCH_SIZE is {hicache_storage.STORAGE_BATCH_SIZE}, "
                           f"this bench models {BATCH}")
    results = []
    for page_bytes in page_sizes:
        pages = max(request, total // page_bytes)
        order = [list(range(i, min(i + request, pages))) for i in range(0, pages, request)]
        shuffled = [order[int(i)] for i in np.random.default_rng(page_bytes).permutation(len(order))]
        pool = HostPool(pages, page_bytes)
        for name in backends or list(BACKENDS):
            root = tempfile.mkdtemp(prefix=f"uring-kv-sglang-{name}-", dir=directory)
            backend = _backend(name, root, pool, (pages + 1) * page_bytes)
            try:
                direct = backend.store.store.engine.stats()["direct"] if name == "uring_kv" else None
                controller = _Controller(backend, name == "uring_kv", pool)
                for op, requests in (("set", order), ("get", shuffled)):
                    if progress:
                        progress(f"{page_bytes >> 10} KiB pages, {name}: {op} of {pages} pages")
                    if op == "set":
                        pool.stamp()
                    else:
                        pool.words.zero_()
                        _drop_cache(root)
                    seconds, latencies, ok = _drive(controller, requests, threads, op == "get")
                    if op == "get":
                        ok &= pool.stamped()
                    results.append(Result(name, page_bytes, op, pages * page_bytes / seconds / 1e9,
                                          percentile(latencies, 0.5) * 1e3, percentile(latencies, 0.99) * 1e3,
                                          len(latencies), ok, direct))
            finally:
                if hasattr(backend, "close"):
                    backend.close()
                shutil.rmtree(root, ignore_errors=True)
        del pool
    return results


def render(results: list[Result]) -> list[str]:
    lines = [f"{'pages':>8}  {'op':<4} {'backend':<9} {'GB/s':>7} {'p50 ms':>8} {'p99 ms':>8}  {'ok':<3} "
             "uring_kv ÷ HiCacheFile"]
    for r in results:
        ratio = ""
        peer = next((o for o in results if (o.backend, o.page_bytes, o.op) == ("file", r.page_bytes, r.op)), None)
        if r.backend == "uring_kv" and peer is not None:
            ratio = f"{r.gbps / peer.gbps:.2f}× the GB/s, {r.p99_ms / peer.p99_ms:.2f}× the p99"
        lines.append(f"{r.page_bytes >> 10:>4} KiB  {r.op:<4} {r.backend:<9} {r.gbps:7.2f} {r.p50_ms:8.2f} "
                     f"{r.p99_ms:8.2f}  {'yes' if r.verified else 'NO':<3} {ratio}")
    return lines


def main(args: argparse.Namespace) -> int:
    try:
        import sglang.srt.mem_cache.hicache_storage
        import sglang.srt.mem_cache.storage  # noqa: F401
    except ImportError as exc:
        print(f"uring-kv bench-sglang: SGLang's HiCache is not importable here ({exc}); pip install sglang",
              file=sys.stderr)
        return 2

    progress = progress_printer("bench-sglang")
    results = run(args.path, args.page_bytes or [128 << 10, 2 << 20], args.bytes, args.request, args.threads,
                  args.backend, progress)
    title = (f"uring-kv bench-sglang · UringKVHiCacheStorage vs SGLang's HiCacheFile · {args.path} · requests of "
             f"{args.request} pages, calls of ≤ {BATCH}, {args.threads} threads · {time.strftime('%Y-%m-%d')}")
    config = {"path": args.path, "bytes": args.bytes, "request": args.request, "threads": args.threads,
              "tokens_per_page": TOKENS_PER_PAGE, "batch": BATCH}
    return framework_report(title, render(results), args.json, config, results)


def add_command(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """The command's arguments, in ``uring-kv``'s parser (:func:`command` runs it)."""
    parser = commands.add_parser("bench-sglang", formatter_class=Defaults,
                                 help="UringKVHiCacheStorage against SGLang's own HiCacheFile backend (needs SGLang)")
    parser.add_argument("--path", help="directory for both backends' files (default: the temp directory)")
    parser.add_argument("--page-bytes", type=byte_size, action="append",
                        help="bytes per host-pool page, SGLang's unit of storage (repeatable; default 128K, 2M)")
    parser.add_argument("--bytes", type=byte_size, default=1 << 30,
                        help="bytes each backend backs up per page size (the host pool holds them all)")
    parser.add_argument("--request", type=at_least(1), default=32,
                        help="pages per request (its calls: at most 128 pages, SGLang's batch)")
    parser.add_argument("--threads", type=at_least(1), default=2, help="threads calling each backend at once")
    parser.add_argument("--backend", action="append", choices=("uring_kv", "file"),
                        help="backends to run (repeatable; default both)")
    parser.add_argument("--json", help="write the results as JSON to this file")
    parser.set_defaults(func=command)


def command(args: argparse.Namespace) -> int:
    """Checks what the parser cannot (sizes, the directory, its free space), then runs the bench."""
    check_multiples("--page-bytes", args.page_bytes, 4096,
                    "a page of the host pool is read and written whole, in place")
    args.path = usable_directory(args.path)
    pages = max(args.page_bytes or [2 << 20])
    check_free_space(args.path, max(args.bytes, args.request * pages) + pages)  # one backend's files at a time
    return main(args)
