"""``Tuning``: the environment read once, malformed values named, and the engine doing what it says."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from uring_kv import Engine, Tuning


def test_from_env_reads_settings_and_diagnostics() -> None:
    tuning = Tuning.from_env({"URING_KV_IO": "threads", "URING_KV_REAP_BUDGET_US": "7",
                              "URING_KV_DEBUG_PUMP": "0", "URING_KV_DEBUG_SQE_ASYNC": "1"})
    assert tuning.io == "threads" and tuning.reap_budget_us == 7
    assert tuning.pumps is False and tuning.sqe_async is True
    assert tuning.pump_scatter is True  # unset: the default
    assert Tuning.from_env({}) == Tuning()
    assert Tuning.from_env({"URING_KV_PREFETCH_DEPTH": "3"}).prefetch_depth == 3
    assert Tuning.from_env({"URING_KV_PREFETCH_DEPTH": "auto"}).prefetch_depth is None


@pytest.mark.parametrize(("name", "value"), [("URING_KV_IO", "fast"), ("URING_KV_REAP_BUDGET_US", "-1"),
                                             ("URING_KV_DEBUG_PUMP", "off"), ("URING_KV_HOST_INLINE_BYTES", "1k"),
                                             ("URING_KV_COPIER_POLL_US", "on"), ("URING_KV_CUDA_MAPPED", "yes"),
                                             ("URING_KV_PREFETCH_DEPTH", "half")])
def test_a_malformed_variable_is_named(name: str, value: str) -> None:
    with pytest.raises(ValueError, match=name):
        Tuning.from_env({name: value})


def test_bad_fields_are_refused() -> None:
    with pytest.raises(ValueError, match="iowq_workers"):
        Tuning(iowq_workers=-1)
    with pytest.raises(ValueError, match="I/O mode"):
        Tuning(io="fast")
    with pytest.raises(ValueError, match="prefetch_depth"):
        Tuning(prefetch_depth=-1)


def test_sqe_flags_policy() -> None:
    tuning = Tuning()
    assert tuning.sqe_flags(gpu=True, direct=True, num_slots=16, stride=128 << 10) == (True, True)
    assert tuning.sqe_flags(gpu=False, direct=False, num_slots=4, stride=4096) == (True, False)  # buffered reads
    assert tuning.sqe_flags(gpu=False, direct=True, num_slots=4, stride=4096) == (False, False)  # inline copies
    forced = dataclasses.replace(tuning, sqe_async=False)
    assert forced.sqe_flags(gpu=True, direct=True, num_slots=16, stride=128 << 10) == (False, False)
    assert not dataclasses.replace(tuning, sqe_async=True).pump_inline(4, 4096)


def test_copier_poll_policy() -> None:
    """auto: the threads poll where the process has 8 CPUs or more, sleep at once on fewer; a number
    (the environment's too) wins either way."""
    assert Tuning().copier_poll(cpus=16) == 200 and Tuning().copier_poll(cpus=2) == 0
    assert Tuning(copier_poll_us=0).copier_poll(cpus=16) == 0
    assert Tuning.from_env({"URING_KV_COPIER_POLL_US": "50"}).copier_poll(cpus=2) == 50
    assert Tuning.from_env({"URING_KV_COPIER_POLL_US": "auto"}) == Tuning()
    with pytest.raises(ValueError, match="copier_poll_us"):
        Tuning(copier_poll_us=-5)


def test_staging_slots_policy() -> None:
    tuning = Tuning()
    assert tuning.staging_slots(32, 128 << 10, gpu=True) == 48  # half the depth again on a GPU
    assert tuning.staging_slots(32, 16 << 10, gpu=False) == 64  # small O_DIRECT: as many again
    assert tuning.staging_slots(32, 16 << 10, gpu=False, direct=False) == 32  # buffered: none


async def test_the_engine_reads_the_environment_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    caches = [(torch.arange(8 * 1024) % 251).to(torch.uint8).reshape(8, 1024)]
    monkeypatch.setenv("URING_KV_DEBUG_PUMP", "0")
    engine = Engine(caches, tmp_path / "kv", num_disk_blocks=8, num_slots=4)
    monkeypatch.setenv("URING_KV_DEBUG_PUMP", "1")  # too late: read at construction
    async with engine:
        await engine.store_batch([0, 1], [0, 1])
        stats = engine.stats()
    assert stats["tuning"]["pumps"] is False and stats["pumped_batches"] == 0


async def test_an_explicit_tuning_wins_over_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    caches = [(torch.arange(8 * 1024) % 251).to(torch.uint8).reshape(8, 1024)]
    monkeypatch.setenv("URING_KV_IO", "uring")
    async with Engine(caches, tmp_path / "kv", num_disk_blocks=8, num_slots=4,
                      tuning=Tuning(io="threads")) as engine:
        want = caches[0][:2].clone()
        await engine.store_batch([0, 1], [2, 3])
        caches[0][:] = 0
        await engine.load_batch([2, 3], [0, 1])
        assert "thread" in engine.stats()["io"]
    assert torch.equal(caches[0][:2], want)
    with pytest.raises(TypeError, match="Tuning"):
        Engine(caches, tmp_path / "kv", num_disk_blocks=8, tuning={"io": "threads"})  # type: ignore[arg-type]


def test_info_prints_the_tuning_in_force() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("URING_KV_")}
    env["URING_KV_DEBUG_PUMP_SCATTER"] = "0"
    done = subprocess.run([sys.executable, "-P", "-m", "uring_kv", "info"], capture_output=True, text=True,
                          timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    assert "pump_scatter=False" in done.stdout
    bad = subprocess.run([sys.executable, "-P", "-m", "uring_kv", "info"], capture_output=True, text=True,
                         timeout=120, env={**env, "URING_KV_DEBUG_PUMP": "maybe"})
    assert bad.returncode == 1 and "URING_KV_DEBUG_PUMP" in bad.stderr


def _vm_flags(addr: int) -> list[str]:
    """The VmFlags of this process's mapping that holds ``addr`` (/proc/self/smaps)."""
    flags: list[str] = []
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            start, end = (int(part, 16) for part in head.split("-"))
            inside = start <= addr < end
        elif inside and head == "VmFlags:":
            flags = line.split()[1:]
    return flags


def _thp_possible() -> bool:
    mode = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    return mode.exists() and "[never]" not in mode.read_text()


@pytest.mark.skipif(not _thp_possible(), reason="transparent huge pages are off (or absent) on this kernel")
@pytest.mark.parametrize("huge", [True, False])
async def test_staging_slots_are_advised_onto_huge_pages(tmp_path: Path, huge: bool) -> None:
    """Slots of 2 MiB blocks get MADV_HUGEPAGE (VmFlags "hg") unless Tuning(huge_pages=False): a
    2 MiB O_DIRECT read into fragmented 4 KiB pages splits into several device requests."""
    caches = [torch.zeros(2, 2 << 20, dtype=torch.uint8)]
    async with Engine(caches, tmp_path / "kv", num_disk_blocks=4, num_slots=2,
                      tuning=Tuning(huge_pages=huge)) as engine:
        assert engine.stats()["huge_pages"] is huge
        assert ("hg" in _vm_flags(engine.pool.slab.addr)) is huge
        caches[0][1].fill_(7)
        await engine.store_batch([1], [3])
        caches[0].zero_()
        await engine.load_batch([3], [0])
        assert bool((caches[0][0] == 7).all())
    small = Engine([torch.zeros(2, 4096, dtype=torch.uint8)], tmp_path / "small", num_disk_blocks=4, num_slots=2)
    async with small:
        assert small.stats()["huge_pages"] is False  # 8 KiB of slots span no huge page: not advised
