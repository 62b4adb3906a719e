"""UringKVHiCacheStorage built by SGLang's own dynamic-backend factory (sglang 0.5.23, in its own
virtualenv), driven with the calls SGLang's cache controller makes from its prefetch and backup
threads: ``batch_set_v1`` / ``batch_exists`` / ``batch_get_v1`` on host-pool token slots.

The host pool is a stand-in laid out exactly as SGLang's (``MHATokenToKVPoolHost`` /
``MLATokenToKVPoolHost`` ``init_kv_buffer``, checked against the installed source below): the
real classes live in ``sglang.srt.mem_cache.pool_host``, whose imports reach transformers and
torchvision, and PyPI's torchvision does not import on the CPU torch. Pages are random bytes;
every page read back is compared byte for byte, through SGLang's own ``get_data_page`` formulas.
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Iterator
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import pytest
import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheFile, HiCacheStorageConfig
from sglang.srt.mem_cache.storage import StorageBackendFactory
from tmpfs import mounted_tmpfs

from uring_kv.integrations.sglang import UringKVHiCacheStorage

PAGE = 8  # tokens a page
LAYERS, HEADS, DIM = 2, 2, 64  # bf16: 4 KiB of K and 4 KiB of V a page (MHA)
PAGES = 16


class HostPool:
    """SGLang's host pool as the backend sees it: ``kv_buffer`` in SGLang's layout, ``size`` token
    slots (a whole number of pages), ``page_size``, ``page_num``, ``size_per_token``, ``layout``,
    and ``get_data_page`` as SGLang defines it for that layout."""

    def __init__(self, layout: str = "page_first", mla: bool = False, pages: int = PAGES) -> None:
        self.layout, self.mla = layout, mla
        self.page_size, self.page_num, self.size = PAGE, pages, pages * PAGE
        self.dtype = torch.bfloat16
        self.dcp_size = 1
        dims: tuple[int, ...]
        if mla:  # MLATokenToKVPoolHost: one latent row of kv_cache_dim a token and layer
            dims = {"page_first": (self.size, LAYERS, 1, 2 * HEADS * DIM),
                    "layer_first": (LAYERS, self.size, 1, 2 * HEADS * DIM)}[layout]
        else:  # MHATokenToKVPoolHost
            dims = {"page_first": (2, self.size, LAYERS, HEADS, DIM),
                    "layer_first": (2, LAYERS, self.size, HEADS, DIM),
                    "page_first_direct": (2, pages, LAYERS, PAGE, HEADS, DIM),
                    "page_head": (2, pages, HEADS, PAGE, LAYERS, DIM)}[layout]
        self.kv_buffer = torch.zeros(dims, dtype=self.dtype)
        self.size_per_token = 2 * HEADS * DIM * LAYERS * self.dtype.itemsize

    def page(self, index: int) -> torch.Tensor:
        """The page at token slot ``index``, unflattened: SGLang's get_data_page slice."""
        b, ps = self.kv_buffer, self.page_size
        if self.mla:
            return b[index:index + ps] if self.layout == "page_first" else b[:, index:index + ps]
        if self.layout in ("page_first_direct", "page_head"):
            return b[:, index // ps:index // ps + 1]
        return b[:, index:index + ps] if self.layout == "page_first" else b[:, :, index:index + ps]

    def get_data_page(self, index: int) -> torch.Tensor:
        """SGLang's get_data_page(index, flat=True)."""
        return self.page(index).flatten()

    def page_bytes(self, page: int) -> bytes:
        return self.get_data_page(page * self.page_size).view(torch.uint8).numpy().tobytes()

    def fill(self, pages: list[int], seed: int) -> list[bytes]:
        """Random bytes into each page; returns them."""
        g = torch.Generator().manual_seed(seed)
        for p in pages:
            target = self.page(p * self.page_size)
            data = torch.randint(-128, 128, (target.numel() * self.dtype.itemsize,), dtype=torch.int8, generator=g)
            target.copy_(data.view(self.dtype).view(target.shape))
        return [self.page_bytes(p) for p in pages]


PAGE_BYTES = HostPool().size_per_token * PAGE


def slots(pages: list[int]) -> torch.Tensor:
    """The host indices SGLang passes: every token slot of each page, page after page."""
    return torch.cat([torch.arange(p * PAGE, (p + 1) * PAGE, dtype=torch.int64) for p in pages])


def keys(*numbers: int) -> list[str]:
    return [f"{n:064x}" for n in numbers]  # SGLang's keys: hex page hashes


def storage_config(root: Path | list[str], capacity_pages: int = 64, model: str = "m",
                   **extra: Any) -> HiCacheStorageConfig:
    return HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=False,
        enable_storage_metrics=False, is_page_first_layout=True, model_name=model,
        extra_config={"backend_name": "uring_kv", "module_path": "uring_kv.integrations.sglang",
                      "class_name": "UringKVHiCacheStorage", "interface_v1": 1,
                      "root_dir": root if isinstance(root, list) else str(root),
                      "capacity_bytes": capacity_pages * PAGE_BYTES, **extra})


def make(root: Path | list[str], pool: HostPool, capacity_pages: int = 64, **extra: Any) -> UringKVHiCacheStorage:
    """As SGLang's cache controller attaches a storage backend: the factory, then the host pool."""
    backend = StorageBackendFactory.create_backend("dynamic", storage_config(root, capacity_pages, **extra), pool)
    backend.register_mem_pool_host(pool)
    assert isinstance(backend, UringKVHiCacheStorage)
    return backend


@pytest.fixture
def pool() -> HostPool:
    return HostPool()


@pytest.fixture
def backend(tmp_path: Path, pool: HostPool) -> Iterator[UringKVHiCacheStorage]:
    b = make(tmp_path, pool)
    yield b
    b.close()


def test_a_capacity_beyond_the_free_space_is_refused_when_the_backend_is_attached(tmp_path: Path,
                                                                                  pool: HostPool) -> None:
    """The store's one-line refusal reaches SGLang's factory; nothing is left behind."""
    with mounted_tmpfs(tmp_path / "small", "size=2m") as mount:
        with pytest.raises(ValueError, match=r"num_disk_blocks=\d+: a file of .* \(4 MiB\) does not fit in the "
                                             r"2 MiB free on the filesystem of .*/small$"):
            make(mount, pool, capacity_pages=(4 << 20) // PAGE_BYTES)
        assert os.listdir(mount) == []


def test_the_stand_in_pool_has_sglangs_layout() -> None:
    """The stand-in's buffer shapes are the ones SGLang 0.5.23 allocates (its source, verbatim)."""
    spec = find_spec("sglang")
    assert spec is not None and spec.submodule_search_locations
    pool_host = Path(spec.submodule_search_locations[0]) / "srt" / "mem_cache" / "pool_host"
    mha = re.sub(r"\s+", "", (pool_host / "mha.py").read_text())  # whitespace-free, as below
    mla = re.sub(r"\s+", "", (pool_host / "mla.py").read_text())
    for dims in ("(2,self.size,self.layer_num,self.head_num,self.head_dim)",  # page_first
                 "(2,self.layer_num,self.size,self.head_num,self.head_dim)",  # layer_first
                 "(2,self.page_num,self.layer_num,self.page_size,self.head_num,self.head_dim,)",  # page_first_direct
                 "(2,self.page_num,self.head_num,self.page_size,self.layer_num,self.head_dim,)"):  # page_head
        assert f"dims={dims}" in mha
    for dims in ("(self.size,self.layer_num,1,self.kv_cache_dim,)",  # page_first
                 "(self.layer_num,self.size,1,self.kv_cache_dim,)"):  # layer_first
        assert f"dims={dims}" in mla
    # get_data_page: the slices HostPool.page takes
    assert "data_page=self.kv_buffer[:,index:index+self.page_size,:,:,:]" in mha
    assert "data_page=self.kv_buffer[:,:,index:index+self.page_size,:,:]" in mha
    assert "data_page=self.kv_buffer[:,real_index:real_index+1,:,:,:,:]" in mha
    assert "data_page=self.kv_buffer[index:index+self.page_size,:,:,:]" in mla
    assert "data_page=self.kv_buffer[:,index:index+self.page_size,:,:]" in mla


@pytest.mark.parametrize(("layout", "mla"), [("page_first", False), ("layer_first", False),
                                                   ("page_first_direct", False), ("page_head", False),
                                                   ("page_first", True), ("layer_first", True)])
def test_set_exists_get_round_trip_is_byte_identical(tmp_path: Path, layout: str, mla: bool) -> None:
    pool = HostPool(layout, mla)
    backend = make(tmp_path, pool)
    try:
        ks = keys(1, 2, 3, 4)
        stored = pool.fill([3, 7, 1, 12], seed=1)
        assert backend.batch_set_v1(ks, slots([3, 7, 1, 12])) == [True] * 4
        assert backend.batch_exists(ks) == 4 and all(backend.exists(k) for k in ks)
        pool.kv_buffer.zero_()
        assert backend.batch_get_v1(ks, slots([0, 5, 9, 15])) == [True] * 4  # prefetched into other pages
        assert [pool.page_bytes(p) for p in (0, 5, 9, 15)] == stored
        assert backend.stats()["keys"] == 4
    finally:
        backend.close()


def test_a_layer_count_equal_to_the_page_count_does_not_confuse_the_axes(tmp_path: Path) -> None:
    """MLA layer_first is (layers, tokens, 1, dim): with as many layers as pages, the page must
    still be found on the token axis (a page is page_size slots of every layer)."""
    pool = HostPool("layer_first", mla=True, pages=LAYERS)
    backend = make(tmp_path, pool)
    try:
        stored = pool.fill([0, 1], seed=8)
        assert backend.batch_set_v1(keys(1, 2), slots([0, 1])) == [True, True]
        pool.kv_buffer.zero_()
        assert backend.batch_get_v1(keys(1, 2), slots([1, 0])) == [True, True]
        assert [pool.page_bytes(1), pool.page_bytes(0)] == stored
    finally:
        backend.close()


def test_an_unknown_layout_is_refused(tmp_path: Path) -> None:
    pool = HostPool()
    pool.layout = "page_first_kv_split"
    backend = StorageBackendFactory.create_backend("dynamic", storage_config(tmp_path), pool)
    with pytest.raises(ValueError, match="page_first_kv_split"):
        backend.register_mem_pool_host(pool)
    assert list(tmp_path.iterdir()) == []


def test_batch_exists_counts_the_leading_hits(backend: UringKVHiCacheStorage, pool: HostPool) -> None:
    pool.fill([0, 1, 2], seed=2)
    assert backend.batch_set_v1(keys(1, 2, 4), slots([0, 1, 2])) == [True] * 3
    assert backend.batch_exists(keys(1, 2, 3, 4)) == 2
    assert backend.batch_exists(keys(9, 1)) == 0
    assert backend.batch_exists([]) == 0


def test_a_key_already_held_is_not_rewritten_and_a_repeated_key_is_written_once(
        backend: UringKVHiCacheStorage, pool: HostPool) -> None:
    first = pool.fill([0], seed=3)
    assert backend.batch_set_v1(keys(1), slots([0])) == [True]
    pool.fill([0, 1], seed=4)
    assert backend.batch_set_v1(keys(1, 2, 2), slots([0, 1, 2])) == [True] * 3
    assert backend.stats()["keys"] == 2
    assert backend.batch_get_v1(keys(1), slots([5])) == [True]
    assert pool.page_bytes(5) == first[0]


def test_a_key_asked_twice_in_one_prefetch_fills_both_pages(backend: UringKVHiCacheStorage, pool: HostPool) -> None:
    stored = pool.fill([0], seed=9)
    assert backend.batch_set_v1(keys(1), slots([0])) == [True]
    pool.fill([4, 5], seed=10)  # other bytes where the prefetch lands
    assert backend.batch_get_v1(keys(1, 1), slots([4, 5])) == [True, True]
    assert pool.page_bytes(4) == stored[0] and pool.page_bytes(5) == stored[0]


def test_capacity_is_respected_and_evicted_keys_are_misses(tmp_path: Path, pool: HostPool) -> None:
    backend = make(tmp_path, pool, capacity_pages=4)
    try:
        fd = backend._store.store.engine.file.fd  # type: ignore[union-attr]
        data = {}
        for n in range(0, 10, 2):
            for k, b in zip(keys(n, n + 1), pool.fill([n, n + 1], seed=n), strict=True):
                data[k] = b
            assert backend.batch_set_v1(keys(n, n + 1), slots([n, n + 1])) == [True, True]
            stats = backend.stats()
            assert stats["keys"] <= 4 and stats["capacity_blocks"] == 4
            assert os.fstat(fd).st_size <= 4 * PAGE_BYTES
        assert backend.stats()["evictions"] == 6
        assert backend.batch_exists(keys(*range(10))) == 0  # the oldest went first
        assert backend.batch_exists(keys(6, 7, 8, 9)) == 4
        assert backend.batch_get_v1(keys(0, 6), slots([14, 15])) == [False, True]
        assert pool.page_bytes(15) == data[keys(6)[0]]
    finally:
        backend.close()


def test_a_failed_load_is_false_and_later_a_miss(backend: UringKVHiCacheStorage, pool: HostPool) -> None:
    """The file cut short under the store: the prefetch reports False for its keys, and every
    later batch_exists stops before them (SGLang recomputes instead of prefetching them again)."""
    ks = keys(5, 6)
    pool.fill([0, 1], seed=5)
    assert backend.batch_set_v1(ks, slots([0, 1])) == [True, True]
    os.ftruncate(backend._store.store.engine.file.fd, 0)  # type: ignore[union-attr]
    assert backend.batch_get_v1(ks, slots([2, 3])) == [False, False]
    assert backend.batch_exists(ks) == 0 and not backend.exists(ks[0])
    assert backend.stats()["load_failures"] == 2
    assert backend.batch_get_v1(ks, slots([2, 3])) == [False, False]


def test_a_key_evicted_before_its_load_fails_alone(backend: UringKVHiCacheStorage, pool: HostPool) -> None:
    ks = keys(1, 2, 3)
    stored = pool.fill([0, 1, 2], seed=6)
    assert backend.batch_set_v1(ks, slots([0, 1, 2])) == [True] * 3
    sync = backend._store
    assert sync is not None
    store = sync.store

    async def drop() -> None:
        store._drop(store._index[ks[1].encode()])

    sync._loop.submit(drop()).result()
    pool.kv_buffer.zero_()
    assert backend.batch_get_v1(ks, slots([4, 5, 6])) == [True, False, True]
    assert pool.page_bytes(4) == stored[0] and pool.page_bytes(6) == stored[2]
    assert not any(pool.page_bytes(5))


def test_backup_and_prefetch_threads_at_once(tmp_path: Path) -> None:
    """SGLang's backup thread writing while its prefetch thread checks and reads: every page read
    is the one written under its key."""
    pool = HostPool(pages=32)
    backend = make(tmp_path, pool)
    try:
        stored = dict(zip(keys(*range(16)), pool.fill(list(range(16)), seed=9), strict=True))
        errors: list[str] = []

        def backup() -> None:
            for n in range(0, 16, 2):
                if backend.batch_set_v1(keys(n, n + 1), slots([n, n + 1])) != [True, True]:
                    errors.append(f"backup {n} failed")

        def prefetch() -> None:
            done = 0
            while done < 16:
                done = backend.batch_exists(keys(*range(16)))
                ks = keys(*range(done))
                if ks and backend.batch_get_v1(ks, slots([16 + i for i in range(done)])) != [True] * done:
                    errors.append("a prefetch failed")
                for i, k in enumerate(ks):
                    if pool.page_bytes(16 + i) != stored[k]:
                        errors.append(f"page of {i} differs")

        threads = [threading.Thread(target=backup), threading.Thread(target=prefetch)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors and backend.stats()["keys"] == 16
    finally:
        backend.close()


def test_malformed_host_indices_fail_every_key(backend: UringKVHiCacheStorage) -> None:
    assert backend.batch_set_v1(keys(1, 2), slots([0])) == [False, False]  # one page for two keys
    assert backend.batch_set_v1(keys(1), slots([0]) + 1) == [False]  # not page-aligned
    assert backend.batch_exists(keys(1)) == 0


def test_options_reach_the_engine(tmp_path: Path, pool: HostPool) -> None:
    backend = make(tmp_path, pool, num_slots=8, io_depth=4, direct=False, io="threads")
    try:
        engine = backend._store.store.engine  # type: ignore[union-attr]
        assert engine.num_slots == 8 and engine.io_depth == 4 and not engine.file.direct
        assert "thread" in engine.stats()["io"]
    finally:
        backend.close()


@pytest.mark.parametrize(("change", "message"), [
    ({"interface_v1": 0}, "interface_v1"),
    ({"root_dir": None}, "root_dir"),
])
def test_the_factory_refuses_a_bad_config(tmp_path: Path, pool: HostPool, change: dict[str, Any],
                                          message: str) -> None:
    config = storage_config(tmp_path)
    assert config.extra_config is not None
    for k, v in change.items():
        if v is None:
            del config.extra_config[k]
        else:
            config.extra_config[k] = v
    with pytest.raises(ValueError, match=message):
        StorageBackendFactory.create_backend("dynamic", config, pool)


def test_replicated_mla_across_ranks_is_refused(tmp_path: Path, pool: HostPool) -> None:
    config = storage_config(tmp_path)
    config.is_mla_model, config.tp_size = True, 2
    with pytest.raises(ValueError, match="MLA"):
        StorageBackendFactory.create_backend("dynamic", config, pool)


def test_close_leaves_no_thread_and_no_file(tmp_path: Path, pool: HostPool) -> None:
    threads = set(threading.enumerate())
    fds = set(os.listdir("/proc/self/fd"))
    backend = make(tmp_path, pool)
    pool.fill(list(range(PAGES)), seed=7)
    assert backend.batch_set_v1(keys(*range(PAGES)), slots(list(range(PAGES)))) == [True] * PAGES
    backend.close()
    backend.close()  # idempotent
    assert set(threading.enumerate()) <= threads, "a thread outlived close()"
    assert set(os.listdir("/proc/self/fd")) <= fds, "an fd outlived close()"
    assert list(tmp_path.iterdir()) == []
    assert backend.batch_exists(keys(0)) == 0
    assert backend.batch_set_v1(keys(0), slots([0])) == [False]
    assert backend.batch_get_v1(keys(0), slots([0])) == [False]


def test_sglangs_own_file_backend_round_trips(tmp_path: Path) -> None:
    """SGLang's HiCacheFile in the same environment (the install is a working SGLang)."""
    config = storage_config(tmp_path)
    config.extra_config = {"file_storage_path": str(tmp_path / "hicache")}
    store = HiCacheFile(config)
    page = torch.randn(2 * LAYERS * PAGE * HEADS * DIM).to(torch.bfloat16)
    assert store.batch_set(keys(1, 2), [page, page * 2])
    assert store.batch_exists(keys(1, 2, 3)) == 2
    got = store.get(keys(2)[0], torch.zeros_like(page))
    assert got is not None and torch.equal(got, page * 2)


def test_a_persistent_store_serves_its_pages_after_a_restart(tmp_path: Path) -> None:
    """``persistent: true``: pages backed up before a close are there after SGLang starts again
    with the same model and layout, byte-identical; another model (same pages, same keys) opens a
    file of its own and finds nothing."""
    pool = HostPool()
    ks = keys(1, 2, 3)
    stored = pool.fill([2, 4, 6], seed=3)
    first = make(tmp_path, pool, persistent=True)
    try:
        assert first.batch_set_v1(ks, slots([2, 4, 6])) == [True] * 3
    finally:
        first.close()
    pool.kv_buffer.zero_()
    again = make(tmp_path, pool, persistent=True)
    try:
        assert again.batch_exists(ks) == 3
        assert again.batch_get_v1(ks, slots([1, 3, 5])) == [True] * 3
        assert [pool.page_bytes(p) for p in (1, 3, 5)] == stored
    finally:
        again.close()
    other = make(tmp_path, pool, persistent=True, model="another-model")
    try:
        assert other.batch_exists(ks) == 0
    finally:
        other.close()
    files = sorted(p.name for p in tmp_path.iterdir() if p.name.endswith(".bin"))
    assert len(files) == 2 and all(name.startswith("uring-kv-sglang-") for name in files), files


def test_a_store_over_several_directories_stripes_its_pages(tmp_path: Path, pool: HostPool) -> None:
    """``root_dir`` a list: one file per directory, a backup's pages split evenly over them and
    prefetched back byte-identical; fsync without persistence is refused."""
    drives = [tmp_path / "nvme0", tmp_path / "nvme1"]
    for drive in drives:
        drive.mkdir()
    backend = make([str(d) for d in drives], pool)
    try:
        ks = keys(*range(8))
        stored = pool.fill(list(range(8)), seed=5)
        assert backend.batch_set_v1(ks, slots(list(range(8)))) == [True] * 8
        assert backend.stats()["stripes"] == 2
        assert [s.stats()["keys"] for s in backend._store.store.stripes] == [4, 4]  # type: ignore[union-attr]
        pool.kv_buffer.zero_()
        assert backend.batch_get_v1(ks, slots(list(range(8, 16)))) == [True] * 8
        assert [pool.page_bytes(p) for p in range(8, 16)] == stored
    finally:
        backend.close()
    with pytest.raises(ValueError, match="fsync applies to a persistent store"):
        make(tmp_path, pool, fsync=True)


def test_its_reads_run_as_prefetches(backend: UringKVHiCacheStorage, pool: HostPool) -> None:
    """SGLang reads its storage only from its prefetch thread, for requests not yet scheduled:
    every batch_get_v1 runs in uring_kv's prefetch class (behind demand loads, ahead of the backup
    thread's writes), as the engine's books for the last second show."""
    ks = keys(1, 2)
    pool.fill([0, 1], seed=3)
    assert backend.batch_set_v1(ks, slots([0, 1])) == [True, True]
    assert backend.batch_get_v1(ks, slots([4, 5])) == [True, True]
    metrics = backend._store.store.engine.metrics()  # type: ignore[union-attr]
    assert metrics["prefetch"]["rate_bytes_s"] > 0
    assert metrics["load"]["rate_bytes_s"] == 0  # no demand load
