"""UringKVL2Adapter built by LMCache's own plugin loader (lmcache 0.5.6, in its own virtualenv) from
the JSON its server takes (``--l2-adapter``), and driven as LMCache's store and prefetch controllers
drive an L2 adapter: ``submit_*`` calls, completions waited for on the three eventfds, results
popped or queried once. The patterns follow LMCache's own adapter tests (its example plugin's
round-trip tests and its fs adapter's tests): chunks are ``TensorMemoryObj`` views of an L1 arena
described by an ``L1MemoryDesc`` (as LMCache's ``lmcache bench l2`` builds them), or standalone
tensors. Every chunk read back is compared byte for byte.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from lmcache.v1.distributed.api import ObjectKey
from lmcache.v1.distributed.internal_api import L1MemoryDesc
from lmcache.v1.distributed.l2_adapters import create_l2_adapter
from lmcache.v1.distributed.l2_adapters.config import add_l2_adapters_args, parse_args_to_l2_adapters_config
from lmcache.v1.memory_management import MemoryFormat, MemoryObjMetadata, TensorMemoryObj
from lmcache.v1.platform import consume_fd
from tmpfs import mounted_tmpfs, take_space

from uring_kv.integrations.lmcache import UringKVL2Adapter, UringKVL2AdapterConfig

CHUNK = 16 << 10  # bytes a chunk (a multiple of 4 KiB, as LMCache's L1 aligns them)
TIMEOUT = 20.0


def spec(root: Path, capacity_chunks: int = 64, **params: Any) -> str:
    """The documented ``--l2-adapter`` JSON."""
    return json.dumps({"type": "plugin", "module_path": "uring_kv.integrations.lmcache",
                       "class_name": "UringKVL2Adapter",
                       "adapter_params": {"root_dir": str(root), "capacity_bytes": capacity_chunks * CHUNK, **params}})


def build(spec_json: str, arena: Arena | None = None) -> UringKVL2Adapter:
    """What LMCache's StorageManager does with an ``--l2-adapter`` JSON: parse it, build the adapter
    through the factory registry (the plugin loader), with the L1 arena's descriptor."""
    config = parse_args_to_l2_adapters_config(argparse.Namespace(l2_adapter=[spec_json])).adapters[0]
    adapter = create_l2_adapter(config, l1_memory_desc=arena.desc if arena is not None else None)
    assert isinstance(adapter, UringKVL2Adapter)
    return adapter


def key(i: int, model: str = "test-model") -> ObjectKey:
    return ObjectKey(chunk_hash=i.to_bytes(16, "big"), model_name=model, kv_rank=0)


def tensor_obj(raw: torch.Tensor) -> TensorMemoryObj:
    """A chunk over ``raw`` (uint8), as LMCache's tests and its L2 bench make them."""
    meta = MemoryObjMetadata(shape=torch.Size([raw.numel()]), dtype=torch.uint8, address=raw.data_ptr(),
                             phy_size=raw.numel(), fmt=MemoryFormat.KV_2LTD, ref_count=1)
    return TensorMemoryObj(raw_data=raw, metadata=meta, parent_allocator=None)


class Arena:
    """An L1 arena of ``slots`` chunks (page-aligned), its descriptor, and chunks at its slots."""

    def __init__(self, slots: int) -> None:
        backing = torch.empty(slots * CHUNK + 4096, dtype=torch.uint8)
        start = -backing.data_ptr() % 4096
        self.buffer = backing[start:start + slots * CHUNK]
        self.desc = L1MemoryDesc(ptr=self.buffer.data_ptr(), size=slots * CHUNK, align_bytes=4096)

    def chunk(self, slot: int, offset: int = 0) -> TensorMemoryObj:
        return tensor_obj(self.buffer[slot * CHUNK + offset:(slot + 1) * CHUNK + offset])


def standalone(n: int) -> list[TensorMemoryObj]:
    return [tensor_obj(torch.empty(CHUNK, dtype=torch.uint8)) for _ in range(n)]


def fill(objs: list[TensorMemoryObj], seed: int) -> list[bytes]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for obj in objs:
        obj.raw_data.copy_(torch.randint(0, 256, (CHUNK,), dtype=torch.uint8, generator=g))
        out.append(bytes(obj.byte_array))
    return out


class Driver:
    """LMCache's side of the interface: submit, wait on the task's eventfd, take the result once."""

    def __init__(self, adapter: UringKVL2Adapter) -> None:
        self.a = adapter
        self.stores: dict[int, Any] = {}

    def _wait(self, fd: int, done: Any) -> Any:
        deadline = time.monotonic() + TIMEOUT
        while (result := done()) is None:
            left = deadline - time.monotonic()
            assert left > 0, "no completion within the timeout"
            poller = select.poll()
            poller.register(fd, select.POLLIN)
            if poller.poll(min(left, 0.2) * 1000):
                consume_fd(fd)
        return result

    def store_result(self, tid: int) -> Any:
        def done() -> Any:
            self.stores.update(self.a.pop_completed_store_tasks())
            return self.stores.pop(tid, None)
        return self._wait(self.a.get_store_event_fd(), done)

    def store(self, keys: list[ObjectKey], objs: list[Any]) -> Any:
        return self.store_result(self.a.submit_store_task(keys, objs))

    def lookup(self, keys: list[ObjectKey]) -> list[bool]:
        tid = self.a.submit_lookup_and_lock_task(keys, {})
        bitmap = self._wait(self.a.get_lookup_and_lock_event_fd(), lambda: self.a.query_lookup_and_lock_result(tid))
        return [bool(bitmap.test(i)) for i in range(len(keys))]

    def load_result(self, tid: int, n: int) -> list[bool]:
        bitmap = self._wait(self.a.get_load_event_fd(), lambda: self.a.query_load_result(tid))
        return [bool(bitmap.test(i)) for i in range(n)]

    def load(self, keys: list[ObjectKey], objs: list[Any]) -> list[bool]:
        return self.load_result(self.a.submit_load_task(keys, objs), len(keys))

    def present(self, keys: list[ObjectKey]) -> list[bool]:
        """A lookup whose locks are released at once."""
        hits = self.lookup(keys)
        self.a.submit_unlock([k for k, hit in zip(keys, hits, strict=True) if hit])
        return hits


@pytest.fixture
def adapters() -> Iterator[list[UringKVL2Adapter]]:
    """Adapters a test builds; each is closed after it (again: close is idempotent), and no thread
    of theirs may be left."""
    made: list[UringKVL2Adapter] = []
    threads = set(threading.enumerate())
    yield made
    for adapter in made:
        adapter.close()
    assert set(threading.enumerate()) <= threads, "an adapter thread outlived close()"


def test_built_from_the_documented_json_through_lmcaches_cli_parser(tmp_path: Path,
                                                                     adapters: list[UringKVL2Adapter]) -> None:
    """The server's own argument parsing (``--l2-adapter`` among its registered adapter types) and
    plugin loader build the adapter with its config class, which checks the options when the
    loader builds it; the three eventfds are distinct."""
    parser = argparse.ArgumentParser()
    add_l2_adapters_args(parser)
    args = parser.parse_args(["--l2-adapter", spec(tmp_path, rows="staging", num_slots=8)])
    config = parse_args_to_l2_adapters_config(args).adapters[0]
    adapter = create_l2_adapter(config)
    adapters.append(adapter)
    assert isinstance(adapter, UringKVL2Adapter) and isinstance(adapter._config, UringKVL2AdapterConfig)
    assert adapter._config.num_slots == 8 and adapter._config.rows == "staging"
    fds = {adapter.get_store_event_fd(), adapter.get_lookup_and_lock_event_fd(), adapter.get_load_event_fd()}
    assert len(fds) == 3
    assert adapter.report_status()["is_healthy"]
    for bad, what in (({"capacity_bytes": 0}, "capacity_bytes"), ({"rows": "gpu"}, "rows"),
                      ({"surprise": 1}, "surprise"), ({"direct": "yes"}, "direct")):
        with pytest.raises(ValueError, match=what):  # from the config class, when the loader builds it
            build(spec(tmp_path, **bad))
    with pytest.raises(ValueError, match="not a directory"):
        build(spec(tmp_path / "missing"))


@pytest.mark.parametrize("rows", ["l1", "staging"])
def test_round_trip_is_byte_exact(tmp_path: Path, adapters: list[UringKVL2Adapter], rows: str) -> None:
    """8 chunks stored in one task, looked up (with a missing key), loaded into other buffers:
    byte-exact. Over the arena ("l1": its slots are the store's rows, nothing copied) and through
    staging rows (standalone chunks, as without an arena). A second store of held keys writes
    nothing and still succeeds."""
    arena = Arena(16) if rows == "l1" else None
    adapter = build(spec(tmp_path, rows=rows), arena)
    adapters.append(adapter)
    d = Driver(adapter)
    keys = [key(i) for i in range(8)]
    src = [arena.chunk(i) for i in range(8)] if arena else standalone(8)
    data = fill(src, 1)
    result = d.store(keys, src)
    assert result.is_successful() and result.bytes_transferred() == 8 * CHUNK
    assert d.lookup([*keys, key(99)]) == [True] * 8 + [False]
    dst = [arena.chunk(8 + i) for i in range(8)] if arena else standalone(8)
    fill(dst, 2)
    assert d.load(keys[::-1], dst) == [True] * 8
    assert [bytes(o.byte_array) for o in dst] == data[::-1]
    adapter.submit_unlock(keys)
    again = d.store(keys, src)
    assert again.is_successful() and again.bytes_transferred() == 0
    stats = adapter.stats()
    assert stats["keys"] == 8 and stats["block_bytes"] == CHUNK and stats["unplaced"] == 0
    assert stats["in_place" if rows == "l1" else "staged"] == 16
    assert adapter.get_usage().total_bytes_used == 8 * CHUNK


def test_capacity_is_bounded_least_recently_used_first(tmp_path: Path, adapters: list[UringKVL2Adapter]) -> None:
    """Capacity 4 chunks, 6 stored one task each: the two oldest are evicted (misses, not stale
    bytes), the file never exceeds the capacity, and a load reads back the 4 held."""
    adapter = build(spec(tmp_path, capacity_chunks=4, rows="staging"))
    adapters.append(adapter)
    d = Driver(adapter)
    src = standalone(6)
    data = fill(src, 3)
    for i in range(6):
        assert d.store([key(i)], [src[i]]).is_successful()
    assert d.present([key(i) for i in range(6)]) == [False, False, True, True, True, True]
    assert adapter.stats()["evictions"] == 2
    store = adapter._store
    assert store is not None and os.fstat(store.engine.file.fd).st_size <= 4 * CHUNK
    dst = standalone(6)
    assert d.load([key(i) for i in range(6)], dst) == [False, False, True, True, True, True]
    assert [bytes(o.byte_array) for o in dst[2:]] == data[2:]


def test_lookup_and_lock_pins_keys_against_eviction_until_unlocked(tmp_path: Path,
                                                                   adapters: list[UringKVL2Adapter]) -> None:
    """Capacity 2, both keys locked (key 0 twice): a store of a third key finds no room and fails
    (a miss, nothing evicted); one unlock of key 0 still holds it; once every lock is released the
    third key evicts the least recently used one. Unlocking a key never locked changes nothing."""
    adapter = build(spec(tmp_path, capacity_chunks=2, rows="staging"))
    adapters.append(adapter)
    d = Driver(adapter)
    src = standalone(3)
    data = fill(src, 4)
    assert d.store([key(0), key(1)], src[:2]).is_successful()
    assert d.lookup([key(0), key(1), key(0)]) == [True, True, True]
    adapter.submit_unlock([key(5)])  # never locked
    failed = d.store([key(2)], [src[2]])
    assert not failed.is_successful() and failed.bytes_transferred() == 0
    assert d.present([key(0), key(1), key(2)]) == [True, True, False]
    assert adapter.stats()["no_room"] == 1 and adapter.stats()["evictions"] == 0
    adapter.submit_unlock([key(0), key(1)])  # key 0 is still locked once
    assert d.store([key(2)], [src[2]]).is_successful()  # evicts key 1, the only unlocked key
    assert d.present([key(0), key(1), key(2)]) == [True, False, True]
    adapter.submit_unlock([key(0)])
    dst = standalone(2)
    assert d.load([key(0), key(2)], dst) == [True, True]
    assert [bytes(o.byte_array) for o in dst] == [data[0], data[2]]
    assert adapter.stats()["pinned"] == 0


def test_a_chunk_outside_the_arenas_slots_is_a_miss_never_misplaced(tmp_path: Path,
                                                                    adapters: list[UringKVL2Adapter]) -> None:
    """Over the arena, the store's rows are the arena's chunk slots: a chunk at another offset (or
    of another size) cannot be a row, so its store fails and it stays a miss; a load into such a
    buffer is a miss and leaves it untouched. Slot-aligned chunks beside it are stored and loaded."""
    arena = Arena(8)
    adapter = build(spec(tmp_path), arena)
    adapters.append(adapter)
    d = Driver(adapter)
    good, odd = arena.chunk(0), arena.chunk(2, offset=4096)
    data = fill([good, odd], 5)
    result = d.store([key(0), key(1)], [good, odd])
    assert not result.is_successful()
    assert d.present([key(0), key(1)]) == [True, False]
    assert adapter.stats()["unplaced"] == 1
    assert d.store([key(1)], [arena.chunk(4)]).is_successful()
    fill([odd], 6)
    before = bytes(odd.byte_array)
    assert d.load([key(0), key(1)], [arena.chunk(5), odd]) == [True, False]
    assert bytes(arena.chunk(5).byte_array) == data[0] and bytes(odd.byte_array) == before


def test_a_failed_or_refused_task_is_a_miss_never_a_hang(tmp_path: Path, adapters: list[UringKVL2Adapter]) -> None:
    """Tasks LMCache cannot have sent well (more keys than chunks) fail whole and report at once;
    a lookup or load before anything was stored is all misses; a chunk larger than a block is a
    failed store."""
    adapter = build(spec(tmp_path, rows="staging"))
    adapters.append(adapter)
    d = Driver(adapter)
    assert d.lookup([key(0)]) == [False]
    assert d.load([key(0)], standalone(1)) == [False]
    assert not d.store([key(0), key(1)], standalone(1)).is_successful()
    assert d.load([key(0)], standalone(2)) == [False]
    assert d.store([key(0)], standalone(1)).is_successful()  # the block size is now CHUNK
    big = tensor_obj(torch.zeros(2 * CHUNK, dtype=torch.uint8))
    assert not d.store([key(1)], [big]).is_successful()
    assert d.present([key(0), key(1)]) == [True, False]


def fault_mount(tmp_path: Path) -> Any:
    """The main suite's FUSE fault filesystem (tests/faultfs.py), or a skip with the reason."""
    if os.geteuid() != 0 or not os.path.exists("/dev/fuse"):
        pytest.skip("needs root and /dev/fuse for the fault filesystem")
    pytest.importorskip("mfusepy")
    from faultfs import mounted

    mount = tmp_path / "faulty"
    mount.mkdir()
    return mount, mounted(mount)


def test_eio_from_the_disk_turns_stores_and_loads_into_misses(tmp_path: Path,
                                                              adapters: list[UringKVL2Adapter]) -> None:
    """Real EIO (the kernel's, through FUSE): writes failing make a store task fail and its keys
    misses; a read failing makes that key a 0 in the load's bitmap and a miss from then on (never
    stale bytes); the other keys keep loading byte for byte."""
    mount, mounted = fault_mount(tmp_path)
    with mounted as faults:
        adapter = build(spec(mount, rows="staging"))
        adapters.append(adapter)
        d = Driver(adapter)
        src = standalone(6)
        data = fill(src, 7)
        assert d.store([key(0), key(1)], src[:2]).is_successful()  # blocks 0 and 1 of the file
        faults.fail_writes(0, 1 << 30)
        assert not d.store([key(2), key(3)], src[2:4]).is_successful()
        assert d.present([key(2), key(3)]) == [False, False]
        faults.clear()
        assert d.store([key(4), key(5)], src[4:]).is_successful()
        faults.fail_reads(0, CHUNK)  # the first block of the file: key 0's
        dst = standalone(3)
        fill(dst, 8)
        assert d.load([key(0), key(1), key(4)], dst) == [False, True, True]
        assert bytes(dst[1].byte_array) == data[1] and bytes(dst[2].byte_array) == data[4]
        assert d.present([key(0), key(1)]) == [False, True]
        stats = adapter.stats()
        assert stats["store_failures"] == 2 and stats["load_failures"] == 1
        adapter.close()


def test_enospc_makes_the_chunks_that_did_not_fit_misses(tmp_path: Path, adapters: list[UringKVL2Adapter]) -> None:
    """A capacity of 4 MiB on a tmpfs that another file fills up to its last 1 MiB after the
    adapter opened: the chunks past that fail with ENOSPC, their task fails and they stay misses;
    those that fit load back byte for byte."""
    with mounted_tmpfs(tmp_path / "tiny", "size=8m") as mount:
        adapter = build(spec(mount, capacity_chunks=256, rows="staging", block_bytes=CHUNK))  # opens now
        adapters.append(adapter)
        take_space(mount, leave=1 << 20)
        d = Driver(adapter)
        src = standalone(96)  # 1.5 MiB
        data = fill(src, 9)
        keys = [key(i) for i in range(96)]
        assert not d.store(keys, src).is_successful()
        hits = d.present(keys)
        assert 0 < sum(hits) < 96 and adapter.stats()["store_failures"] == 96 - sum(hits)
        held = [i for i, hit in enumerate(hits) if hit]
        dst = standalone(len(held))
        assert d.load([keys[i] for i in held], dst) == [True] * len(held)
        assert [bytes(o.byte_array) for o in dst] == [data[i] for i in held]
        adapter.close()


@pytest.mark.parametrize("block_bytes", [None, CHUNK], ids=["opened-at-the-first-chunk", "opened-now"])
def test_a_capacity_beyond_the_free_space_is_refused_when_the_adapter_is_built(tmp_path: Path,
                                                                                block_bytes: int | None) -> None:
    """A capacity the disk has no room for is refused in one line when LMCache builds the adapter
    (the store's own refusal where the block size is known, so the store opens now; else the
    capacity against the room); nothing is left behind."""
    says = (r"num_disk_blocks=256: a file of 256 × 16384 bytes \(4 MiB\)" if block_bytes else
            r"UringKVL2Adapter: capacity_bytes=4194304 \(4 MiB in .*/small\)")
    with mounted_tmpfs(tmp_path / "small", "size=2m") as mount:
        params = {"block_bytes": block_bytes} if block_bytes else {}
        with pytest.raises(ValueError, match=f"^{says} does not fit in the 2 MiB free on the filesystem of .*/small$"):
            build(spec(mount, capacity_chunks=256, **params))
        assert os.listdir(mount) == []


def test_close_with_tasks_in_flight_reports_each_once_and_leaves_nothing(
        tmp_path: Path, adapters: list[UringKVL2Adapter]) -> None:
    """LMCache closes the adapter while store and load tasks are under way (slowed by the fault
    filesystem): close waits for them, each posts its result once (the stores succeed, the loads
    deliver their bytes), later submits fail at once, no thread is left and no file is left."""
    mount, mounted = fault_mount(tmp_path)
    with mounted as faults:
        adapter = build(spec(mount, rows="staging"))
        d = Driver(adapter)
        src = standalone(8)
        data = fill(src, 10)
        assert d.store([key(i) for i in range(4)], src[:4]).is_successful()
        faults.slow_down(0, 1 << 30, 0.2)
        stores = [adapter.submit_store_task([key(i)], [src[i]]) for i in range(4, 8)]
        dst = standalone(4)
        load = adapter.submit_load_task([key(i) for i in range(4)], dst)
        time.sleep(0.05)
        adapter.close()
        done = adapter.pop_completed_store_tasks()
        assert sorted(done) == stores and all(r.is_successful() for r in done.values())
        bitmap = adapter.query_load_result(load)
        assert bitmap is not None and bitmap.get_indices_list() == [0, 1, 2, 3]
        assert [bytes(o.byte_array) for o in dst] == data[:4]
        assert adapter.query_load_result(load) is None  # once
        late = adapter.submit_store_task([key(9)], [src[0]])
        assert not adapter.pop_completed_store_tasks()[late].is_successful()
        late_lookup = adapter.submit_lookup_and_lock_task([key(0)], {})
        assert adapter.query_lookup_and_lock_result(late_lookup).get_indices_list() == []
        adapter.submit_unlock([key(0)])
        adapter.close()
        assert list(mount.iterdir()) == []


def test_lmcaches_server_starts_with_the_adapter_and_shuts_down_clean(tmp_path: Path) -> None:
    """`lmcache server` (LMCache's own process, CPU only) with the documented ``--l2-adapter`` line:
    its storage manager builds the adapter, its status page reports it healthy, and on SIGTERM
    it exits leaving nothing in root_dir. (A store/load round trip through the server needs a
    serving engine's client: its store and retrieve requests carry KV from the engine's buffers.)"""
    import signal
    import socket
    import urllib.request

    def free_port() -> int:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return int(s.getsockname()[1])

    port, http_port = free_port(), free_port()
    root = tmp_path / "kv"
    root.mkdir()
    server = subprocess.Popen(
        [str(Path(sys.executable).with_name("lmcache")), "server", "--host", "127.0.0.1", "--port", str(port),
         "--http-host", "127.0.0.1", "--http-port", str(http_port), "--l1-size-gb", "0.05",
         "--eviction-policy", "LRU", "--l2-adapter", spec(root)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 90
        status: dict[str, Any] | None = None
        while status is None:
            assert server.poll() is None, f"the server exited: {server.communicate()[0][-3000:]}"
            assert time.monotonic() < deadline, "the server did not come up"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/status", timeout=2) as reply:
                    status = json.load(reply)
            except OSError:
                time.sleep(0.5)
        (adapter,) = status["storage_manager"]["l2_adapters"]
        assert adapter["type"] == "UringKVL2Adapter" and adapter["is_healthy"], adapter
        assert adapter["root_dir"] == str(root)
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            output = server.communicate(timeout=60)[0]
        except subprocess.TimeoutExpired:
            server.kill()
            output = server.communicate()[0]
            pytest.fail(f"the server did not exit on SIGTERM: {output[-3000:]}")
    assert list(root.iterdir()) == []
    assert "Traceback" not in output, output[-3000:]


def test_every_store_result_is_popped_exactly_once_while_tasks_complete(
        tmp_path: Path, adapters: list[UringKVL2Adapter]) -> None:
    """LMCache's store controller pops completed stores while others complete: 400 one-chunk tasks,
    popped in a tight loop from the submitting thread; each result comes out exactly once (a result
    posted into a table just swapped out by a pop would be lost: a task that never completes)."""
    adapter = build(spec(tmp_path, capacity_chunks=512, rows="staging", direct=False))
    adapters.append(adapter)
    src = standalone(1)
    fill(src, 11)
    submitted = [adapter.submit_store_task([key(i)], src) for i in range(400)]
    seen: list[int] = []
    deadline = time.monotonic() + TIMEOUT
    while len(seen) < len(submitted) and time.monotonic() < deadline:
        seen += list(adapter.pop_completed_store_tasks())
    assert sorted(seen) == submitted


def test_a_persistent_adapter_serves_its_chunks_after_a_restart(tmp_path: Path,
                                                                 adapters: list[UringKVL2Adapter]) -> None:
    """``persistent: true``: chunks stored before a close are found and loaded byte-exact by the
    next adapter on the same directory; its file stays, one per block size."""
    first = build(spec(tmp_path, rows="staging", persistent=True, block_bytes=CHUNK))
    adapters.append(first)
    keys = [key(i) for i in range(4)]
    src = standalone(4)
    data = fill(src, 3)
    assert Driver(first).store(keys, src).is_successful()
    first.close()
    again = build(spec(tmp_path, rows="staging", persistent=True, block_bytes=CHUNK))
    adapters.append(again)
    d = Driver(again)
    assert d.lookup([*keys, key(7)]) == [True] * 4 + [False]
    dst = standalone(4)
    fill(dst, 4)
    assert d.load(keys, dst) == [True] * 4
    assert [bytes(o.byte_array) for o in dst] == data
    again.submit_unlock(keys)
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".bin")] == [f"uring-kv-lmcache-{CHUNK}.bin"]
    with pytest.raises(ValueError, match="fsync applies to a persistent adapter"):
        build(spec(tmp_path, fsync=True))
    with pytest.raises(ValueError, match="needs block_bytes"):
        build(spec(tmp_path, persistent=True))


def test_an_adapter_over_several_directories_stripes_its_chunks(tmp_path: Path,
                                                                adapters: list[UringKVL2Adapter]) -> None:
    """``root_dir`` a list: one file per directory, a task's chunks split evenly over them; the
    lookup's locks pin them in their files; loads are byte-exact."""
    drives = [tmp_path / "nvme0", tmp_path / "nvme1"]
    for drive in drives:
        drive.mkdir()
    adapter = build(json.dumps({"type": "plugin", "module_path": "uring_kv.integrations.lmcache",
                                "class_name": "UringKVL2Adapter",
                                "adapter_params": {"root_dir": [str(d) for d in drives], "capacity_bytes": 64 * CHUNK,
                                                   "rows": "staging"}}))
    adapters.append(adapter)
    d = Driver(adapter)
    keys = [key(i) for i in range(8)]
    src = standalone(8)
    data = fill(src, 5)
    assert d.store(keys, src).is_successful()
    assert adapter.stats()["stripes"] == 2
    assert [s.stats()["keys"] for s in adapter._store.stripes] == [4, 4]  # type: ignore[union-attr]
    assert d.lookup(keys) == [True] * 8
    assert sum(s.stats()["pinned"] for s in adapter._store.stripes) == 8  # type: ignore[union-attr]
    dst = standalone(8)
    fill(dst, 6)
    assert d.load(keys, dst) == [True] * 8
    assert [bytes(o.byte_array) for o in dst] == data
    adapter.submit_unlock(keys)
