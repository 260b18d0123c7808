"""A request the gateway's shutdown cancels past its drain timeout (``Responder._cut``): what the client
is told depends on what already went out on its connection, and its status (the one the client got) is
counted once."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace
from typing import Any

import pytest

from gateway.admission import Admission
from gateway.errors import APIError, BadRequest
from gateway.metrics import GatewayMetrics
from gateway.responder import Responder
from gateway.shapes import ChatShape


class _Exchange:
    def __init__(self, response_started: bool) -> None:
        self.loop = asyncio.get_running_loop()
        self.response_started = response_started
        self.sent: list[tuple[str, Any]] = []

    async def send_json(self, body: bytes, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        self.sent.append(("json", (status, json.loads(body)["error"]["code"])))

    async def send_chunk(self, chunk: bytes) -> None:
        self.sent.append(("chunk", json.loads(chunk.removeprefix(b"data: "))["error"]["code"]))

    async def end_stream(self, last: bytes) -> None:
        self.sent.append(("end", last))


def _counted(metrics: GatewayMetrics, status: str) -> float:
    return metrics.requests.labels("chat", status).value


@pytest.mark.parametrize("stream_started, head_out, answering, sent", [
    (True, True, None, [("chunk", "shutting_down"), ("end", b"data: [DONE]\n\n")]),
    # the stream's first chunk was waiting for the client's socket: no head went out, so a 503, not a chunk
    (True, False, None, [("json", (503, "shutting_down"))]),
    (False, False, None, [("json", (503, "shutting_down"))]),
    # an error answer, counted, whose sending was cut: that answer (not counted again), or nothing if it is out
    (False, False, BadRequest("bad", code="bad_thing"), [("json", (400, "bad_thing"))]),
    (False, True, BadRequest("bad", code="bad_thing"), []),
])
def test_what_a_cut_request_is_told(stream_started: bool, head_out: bool, answering: APIError | None,
                                   sent: list[tuple[str, Any]]) -> None:
    async def main() -> None:
        metrics = GatewayMetrics()
        host = SimpleNamespace(metrics=metrics, admission=Admission(0, 0, 1.0, metrics))
        responder = Responder(host, ChatShape())  # type: ignore[arg-type]
        exchange = _Exchange(head_out)
        run = SimpleNamespace(started=stream_started) if stream_started or head_out else None
        await responder._cut(exchange, run, answering)  # type: ignore[arg-type]
        assert exchange.sent == sent
        # counted once, under the status the client got: a stream's head went out with 200
        assert _counted(metrics, "200" if head_out else "503") == (0 if answering else 1)
        assert _counted(metrics, "503" if head_out else "200") == 0

    asyncio.run(main())
