"""HTTP clients for the gateway's SGLang path: CPU-µs per small POST, measured in one run.

A trivial HTTP/1.1 server (an asyncio Protocol answering every request with a fixed small JSON
body, keep-alive) runs in a child process pinned to core 1; this process, pinned to core 0, sends
``--requests`` POSTs of a ~200-byte JSON body with each client, one at a time and 32 at a time,
over pooled keep-alive connections, and prints its own CPU time (``time.process_time``) per
request. The baseline in the same run is a hand-written raw-socket client (an asyncio Protocol
writing the request bytes and reading the fixed-length answer): what the work costs with no
library at all. The relay's own client (``gateway/worker_http.py``) is measured beside aiohttp (which the relay
used before it) and httpx.

    .venv/bin/python loadtests/bench_http_client.py [--requests 4000]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import sys
import time
from collections.abc import Awaitable, Callable
from typing import cast

import uvloop

BODY = json.dumps({"text": "The gateway relays this request to an SGLang worker.", "stream": False,
                   "sampling_params": {"max_new_tokens": 16, "temperature": 0}, "bootstrap_host": "10.0.0.1",
                   "bootstrap_port": 8998, "bootstrap_room": 1234567890123}).encode()
ANSWER = b'{"text": "ok", "meta_info": {"finish_reason": {"type": "length", "length": 16}}}'
RESPONSE = (b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(ANSWER)) + ANSWER


class _Server(asyncio.Protocol):
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        self.buf = b""

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while True:
            head_end = self.buf.find(b"\r\n\r\n")
            if head_end < 0:
                return
            head = self.buf[:head_end].lower()
            length = 0
            for line in head.split(b"\r\n"):
                if line.startswith(b"content-length:"):
                    length = int(line.split(b":", 1)[1])
            end = head_end + 4 + length
            if len(self.buf) < end:
                return
            self.buf = self.buf[end:]
            self.transport.write(RESPONSE)


def serve(port: int) -> None:
    os.sched_setaffinity(0, {1})

    async def main() -> None:
        server = await asyncio.get_running_loop().create_server(_Server, "127.0.0.1", port)
        await server.serve_forever()

    uvloop.run(main())


class _RawClient(asyncio.Protocol):
    """One keep-alive connection; ``post()`` writes a request and waits for the fixed-size answer."""

    def __init__(self) -> None:
        self.buf = b""
        self.waiter: asyncio.Future[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self.buf += data
        if len(self.buf) >= len(RESPONSE) and self.waiter is not None:
            self.buf = self.buf[len(RESPONSE):]
            self.waiter.set_result(None)

    async def post(self, request: bytes) -> None:
        self.waiter = asyncio.get_running_loop().create_future()
        self.transport.write(request)
        await self.waiter


async def measure(name: str, post: Callable[[], Awaitable[None]], n: int, concurrency: int) -> float:
    for _ in range(200):
        await post()
    started = time.process_time()
    if concurrency == 1:
        for _ in range(n):
            await post()
    else:
        async def lane() -> None:
            for _ in range(n // concurrency):
                await post()
        await asyncio.gather(*(lane() for _ in range(concurrency)))
    return (time.process_time() - started) / n * 1e6


async def run_at(port: int, n: int, concurrency: int) -> list[tuple[str, int, float]]:
    import aiohttp
    import httpx

    url = f"http://127.0.0.1:{port}/generate"
    rows = []
    conns = []
    for _ in range(concurrency):
        transport, proto = await asyncio.get_running_loop().create_connection(_RawClient, "127.0.0.1", port)
        transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conns.append(proto)
    request = (b"POST /generate HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
               b"content-length: %d\r\n\r\n" % len(BODY)) + BODY
    free = list(conns)

    async def raw_post() -> None:
        conn = free.pop()
        try:
            await conn.post(request)
        finally:
            free.append(conn)

    rows.append(("raw socket (baseline)", concurrency, await measure("raw", raw_post, n, concurrency)))
    for conn in conns:
        conn.transport.close()

    headers = {"content-type": "application/json"}
    connector = aiohttp.TCPConnector(limit=64, keepalive_timeout=30)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=30)) as session:
        async def aiohttp_post() -> None:
            async with session.post(url, data=BODY, headers=headers) as reply:
                await reply.read()

        rows.append((f"aiohttp {aiohttp.__version__}", concurrency,
                     await measure("aiohttp", aiohttp_post, n, concurrency)))

    from gateway.worker_http import HttpPool

    pool = HttpPool(limit_per_host=64, timeout_s=30, connect_timeout_s=10, keepalive_s=30)
    try:
        async def pool_post() -> None:
            async with await pool.post(url, BODY, headers) as reply:
                await reply.read()

        rows.append(("ours (gateway/worker_http.py)", concurrency,
                     await measure("worker_http", pool_post, n, concurrency)))
    finally:
        pool.close()

    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    async with httpx.AsyncClient(limits=limits, timeout=30) as client:
        async def httpx_post() -> None:
            reply = await client.post(url, content=BODY, headers=headers)
            reply.read()

        rows.append((f"httpx {httpx.__version__} (http/1.1, httpcore)", concurrency,
                     await measure("httpx", httpx_post, max(n // 4, 64), concurrency)))
    return rows


async def run(port: int, n: int) -> list[tuple[str, int, float]]:
    return [row for concurrency in (1, 32) for row in await run_at(port, n, concurrency)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=4000)
    args = ap.parse_args()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    pid = os.fork()
    if pid == 0:
        try:
            serve(port)
        finally:
            os._exit(0)
    try:
        time.sleep(0.5)
        if {0, 1} <= os.sched_getaffinity(0):
            os.sched_setaffinity(0, {0})
        rows = uvloop.run(run(port, args.requests))
    finally:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
    print("client CPU-µs per small POST (keep-alive pool; server: a trivial asyncio protocol on another core)")
    print(f"{'client':40} {'concurrency':>11} {'CPU µs/request':>15}")
    for name, concurrency, us in rows:
        print(f"{name:40} {concurrency:>11} {us:>15.1f}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
