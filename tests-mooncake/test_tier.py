"""TieredStore over a real mooncake_master: remote hits byte-checked, promotion into the local tier,
write-through and write-back, lookups across both tiers, and a bad remote value turned into a miss."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from blocks import fill, holds, key, make_caches, poison, row_bytes

from uring_kv.errors import KeyMissingError
from uring_kv.integrations.mooncake import MooncakeConfig, TieredStore
from uring_kv.integrations.mooncake.local import LocalMaster

pytestmark = pytest.mark.timeout(120)


def config(master: LocalMaster, **overrides: object) -> MooncakeConfig:
    options: dict[str, object] = {"segment_bytes": 32 << 20, "local_buffer_bytes": 4 << 20, "staging_rows": 4,
                                  "namespace": "tests"}
    options.update(overrides)
    return MooncakeConfig(master.master_address, master.metadata_server, **options)  # type: ignore[arg-type]


def test_a_second_store_loads_what_the_first_put_and_promotes_it(master: LocalMaster, tmp_path: Path) -> None:
    async def main() -> None:
        writer_caches, reader_caches = make_caches(), make_caches()
        keys = [key(i) for i in range(10)]  # more than the 4 staging rows: several chunks
        for row, k in enumerate(keys):
            fill(writer_caches, row, k)
        async with TieredStore(writer_caches, tmp_path / "a", 32, remote=config(master)) as writer, \
                TieredStore(reader_caches, tmp_path / "b", 32, remote=config(master, segment_bytes=0)) as reader:
            await writer.put(keys, range(10))
            assert writer.stats()["remote_stored"] == 10
            assert await reader.lookup_shared([*keys, key(99)]) == 10
            assert reader.lookup(keys) == 0
            poison(reader_caches, range(16))
            rows = [15 - i for i in range(10)]
            assert await reader.get_present(keys, rows) == keys
            assert all(holds(reader_caches, row, k) for row, k in zip(rows, keys, strict=True))
            stats = reader.stats()
            assert stats["remote_hits"] == 10 and stats["remote_hits_promoted"] == 10
            assert reader.lookup(keys) == 10  # promoted: the next get is local
            poison(reader_caches, range(16))
            await reader.get(keys, range(10))
            assert all(holds(reader_caches, row, k) for row, k in enumerate(keys))
            assert reader.stats()["remote_hits"] == 10
            with pytest.raises(KeyMissingError) as missing:
                await reader.get([keys[0], key(99)], [0, 1])
            assert missing.value.keys == [key(99)] and holds(reader_caches, 0, keys[0])
            assert reader.stats()["remote_misses"] == 1

    asyncio.run(main())


def test_write_back_lands_after_put_returns(master: LocalMaster, tmp_path: Path) -> None:
    async def main() -> None:
        caches = make_caches()
        keys = [key(i, "back") for i in range(6)]
        for row, k in enumerate(keys):
            fill(caches, row, k)
        async with TieredStore(caches, tmp_path / "a", 32, remote=config(master), write="back") as store:
            await store.put(keys, range(6))
            poison(caches, range(6))  # the rows were copied before put returned
            for _ in range(200):
                if store.stats()["remote_pending_stores"] == 0:
                    break
                await asyncio.sleep(0.01)
            assert store.stats()["remote_stored"] == 6, str(store.stats())
            assert await store.remote.fetch(keys, range(6, 12)) == keys
            assert all(holds(caches, 6 + i, k) for i, k in enumerate(keys))

    asyncio.run(main())


def test_a_wrong_remote_value_is_a_miss_never_a_block(master: LocalMaster, tmp_path: Path) -> None:
    import crc32c
    from mooncake.store import MooncakeDistributedStore

    from uring_kv.integrations.mooncake.staging import MAGIC, TRAILER

    async def main() -> None:
        caches = make_caches()
        good, torn, short, moved = (key(i, "bad") for i in range(4))
        fill(caches, 0, good)
        async with TieredStore(caches, tmp_path / "a", 32, remote=config(master), promote=False) as store:
            tier = store.remote
            await store.put([good], [0])
            payload = row_bytes(caches, 0)
            sum_ = crc32c.crc32c(payload, crc32c.crc32c(tier.remote_key(good).encode()))
            seal = TRAILER.pack(MAGIC, len(payload), sum_, 0)
            assert len(payload + seal) == tier.value_bytes
            flipped = bytearray(payload + seal)
            flipped[100] ^= 1  # one bit off: a torn or corrupted transfer
            # wrong values written with a raw client under the keys the tier would read
            raw = MooncakeDistributedStore()
            assert raw.setup("127.0.0.1", master.metadata_server, 0, 4 << 20, "tcp", "", master.master_address) == 0
            try:
                assert raw.put(tier.remote_key(torn), bytes(flipped)) == 0
                assert raw.put(tier.remote_key(short), payload + seal[:-1]) == 0
                assert raw.put(tier.remote_key(moved), payload + seal) == 0  # good's value: the checksum names the key
            finally:
                raw.close()
            poison(caches, range(1, 16))
            before = row_bytes(caches, 1)
            assert await tier.fetch([torn, short, moved, good], [1, 2, 3, 4]) == [good]
            assert all(row_bytes(caches, row) == before for row in (1, 2, 3)) and holds(caches, 4, good)
            assert tier.stats()["bad_values"] == 3 and tier.stats()["hits"] == 1
            assert await store.get_present([torn, good], [5, 6]) == [good]  # good from the local tier
            assert holds(caches, 6, good) and row_bytes(caches, 5) == before

    asyncio.run(main())


def test_under_trio(master: LocalMaster, tmp_path: Path) -> None:
    trio = pytest.importorskip("trio")

    async def main() -> None:
        caches = make_caches()
        keys = [key(i, "trio") for i in range(5)]
        for row, k in enumerate(keys):
            fill(caches, row, k)
        async with TieredStore(caches, tmp_path / "a", 32, remote=config(master)) as store:
            await store.put(keys, range(5))
            poison(caches, range(5, 10))
            assert await store.remote.fetch(keys, range(5, 10)) == keys
            assert all(holds(caches, 5 + i, k) for i, k in enumerate(keys))
            assert await store.lookup_shared([*keys, key(9, "trio")]) == 5

    trio.run(main)


def test_closing_while_a_get_is_in_flight_waits_for_its_rows(master: LocalMaster, tmp_path: Path) -> None:
    async def main() -> None:
        caches = make_caches()
        keys = [key(i, "closing") for i in range(8)]
        for row, k in enumerate(keys):
            fill(caches, row, k)
        store = await TieredStore(caches, tmp_path / "a", 32, remote=config(master)).open()
        await store.put(keys, range(8))
        poison(caches, range(8, 16))
        fetching = asyncio.ensure_future(store.remote.fetch(keys, range(8, 16)))
        await asyncio.sleep(0)  # its call is on the worker thread now
        untouched = row_bytes(caches, 8)
        await store.aclose()  # the staging rows are unmapped only after the fetch copied out of them
        loaded = await fetching  # its first chunk (4 staging rows); closing refused the rest
        assert loaded == keys[:4]
        assert all(holds(caches, 8 + i, k) for i, k in enumerate(loaded))
        assert all(row_bytes(caches, row) == untouched for row in range(12, 16))

    asyncio.run(main())
