"""What the crash test's child process runs (``test_crash.py``): a persistent store storing at full
speed until it is killed.

Three workers put batches of keys drawn from three times the store's capacity (so most puts
evict, and some re-put keys the store holds) and now and then read some back. Key ``key(i)``
always holds the self-identifying block ``i`` at version 1 (``uring_kv.testing``), so whoever
reopens the store can tell each key's bytes exactly. A child that reads back a wrong block exits
with ``WRONG_BYTES``; ``progress`` counts the keys its puts stored.

Each child is a fork of a forkserver that imported torch and uring_kv once.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import random
from typing import Any

from uring_kv import BlockStore, KeyIOError
from uring_kv.testing import fill, id_caches, identify

CAPACITY = 32
KEYS = 3 * CAPACITY
LAYERS = 2
WORKERS = 3
ROWS = 6  # per worker
FINGERPRINT = "crash-test"
WRONG_BYTES = 3


def key(i: int) -> bytes:
    return hashlib.sha256(b"crash %d" % i).digest()


def caches() -> Any:
    return id_caches("cpu", layers=LAYERS, blocks=WORKERS * ROWS)


def open_store(path: str, fsync: bool, rows: Any = None) -> BlockStore:
    return BlockStore(rows if rows is not None else caches(), path, CAPACITY, 4, persistent=True,
                      fingerprint=FINGERPRINT, fsync=fsync)


def run(path: str, seed: int, fsync: bool, ready: Any, progress: Any) -> None:
    """The child's body: open the store, say so (``ready.set()``), store until killed."""
    asyncio.run(_run(path, seed, fsync, ready, progress))


async def _run(path: str, seed: int, fsync: bool, ready: Any, progress: Any) -> None:
    rows_of = caches()
    store = open_store(path, fsync, rows_of)
    await store.open()
    ready.set()

    async def worker(index: int) -> None:
        rng = random.Random(seed * 1009 + index)
        rows = list(range(index * ROWS, (index + 1) * ROWS))
        while True:
            ids = rng.sample(range(KEYS), rng.randint(1, ROWS))
            if rng.random() < 0.8:
                for i, row in zip(ids, rows, strict=False):
                    fill(rows_of, row, i, 1)
                try:
                    await store.put([key(i) for i in ids], rows[:len(ids)])
                except KeyIOError:  # no room: every block in flight
                    continue
                progress.value += len(ids)
            else:
                loaded = set(await store.get_present([key(i) for i in ids], rows[:len(ids)]))
                for i, row in zip(ids, rows, strict=False):
                    if key(i) in loaded and identify(rows_of, row) != (i, 1, True):
                        os._exit(WRONG_BYTES)

    await asyncio.gather(*(worker(index) for index in range(WORKERS)))


def put_then_wait(path: str, fsync: bool, done: Any) -> None:
    """Another child's body: put keys 0 .. CAPACITY/2 - 1 (two puts), say so (``done.set()``), then
    wait to be killed."""
    asyncio.run(_put_then_wait(path, fsync, done))


async def _put_then_wait(path: str, fsync: bool, done: Any) -> None:
    rows_of = caches()
    async with open_store(path, fsync, rows_of) as store:
        for first in range(0, CAPACITY // 2, ROWS):
            ids = list(range(first, min(first + ROWS, CAPACITY // 2)))
            for row, i in enumerate(ids):
                fill(rows_of, row, i, 1)
            await store.put([key(i) for i in ids], range(len(ids)))
        done.set()
        await asyncio.sleep(3600)


def key_id(k: bytes) -> int:
    """The i of ``key(i)``."""
    return _IDS[k]


_IDS = {key(i): i for i in range(KEYS)}
