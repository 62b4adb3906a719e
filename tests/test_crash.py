"""Crash safety of the persistent store, with real kills: a child process storing at full speed
(``crashload.py``) is SIGKILLed at a random point, again and again on the same files, and after
each kill a reopened store must serve only keys whose bytes are exactly what was stored.

Each child is forked from a forkserver that has imported torch and uring_kv once, so a round
costs about a tenth of a second, not an interpreter start."""

from __future__ import annotations

import multiprocessing
import os
import random
import signal
import time
from pathlib import Path
from typing import Any

import crashload
import pytest

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


async def check_reopened(path: Path, fsync: bool) -> tuple[int, list[str]]:
    """Reopen the store and load every key it holds: (keys held, what was wrong)."""
    problems: list[str] = []
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
            except KeyIOError as exc:  # a block that fails its check: the index and the file disagree
                problems.append(f"loads failed: {exc}")
                continue
            problems += [f"key {i} holds {identify(caches, row)}"
                         for row, i in enumerate(ids) if identify(caches, row) != (i, 1, True)]
    return len(held), problems


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
        held, wrong = await check_reopened(path, fsync)
        held_total += held
        problems += [f"round {round_}: {problem}" for problem in wrong]
    assert not problems, "\n".join(problems[:20])
    # not vacuous: the children stored and evicted plenty, and the reopened stores held keys
    assert during_puts >= 30 and stored > 10 * crashload.CAPACITY and held_total > KILLS * crashload.CAPACITY // 2
