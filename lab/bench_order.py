"""Each method's batch times in a `uring-kv bench --json` file, grouped by what ran just before.

The bench runs every batch with every method, rotating the order from one batch to the next
(`bench.measure.measure`): in round r the methods run in their listed order starting from the (r mod n)th.
This replays that order from the JSON (the rows of an op and case are listed in that order; the
first `config.warmup` rounds are not in `batch_ms`) and prints, per method, the mean batch time
after each predecessor, and whether the predecessor had just read or written the same blocks
(the same round) or other ones (the previous round).

    python lab/bench_order.py RESULT.json [...] [--op load] [--case cold]
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from typing import Any


def by_predecessor(result: dict[str, Any], op: str, case: str) -> dict[str, dict[tuple[str, bool], list[float]]]:
    """method → (predecessor, same round) → batch times in ms, for every (block size) row set."""
    warmup = int(result["config"]["warmup"])
    out: dict[str, dict[tuple[str, bool], list[float]]] = defaultdict(lambda: defaultdict(list))
    sizes = sorted({row["block_bytes"] for row in result["rows"] if row["op"] == op and row["case"] == case})
    for size in sizes:
        rows = {row["method"]: row for row in result["rows"]
                if row["op"] == op and row["case"] == case and row["block_bytes"] == size and "batch_ms" in row
                and isinstance(row["batch_ms"], list)}
        names = list(rows)
        if not names:
            continue
        rounds = len(rows[names[0]]["batch_ms"]) + warmup
        order = [(r, name) for r in range(rounds)
                 for name in names[r % len(names):] + names[:r % len(names)]]
        for (r, name), (prev_round, prev) in zip(order[1:], order, strict=False):
            if r >= warmup:
                out[f"{name} ({size >> 10} KiB)"][(prev, prev_round == r)].append(rows[name]["batch_ms"][r - warmup])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+")
    parser.add_argument("--op", default="load", choices=["load", "store"])
    parser.add_argument("--case", default="cold", choices=["cold", "hot"])
    args = parser.parse_args()
    for path in args.files:
        with open(path) as f:
            table = by_predecessor(json.load(f), args.op, args.case)
        print(f"{path}: {args.op}, {args.case}")
        for method, groups in table.items():
            for (prev, same), times in sorted(groups.items()):
                blocks = "same blocks" if same else "other blocks"
                mean = statistics.mean(times)
                print(f"  {method:28} after {prev:14} ({blocks:12}) n={len(times):3}  mean {mean:7.2f} ms")


if __name__ == "__main__":
    main()
