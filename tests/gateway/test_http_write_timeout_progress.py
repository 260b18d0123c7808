"""The write timeout is for a client that reads nothing, not for one that reads a large answer slowly."""

from __future__ import annotations

import asyncio
import socket
import time
from typing import Any

import uvicorn

from gateway.http_protocol import ClientLimits, protocol_class

WRITE_TIMEOUT_S = 1.0
BIG = 24 * 1024 * 1024  # one large whole answer (a JSON body with logprobs of several choices can be this big)


async def big_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"%d" % BIG)]})
    await send({"type": "http.response.body", "body": b"x" * BIG})  # one write: the transport buffers it


def test_a_client_reading_steadily_but_slower_than_the_write_timeout_is_not_cut() -> None:
    """The write timeout is for a client that reads nothing (module doc, point 4). A client that keeps
    reading a large answer, though it takes longer than ``write_timeout_s`` to read it all, must get it
    whole: the transport's buffer stays above its low-water mark the whole time (``resume_writing`` is
    never called), but it shrinks with every read."""

    async def main() -> None:
        config = uvicorn.Config(big_app, host="127.0.0.1", port=0, log_level="warning", lifespan="off",
                                http=protocol_class(ClientLimits(write_timeout_s=WRITE_TIMEOUT_S)))
        server = uvicorn.Server(config)
        task = asyncio.create_task(server.serve())
        while not server.started:
            await asyncio.sleep(0.01)
        port = server.servers[0].sockets[0].getsockname()[1]
        loop = asyncio.get_running_loop()

        def slow_client() -> tuple[int, float]:
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
            sock.connect(("127.0.0.1", port))
            sock.settimeout(10)
            sock.sendall(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
            got, start = 0, time.monotonic()
            try:
                while True:  # never idle more than ~10 ms: about 6 MB/s, ~4 s for the whole answer
                    chunk = sock.recv(64 * 1024)
                    if not chunk:
                        break
                    got += len(chunk)
                    if got >= BIG:
                        break
                    time.sleep(0.01)
            except OSError:
                pass
            finally:
                sock.close()
            return got, time.monotonic() - start

        try:
            got, took = await loop.run_in_executor(None, slow_client)
        finally:
            server.should_exit = True
            await task
        assert got >= BIG, f"cut after {got} of {BIG} bytes ({took:.1f}s) while reading all along"
        assert took > 2 * WRITE_TIMEOUT_S, f"the client read too fast to test anything ({took:.1f}s)"

    asyncio.run(main())
