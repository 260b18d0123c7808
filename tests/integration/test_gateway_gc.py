"""Requests leave no reference cycles behind in the gateway.

The gateway raises the young generation's collection threshold (``gateway.app.GC_YOUNG_THRESHOLD``)
because its in-flight state was walked again every few requests; that is only safe while a finished
request is freed by reference counting alone. Here a real gateway runs in this process (its uvicorn
server and own HTTP cycle, on this test's event loop) over real sim P+D workers; with the collector
off, every generation route is asked streamed and not, and then nothing of the gateway's may be left
for the collector to find.
"""

from __future__ import annotations

import asyncio
import gc
import json
from collections.abc import Callable

import uvicorn
from pdtest import SimCluster, free_port

from gateway.app import GatewayConfig, create_app
from gateway.cli import server_config

ROUTES = (
    ("/v1/chat/completions", {"model": "sim", "messages": [{"role": "user", "content": "no cycles, please"}]}),
    ("/v1/completions", {"model": "sim", "prompt": "no cycles, please"}),
    ("/generate", {"text": "no cycles, please", "sampling_params": {}}),
)


async def _post(port: int, path: str, body: dict[str, object]) -> bytes:
    data = json.dumps(body).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: "
                     f"{len(data)}\r\nConnection: close\r\n\r\n".encode() + data)
        raw = await asyncio.wait_for(reader.read(), 30)
    finally:
        writer.close()
    assert raw.startswith(b"HTTP/1.1 200"), raw[:300]
    return raw


async def _serve_and_count_garbage(prefill: str, decode: str) -> list[str]:
    config = GatewayConfig(prefill=(prefill,), decode=(decode,), port=free_port())
    app = create_app(config)
    server = uvicorn.Server(server_config(config, app, "warning"))
    serving = asyncio.create_task(server.serve())
    threshold = gc.get_threshold()
    try:
        while not server.started:
            assert not serving.done(), "the gateway did not start"
            await asyncio.sleep(0.05)
        for path, body in ROUTES:  # warm-up: caches, metrics children, connection pools
            await _post(config.port, path, {**body, "max_tokens": 4, "stream": True})
        gc.collect()
        gc.disable()
        gc.set_debug(gc.DEBUG_SAVEALL)
        try:
            for _ in range(3):
                for path, body in ROUTES:
                    for stream in (False, True):
                        sampling = {"sampling_params": {"max_new_tokens": 6}} if path == "/generate" else \
                            {"max_tokens": 6}
                        raw = await _post(config.port, path, {**body, **sampling, "stream": stream})
                        assert (b"data: [DONE]" in raw) == stream, raw[-300:]
            await asyncio.sleep(0.2)  # connections closed, tasks done
            gc.collect()
            left = sorted({f"{type(o).__module__}.{type(o).__qualname__}" for o in gc.garbage
                           if type(o).__module__.startswith(("gateway", "workers"))})
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
            gc.enable()
        return left
    finally:
        server.should_exit = True
        await asyncio.wait_for(serving, 30)
        gc.unfreeze()  # (the gateway's start-up froze this whole test process's objects)
        gc.set_threshold(*threshold)


def test_finished_requests_leave_no_reference_cycles(sim_cluster: Callable[..., SimCluster]) -> None:
    cluster = sim_cluster()
    left = asyncio.run(_serve_and_count_garbage(cluster.prefills[0].url, cluster.decodes[0].url))
    assert left == [], f"objects of the gateway's freed only by the garbage collector: {left}"
