"""The relay passes a worker's ``content-type`` on byte for byte.

The gateway's HTTP client reads header values as latin-1 (one character per byte, as HTTP's field values are
octets); the relay wrote the value back as UTF-8, so any byte above 0x7f in it (a parameter such as a non-ASCII
charset label or a vendor's note) reached the client as two different bytes. The workers here are raw sockets, so
the test sets the exact bytes of the head.
"""

from __future__ import annotations

import asyncio

from relay_harness import Exchange, call, jbody

from gateway.admission import Admission
from gateway.health import HealthConfig
from gateway.metrics import GatewayMetrics
from gateway.router import Router
from gateway.sglang_fleet import RelayConfig, SGLangFleet
from gateway.sglang_relay import SGLangResponder

WHOLE_TYPE = b"application/json; note=caf\xe9"  # (a latin-1 byte: not valid UTF-8 on its own)
STREAM_TYPE = b"text/event-stream; note=\xc3\xa9t\xc3\xa9"  # (UTF-8 bytes: each must come through as it is)
EVENT = b'data: {"text": "a", "meta_info": {"finish_reason": {"type": "length"}}}\n\ndata: [DONE]\n\n'

def _answer(body: bytes) -> bytes:
    if b"/health" in body.split(b"\r\n", 1)[0]:
        return b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}"
    if b'"stream": true' in body or b'"stream":true' in body:
        return (b"HTTP/1.1 200 OK\r\ncontent-type: " + STREAM_TYPE + b"\r\ncontent-length: %d\r\n\r\n" % len(EVENT)
                + EVENT)
    data = b'{"text": "a", "meta_info": {"finish_reason": {"type": "length"}}}'
    return b"HTTP/1.1 200 OK\r\ncontent-type: " + WHOLE_TYPE + b"\r\ncontent-length: %d\r\n\r\n" % len(data) + data


async def _worker() -> tuple[asyncio.Server, str]:
    """A worker answering each request once its whole body is in (requests are small: one read or two)."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value)
                body = await reader.readexactly(length)
                writer.write(_answer(head + body))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return server, f"http://127.0.0.1:{port}"


def _run(body: bytes) -> Exchange:
    async def main() -> Exchange:
        servers: list[asyncio.Server] = []
        try:
            prefill, p_url = await _worker()
            servers.append(prefill)
            decode, d_url = await _worker()
            servers.append(decode)
            metrics = GatewayMetrics()
            fleet = SGLangFleet([(p_url, 8998)], [d_url], Router.build("random", "random"),
                                HealthConfig(probe_interval_s=0.1, breaker_failures=1000),
                                RelayConfig(retry_backoff_s=0.01))
            fleet.start()
            try:
                assert await fleet.wait_ready(5)
                responder = SGLangResponder(fleet, "generate", "generate", Admission(0, 0, 1.0, metrics), metrics,
                                            1 << 24, 10.0)
                exchange = Exchange(body)
                await asyncio.wait_for(call(responder, exchange), 20.0)
                return exchange
            finally:
                await fleet.aclose()
        finally:
            for server in servers:
                server.close()
                await server.wait_closed()

    return asyncio.run(main())


def test_a_whole_answers_content_type_is_relayed_byte_for_byte() -> None:
    exchange = _run(jbody({"text": "hi"}))
    assert exchange.status == 200, exchange.content
    assert exchange.response_headers[b"content-type"] == WHOLE_TYPE


def test_a_streams_content_type_is_relayed_byte_for_byte() -> None:
    exchange = _run(jbody({"text": "hi", "stream": True}))
    assert exchange.status == 200, exchange.content
    assert exchange.response_headers[b"content-type"] == STREAM_TYPE
    assert exchange.content.endswith(b"data: [DONE]\n\n"), exchange.content
