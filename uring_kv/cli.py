"""Command line: ``uring-kv bench`` (the main job), ``uring-kv info`` and ``uring-kv demo``."""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import resource
import sys
import tempfile
from collections.abc import Callable
from typing import Any

from uring_kv import __version__


def _size(text: str) -> int:
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    text = text.strip().lower().removesuffix("ib").removesuffix("b")
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


# The names --baselines takes (uring_kv._bench.BASELINES, which needs torch to import).
_BASELINE_NAMES = ("serial", "threads", "ceiling")


def _baselines(text: str) -> tuple[str, ...]:
    names = tuple(name.strip() for name in text.split(",") if name.strip())
    if names == ("none",):
        return ()
    unknown = [name for name in names if name not in _BASELINE_NAMES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of {', '.join(_BASELINE_NAMES)} "
                                         f"or none, got {text!r}")
    return tuple(name for name in _BASELINE_NAMES if name in names)


def _at_least(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        value = int(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    return parse


def _bench(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from uring_kv._bench import BenchConfig, plot, render, run_bench, to_json

    config = BenchConfig(path=args.path, size=args.size, layers=args.layers, batch=args.batch,
                         batches=args.batches, warmup=args.warmup, slots=args.slots,
                         spare_slots=args.spare_slots, threads=args.threads,
                         direct=args.direct, device=args.device, checksum=args.checksum,
                         baselines=args.baselines,
                         gc_freeze=args.gc_freeze)
    if args.block_size:
        config.block_sizes = args.block_size
    console = Console(stderr=True)
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=console,
                  disable=not console.is_terminal) as progress:
        task = progress.add_task("starting", total=None)

        def report(message: str) -> None:
            progress.update(task, description=message)
            if not console.is_terminal:
                print(f"bench: {message}", file=sys.stderr, flush=True)

        result = asyncio.run(run_bench(config, report))
    screen = Console()
    render(result, screen if screen.is_terminal else Console(width=200))
    if args.json:
        with open(args.json, "w") as out:
            out.write(to_json(result))
    if args.plot:
        plot(result, args.plot)
    print(to_json(result) if args.print_json else f"verified: {'all' if result['all_verified'] else 'NOT ALL'}")
    return 0 if result["all_verified"] else 1


def info(path: str | None) -> tuple[dict[str, Any], str | None]:
    """What uring_kv would use here, and the reason it cannot run (or None)."""
    import torch

    from uring_kv._file import BlockFile
    from uring_kv._io import open_backend
    from uring_kv._native import LIBURING_VERSION, cuda_copy_path, load_cuda_driver

    facts: dict[str, Any] = {"uring_kv": __version__, "kernel": platform.release(),
                             "liburing (static)": LIBURING_VERSION}
    problem = None

    async def probe_io() -> str:
        io = open_backend("auto")
        try:
            return io.description
        finally:
            io.close()

    try:
        facts["io"] = asyncio.run(probe_io())
    except Exception as exc:
        facts["io"] = f"unavailable: {exc}"
        problem = str(exc)
    directory = path or tempfile.gettempdir()
    try:
        probe = BlockFile(os.path.join(directory, f".uring-kv-info-{os.getpid()}"), 4096, 1)
        facts["path"] = directory
        facts["O_DIRECT"] = "yes" if probe.direct else f"no ({probe.reason})"
        facts["alignment"] = probe.alignment
        probe.close()
    except OSError as exc:
        facts["O_DIRECT"] = f"cannot create a block file in {directory}: {exc}"
        problem = problem or facts["O_DIRECT"]
    soft, _hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    facts["RLIMIT_MEMLOCK"] = "unlimited" if soft == resource.RLIM_INFINITY else f"{soft} bytes"
    facts["torch"] = torch.__version__
    if torch.cuda.is_available():
        facts["CUDA"] = torch.version.cuda
        facts["GPU"] = torch.cuda.get_device_name()
        facts["CUDA copies"] = cuda_copy_path() if load_cuda_driver() else "unavailable (libcuda.so.1 not loadable)"
    else:
        facts["CUDA"] = "not available (CPU mode)"
    return facts, problem


def _info(args: argparse.Namespace) -> int:
    facts, problem = info(args.path)
    width = max(len(k) for k in facts)
    for key, value in facts.items():
        print(f"{key:<{width}}  {value}")
    if problem:
        print(f"uring_kv cannot run here: {problem}", file=sys.stderr)
        return 1
    return 0


def _demo(args: argparse.Namespace) -> int:
    import torch

    from uring_kv import Engine

    async def main() -> None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
        caches = {f"layer{i}": torch.randn(64, 16, 128, device=device).to(torch.bfloat16) for i in range(8)}
        original = {k: v.clone() for k, v in caches.items()}
        path = os.path.join(args.path or tempfile.gettempdir(), f"uring-kv-demo-{os.getpid()}.bin")
        async with Engine(caches, path, num_disk_blocks=256, num_slots=8) as engine:
            stats = engine.stats()
            print(f"engine on {device}: {stats['io']}, O_DIRECT={stats['direct']}, "
                  f"block={engine.block_bytes} bytes, pinned={stats['pinned_bytes']} bytes")
            await engine.store_batch(list(range(64)), list(range(100, 164)))
            print("stored GPU blocks 0..63 to disk blocks 100..163")
            for t in caches.values():
                t.zero_()
            await engine.load_batch(list(range(100, 164)), list(range(64)))
            same = all(torch.equal(caches[k], original[k]) for k in caches)
            print(f"loaded them back: {'identical' if same else 'DIFFERENT'}")
        print(f"closed; block file removed: {not os.path.exists(path)}")

    asyncio.run(main())
    return 0


def _soak(args: argparse.Namespace) -> int:
    import torch

    from uring_kv.testing import soak

    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    result = asyncio.run(soak(args.blocks, device=device, slots=args.slots, workers=args.workers,
                              cancel_rate=args.cancel_rate, directory=args.path, io=args.io,
                              checksum=args.checksum, io_depth=args.io_depth))
    print(f"soak {device}: {result.summary()}")
    return 0 if result.ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="uring-kv", description="KV-cache block offload through io_uring")
    parser.add_argument("--version", action="version", version=__version__)
    sub = parser.add_subparsers(dest="command", required=True)
    bench = sub.add_parser("bench", help="measure loads and stores against baselines and ceilings")
    bench.add_argument("--path", help="directory for the block file (default: the temp directory)")
    bench.add_argument("--size", type=_size, default=1 << 30, help="file size per block size (default 1G)")
    bench.add_argument("--block-size", type=_size, action="append", help="bytes per block (repeatable; "
                       "default 128K and 2M)")
    bench.add_argument("--layers", type=int, default=32)
    bench.add_argument("--batch", type=int, default=256, help="blocks per batch")
    bench.add_argument("--batches", type=_at_least(1), default=None,
                       help="measured batches per method (default: enough to move 512 MiB per row, "
                            "4 to 16: 16 at 128K, 4 at 2M)")
    bench.add_argument("--warmup", type=_at_least(0), default=1,
                       help="unmeasured batches per method first (default 1)")
    bench.add_argument("--no-gc-freeze", dest="gc_freeze", action="store_false",
                       help="do not collect and freeze the heap before measuring")
    bench.add_argument("--slots", type=int, default=32,
                       help="I/O depth of uring_kv and of the ring ceiling (default 32)")
    bench.add_argument("--spare-slots", type=_at_least(0), default=None,
                       help="uring_kv's staging slots beyond that depth, for blocks in their copy "
                            "(default: half the depth on a GPU, and in CPU mode when the slots hold "
                            "over 1 MiB; in smaller CPU-mode O_DIRECT set-ups as many as the depth "
                            "while all slots hold at most 1 MiB; else 0)")
    bench.add_argument("--threads", type=int, default=8, help="threads of the thread-pool baseline")
    bench.add_argument("--baselines", type=_baselines, default=_BASELINE_NAMES,
                       help="which methods run beside uring_kv, comma-separated: serial, threads (the "
                            "thread pool), ceiling (the ring ceiling), or none (default: all three)")
    direct = bench.add_mutually_exclusive_group()
    direct.add_argument("--direct", dest="direct", action="store_true", default=None, help="cold (O_DIRECT) only")
    direct.add_argument("--buffered", dest="direct", action="store_false", help="hot (page cache) only")
    bench.add_argument("--device", default="auto", help="cuda, cuda:N or cpu (default: cuda if available)")
    bench.add_argument("--checksum", action="store_true", help="also measure uring_kv with checksum=True")
    bench.add_argument("--json", help="write the results as JSON to this file")
    bench.add_argument("--print-json", action="store_true", help="print the JSON to stdout")
    bench.add_argument("--plot", help="write a PNG of GB/s by block size and method")
    bench.set_defaults(func=_bench)
    info_parser = sub.add_parser("info", help="what uring_kv would use on this machine")
    info_parser.add_argument("--path", help="directory to probe for O_DIRECT (default: the temp directory)")
    info_parser.set_defaults(func=_info)
    demo = sub.add_parser("demo", help="store and load a few blocks and say what happened")
    demo.add_argument("--path")
    demo.set_defaults(func=_demo)
    soak = sub.add_parser("soak", help="concurrent loads, stores and cancellations, every block checked")
    soak.add_argument("--blocks", type=int, default=1_000_000)
    soak.add_argument("--slots", type=int, default=4)
    soak.add_argument("--io-depth", type=int, default=None,
                      help="reads and writes in flight at most (default: the slots; fewer leaves spare slots)")
    soak.add_argument("--workers", type=int, default=16)
    soak.add_argument("--cancel-rate", type=float, default=0.1)
    soak.add_argument("--device", default="auto")
    soak.add_argument("--io", default=None, help="auto, uring or threads")
    soak.add_argument("--checksum", action="store_true")
    soak.add_argument("--path", help="directory for the block file")
    soak.set_defaults(func=_soak)
    args = parser.parse_args(argv)
    return int(args.func(args))
