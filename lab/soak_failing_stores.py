"""The soak with stores failing under loads of the same blocks, at any length (CI runs 3,000 blocks).

Mounts the tests' fault filesystem (``tests/faultfs.py``: root, /dev/fuse and libfuse3 needed),
puts the block file on it, and every millisecond or so makes writes to four random neighbouring
disk blocks fail with EIO while 12 workers load and store (10 % cancelled). Prints the soak's
summary line: ``corrupt`` counts loads that returned a failed store's version or stale bytes.

    python -P lab/soak_failing_stores.py --blocks 300000 --io uring
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from faultfs import mounted

from uring_kv.testing import soak


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--blocks", type=int, default=300_000)
    parser.add_argument("--io", default="uring", choices=["uring", "threads"])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as d, mounted(Path(d), watchdog_seconds=24 * 3600) as state:

        def faults(engine: Any, rng: random.Random) -> None:
            state.clear()
            first = rng.randrange(engine.num_disk_blocks - 4)
            state.fail_writes(engine.file.offset(first), 4 * engine.file.stride)

        result = asyncio.run(soak(args.blocks, slots=4, workers=12, cancel_rate=0.1, disk_blocks=64,
                                  directory=d, io=args.io, faults=faults, seed=args.seed))
    print(f"soak failing stores, io={args.io}: {result.summary()}")
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
