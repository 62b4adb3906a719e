"""What ``uring-kv bench`` prints and plots: a header, the verdict, the table (fits 100 columns).

One ratio everywhere: ``N×`` is uring_kv's GB/s ÷ the other method's on the same operation, block
size and case (above 1: uring_kv is N times faster); against a ceiling the same quotient reads as
the fraction of that limit uring_kv reached ("0.91 of limit").
"""

from __future__ import annotations

from typing import Any

from uring_kv.bench.ceilings import recommend_depth
from uring_kv.bench.config import BenchConfig, staging_slots
from uring_kv.bench.results import LIMIT_CEILINGS, kind_of

# What each peer is called in the verdict
LABELS = {"vllm-disk": "vLLM DiskBackend"}  # threadsN and kvikioN: see _label
# the ceilings the verdict names, as it names them
LIMITS = {"ring ceiling": "disk limit", "copy ceiling": "copy limit", "rows ceiling": "rows limit", "fio": "fio"}
LAG_TARGET_MS = (1.0, 0.2)  # max, p99: the loop-lag targets
WIDTH = 100  # the output fits this many columns


def _wrapped(lead: str, parts: list[str]) -> list[str]:
    """``lead`` then ``parts`` joined by " · ", broken into lines of at most WIDTH columns."""
    lines, line = [], lead
    for i, part in enumerate(parts):
        piece = part if i == 0 else f" · {part}"
        if i and len(line) + len(piece) > WIDTH:
            lines.append(line)
            line, piece = " " * len(lead), part
        line += piece
    return [*lines, line]


def _label(method: str) -> str:
    if method.startswith("threads"):
        return f"{method[7:]}-thread pool"
    if method.startswith("kvikio"):
        return f"KvikIO ({method[6:]} threads)"
    return LABELS.get(method, method)


def _size(nbytes: float) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift:
            value = nbytes / (1 << shift)
            return f"{value:.0f} {unit}" if value == int(value) or value >= 10 else f"{value:.1f} {unit}"
    return f"{nbytes:.0f} B"


def _rows(result: dict[str, Any]) -> list[dict[str, Any]]:
    return [r for r in result["rows"] if r["case"] != "pcie"]


def _groups(result: dict[str, Any]) -> list[tuple[int, str, str]]:
    """(block bytes, case, op) in the order the bench ran them."""
    seen: list[tuple[int, str, str]] = []
    for r in _rows(result):
        key = (r["block_bytes"], r["case"], r["op"])
        if key not in seen:
            seen.append(key)
    return seen


def _mine(result: dict[str, Any], block: int, case: str, op: str) -> dict[str, Any] | None:
    return next((r for r in result["rows"] if r["method"] == "uring_kv" and
                 (r["block_bytes"], r["case"], r["op"]) == (block, case, op)), None)


def header(result: dict[str, Any]) -> list[str]:
    config, machine = result["config"], result["machine"]
    first: dict[str, Any] = next(iter(result["extra"].values()), {})
    case = first.get("cold") or first.get("hot") or {}
    where = machine["gpu"] or f"CPU mode, {machine['cpus']} CPUs"
    direct = "yes" if case.get("direct") else "no"
    return [f"uring-kv bench · {where} · {machine['date']}", *_wrapped("", [
        f"file in {result['path']} ({result['filesystem']}, O_DIRECT {direct}, "
        f"{_size(case.get('file_bytes', config['size']))})", f"{config['layers']} layers", f"batch {config['batch']}",
        f"{case.get('slots', '?')} slots", f"I/O depth {case.get('io_depth', '?')}"])]


def verdict(result: dict[str, Any]) -> list[str]:
    """A line per operation, block size and case; the loop's lag; the sizing advice."""
    lines = []
    limits = dict(LIMITS)
    if result["filesystem"] in ("tmpfs", "ramfs"):  # the RAM-backed run: the ring's limit, not a disk's
        limits["ring ceiling"] = "ring limit"
    for block, case, op in _groups(result):
        mine = _mine(result, block, case, op)
        if mine is None:
            continue
        ratios = mine["ratios"]
        # the binding one of the ring, copy and rows ceilings (the lowest: its share is the largest), and fio
        binding = [m for m in LIMIT_CEILINGS if m in ratios]
        shown = [max(binding, key=lambda m: ratios[m])] if binding else []
        parts = [f"{ratios[m]:.2f} of {limits[m]}" for m in limits if m in ratios and (m in shown or m == "fio")]
        parts += [f"{ratios[m]:.1f}× {_label(m)}" for m in ratios if kind_of(m) == "peer"]
        lines += _wrapped(f"{op:<5} {_size(block):>7} {case:<4} {mine['gbps']:6.2f} GB/s  ", parts)
    lag = result.get("uring_kv_lag")
    if lag and lag["samples"]:
        ok = lag["max_ms"] < LAG_TARGET_MS[0] and lag["p99_ms"] < LAG_TARGET_MS[1]
        lines.append(f"event loop while uring_kv ran: lag max {lag['max_ms']:.2f} ms, p99 {lag['p99_ms']:.3f} ms "
                     f"({'within' if ok else 'outside'} the targets < {LAG_TARGET_MS[0]:g} ms, "
                     f"< {LAG_TARGET_MS[1]:g} ms)")
    lines += sizing(result)
    if not result["all_verified"]:
        lines.append("SOME METHOD MOVED WRONG BYTES: see the 'ok' column")
    return lines


def sizing(result: dict[str, Any]) -> list[str]:
    """The I/O depth this disk needs (the smallest whose ring-ceiling rate, as a share of the best
    of its block size's sweep and averaged over the block sizes, reaches 0.95) and the slots and
    pinned memory it costs."""
    import torch

    swept = [(int(size), {int(d): r for d, r in extra["depth_sweep"].items()}, extra["cold"]["stride"])
             for size, extra in result["extra"].items() if extra.get("depth_sweep") and "cold" in extra]
    if not swept:
        return []
    # each block size's rates as shares of its best, averaged over the block sizes
    depths = sorted(set.intersection(*(set(sweep) for _, sweep, _ in swept)))
    mean = {d: sum(sweep[d] / max(sweep.values()) for _, sweep, _ in swept) / len(swept) for d in depths}
    depth = recommend_depth(mean)
    share = mean[depth]
    device = torch.device("cuda" if result["device"].startswith("cuda") else "cpu")
    costs = [(staging_slots(BenchConfig(io_depth=depth), device, size), size, stride) for size, _, stride in swept]
    slots = costs[-1][0]
    pinned = ", ".join(f"{_size(n * stride)} at {_size(size)}" for n, size, stride in costs)
    tried = f"{depths[0]}–{depths[-1]}"
    return [f"sizing: I/O depth {depth} reaches {share:.2f} of this disk's best rate (ring ceiling, depths {tried})",
            f"  → Engine(..., num_slots={slots}, io_depth={depth}): pinned {pinned} blocks"]


def render(result: dict[str, Any], console: Any, verbose: bool = False) -> None:
    """The disk's run, then the RAM-backed one (or why there is none)."""
    _render_run(result, console, verbose)
    if "ram" in result:
        console.print()
        console.print("RAM-backed file: the same run with the disk out of the way (the engine's own limit)",
                      highlight=False, markup=False, style="bold")
        _render_run({**result, **result["ram"]}, console, verbose)
    elif result.get("ram_skipped"):
        console.print(f"RAM-backed run: {result['ram_skipped']}", highlight=False, markup=False)


def _render_run(result: dict[str, Any], console: Any, verbose: bool) -> None:
    from rich import box
    from rich.table import Table

    def say(text: str, **style: Any) -> None:  # plain text: no markup ("uring-kv[peers]"), no highlighting
        console.print(text, highlight=False, markup=False, **style)

    for line in header(result):
        say(line)
    for line in verdict(result):
        say(line)
    say("N× = uring_kv's GB/s ÷ the method's (a ceiling's row: the share of it uring_kv reached); 'of limit' = "
        "each method's share of the lowest of the ring, copy and rows ceilings; core-s/GB = the process's CPU seconds "
        "(every thread) per GB moved; lag ms = the event loop's longest lag", style="dim")
    table = Table(box=box.SIMPLE, pad_edge=False, padding=(0, 1), collapse_padding=True)
    columns = ["block", "case", "op", "method", "GB/s", "uring_kv", "of limit", "p99 ms", "core-s/GB", "lag ms", "ok"]
    if verbose:
        columns[7:7] = ["blocks/s", "p50 ms", "CPU s"]
        columns[-1:-1] = ["lag p99 ms"]
    for column in columns:
        table.add_column(column, justify="left" if column in ("case", "op", "method") else "right",
                         no_wrap=column == "method")
    for row in result["rows"]:
        mine = _mine(result, row["block_bytes"], row["case"], row["op"])
        ratio = ""
        if mine is not None and row["method"] in mine["ratios"]:
            value = mine["ratios"][row["method"]]
            ratio = f"{value:.2f}" if row["kind"] == "ceiling" else f"{value:.2f}×"
        cells = {"block": _size(row["block_bytes"]), "case": row["case"], "op": row["op"], "method": row["method"],
                 "GB/s": f"{row['gbps']:.2f}", "uring_kv": ratio,
                 "of limit": "" if row.get("of_limit") is None else f"{row['of_limit']:.2f}",
                 "p99 ms": f"{row['p99_ms']:.2f}",
                 "lag ms": f"{row['lag_max_ms']:.2f}", "ok": "yes" if row["verified"] else "NO",
                 "blocks/s": f"{row['blocks_per_s']:.0f}", "p50 ms": f"{row['p50_ms']:.2f}",
                 "CPU s": f"{row['cpu_s']:.2f}", "lag p99 ms": f"{row['lag_p99_ms']:.3f}",
                 "core-s/GB": f"{row.get('core_s_per_gb', 0.0):.3f}"}
        if row["kind"] == "ceiling" and row["method"] not in ("ring ceiling", "copy ceiling", "rows ceiling"):
            for key in ("p99 ms", "lag ms", "p50 ms", "CPU s", "lag p99 ms", "core-s/GB"):
                cells[key] = ""
        table.add_row(*(cells[c] for c in columns))
    console.print(table)
    notes = {key: note for extra in result["extra"].values() for key, note in extra.get("notes", {}).items()}
    for key, note in notes.items():
        say(f"{key}: {note}")
    if verbose:
        for size, extra in result["extra"].items():
            for case in ("cold", "hot"):
                if case in extra:
                    facts = ", ".join(f"{k}={v}" for k, v in extra[case].items())
                    say(f"{_size(int(size))} {case}: {facts}")
            if extra.get("depth_sweep"):
                sweep = ", ".join(f"QD{d} {r:.2f}" for d, r in extra["depth_sweep"].items())
                say(f"{_size(int(size))} ring ceiling GB/s by depth: {sweep}")


def plot(result: dict[str, Any], path: str) -> None:
    """One panel per operation and case; bars per block size, one colour per method across all
    panels; ceilings as horizontal lines over their block size; the legend outside the panels."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = _rows(result)
    panels = [(op, case) for op, case in (("load", "cold"), ("store", "cold"), ("load", "hot"), ("store", "hot"))
              if any((r["op"], r["case"]) == (op, case) for r in rows)]
    methods = [m for m in dict.fromkeys(r["method"] for r in rows if r["kind"] != "ceiling")]
    ceilings = [m for m in dict.fromkeys(r["method"] for r in rows if r["kind"] == "ceiling")]
    palette = plt.get_cmap("tab10")
    colour = {m: palette(i % 10) for i, m in enumerate(methods + ceilings)}
    sizes = sorted({r["block_bytes"] for r in rows})
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels) + 2.5, 4.2), squeeze=False)
    width = 0.8 / max(1, len(methods))
    for ax, (op, case) in zip(axes[0], panels, strict=True):
        for i, method in enumerate(methods):
            values = [next((r["gbps"] for r in rows if (r["op"], r["case"], r["method"], r["block_bytes"]) ==
                            (op, case, method, s)), 0.0) for s in sizes]
            ax.bar([x - 0.4 + width * (i + 0.5) for x in range(len(sizes))], values, width, color=colour[method],
                   label=method)
        for method in ceilings:
            for x, s in enumerate(sizes):
                rate = next((r["gbps"] for r in rows if (r["op"], r["case"], r["method"], r["block_bytes"]) ==
                             (op, case, method, s)), None)
                if rate is not None:
                    ax.hlines(rate, x - 0.45, x + 0.45, colors=[colour[method]], linestyles="--", label=method)
        ax.set_xticks(range(len(sizes)), [_size(s) for s in sizes])
        ax.set_ylabel("GB/s")
        ax.set_title(f"{op}, {case}")
    handles: dict[str, Any] = {}
    for ax in axes[0]:
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            handles.setdefault(label, handle)
    fig.legend(handles.values(), handles.keys(), loc="center right", fontsize=8)
    machine = result["machine"]
    fig.suptitle(f"uring-kv bench · {machine['gpu'] or 'CPU mode'} · {result['path']} ({result['filesystem']}) · "
                 f"{machine['date']}", fontsize=10)
    fig.tight_layout(rect=(0, 0, 1 - 2.3 / (4.2 * len(panels) + 2.5), 0.95))
    fig.savefig(path)
    plt.close(fig)
