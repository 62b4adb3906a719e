"""A real transformer's KV cache through uring_kv: prefill, offload, drop, reload, generate.

A small randomly initialised Llama (no weights to download) prefills a prompt; its per-layer K/V
are packed into vLLM-style blocks (one tensor per layer, dim 0 = block of 16 tokens), stored to the
file, wiped from the device, loaded back into *other* GPU blocks and unpacked into a fresh cache.
Greedy generation from the reloaded cache must match generation from the untouched cache token for
token. Run: ``python examples/transformer_offload.py`` (GPU if available, else CPU).
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import warnings
from typing import Any

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from uring_kv import Engine

BLOCK_TOKENS = 16


def layers(cache: DynamicCache) -> list[Any]:
    """The per-layer (keys, values) holders of a DynamicCache."""
    return list(cache.layers)


def pack(cache: DynamicCache, kv_blocks: list[torch.Tensor], gpu_blocks: list[int]) -> None:
    for layer, blocks in zip(layers(cache), kv_blocks, strict=True):
        for index, gpu_block in enumerate(gpu_blocks):
            tokens = slice(index * BLOCK_TOKENS, (index + 1) * BLOCK_TOKENS)
            blocks[gpu_block, 0] = layer.keys[0, :, tokens]
            blocks[gpu_block, 1] = layer.values[0, :, tokens]


def unpack(kv_blocks: list[torch.Tensor], gpu_blocks: list[int], config: LlamaConfig) -> DynamicCache:
    cache = DynamicCache(config=config)
    for layer_index, blocks in enumerate(kv_blocks):
        keys = torch.cat([blocks[g, 0] for g in gpu_blocks], dim=1).unsqueeze(0)
        values = torch.cat([blocks[g, 1] for g in gpu_blocks], dim=1).unsqueeze(0)
        cache.update(keys, values, layer_index)
    return cache


def generate(model: Any, ids: torch.Tensor, cache: DynamicCache) -> list[int]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # the cache argument's name moves in transformers 6
        out = model.generate(ids, past_key_values=cache, max_new_tokens=24, do_sample=False)
    return [int(t) for t in out[0, ids.shape[1]:]]


async def main() -> int:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    config = LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=512,
                         initializer_range=0.3)  # wide weights: varied tokens that a wrong cache would change
    torch.manual_seed(0)
    model: Any = LlamaForCausalLM(config)
    model = model.to(device).eval()
    kv_heads, head_dim = 2, 256 // 8
    prompt_blocks = 4
    ids = torch.randint(0, config.vocab_size, (1, prompt_blocks * BLOCK_TOKENS + 1), device=device)
    with torch.no_grad():
        prefill = model(ids[:, :-1], use_cache=True).past_key_values  # the last token goes to generate()

    kv_blocks = [torch.zeros(16, 2, kv_heads, BLOCK_TOKENS, head_dim, device=device) for _ in range(4)]
    pack(prefill, kv_blocks, [0, 1, 2, 3])
    reference = unpack(kv_blocks, [0, 1, 2, 3], config)
    path = os.path.join(tempfile.mkdtemp(), "kv.bin")
    async with Engine(kv_blocks, path, num_disk_blocks=256, num_slots=4) as engine:
        await engine.store_batch([0, 1, 2, 3], [100, 101, 102, 103])
        for blocks in kv_blocks:
            blocks.zero_()  # the GPU memory is given to other requests
        del prefill
        await engine.load_batch([100, 101, 102, 103], [8, 9, 10, 11])
        reloaded = unpack(kv_blocks, [8, 9, 10, 11], config)
        print(f"{device}: offloaded and reloaded {len(kv_blocks)} layers × {prompt_blocks} blocks "
              f"of {engine.block_bytes} bytes ({engine.stats()['io']})")
    same_kv = all(torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
                  for a, b in zip(layers(reference), layers(reloaded), strict=True))
    want, got = generate(model, ids, reference), generate(model, ids, reloaded)
    # Control: the same check on a cache with one wrong block (block 1 where block 2 belongs) must
    # see a difference (attention ignores the order of the blocks, not their content).
    wrong = generate(model, ids, unpack(kv_blocks, [8, 9, 9, 11], config))
    print("K/V bytes identical after reload:", same_kv)
    print("tokens without offload:", want)
    print("tokens after reload:   ", got)
    print("identical generation:", want == got)
    print("control (one wrong block) differs:", wrong != want)
    return 0 if same_kv and want == got and wrong != want else 1


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main()))
