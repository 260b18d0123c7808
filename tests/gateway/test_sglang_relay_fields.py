"""Security review: fields the relay passes to SGLang workers that the native path refuses."""

from __future__ import annotations

import asyncio
import json

import pytest
from aiohttp import web
from relay_harness import Exchange, call, jbody, relay


async def prefill_ok(request: web.Request) -> web.Response:
    await request.read()
    return web.json_response({"text": "", "meta_info": {}})


@pytest.mark.parametrize("field", ["custom_logit_processor"])
def test_fields_the_gateway_refuses_natively_do_not_reach_sglang_workers(field: str) -> None:
    """``custom_logit_processor`` is a serialized (dill) callable that an SGLang worker started with
    ``--enable-custom-logit-processor`` runs: code execution on the worker for whoever holds a client key. The
    native path answers 400 for it (docs/api.md); the relay forwards the body as it came."""
    seen: list[dict[str, object]] = []

    async def decode(request: web.Request) -> web.Response:
        seen.append(json.loads(await request.read()))
        return web.json_response({"text": "x", "meta_info": {}})

    async def main() -> None:
        async with relay(prefill_ok, decode) as (responder, _):
            exchange = Exchange(jbody({"text": "hi", field: "x"}))
            await call(responder, exchange)
            assert exchange.status == 400 or not any(field in body for body in seen), (exchange.status, seen)

    asyncio.run(main())
