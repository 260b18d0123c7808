"""The chaos runner's clients (``loadtests/chaos_load.py``) judge every reply, however odd its shape.

A 200 whose JSON is not the shape a completion has (a list, a null choice, a usage that is no object,
an SSE event that is no object) raised out of ``Load.one``: the outcome was never recorded and the
client's loop ended silently (``stop()`` gathers with ``return_exceptions``), so a gateway answering
such bodies left the run with fewer clients and its verdict OK. Each must be recorded as a bad outcome.
"""

from __future__ import annotations

import asyncio
import random
import sys

import pytest
from aiohttp import web
from pdtest import ROOT

sys.path.insert(0, str(ROOT / "loadtests"))  # loadtests is not a package
from chaos_load import Load, Result


class _Reference:
    def text(self, prompt: int, max_tokens: int) -> str:
        return "abcdefgh"[:max_tokens]


WHOLE_BODIES = [b"[]", b'{"id": "x", "choices": [null]}', b'{"id": "x", "choices": [{"text": "abcdefgh"}], "usage": 5}']
STREAM_BODIES = [b"data: 5\n\ndata: [DONE]\n\n", b'data: {"id": "x", "choices": [null]}\n\ndata: [DONE]\n\n']


async def _serve(body: bytes, content_type: str) -> tuple[web.AppRunner, str]:
    async def reply(_: web.Request) -> web.Response:
        return web.Response(body=body, content_type=content_type)

    app = web.Application()
    app.router.add_post("/v1/completions", reply)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    return runner, f"http://127.0.0.1:{port}"


@pytest.mark.parametrize(("kind", "body"), [*(("whole", b) for b in WHOLE_BODIES),
                                            *(("stream", b) for b in STREAM_BODIES)])
def test_an_odd_shaped_reply_is_recorded_not_raised(kind: str, body: bytes) -> None:
    async def run() -> list[Result]:
        runner, url = await _serve(body, "application/json" if kind == "whole" else "text/event-stream")
        load = Load(url, _Reference(), [[97, 98]], random.Random(0), request_timeout_s=10)  # type: ignore[arg-type]
        load.start(0)
        try:
            outcome = await load.one(random.Random(0), kind)
        finally:
            await load.stop()
            await runner.cleanup()
        assert outcome in load.outcomes and not load.inflight
        return [o.result for o in load.outcomes]

    results = asyncio.run(run())
    assert results in ([Result.UNCLEAR], [Result.WRONG]), results
