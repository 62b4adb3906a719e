"""Crash safety of the persistent store, with real kills: a child process storing at full speed
(``crashload.py``) is SIGKILLed at a random point, again and again on the same files, and after
each kill a reopened store must serve only keys whose bytes are exactly what was stored.

Each child is forked from a forkserver that has imported torch and uring_kv once, so a round
costs about a tenth of a second, not an interpreter start."""

from __future__ import annotations

import errno
import multiprocessing
import os
import random
import signal
import time
from pathlib import Path
from typing import Any

import crashload
import pytest
from faultfs import FaultState

from uring_kv import KeyIOError
from uring_kv.testing import identify

KILLS = 50  # per fsync policy


def forkserver() -> Any:
    """A forkserver context whose server has imported torch and uring_kv (through
    ``uring_kv.testing``) and pytest (which each child imports again as its main module). The
    server does not apply the parent's sys.path before it preloads (CPython 3.11), so only
    installed modules can be preloaded: each child imports ``crashload`` itself, at little cost."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["uring_kv.testing", "pytest"])
    return context


async def check_reopened(path: Path, fsync: bool) -> tuple[list[int], list[str], int]:
    """Reopen the store and load every key it holds: (the keys held, what was wrong, how many
    blocks failed their crc32c check: caught, not served, but the index and the file disagreed)."""
    problems: list[str] = []
    refused = 0
    caches = crashload.caches()
    rows = len(caches["layer0"])
    async with crashload.open_store(str(path), fsync, caches) as store:
        held = [i for i in range(crashload.KEYS) if store.contains(crashload.key(i))]
        stats = store.stats()
        if stats["keys"] != len(held):
            problems.append(f"the index holds {stats['keys']} keys, {len(held)} of them the child's")
        blocks = [entry.disk_block for entry in store._index.values()]
        if len(set(blocks)) != len(blocks) or not all(0 <= b < crashload.CAPACITY for b in blocks):
            problems.append(f"blocks shared or out of range: {sorted(blocks)}")
        if stats["keys"] + stats["free_blocks"] != crashload.CAPACITY:
            problems.append(f"keys + free blocks != capacity: {stats}")
        for start in range(0, len(held), rows):
            ids = held[start:start + rows]
            try:
                await store.get([crashload.key(i) for i in ids], range(len(ids)))
            except KeyIOError as exc:
                if set(exc.failures.values()) != {errno.EBADMSG}:
                    problems.append(f"loads failed: {exc}")
                refused += len(exc.failures)
                failed = {ids.index(crashload.key_id(k)) for k in exc.failures}
            else:
                failed = set()
            problems += [f"key {i} holds {identify(caches, row)}" for row, i in enumerate(ids)
                         if row not in failed and identify(caches, row) != (i, 1, True)]
    return held, problems, refused


@pytest.mark.timeout(600)
@pytest.mark.parametrize("fsync", [False, True], ids=["no-fsync", "fsync"])
async def test_random_sigkills_never_leave_a_bad_block_served(tmp_path: Path, fsync: bool) -> None:
    """50 SIGKILLs at random points of a child storing at full speed: in one round out of five
    during its open (recovery from the last kill included), else 5–150 ms into its puts. After
    each, every key the reopened store holds loads, byte-exact, no block fails its crc32c, no two
    keys share a block, and keys + free blocks = capacity.

    Mutation tried (the durability rule broken): the old row's deletion committed together with
    the new row, after the write, instead of before it (a put no longer waits for it). The test
    failed: in 9 rounds of the 50 (the first at round 15) the reopened store held evicted keys
    whose blocks a later put had rewritten before the kill (their crc32c check failed)."""
    context = forkserver()
    path = tmp_path / "kv.bin"
    rng = random.Random(29 + fsync)
    stored = during_puts = held_total = 0
    problems: list[str] = []
    for round_ in range(KILLS):
        ready, progress = context.Event(), context.Value("q", 0, lock=False)
        child = context.Process(target=crashload.run, args=(str(path), round_, fsync, ready, progress))
        child.start()
        if rng.random() < 0.2:
            time.sleep(rng.uniform(0.0, 0.05))
        else:
            assert ready.wait(60), "the child did not open its store"
            time.sleep(rng.uniform(0.005, 0.15))
            during_puts += 1
        os.kill(child.pid, signal.SIGKILL)
        child.join()
        assert child.exitcode == -signal.SIGKILL, f"round {round_}: the child ended by itself ({child.exitcode})"
        stored += progress.value
        held, wrong, refused = await check_reopened(path, fsync)
        held_total += len(held)
        problems += [f"round {round_}: {problem}" for problem in wrong]
        if refused:
            problems.append(f"round {round_}: {refused} blocks failed their crc32c check")
    assert not problems, "\n".join(problems[:20])
    # not vacuous: the children stored and evicted plenty, and the reopened stores held keys
    assert during_puts >= 30 and stored > 10 * crashload.CAPACITY and held_total > KILLS * crashload.CAPACITY // 2


POWER_CUTS = 20  # per fsync policy


@pytest.mark.timeout(600)
@pytest.mark.parametrize("fsync", [True, False], ids=["fsync", "no-fsync"])
async def test_power_loss_never_serves_a_bad_block(fault_fs: tuple[Path, FaultState], fsync: bool) -> None:
    """The same child on the fault filesystem, cut off by a simulated power loss instead: the
    filesystem freezes at a random point of the puts, the child is killed, and each file keeps
    its synced bytes plus a random part of its unsynced writes (``faultfs``). After each of 20
    cuts, the reopened store serves no wrong byte. With ``fsync`` no block may fail its crc32c
    check either (every row's block was synced before the row); without, some do (their rows
    outlived their bytes) and are refused, never served.

    Mutation tried: the block file's fdatasync left out of the group commit with ``fsync``: the
    test failed from the first cut on (235 blocks over the 20 cuts failed their crc32c check:
    rows that outlived their blocks' bytes)."""
    mountpoint, state = fault_fs
    state.volatile = True
    state.sync_delay = 0.005  # so that writes wait, unsynced, as on a disk
    context = forkserver()
    path = mountpoint / "kv.bin"
    rng = random.Random(31 + fsync)
    keep = 0.5 if fsync else 0.95
    problems: list[str] = []
    lost = refused_total = held_total = rounds_held = 0
    for round_ in range(POWER_CUTS):
        ready, progress = context.Event(), context.Value("q", 0, lock=False)
        child = context.Process(target=crashload.run, args=(str(path), round_, fsync, ready, progress))
        child.start()
        assert ready.wait(60), "the child did not open its store"
        wait_for_puts(progress)  # so that the cut lands among the puts, however loaded the machine
        time.sleep(rng.uniform(0.02, 0.2))
        state.freeze()
        os.kill(child.pid, signal.SIGKILL)
        child.join()
        lost += state.power_cut(rng, keep)
        held, wrong, refused = await check_reopened(path, fsync)
        held_total += len(held)
        rounds_held += bool(held)
        refused_total += refused
        problems += [f"round {round_}: {problem}" for problem in wrong]
        if fsync and refused:
            problems.append(f"round {round_}: {refused} blocks failed their crc32c check")
    assert not problems, "\n".join(problems[:20])
    totals = (f"{lost} writes lost, {held_total} keys held (after {rounds_held} of {POWER_CUTS} cuts), "
              f"{refused_total} blocks refused")
    # not vacuous: writes were lost, and reopened stores served keys (how many depends on how far
    # the child got before the cut: without fsync, 140 to 270 keys after 13 to 20 of the 20 cuts on
    # a two-core machine with three busy processes beside it; with fsync over 500 after all 20)
    assert lost > POWER_CUTS and rounds_held >= POWER_CUTS // 4 and held_total > POWER_CUTS, totals
    assert fsync or refused_total > 0, totals  # without fsync, rows did outlive their bytes: the check caught them


def wait_for_puts(progress: Any, timeout: float = 60.0) -> None:
    """Until the child's puts have stored a key (``progress`` counts them)."""
    deadline = time.monotonic() + timeout
    while not progress.value:
        assert time.monotonic() < deadline, "the child stored nothing"
        time.sleep(0.002)


@pytest.mark.timeout(120)
async def test_keys_a_put_returned_survive_a_power_loss_with_fsync(fault_fs: tuple[Path, FaultState]) -> None:
    """A child puts 16 keys, its puts return, and the power goes (every unsynced write lost or
    kept at random): with ``fsync=True`` all 16 keys are served after the restart, byte-exact.
    Mutation tried: the fdatasync left out (10 of the 16 keys failed their crc32c check)."""
    mountpoint, state = fault_fs
    state.volatile = True
    context = forkserver()
    path = mountpoint / "kv.bin"
    done = context.Event()
    child = context.Process(target=crashload.put_then_wait, args=(str(path), True, done))
    child.start()
    assert done.wait(60), "the child's puts did not return"
    state.freeze()
    os.kill(child.pid, signal.SIGKILL)
    child.join()
    state.power_cut(random.Random(5))  # (nothing is unsynced, unless a sync was left out)
    held, wrong, refused = await check_reopened(path, True)
    assert held == list(range(crashload.CAPACITY // 2)) and not wrong and not refused
