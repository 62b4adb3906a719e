"""An aiohttp server that answers requests while KV blocks are offloaded and reloaded in the background.

Run ``python examples/server.py`` to serve on http://127.0.0.1:8080 (``/generate``, ``/metrics``), or
``python examples/server.py --self-test 300`` to start it on a free port, send requests from a client
while the offload loop runs, and print the request latencies: the loop stays responsive because
every disk and copy wait happens off the event loop.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import tempfile
import time
from typing import Any

import torch
from aiohttp import ClientSession, web

from uring_kv import Engine
from uring_kv.testing import fill, id_caches, identify


async def offload_loop(engine: Engine, caches: dict[str, torch.Tensor], stop: asyncio.Event,
                       report: dict[str, int]) -> None:
    """Store and reload blocks forever, checking every reloaded block."""
    rng = random.Random(0)
    version = 0
    while not stop.is_set():
        version += 1
        disk_blocks = rng.sample(range(256), 16)
        for gpu_block, disk_block in enumerate(disk_blocks):
            fill(caches, gpu_block, disk_block, version)
        await engine.store_batch(list(range(16)), disk_blocks)
        await engine.load_batch(disk_blocks, list(range(16, 32)))
        report["blocks"] += 32
        report["bad"] += sum(identify(caches, 16 + i) != (d, version, True) for i, d in enumerate(disk_blocks))


def make_app(engine: Engine) -> web.Application:
    async def generate(request: web.Request) -> web.Response:
        started = time.perf_counter()
        tokens = [random.randrange(32000) for _ in range(int(request.query.get("n", "8")))]
        await asyncio.sleep(0)  # a real server would await its model step here
        return web.json_response({"tokens": tokens, "server_ms": (time.perf_counter() - started) * 1e3})

    async def metrics(request: web.Request) -> web.Response:
        snap = engine.metrics()
        fields = ("blocks", "bytes", "batches")
        return web.json_response({d: {k: snap[d][k] for k in fields} for d in ("load", "store")})

    app = web.Application()
    app.add_routes([web.get("/generate", generate), web.get("/metrics", metrics)])
    return app


async def serve(port: int, self_test: int) -> int:
    caches = id_caches("cuda" if torch.cuda.is_available() else "cpu", blocks=32)
    path = os.path.join(tempfile.mkdtemp(), "kv.bin")
    report = {"blocks": 0, "bad": 0}
    async with Engine(caches, path, num_disk_blocks=256, num_slots=8) as engine:
        runner = web.AppRunner(make_app(engine))
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", port)
        await site.start()
        address: Any = runner.addresses[0]
        stop = asyncio.Event()
        offloader = asyncio.create_task(offload_loop(engine, caches, stop, report))
        try:
            if not self_test:
                print(f"serving on http://{address[0]}:{address[1]} (Ctrl-C to stop)")
                await asyncio.Event().wait()
            latencies: list[float] = []
            async with ClientSession() as client:
                async def one() -> None:
                    started = time.perf_counter()
                    async with client.get(f"http://{address[0]}:{address[1]}/generate?n=16") as response:
                        assert response.status == 200
                        assert len((await response.json())["tokens"]) == 16
                    latencies.append(time.perf_counter() - started)

                for _ in range(self_test // 10):
                    await asyncio.gather(*(one() for _ in range(10)))
                async with client.get(f"http://{address[0]}:{address[1]}/metrics") as response:
                    moved = await response.json()
        finally:
            stop.set()
            await offloader
            await runner.cleanup()
    latencies.sort()
    print(f"{len(latencies)} requests while {report['blocks']} blocks were offloaded/reloaded "
          f"({moved['load']['blocks']} loaded): latency p50 {statistics.median(latencies) * 1e3:.2f} ms, "
          f"p99 {latencies[int(0.99 * (len(latencies) - 1))] * 1e3:.2f} ms, max {latencies[-1] * 1e3:.2f} ms; "
          f"wrong blocks: {report['bad']}")
    return 0 if report["bad"] == 0 and report["blocks"] > 0 and len(latencies) == self_test // 10 * 10 else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument("--self-test", type=int, default=0, metavar="REQUESTS")
    args = parser.parse_args()
    raise SystemExit(asyncio.run(serve(0 if args.self_test else args.port, args.self_test)))
