"""Two serving processes share a prompt prefix through Mooncake Store.

Run: ``python examples/mooncake_shared_prefix.py`` (needs ``pip install 'uring-kv[mooncake]'`` and
the libibverbs1 system package; no RDMA hardware: the example uses TCP on 127.0.0.1).

It starts a ``mooncake_master`` on 127.0.0.1 (``LocalMaster``), then two processes of this script,
each with its own local tier (a file of its own) over the shared Mooncake tier:

* ``prefill`` computes the KV blocks of a long system prompt (a stand-in: each block's bytes are a
  function of its key), stores them with ``put`` (local file and Mooncake, written through), and
  keeps serving: its Mooncake segment is where the blocks live;
* ``decode`` has never seen the prompt: ``lookup_shared`` finds the whole prefix in the cluster,
  ``get`` loads it through Mooncake (checked with crc32c on the way), and it compares every byte
  with what it would have computed itself. A second ``get`` is served by its local tier.

Block keys chain like vLLM's block hashes: a block's key names its tokens and every block before.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

BLOCKS, BLOCK_TOKENS = 48, 16
LAYERS, HEADS, HEAD_DIM = 8, 4, 64


def caches() -> dict[str, torch.Tensor]:
    """A vLLM-like layout on the host: one tensor per layer, dim 0 = block (K and V)."""
    return {f"layer{i}": torch.zeros(2 * BLOCKS, 2, BLOCK_TOKENS, HEADS, HEAD_DIM, dtype=torch.bfloat16)
            for i in range(LAYERS)}


def prefix_keys(prompt: str) -> list[bytes]:
    tokens = prompt.encode()
    keys, parent = [], b""
    for block in range(BLOCKS):
        chunk = tokens[block * BLOCK_TOKENS:(block + 1) * BLOCK_TOKENS]
        parent = hashlib.sha256(parent + chunk).digest()
        keys.append(parent)
    return keys


def compute_block(kv: dict[str, torch.Tensor], row: int, key: bytes) -> None:
    """The stand-in for prefill: the block's K/V values, a function of its key."""
    generator = torch.Generator().manual_seed(int.from_bytes(key[:8], "little"))
    for tensor in kv.values():
        tensor[row].copy_(torch.randn(tensor[row].shape, generator=generator).to(tensor.dtype))


def serve(role: str, master_address: str, metadata_server: str) -> None:
    from uring_kv.integrations.mooncake import MooncakeConfig, SyncTieredStore

    kv = caches()
    keys = prefix_keys("Answer questions about the return policy of the shop, politely and briefly. " * 12)
    config = MooncakeConfig(master_address, metadata_server, segment_bytes=(64 << 20) if role == "prefill" else 0,
                            namespace="example-model")
    with SyncTieredStore(kv, tempfile.mkdtemp(prefix=f"kv-{role}-"), capacity_blocks=2 * BLOCKS,
                         remote=config) as store:
        if role == "prefill":
            for row, key in enumerate(keys):
                compute_block(kv, row, key)
            started = time.perf_counter()
            store.put(keys, range(BLOCKS))
            print(json.dumps({"stored": BLOCKS, "seconds": time.perf_counter() - started}), flush=True)
            sys.stdin.readline()  # keep serving (and holding the segment) until told to stop
            return
        found = store.lookup_shared(keys)
        rows = list(range(BLOCKS, 2 * BLOCKS))
        started = time.perf_counter()
        store.get(keys, rows)  # through Mooncake: the local tier has none of them
        remote_seconds = time.perf_counter() - started
        started = time.perf_counter()
        store.get(keys, rows)  # promoted on the first get: now local
        local_seconds = time.perf_counter() - started
        mine = caches()
        for row, key in enumerate(keys):
            compute_block(mine, row, key)
        same = all(torch.equal(kv[name][BLOCKS:], mine[name][:BLOCKS]) for name in kv)
        stats = store.stats()
        print(json.dumps({"found": found, "identical": same, "remote_hits": stats["remote_hits"],
                          "remote_seconds": remote_seconds, "local_seconds": local_seconds,
                          "block_bytes": sum(t[0].numel() * t.element_size() for t in kv.values())}), flush=True)


def main() -> None:
    from uring_kv.integrations.mooncake.local import LocalMaster

    env = {**os.environ, "MC_TCP_BIND_ADDRESS": "127.0.0.1"}
    with LocalMaster() as master:
        print(f"mooncake_master on {master.master_address}, metadata at {master.metadata_server}")
        command = [sys.executable, os.path.abspath(__file__), master.master_address, master.metadata_server]
        with subprocess.Popen([*command, "prefill"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True, env=env) as prefill:
            assert prefill.stdin is not None and prefill.stdout is not None
            stored = json.loads(prefill.stdout.readline())
            print(f"prefill: stored {stored['stored']} blocks in {stored['seconds'] * 1e3:.1f} ms")
            decode = subprocess.run([*command, "decode"], capture_output=True, text=True, env=env, check=True)
            result = json.loads(decode.stdout.splitlines()[0])
            prefill.stdin.write("\n")
            prefill.stdin.flush()
        mib = BLOCKS * result["block_bytes"] / 2**20
        print(f"decode: lookup_shared found {result['found']}/{BLOCKS} blocks; loaded {mib:.1f} MiB through Mooncake "
              f"in {result['remote_seconds'] * 1e3:.1f} ms ({result['remote_hits']} remote hits), again from its "
              f"own tier in {result['local_seconds'] * 1e3:.1f} ms; bytes identical to its own: {result['identical']}")
        if not result["identical"] or result["found"] != BLOCKS:
            sys.exit(1)


if __name__ == "__main__":
    if len(sys.argv) == 4:
        serve(sys.argv[3], sys.argv[1], sys.argv[2])
    else:
        main()
