"""Faults under a TieredStore, with a real mooncake_master: the master killed and restarted mid-run,
a master that stops answering (SIGSTOP: a partition, as clients see it), a segment that is full.
Each must be a miss or an unstored key, never a wrong block, and the local tier keeps serving.
Every row a call reports loaded is byte-checked; every other row must be left as it was."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest
import torch
from blocks import fill, holds, key, make_caches, poison, row_bytes

from uring_kv.integrations.mooncake import MooncakeConfig, TieredStore
from uring_kv.integrations.mooncake.local import LocalMaster

pytestmark = pytest.mark.timeout(120)


def config(master: LocalMaster, **overrides: object) -> MooncakeConfig:
    options: dict[str, object] = {"segment_bytes": 32 << 20, "local_buffer_bytes": 4 << 20, "staging_rows": 8,
                                  "namespace": "faults", "timeout": 1.0, "retry_after": 0.2}
    options.update(overrides)
    options.setdefault("master_address", master.master_address)
    return MooncakeConfig(metadata_server=master.metadata_server, **options)  # type: ignore[arg-type]


async def checked_get(store: TieredStore, caches: dict[str, torch.Tensor], keys: list[bytes],
                      rows: list[int]) -> list[bytes]:
    """get_present into poisoned rows; every key it returns holds its bytes, every other row is untouched."""
    poison(caches, rows)
    untouched = row_bytes(caches, rows[0])
    loaded = await store.get_present(keys, rows)
    for k, row in zip(keys, rows, strict=True):
        if k in loaded:
            assert holds(caches, row, k), f"row {row} has wrong bytes for a key reported loaded"
        else:
            assert row_bytes(caches, row) == untouched, f"row {row} was written for a key reported missing"
    return loaded


def test_master_killed_and_restarted_mid_run(master: LocalMaster, tmp_path: Path) -> None:
    # The master is killed and restarted by timers on another thread while puts and gets run back
    # to back, so either may land in the middle of a call.
    events: dict[str, float] = {}

    def kill() -> None:
        master.kill()
        events["killed"] = time.monotonic()

    def restart() -> None:
        master.restart()
        events["restarted"] = time.monotonic()

    async def main() -> None:
        caches = make_caches(32)
        # a local tier of 4 blocks: most gets of older keys must go to Mooncake
        async with TieredStore(caches, tmp_path / "a", 4, remote=config(master)) as store:
            written: list[bytes] = []
            rounds: list[tuple[float, float, int]] = []  # (start, end, remote hits) of each round
            timers = [threading.Timer(0.6, kill), threading.Timer(1.6, restart)]
            for timer in timers:
                timer.start()
            try:
                for round_ in range(400):
                    started = time.monotonic()
                    new = [key(2 * round_ + i, "kill") for i in range(2)]
                    for row, k in zip((0, 1), new, strict=True):
                        fill(caches, row, k)
                    await store.put(new, [0, 1])  # the local tier stores them whatever Mooncake does
                    written += new
                    assert store.contains(new[0]) and store.contains(new[1])
                    older = written[-12:-2]  # mostly evicted from the 4 local blocks: remote hits or misses
                    hits = store.stats()["remote_hits"]
                    loaded = await checked_get(store, caches, [*new, *older], list(range(2, 4 + len(older))))
                    assert new[0] in loaded and new[1] in loaded, "the local tier stopped serving"
                    rounds.append((started, time.monotonic(), store.stats()["remote_hits"] - hits))
                    after = [n for start, _, n in rounds if start > events.get("restarted", float("inf")) + 0.5]
                    if len(after) >= 3 and min(after[-3:]) >= 6:
                        break  # remote hits are back (of the keys written since the restart)
                    await asyncio.sleep(0.02)
            finally:
                for timer in timers:
                    timer.cancel()
                    timer.join()
            stats = store.stats()
            killed, restarted = events["killed"], events["restarted"]
            assert max(n for _, end, n in rounds if end < killed) > 0, stats  # remote hits before the kill
            down = [n for start, end, n in rounds if killed < start and end < restarted]
            assert down and sum(down) == 0, stats  # none while the master is dead (and nothing wrong)
            assert after and after[-1] > 0, f"no remote hit {time.monotonic() - restarted:.1f} s after the restart"
            assert stats["remote_errors"] > 0 or stats["remote_not_tried"] > 0, stats

    asyncio.run(main())


def test_a_master_that_stops_answering_times_out_and_the_local_tier_keeps_serving(
        master: LocalMaster, tmp_path: Path) -> None:
    async def main() -> None:
        caches = make_caches(32)
        async with TieredStore(caches, tmp_path / "a", 4, remote=config(master, timeout=0.5)) as store:
            keys = [key(i, "pause") for i in range(8)]
            for row, k in enumerate(keys):
                fill(caches, row, k)
            await store.put(keys[:4], range(4))
            await store.put(keys[4:], range(4, 8))
            local, remote_only = keys[4:], keys[:4]  # the 4 local blocks keep the last 4
            assert store.lookup(local) == 4 and not any(store.contains(k) for k in remote_only)
            # Keys no client ever put: their lookup needs the master. (Mooncake's client answered a
            # get of keys this process had just put, once in many runs, with its master stopped.)
            absent = [key(i, "pause-absent") for i in range(4)]
            master.pause()
            try:
                started = time.monotonic()
                loaded = await checked_get(store, caches, [*local, *absent], list(range(8, 16)))
                took = time.monotonic() - started
                assert loaded == local and 0.4 < took < 3.0, (loaded, took)
                stats = store.stats()
                assert stats["remote_timeouts"] == 1 and stats["remote_stuck_calls"] == 1
                assert stats["remote_available"] == 0
                # while the late call is stuck, calls do not wait for Mooncake at all
                started = time.monotonic()
                assert await checked_get(store, caches, [*local, *remote_only], list(range(8, 16))) == local
                new = key(100, "pause")
                fill(caches, 16, new)
                await store.put([new], [16])
                assert time.monotonic() - started < 2.0 and store.contains(new)
                stats = store.stats()  # no second timeout: nothing went to Mooncake
                assert stats["remote_timeouts"] == 1 and stats["remote_not_tried"] >= 5
            finally:
                master.resume()
            for _ in range(100):  # the stuck calls return once the master answers again
                if store.stats()["remote_available"]:
                    break
                await asyncio.sleep(0.05)
            assert store.stats()["remote_available"] == 1 and store.stats()["remote_stuck_calls"] == 0
            assert await checked_get(store, caches, remote_only, list(range(8, 12))) == remote_only
            assert store.stats()["remote_resting_rows"] == 0

    asyncio.run(main())


def test_a_get_cancelled_while_mooncake_holds_its_call_leaves_the_rows_alone(
        master: LocalMaster, tmp_path: Path) -> None:
    async def main() -> None:
        caches = make_caches(32)
        async with TieredStore(caches, tmp_path / "a", 4, remote=config(master, timeout=20.0)) as store:
            keys = [key(i, "cancel") for i in range(4)]
            for row, k in enumerate(keys):
                fill(caches, row, k)
            await store.put(keys, range(4))
            poison(caches, range(4, 8))
            untouched = row_bytes(caches, 4)
            for _ in range(100):  # a call that goes to Mooncake, not a back-off's quick miss
                if store.remote.available:
                    break
                await asyncio.sleep(0.05)
            assert store.remote.available, store.remote.stats()
            master.pause()
            try:
                task = asyncio.ensure_future(store.remote.fetch(keys, range(4, 8)))
                await asyncio.sleep(0.3)
                assert not task.done(), f"the fetch ended with the master stopped: {task!r}, {store.remote.stats()}"
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
            finally:
                master.resume()
            for _ in range(100):  # the call returns once the master answers; its rows come back then
                await asyncio.sleep(0.05)
                if store.remote.rows._free and len(store.remote.rows._free) == store.remote.rows.count:
                    break
            assert len(store.remote.rows._free) == store.remote.rows.count
            assert all(row_bytes(caches, row) == untouched for row in range(4, 8))
            assert await store.remote.fetch(keys, range(4, 8)) == keys
            assert all(holds(caches, 4 + i, k) for i, k in enumerate(keys))

    asyncio.run(main())


def test_a_full_segment_leaves_keys_local_only(master: LocalMaster, tmp_path: Path) -> None:
    async def main() -> None:
        # 2 MiB blocks, a 16 MiB segment (Mooncake's smallest): 12 values do not fit
        caches = {"kv": torch.zeros(24, 2 << 20, dtype=torch.uint8)}
        keys = [key(i, "full") for i in range(12)]
        for row, k in enumerate(keys):
            fill(caches, row, k)
        small = config(master, segment_bytes=16 << 20)
        async with TieredStore(caches, tmp_path / "a", 16, remote=small) as writer:
            await writer.put(keys, range(12))  # does not raise: the local tier took every key
            stats = writer.stats()
            assert stats["keys"] == 12
            assert stats["remote_no_space"] > 0 and stats["remote_stored"] + stats["remote_store_failures"] == 12
            async with TieredStore(caches, tmp_path / "b", 16, remote=config(master, segment_bytes=0)) as reader:
                loaded = await checked_get(reader, caches, keys, list(range(12, 24)))
                assert 0 < len(loaded) <= stats["remote_stored"]
                assert reader.stats()["remote_hits"] == len(loaded)

    asyncio.run(main())


def test_an_unreachable_master_fails_open_at_once_and_closes_the_local_tier(master: LocalMaster,
                                                                           tmp_path: Path) -> None:
    from uring_kv.integrations.mooncake import MooncakeError
    from uring_kv.integrations.mooncake.local import free_port

    async def main() -> None:
        store = TieredStore(make_caches(), tmp_path / "a", 4,
                            remote=config(master, master_address=f"127.0.0.1:{free_port()}"))
        started = time.monotonic()
        with pytest.raises(MooncakeError, match=r"master at 127\.0\.0\.1:\d+ is not reachable"):
            await store.open()
        assert time.monotonic() - started < 5 and store.local.closed

    asyncio.run(main())
