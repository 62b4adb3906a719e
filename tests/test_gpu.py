"""CUDA-only behaviour (skipped without a GPU): 32 bf16 layers byte-exact, ordering after an
after= event or the caller's current stream, the enqueued form's event, and pinned staging
registered with CUDA."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import release_on_submit, seed_race

from uring_kv import Engine
from uring_kv.testing import id_caches

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def bf16_layers(layers: int = 32, blocks: int = 64, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return {f"model.layers.{i}.kv": torch.randn(blocks, 2, 16, 8, 128, device="cuda", generator=gen,
                                                dtype=torch.float32).to(torch.bfloat16) for i in range(layers)}


async def store_zero_load(engine: Engine, caches: dict[str, torch.Tensor], disk_blocks: list[int]) -> None:
    """Store every cache block to ``disk_blocks``, zero the caches, load them back: each tensor must
    then hold its bytes as before, bit for bit (compared as int16: bf16 NaNs would not equal)."""
    reference = {name: t.clone() for name, t in caches.items()}
    every = list(range(len(disk_blocks)))
    await engine.store_batch(every, disk_blocks)
    for t in caches.values():
        t.zero_()
    await engine.load_batch(disk_blocks, every)
    torch.cuda.synchronize()
    for name, t in caches.items():
        assert torch.equal(t.view(torch.int16), reference[name].view(torch.int16)), name


COPY_PATHS = {  # id: (URING_KV_DEBUG_CUDA_STAGED, _MAPPED, _BATCH, how stats()["copy"] starts)
    "staged": ("1", "0", "1", "staged"),
    "mapped": ("1", "1", "1", "mapped"),
    "batched-copies": ("0", "0", "1", "cuMemcpyBatchAsync"),
    "per-copy": ("0", "0", "0", "per-copy"),
}


@pytest.mark.parametrize("path", list(COPY_PATHS))
@pytest.mark.parametrize("io", ["uring", "threads"])
async def test_32_bf16_layers_round_trip_byte_exact(tmp_path: Path, io: str, path: str,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    staged, mapped, batch, description = COPY_PATHS[path]
    monkeypatch.setenv("URING_KV_DEBUG_CUDA_STAGED", staged)
    monkeypatch.setenv("URING_KV_CUDA_MAPPED", mapped)
    monkeypatch.setenv("URING_KV_DEBUG_CUDA_BATCH", batch)
    caches = bf16_layers()
    async with Engine(caches, tmp_path / "kv.bin", 256, num_slots=16, io=io) as engine:
        assert engine.stats()["copy"].startswith(description)
        await store_zero_load(engine, caches, list(range(100, 164)))
        stats = engine.stats()
        assert stats["leases_held"] == 0
        assert stats["plan"]["copier"] == {"staged": "staged", "mapped": "mapped"}.get(path, "pieces")
        # GPU mode: batches in native pumps on the native copier (kernel copies), every SQE
        # (O_DIRECT too) handed to io-wq
        assert (stats["pumped_batches"] == 2) == (io == "uring" and path in ("staged", "mapped"))
        assert ("IOSQE_ASYNC" in stats["io"]) == (io == "uring")


async def test_buffered_engine_hands_reads_to_io_wq_and_writes_not(tmp_path: Path) -> None:
    """GPU mode on a buffered file: reads carry IOSQE_ASYNC (a page-cache hit would be copied on
    the loop thread), writes do not (on io-wq they cost ~9x the CPU and held the loop up to 5 ms
    on the H200); bytes exact both ways, through the pumps."""
    caches = bf16_layers()
    async with Engine(caches, tmp_path / "kv.bin", 128, num_slots=16, direct=False) as engine:
        assert "IOSQE_ASYNC on reads" in engine.stats()["io"]
        await store_zero_load(engine, caches, list(range(64)))
        assert engine.stats()["pumped_batches"] == 2


async def test_store_after_event_sees_the_producers_bytes(tmp_path: Path) -> None:
    """The producer writes the block on a side stream after a long sleep; a store ordered only after
    the caller's current stream would copy the old bytes."""
    caches = bf16_layers(layers=4, blocks=8)
    side = torch.cuda.Stream()
    async with Engine(caches, tmp_path / "kv.bin", 8, num_slots=2) as engine:
        produced = torch.cuda.Event()
        with torch.cuda.stream(side):
            torch.cuda._sleep(200_000_000)
            for t in caches.values():
                t[3].fill_(7.0)
            produced.record(side)
        await engine.store_batch([3], [5], after=produced)
        await engine.load_batch([5], [6])
        torch.cuda.synchronize()
        assert all(bool((t[6] == 7.0).all()) for t in caches.values())


async def test_load_after_event_lands_after_the_last_user(tmp_path: Path) -> None:
    caches = bf16_layers(layers=4, blocks=8)
    side = torch.cuda.Stream()
    async with Engine(caches, tmp_path / "kv.bin", 8, num_slots=2) as engine:
        for t in caches.values():
            t[1].fill_(1.0)
        await engine.store_batch([1], [2])
        last_use = torch.cuda.Event()
        with torch.cuda.stream(side):
            torch.cuda._sleep(200_000_000)
            for t in caches.values():
                t[4].fill_(9.0)  # the last user of block 4 writes it late
            last_use.record(side)
        await engine.load_batch([2], [4], after=last_use)
        torch.cuda.synchronize()
        assert all(bool((t[4] == 1.0).all()) for t in caches.values())


def current_stream(which: str) -> Any:
    return torch.cuda.Stream() if which == "side" else torch.cuda.default_stream()


@pytest.mark.parametrize("form", ["awaited", "enqueued"])
@pytest.mark.parametrize("which", ["default", "side"])
async def test_store_waits_for_the_callers_current_stream(tmp_path: Path, which: str, form: str) -> None:
    """Without after=, a store copies the block only after the work queued so far on the caller's
    current stream (the legacy default stream, or one the caller made current): ordered after
    nothing, it would copy the bytes from before the late fill."""
    caches = bf16_layers(layers=4, blocks=8)
    async with Engine(caches, tmp_path / "kv.bin", 8, num_slots=2) as engine:
        # Every kernel once first: a kernel's first launch may load its module, which waits for the
        # work in flight (the sleep below) and would order the store by itself.
        for t in caches.values():
            t[3].fill_(0.0)
        await engine.store_batch([0], [7])
        await engine.load_batch([7], [1])
        torch.cuda.synchronize()
        with torch.cuda.stream(current_stream(which)):
            torch.cuda._sleep(200_000_000)
            for t in caches.values():
                t[3].fill_(7.0)
            if form == "awaited":
                await engine.store_batch([3], [5])
            else:
                await (await engine.store_batch_async([3], [5]))
        await engine.load_batch([5], [6])
        torch.cuda.synchronize()
        assert all(bool((t[6] == 7.0).all()) for t in caches.values())


@pytest.mark.parametrize("which", ["default", "side"])
async def test_load_lands_after_the_callers_current_stream(tmp_path: Path, which: str) -> None:
    """Without after=, a load's bytes land after the work queued so far on the caller's current
    stream: the late write there by the block's last user comes first, the loaded bytes win."""
    caches = bf16_layers(layers=4, blocks=8)
    async with Engine(caches, tmp_path / "kv.bin", 8, num_slots=2) as engine:
        for t in caches.values():
            t[1].fill_(1.0)
        await engine.store_batch([1], [2])
        await engine.load_batch([2], [0])  # every kernel once first: see the store test
        torch.cuda.synchronize()
        with torch.cuda.stream(current_stream(which)):
            torch.cuda._sleep(200_000_000)
            for t in caches.values():
                t[4].fill_(9.0)
            await engine.load_batch([2], [4])
        torch.cuda.synchronize()
        assert all(bool((t[4] == 1.0).all()) for t in caches.values())


async def test_enqueued_form_event_orders_a_consumer_stream(tmp_path: Path) -> None:
    caches = bf16_layers(layers=4, blocks=8)
    async with Engine(caches, tmp_path / "kv.bin", 8, num_slots=2) as engine:
        for t in caches.values():
            t[0].fill_(3.0)
        await engine.store_batch([0], [1])
        handle = await engine.load_batch_async([1], [5])
        consumer = torch.cuda.Stream()
        handle.wait_on(consumer)
        with torch.cuda.stream(consumer):
            sums = [t[5].float().sum() for t in caches.values()]
        consumer.synchronize()
        expected = float(caches["model.layers.0.kv"][5].numel() * 3.0)
        assert all(float(s) == expected for s in sums)
        await handle
        assert engine.stats()["pumped_batches"] == 1  # the store; the enqueued form is not pumped


async def test_enqueued_form_returns_before_its_slowed_copies_land(tmp_path: Path) -> None:
    """Every copy call held ~50 ms on the GPU: ``load_batch_async`` returns once the copies are on
    their stream, before they have run (its handle's event not yet fired); awaiting the handle
    waits for them. A pumped batch would only return when complete (which is why the enqueued form
    does not use a pump in GPU mode)."""
    caches = bf16_layers(layers=4, blocks=8)
    async with Engine(caches, tmp_path / "kv.bin", 8, num_slots=2, copy_delay=0.05) as engine:
        for t in caches.values():
            t[0].fill_(2.0)
        await engine.store_batch([0], [1])
        handle = await engine.load_batch_async([1], [5])
        assert not handle.event.query(), "the enqueued form returned after its copies had run"
        await handle
        torch.cuda.synchronize()
        assert all(bool((t[5] == 2.0).all()) for t in caches.values())


async def test_staging_is_registered_pinned_memory(tmp_path: Path) -> None:
    caches = bf16_layers(layers=2, blocks=4)
    async with Engine(caches, tmp_path / "kv.bin", 4, num_slots=3) as engine:
        staging = torch.frombuffer(engine.pool.slab.view, dtype=torch.uint8)
        assert staging.is_pinned()
        assert engine.stats()["pinned_bytes"] == 3 * engine.file.stride
        del staging


async def test_the_staged_kernel_is_compiled_off_the_loop(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """NVRTC takes long enough to stall the loop: the first open on a device compiles the kernel on
    the worker thread that creates the file, and the engine then uses it."""
    import threading

    from uring_kv import _cuda

    compiled_on: list[int] = []
    real_compile = torch.cuda._compile_kernel

    def recording_compile(*args: Any, **kwargs: Any) -> Any:
        compiled_on.append(threading.get_ident())
        return real_compile(*args, **kwargs)

    monkeypatch.setattr(_cuda, "_KERNELS", {})
    monkeypatch.setattr(torch.cuda, "_compile_kernel", recording_compile)
    caches = bf16_layers(layers=2, blocks=4)
    async with Engine(caches, tmp_path / "kv.bin", 4, num_slots=2) as engine:
        assert engine.stats()["plan"]["copier"] == "mapped"  # the kernel path (its default form)
        await engine.store_batch([0], [1])
        await engine.load_batch([1], [2])
        torch.cuda.synchronize()
        for t in caches.values():
            assert torch.equal(t[2].view(torch.int16), t[0].view(torch.int16))
    assert len(compiled_on) == 1 and compiled_on[0] != threading.get_ident()


@pytest.mark.parametrize("protection", ["kept", "removed"])
@pytest.mark.parametrize("copier", ["native", "native-mapped", "python"])
async def test_a_slowed_gpu_never_hands_a_slot_on_before_its_copy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                  copier: str, protection: str) -> None:
    """Two slots and every copy call held ~3 ms on the GPU (the native copier launches a kernel
    that only waits, the Python lanes torch's sleep) before its copies, on their stream: a slot
    reissued before its copy finished would hand the copy the next read's bytes (on the mapped
    path the kernel reads the host slot itself). With the native copier the batches run in native
    pumps. With the protection removed (slots freed when their copy is enqueued, block by block)
    the same race must corrupt blocks, or the kept case proves nothing."""
    import time

    monkeypatch.setenv("URING_KV_DEBUG_NATIVE_COPIER", "0" if copier == "python" else "1")
    monkeypatch.setenv("URING_KV_CUDA_MAPPED", "1" if copier == "native-mapped" else "0")
    if protection == "removed":
        release_on_submit(monkeypatch)
    caches = id_caches("cuda", blocks=8)
    async with Engine(caches, tmp_path / "kv.bin", 32, num_slots=2, copy_delay=0.003) as engine:
        assert getattr(engine.copier, "native", False) == (copier != "python")
        assert (engine.stats()["plan"]["copier"] == "mapped") == (copier == "native-mapped")
        await engine.store_batch([0], [0])
        start = time.perf_counter()
        await engine.load_batch([0], [1])
        assert time.perf_counter() - start > 0.001, "the copy was not slowed"
        wrong = await seed_race(engine, caches, calls=25)
        # native, kept: in native pumps (their copy jobs on the native copier); else block by block
        assert (engine.stats()["pumped_batches"] > 0) == (copier != "python" and protection == "kept")
    assert (wrong == 0) if protection == "kept" else (wrong > 0)


_HOG_SOURCE = r"""
extern "C" __global__ void ukv_test_hog(int cycles) {
    const long long start = clock64();
    while (clock64() - start < cycles) {}
}
"""


@pytest.mark.parametrize("form", ["staged", "mapped"])
async def test_a_load_returns_only_after_its_copies_ran_on_a_busy_gpu(tmp_path: Path, form: str,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Every SM held by another stream's kernel (~0.2 s): the kernel path's scatter kernel waits for
    a free SM, while the staged form's host-to-device copy before it does not (a copy engine moves
    it). A load must not return before the scatter ran: its copy event is recorded after. Read
    right after the load by a device-to-host copy (no SM needed either), the block must hold the
    loaded bytes; an event recorded before the copies would return the load with zeros there."""
    monkeypatch.setenv("URING_KV_CUDA_MAPPED", "1" if form == "mapped" else "0")
    caches = bf16_layers(layers=4, blocks=8)
    async with Engine(caches, tmp_path / "kv.bin", 8, num_slots=4) as engine:
        assert engine.stats()["plan"]["copier"] == form
        for t in caches.values():
            t[1].fill_(3.0)
        await engine.store_batch([1], [2])
        for t in caches.values():
            t[5].zero_()
        torch.cuda.synchronize()
        hog = torch.cuda._compile_kernel(_HOG_SOURCE, "ukv_test_hog")
        sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
        busy = torch.cuda.Stream()
        hog(grid=(2 * sms, 1, 1), block=(1024, 1, 1), args=[400_000_000], stream=busy)  # 2 × 1024 threads: full SMs
        await engine.load_batch([2], [5])
        reader = torch.cuda.Stream()
        with torch.cuda.stream(reader):
            landed = [t[5].to("cpu") for t in caches.values()]
        busy.synchronize()
        assert all(bool((block == 3.0).all()) for block in landed)
