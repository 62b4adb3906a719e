"""One serving process of the two-process tests: ``peer.py ROLE MASTER METADATA DIR N`` with its own
local tier (a SyncTieredStore in DIR). ``store`` puts the blocks of keys 0..N-1, prints one JSON
line, then holds its Mooncake segment (where the values live) until a line arrives on stdin.
``load`` gets keys 0..N-1 into poisoned rows and prints one JSON line: the keys loaded, the crc32c
of each loaded row, whether every loaded row holds its key's bytes and every other row is untouched,
and its stats."""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")

import crc32c
from blocks import fill, holds, key, make_caches, poison, row_bytes

from uring_kv.integrations.mooncake import MooncakeConfig, SyncTieredStore


def main() -> None:
    role, master_address, metadata, directory, count = sys.argv[1:6]
    n = int(count)
    caches = make_caches(2 * n)
    config = MooncakeConfig(master_address, metadata, segment_bytes=(32 << 20) if role == "store" else 0,
                            local_buffer_bytes=4 << 20, staging_rows=8, namespace="two-processes")
    keys = [key(i, "shared") for i in range(n)]
    with SyncTieredStore(caches, directory, 2 * n, remote=config) as store:
        if role == "store":
            for row, k in enumerate(keys):
                fill(caches, row, k)
            store.put(keys, range(n))
            print(json.dumps({"stats": store.stats()}), flush=True)
            sys.stdin.readline()
            return
        rows = list(range(n, 2 * n))
        poison(caches, rows)
        untouched = row_bytes(caches, rows[0])
        seen = store.lookup_shared(keys)
        loaded = set(store.get_present(keys, rows))
        right = all(holds(caches, row, k) if k in loaded else row_bytes(caches, row) == untouched
                    for k, row in zip(keys, rows, strict=True))
        sums = {k.hex(): crc32c.crc32c(row_bytes(caches, row)) for k, row in zip(keys, rows, strict=True)
                if k in loaded}
        print(json.dumps({"lookup_shared": seen, "loaded": [k.hex() for k in keys if k in loaded], "sums": sums,
                          "right": right, "local_after": store.lookup(keys), "stats": store.stats()}), flush=True)


if __name__ == "__main__":
    main()
