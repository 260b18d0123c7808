"""Cases the first version of this session's changes missed (from the review of its diff): a retry that
avoids the only decode big enough, SGLang's LoRA model syntax through the relay, a KV receiver that cannot say
whether it is quiesced (logged once), and a worker that moved (its old address is not held against another)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from aiohttp import web
from relay_harness import Exchange, call, jbody, relay
from test_kv_capacity import _fleet

from gateway.health import HealthConfig
from gateway.router import Router
from gateway.sglang_fleet import RelayConfig, SGLangFleet
from workers.pd_queues import DecodeQuarantine


def test_a_retry_that_avoids_the_only_decode_that_fits_goes_back_to_it() -> None:
    """``_selectable``: "a failed worker beats none at all" -- but the capacity filter runs after the avoid
    filter, so in a mixed-size fleet a transient failure on the only big decode turns its retry into a 503
    although it is healthy and the only one that can serve the request."""
    async def main() -> None:
        dispatcher, _, decodes, _ = _fleet([1024], [64, 1024])
        request = dispatcher.router.request(list(range(100)), 200)  # 300 tokens: only decodes[1]
        _, _, decode = dispatcher._select(request, {decodes[1]})
        assert decode is decodes[1]

    asyncio.run(main())


async def _ok(request: web.Request) -> web.Response:
    await request.read()
    return web.json_response({"text": "x", "meta_info": {}})


def test_the_relay_passes_sglangs_lora_adapter_model_syntax() -> None:
    """SGLang selects a LoRA adapter with ``"model": "<served>:<adapter>"``; the new model check 404s it."""
    async def main() -> None:
        async with relay(_ok, _ok) as (responder, _):
            responder.served_model = lambda: "meta-llama/Llama-3.1-8B-Instruct"
            exchange = Exchange(jbody({"text": "hi", "model": "meta-llama/Llama-3.1-8B-Instruct:sql"}))
            await call(responder, exchange)
            assert exchange.status == 200, exchange.sent

    asyncio.run(main())


def test_a_receiver_that_cannot_say_whether_it_is_quiesced_is_logged_once(caplog: Any) -> None:
    """``is_quiesced`` logs a traceback each time it is asked; the scheduler asks on every loop pass."""
    class Broken:
        @property
        def quiesced(self) -> bool:
            raise RuntimeError("backend bug")

    class R:
        kv_receiver = Broken()
        key = "r1"

    q = DecodeQuarantine()
    q.append(R())
    with caplog.at_level(logging.ERROR):
        for _ in range(100):
            q.take_quiesced()
    assert len(caplog.records) <= 1, f"{len(caplog.records)} tracebacks for one broken receiver"


def test_a_twin_check_does_not_use_an_address_a_worker_had_before_it_moved() -> None:
    """``HttpWorker.addresses`` is resolved once, at the first probe, and kept: a worker whose name later
    resolves elsewhere (a pod restarted) keeps its old address, and a new worker given that address (reused)
    is taken for its twin and never selected."""
    async def main() -> None:
        fleet = SGLangFleet([("http://a.example:30000", 8998)], ["http://b.example:30000", "http://c.example:30000"],
                            Router.build("random", "random"), HealthConfig(), RelayConfig())
        b, c = fleet.decodes
        b.addresses = frozenset({("10.0.0.5", 30000, "")})  # b's first probe, before it moved to 10.0.0.9
        c.addresses = frozenset({("10.0.0.5", 30000, "")})  # c now has the address b had
        import gateway.sglang_fleet as sf
        real = sf._addresses

        async def now(url: str) -> frozenset[tuple[str, int, str]]:
            return frozenset({("10.0.0.9" if "b.example" in url else "10.0.0.5", 30000, "")})
        sf._addresses = now
        try:
            ok, reason = await fleet._is_not_a_twin(c)
        finally:
            sf._addresses = real
        assert ok, reason

    asyncio.run(main())
