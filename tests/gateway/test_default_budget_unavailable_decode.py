"""A budget the client did not set is cut to the largest decode pool (``Dispatcher.decode_capacity``) so that it is
no reason to refuse a request. A decode that cannot take requests now (draining through the admin API, its
connection lost, failing its probes) must not set that cut: its pool being the largest, the default budget was
cut to it, every decode left was too small for prompt + budget, and the request was a 503 ("the one that does is
unavailable") for as long as that decode stayed away, a worker that was removed or died keeping every long-prompt
request without max_tokens out; with any smaller max_tokens it was served by the decodes left."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from test_kv_capacity import _fleet

from gateway.api import Frontend
from gateway.api_models import CompletionRequest
from gateway.tokenizer import load_tokenizer


def _away(decode: Any, how: str) -> None:
    if how == "draining":
        decode.is_draining = True  # (the admin API's DELETE: no new requests until it is gone)
    elif how == "disconnected":
        decode._transport = None  # (its connection lost; the gateway keeps its last handshake's pool)
    else:
        for _ in range(decode.health.config.unhealthy_after):
            decode.health.probe_failed("frozen")


@pytest.mark.parametrize("how", ["draining", "disconnected", "unhealthy"])
def test_a_decode_that_cannot_take_requests_does_not_set_the_default_budget(how: str) -> None:
    async def main() -> None:
        # decode 0 holds 256 tokens, decode 1 (the largest) 1,024; the prefill 4,096
        dispatcher, _, decodes, _ = _fleet([1024], [64, 256])
        _away(decodes[1], how)
        assert dispatcher.decode_capacity() == 256
        frontend = Frontend(dispatcher, load_tokenizer("byte"), "m", 4096, default_max_tokens=256)
        prepared = frontend.prepare_completion(CompletionRequest(model="m", prompt=[65] * 200))  # no max_tokens
        assert 0 < prepared.params.max_new_tokens <= 256 - 200
        request = dispatcher.router.request(prepared.input_ids, prepared.params.max_new_tokens)
        _, _, decode = dispatcher._select(request, set())  # served by the decode left (it was a 503)
        assert decode is decodes[0]

    asyncio.run(main())


def test_with_no_decode_available_the_cut_is_the_largest_pool_as_before() -> None:
    async def main() -> None:
        dispatcher, _, decodes, _ = _fleet([1024], [64, 256])
        for decode in decodes:
            decode.is_draining = True
        assert dispatcher.decode_capacity() == 1024

    asyncio.run(main())
