"""The default budget (no max_tokens) is cut to what a prefill that can take requests holds
(``Dispatcher.prefill_context``). A long prefill whose circuit breaker is open cannot take requests
(``_selectable`` leaves it out) just as one that is disconnected cannot: counting its context kept the default
budget sized by it, no selectable prefill took prompt + budget, and every request with no max_tokens whose prompt
the short prefill holds was a 503 for the breaker's whole cooldown (30 s by default), though the short prefill
served it with the budget cut (as it does when the long one is disconnected)."""

from __future__ import annotations

import asyncio

import msgspec
from test_kv_capacity import _fleet

from gateway.api import Frontend
from gateway.api_models import CompletionRequest
from gateway.tokenizer import load_tokenizer


def test_the_default_budget_fits_a_prefill_when_the_long_one_has_an_open_breaker() -> None:
    async def main() -> None:
        dispatcher, prefills, decodes, _ = _fleet([1024, 1024], [1024])
        prefills[0].info = msgspec.structs.replace(prefills[0].info, max_context=512)
        prefills[0].state.connected(prefills[0].info)
        breaker = prefills[1].health.breaker
        for _ in range(breaker.failures_to_open):  # the long prefill failed its requests: its breaker opens
            breaker.record_failure()
        assert not prefills[1].healthy and prefills[1].is_connected
        frontend = Frontend(dispatcher, load_tokenizer("byte"), "m", 4096, default_max_tokens=256)
        prepared = frontend.prepare_completion(CompletionRequest(model="m", prompt=[65] * 400))  # no max_tokens
        assert 0 < prepared.params.max_new_tokens <= 512 - 400
        request = dispatcher.router.request(prepared.input_ids, prepared.params.max_new_tokens)
        _, prefill, decode = dispatcher._select(request, set())  # served by the short prefill (it was a 503)
        assert prefill is prefills[0] and decode is decodes[0]

    asyncio.run(main())
