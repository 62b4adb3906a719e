"""Command line: ``uring-kv bench`` (the main job), ``uring-kv info``, ``uring-kv demo`` and ``uring-kv soak``,
and the registration of the other benches: ``bench-mix`` (``bench/mix.py``) and the framework benches
(``bench-vllm``, ``bench-serve``, ``bench-lmcache``, ``bench-mooncake``, ``bench-sglang``,
``integrations/<framework>/``), each of which defines and checks its arguments in its own module;
none of those imports its framework until it runs."""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import resource
import sys
import tempfile
from typing import Any

from uring_kv import __version__
from uring_kv.bench import mix as mix_bench
from uring_kv.bench.args import (
    Defaults,
    Parser,
    UsageError,
    at_least,
    byte_size,
    check_free_space,
    fraction,
    usable_directory,
)
from uring_kv.integrations.lmcache import bench as lmcache_bench
from uring_kv.integrations.mooncake import bench as mooncake_bench
from uring_kv.integrations.sglang import bench as sglang_bench
from uring_kv.integrations.vllm import bench as vllm_bench
from uring_kv.integrations.vllm import serve_bench as vllm_serve_bench

# The names --peers takes (uring_kv.bench.config.PEERS: the parser imports none of the bench's runs).
_PEER_NAMES = ("vllm-disk", "threads", "kvikio", "fio", "ceiling")


def _peers(text: str) -> tuple[str, ...]:
    names = tuple(name.strip() for name in text.split(",") if name.strip())
    if names == ("none",):
        return ()
    unknown = [name for name in names if name not in _PEER_NAMES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of {', '.join(_PEER_NAMES)} "
                                         f"or none, got {text!r}")
    return tuple(name for name in _PEER_NAMES if name in names)


def _device(name: str) -> Any:
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise UsageError(f"--device: expected cpu, cuda or cuda:N, got {name!r}") from None
    if device.type not in ("cpu", "cuda"):
        raise UsageError(f"--device: expected cpu, cuda or cuda:N, got {name!r}")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise UsageError(f"--device {name}: CUDA is not available here")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise UsageError(f"--device {name}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return device


def _bench(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from uring_kv.bench.config import BenchConfig, largest_file
    from uring_kv.bench.report import plot, render
    from uring_kv.bench.run import run_bench, to_json

    block_sizes = args.block_size or BenchConfig().block_sizes
    for block in block_sizes:
        per_layer, rest = divmod(block, args.layers)
        if rest or per_layer % 64:
            raise UsageError(f"--block-size {block}: does not split into {args.layers} layers of a multiple "
                             "of 64 bytes each")
    device = _device(args.device)
    if args.path and len(args.path) > 1:
        return _bench_striped(args, block_sizes, device)
    directory = usable_directory(args.path[0] if args.path else None)
    config = BenchConfig(path=directory, size=args.size, block_sizes=block_sizes, layers=args.layers,
                         batch=args.batch, batches=args.batches, warmup=args.warmup, io_depth=args.io_depth,
                         slots=args.slots, threads=args.threads, direct=args.direct, device=str(device),
                         checksum=args.checksum, peers=args.peers, gc_freeze=args.gc_freeze, sweep=args.sweep,
                         ram=args.ram)
    check_free_space(directory, largest_file(config))
    console = Console(stderr=True)
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=console,
                  transient=True, disable=not console.is_terminal) as progress:
        task = progress.add_task("starting", total=None)

        def report(message: str) -> None:
            progress.update(task, description=message)
            if not console.is_terminal:
                print(f"bench: {message}", file=sys.stderr, flush=True)

        result = asyncio.run(run_bench(config, report))
    screen = Console(highlight=False)
    if not screen.is_terminal and "COLUMNS" not in os.environ:
        screen = Console(highlight=False, width=100)  # a file or a pipe: the width the output is made for
    render(result, screen, verbose=args.verbose)
    if args.json:
        with open(args.json, "w") as out:
            out.write(to_json(result))
    if args.plot:
        plot(result, args.plot)
    print(to_json(result) if args.print_json else f"verified: {'all' if result['all_verified'] else 'NOT ALL'}")
    return 0 if result["all_verified"] else 1


def _bench_striped(args: argparse.Namespace, block_sizes: list[int], device: Any) -> int:
    from uring_kv._file import round_up
    from uring_kv.bench.results import progress_printer
    from uring_kv.bench.striping import bench_striped

    paths = [usable_directory(path) for path in args.path]
    if len({os.path.realpath(path) for path in paths}) < len(paths):
        raise UsageError("--path: a directory appears twice (give one directory per drive)")
    # per path, at the largest block size: a ceiling file and a stripe's (with room for uneven hashing)
    share = max(max(2 * args.batch * round_up(block, 4096), args.size) for block in block_sizes) // len(paths)
    for path in paths:
        check_free_space(path, share * 5 // 2 + (64 << 20))
    return bench_striped(paths, block_sizes, args.size, args.batch, args.layers, args.io_depth, str(device),
                         args.json, progress_printer("bench"))


# The engine `uring-kv info` opens to show its plan: CPU caches of 128 KiB blocks, 16 staging slots.
INFO_BLOCK_BYTES, INFO_SLOTS = 128 << 10, 16


def info(path: str | None) -> tuple[dict[str, Any], str | None]:
    """What uring_kv would use here, and the reason it cannot run (or None): the tuning in force,
    and what an engine opened in ``path`` (default: the temp directory) on CPU caches chose there:
    I/O, O_DIRECT and the plan of its data path."""
    import torch

    from uring_kv import Engine, Tuning
    from uring_kv._cuda import cuda_copy_path, load_cuda_driver
    from uring_kv._io import open_backend
    from uring_kv._native import LIBURING_VERSION

    facts: dict[str, Any] = {"uring_kv": __version__, "kernel": platform.release(),
                             "liburing (static)": LIBURING_VERSION}
    problem = None
    directory = path or tempfile.gettempdir()
    caches = [torch.zeros(4, INFO_BLOCK_BYTES, dtype=torch.uint8)]
    try:
        engine = Engine(caches, os.path.join(directory, ".uring-kv-info"), 4, INFO_SLOTS)  # (reads the tuning)
    except ValueError as exc:
        facts["tuning"] = f"invalid: {exc}"
        return facts, str(exc)
    tuning, defaults = engine.tuning, Tuning()
    changed = {k: v for k, v in tuning.as_dict().items() if v != getattr(defaults, k)}
    facts["tuning"] = ", ".join(f"{k}={v}" for k, v in changed.items()) or "defaults"

    async def probe_engine() -> dict[str, Any]:
        async with engine:
            return {**engine.stats(), "alignment": engine.file.alignment,
                    "memory_alignment": engine.file.memory_alignment}

    async def probe_io() -> str:  # where no engine opened: the I/O path alone
        io = open_backend(tuning.io, tuning=tuning)
        try:
            return io.description
        finally:
            io.close()

    stats: dict[str, Any] | None = None
    no_file = None
    try:
        stats = asyncio.run(probe_engine())
    except OSError as exc:  # the block file: the I/O path is probed alone below
        no_file = f"cannot create a block file in {directory}: {exc}"
    except Exception as exc:
        facts["io"] = f"unavailable: {exc}"
        problem = str(exc)
    if stats is not None:
        facts["io"] = stats["io"]
        facts["path"] = directory
        facts["O_DIRECT"] = "yes" if stats["direct"] else f"no ({stats['direct_reason']})"
        facts["alignment"] = (f"{stats['alignment']} (offsets and lengths), {stats['memory_alignment']} (buffers)"
                              if stats["direct"] else stats["alignment"])
        facts[f"plan (CPU, {INFO_BLOCK_BYTES >> 10} KiB blocks, {INFO_SLOTS} slots)"] = ", ".join(
            f"{k}={v}" for k, v in stats["plan"].items())
    elif no_file is not None:
        try:
            facts["io"] = asyncio.run(probe_io())
        except Exception as exc:
            facts["io"] = f"unavailable: {exc}"
            problem = str(exc)
        facts["O_DIRECT"] = no_file
        problem = problem or no_file
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

    device = _device(args.device)
    directory = usable_directory(args.path)

    async def main() -> None:
        caches = {f"layer{i}": torch.randn(64, 16, 128, device=device).to(torch.bfloat16) for i in range(8)}
        original = {k: v.clone() for k, v in caches.items()}
        path = os.path.join(directory, f"uring-kv-demo-{os.getpid()}.bin")
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
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn, TimeRemainingColumn

    from uring_kv.testing import soak

    device = _device(args.device)
    directory = usable_directory(args.path)
    console = Console(stderr=True)
    print(f"soak on {device}: {args.blocks} blocks of 8 layers × 4 KiB, {args.workers} workers × batches of 8 "
          f"over 256 disk blocks, {args.slots} slots, cancel rate {args.cancel_rate:g}; on a 2-core machine "
          f"about {args.blocks / 7000:.0f} s (≈7,000 blocks/s there)", file=sys.stderr, flush=True)
    with Progress(BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), TimeRemainingColumn(), console=console,
                  transient=True, disable=not console.is_terminal) as bar:
        task = bar.add_task("soak", total=args.blocks)
        shown = [0]

        def progress(moved: int) -> None:
            bar.update(task, completed=min(moved, args.blocks))
            tenth = moved * 10 // args.blocks
            if not console.is_terminal and tenth > shown[0]:
                shown[0] = tenth
                print(f"soak: {min(moved, args.blocks)} of {args.blocks} blocks", file=sys.stderr, flush=True)

        result = asyncio.run(soak(args.blocks, device=str(device), slots=args.slots, workers=args.workers,
                                  cancel_rate=args.cancel_rate, directory=directory, io=args.io,
                                  checksum=args.checksum, io_depth=args.io_depth, progress=progress))
    print(f"soak {device}: {result.summary()}")
    return 0 if result.ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = Parser(prog="uring-kv", description="KV-cache block offload through io_uring")
    parser.add_argument("--version", action="version", version=__version__)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    defaults = Defaults
    bench = sub.add_parser("bench", help="measure loads and stores against peers and ceilings",
                           formatter_class=defaults)
    bench.add_argument("--path", action="append",
                       help="directory for the block file (default: the temp directory); repeated, one per "
                            "drive: a striped store over one file in each, against each drive's ceiling "
                            "(of the options below, the block sizes, --size, --layers, --batch, --io-depth, "
                            "--device and --json apply)")
    bench.add_argument("--size", type=byte_size, default=1 << 30, help="file size per block size")
    bench.add_argument("--block-size", type=byte_size, action="append",
                       help="bytes per block (repeatable; default 128K and 2M)")
    bench.add_argument("--layers", type=at_least(1), default=32, help="cache tensors a block is split over")
    bench.add_argument("--batch", type=at_least(1), default=256, help="blocks per batch")
    bench.add_argument("--batches", type=at_least(1), default=None,
                       help="measured batches per method (default: enough to move 512 MiB per row, "
                            "4 to 16: 16 at 128K, 4 at 2M)")
    bench.add_argument("--warmup", type=at_least(0), default=1, help="unmeasured batches per method first")
    bench.add_argument("--no-gc-freeze", dest="gc_freeze", action="store_false",
                       help="do not collect and freeze the heap before measuring")
    bench.add_argument("--io-depth", type=at_least(1), default=32,
                       help="reads and writes in flight: uring_kv's, the ring ceiling's and fio's")
    bench.add_argument("--slots", type=at_least(1), default=None,
                       help="uring_kv's staging slots (default: the I/O depth and half as many again where "
                            "copies are copier jobs; see docs/performance.md)")
    bench.add_argument("--threads", type=at_least(1), default=8, help="threads of the thread pool and of KvikIO")
    bench.add_argument("--peers", type=_peers, default=_PEER_NAMES,
                       help="which methods run beside uring_kv, comma-separated, or none")
    direct = bench.add_mutually_exclusive_group()
    direct.add_argument("--direct", dest="direct", action="store_true", default=None,
                        help="cold (O_DIRECT) only (default: cold and hot)")
    direct.add_argument("--buffered", dest="direct", action="store_false", help="hot (page cache) only")
    bench.add_argument("--device", default="auto", help="cuda, cuda:N or cpu (auto: cuda if available)")
    bench.add_argument("--checksum", action="store_true", help="also measure uring_kv with checksum=True")
    bench.add_argument("--no-ram", dest="ram", action="store_false",
                       help="skip the second run on a RAM-backed file in /dev/shm (tmpfs, O_DIRECT where the kernel "
                            "takes it), which tells the engine's own limit from the disk's")
    bench.add_argument("--no-sweep", dest="sweep", action="store_false",
                       help="skip the ring ceiling's depth sweep behind the sizing advice")
    bench.add_argument("--verbose", action="store_true", help="more columns and the engine's set-up")
    bench.add_argument("--json", help="write the results as JSON to this file")
    bench.add_argument("--print-json", action="store_true", help="print the JSON to stdout")
    bench.add_argument("--plot", help="write a PNG of GB/s by block size and method")
    bench.set_defaults(func=_bench)
    mix_bench.add_command(sub)  # its arguments and their checks, beside the bench
    for framework_bench in (vllm_bench, vllm_serve_bench, lmcache_bench, mooncake_bench, sglang_bench):
        framework_bench.add_command(sub)  # each defines its arguments and checks them, beside the bench
    info_parser = sub.add_parser("info", help="what uring_kv would use on this machine")
    info_parser.add_argument("--path", help="directory to probe for O_DIRECT (default: the temp directory)")
    info_parser.set_defaults(func=_info)
    demo = sub.add_parser("demo", help="store and load a few blocks and say what happened", formatter_class=defaults)
    demo.add_argument("--path", help="directory for the block file (default: the temp directory)")
    demo.add_argument("--device", default="auto", help="cuda, cuda:N or cpu (auto: cuda if available)")
    demo.set_defaults(func=_demo)
    soak = sub.add_parser("soak", help="concurrent loads, stores and cancellations, every block checked",
                          formatter_class=defaults)
    soak.add_argument("--blocks", type=at_least(1), default=1_000_000, help="blocks to move in all")
    soak.add_argument("--slots", type=at_least(1), default=4, help="staging slots")
    soak.add_argument("--io-depth", type=at_least(1), default=None,
                      help="reads and writes in flight at most (default: the slots; fewer leaves spare slots)")
    soak.add_argument("--workers", type=at_least(1), default=16, help="concurrent callers")
    soak.add_argument("--cancel-rate", type=fraction, default=0.1, help="share of calls cancelled mid-flight")
    soak.add_argument("--device", default="auto", help="cuda, cuda:N or cpu (auto: cuda if available)")
    soak.add_argument("--io", choices=("auto", "uring", "threads"), default=None,
                      help="I/O backend (default: auto)")
    soak.add_argument("--checksum", action="store_true", help="store and verify a checksum per block")
    soak.add_argument("--path", help="directory for the block file (default: the temp directory)")
    soak.set_defaults(func=_soak)
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except UsageError as exc:
        print(f"uring-kv {args.command}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
