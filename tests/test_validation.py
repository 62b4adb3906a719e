"""Wrong calls are rejected with a precise message before any I/O, and the file is untouched."""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import BOTH_BACKENDS, EngineFactory

from uring_kv import Engine, EngineClosedError
from uring_kv.testing import block_file, id_caches, store_identity


@pytest.fixture(params=BOTH_BACKENDS)
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)

Call = Callable[[Any], Any]  # the calls are wrong on purpose: no static types for them

BAD_CALLS: list[tuple[str, Call, type[Exception], str]] = [
    ("negative disk block", lambda e: e.load_batch([-1], [0]), ValueError, r"disk_blocks\[0\] = -1 is out of range"),
    ("disk block too large", lambda e: e.load_batch([16], [0]), ValueError, r"disk_blocks\[0\] = 16 is out of range"),
    ("gpu block too large", lambda e: e.load_batch([0], [8]), ValueError, r"gpu_blocks\[0\] = 8 is out of range"),
    ("negative gpu block on store", lambda e: e.store_batch([-3], [0]), ValueError, r"gpu_blocks\[0\] = -3"),
    ("float block", lambda e: e.load_batch([1.0], [0]), TypeError, r"disk_blocks\[0\] must be an integer, got float"),
    ("bool block", lambda e: e.store_batch([True], [0]), TypeError, r"gpu_blocks\[0\] is a bool"),
    ("string block", lambda e: e.load_batch(["1"], [0]), TypeError, r"must be an integer, got str"),
    ("string instead of list", lambda e: e.load_batch("12", [0, 1]), TypeError, r"disk_blocks must be a sequence"),
    ("None instead of list", lambda e: e.load_batch(None, [0]), TypeError, r"disk_blocks must be a sequence"),
    ("length mismatch load", lambda e: e.load_batch([0, 1], [0]), ValueError, r"disk_blocks has 2 entries but gpu_blocks has 1"),
    ("length mismatch store", lambda e: e.store_batch([0], [0, 1]), ValueError, r"disk_blocks has 2 entries"),
    ("duplicate gpu block load", lambda e: e.load_batch([0, 1], [3, 3]), ValueError, r"gpu block 3 appears twice"),
    ("duplicate gpu block store", lambda e: e.store_batch([2, 2], [0, 1]), ValueError, r"gpu block 2 appears twice"),
    ("duplicate disk block store", lambda e: e.store_batch([0, 1], [5, 5]), ValueError,
     r"disk block 5 appears twice in one store batch"),
    ("cuda event with cpu caches", lambda e: e.load_batch([0], [0], after=object()), TypeError,
     r"after= takes a torch.cuda.Event and only applies to CUDA caches"),
    ("enqueued form checks too", lambda e: e.load_batch_async([0], [99]), ValueError, r"gpu_blocks\[0\] = 99"),
    ("numpy-like floats", lambda e: e.load_batch(torch.tensor([0.5]), [0]), TypeError, r"got float"),
]


@pytest.mark.parametrize(("call", "error", "message"), [pytest.param(c, e, m, id=i) for i, c, e, m in BAD_CALLS])
async def test_bad_call_rejected_before_io(make_engine: EngineFactory, call: Call, error: type[Exception],
                                           message: str) -> None:
    caches = id_caches("cpu", blocks=8)
    async with make_engine(caches, 16, num_slots=2) as engine:
        await store_identity(engine, caches, 8)
        before = hashlib.sha256(Path(block_file(engine)).read_bytes()).hexdigest()
        snapshot = {k: v.clone() for k, v in caches.items()}
        submitted = engine.pool.reissues
        with pytest.raises(error, match=message):
            await call(engine)
        assert engine.pool.reissues == submitted, "a slot was taken for a call that should have been rejected"
        assert engine.stats()["active_batches"] == 0
        assert hashlib.sha256(Path(block_file(engine)).read_bytes()).hexdigest() == before
        assert all(torch.equal(caches[k], snapshot[k]) for k in caches)


BAD_ENGINES: list[tuple[str, Callable[[Path], Engine], type[Exception], str]] = [
    ("num_slots zero", lambda p: Engine(id_caches("cpu"), p, 4, num_slots=0), ValueError, "num_slots must be a positive"),
    ("num_slots float", lambda p: Engine(id_caches("cpu"), p, 4, num_slots=2.5), ValueError,  # type: ignore[arg-type]
     "num_slots must be a positive"),
    ("no disk blocks", lambda p: Engine(id_caches("cpu"), p, 0), ValueError, "num_disk_blocks must be a positive"),
    ("empty caches", lambda p: Engine({}, p, 4), ValueError, "caches is empty"),
    ("one bare tensor", lambda p: Engine(torch.zeros(4, 4), p, 4), TypeError, "not one tensor"),
    ("not tensors", lambda p: Engine({"a": [1, 2]}, p, 4), TypeError, "cache 'a' is a list, not a torch.Tensor"),
    ("zero-size cache", lambda p: Engine({"a": torch.zeros(0, 4)}, p, 4), ValueError, "cache 'a' has no blocks"),
    ("zero-size block", lambda p: Engine({"a": torch.zeros(4, 0)}, p, 4), ValueError, "cache 'a' has no blocks"),
    ("non-contiguous", lambda p: Engine({"a": torch.zeros(8, 4)[::2]}, p, 4), ValueError, "cache 'a' is not contiguous"),
    ("different block counts", lambda p: Engine({"a": torch.zeros(4, 4), "b": torch.zeros(5, 4)}, p, 4), ValueError,
     "cache 'b' has 5 blocks, cache 'a' has 4"),
    ("meta device", lambda p: Engine({"a": torch.zeros(4, 4, device="meta")}, p, 4), ValueError,
     "only CUDA and CPU tensors"),
    ("negative copy delay", lambda p: Engine(id_caches("cpu"), p, 4, copy_delay=-1.0), ValueError, "copy_delay"),
    ("unknown io mode", lambda p: Engine(id_caches("cpu"), p, 4, io="fast"), ValueError, "'auto', 'uring' or 'threads'"),
]


@pytest.mark.parametrize(("make", "error", "message"), [pytest.param(m, e, s, id=i) for i, m, e, s in BAD_ENGINES])
async def test_bad_engine_rejected_without_leaving_a_file(tmp_path: Path, make: Callable[[Path], Engine],
                                                          error: type[Exception], message: str) -> None:
    path = tmp_path / "kv.bin"
    with pytest.raises(error, match=re.escape(message) if "(" not in message else message):
        engine = make(path)
        await engine.open()
    assert not path.exists()


@pytest.mark.skipif(torch.cuda.device_count() < 1, reason="needs a CUDA device for a two-device mix")
def test_tensors_on_two_devices_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="all caches must be on one device"):
        Engine({"a": torch.zeros(4, 4), "b": torch.zeros(4, 4, device="cuda")}, tmp_path / "kv.bin", 4)


def test_mixed_dtypes_are_allowed_per_tensor(tmp_path: Path) -> None:
    """Each tensor's block is raw bytes, so layers of different dtypes are one disk block."""
    engine = Engine({"a": torch.zeros(4, 4, dtype=torch.int8), "b": torch.zeros(4, 4, dtype=torch.float64)},
                    tmp_path / "kv.bin", 4)
    assert engine.block_bytes == 4 + 32


async def test_closed_engine_refuses_work(make_engine: EngineFactory) -> None:
    engine = make_engine(id_caches("cpu"), 4)
    with pytest.raises(EngineClosedError, match="engine is new"):
        await engine.load_batch([0], [0])
    async with engine:
        pass
    with pytest.raises(EngineClosedError, match="engine is closed"):
        await engine.store_batch([0], [0])


async def test_an_existing_file_at_the_path_is_untouched(tmp_path: Path) -> None:
    """The block file never takes the path's name (it is nameless): whatever is there stays."""
    path = tmp_path / "kv.bin"
    path.write_bytes(b"not ours")
    caches = id_caches("cpu")
    async with Engine(caches, path, 4) as engine:
        await store_identity(engine, caches, 4)
    assert path.read_bytes() == b"not ours"
    assert os.listdir(tmp_path) == ["kv.bin"]
