"""A fleet of mixed contexts serves the longest (``Gateway._max_context``), and each request goes only to workers
whose context holds its prompt + max_new_tokens (``Dispatcher._fitting``): a prefill's too. A budget the client did
not set must then be cut to what a prefill that can take requests holds, as it is cut to the largest decode's pool
(``decode_capacity``): with the long prefill away (dead, restarting, draining, failing its probes) it counts on in
the fleet's context, so the default budget was sized by it, no prefill left took prompt + budget, and every such
request whose prompt the short prefill holds was a 503 for as long as it stayed away (``/v1/models`` already said
``max_model_len`` 512; with any smaller max_tokens the short prefill served it)."""

from __future__ import annotations

import asyncio

import msgspec
from test_kv_capacity import _fleet

from gateway.api import Frontend
from gateway.api_models import CompletionRequest, GenerateRequest
from gateway.tokenizer import load_tokenizer


def test_the_default_budget_fits_a_prefill_that_can_take_requests() -> None:
    async def main() -> None:
        # two prefills, the first with a context of 512, the second (the model's) 4096; one decode of 4096
        dispatcher, prefills, decodes, _ = _fleet([1024, 1024], [1024])
        prefills[0].info = msgspec.structs.replace(prefills[0].info, max_context=512)
        prefills[0].state.connected(prefills[0].info)
        # the long prefill's connection is lost: the fleet still serves 4096
        transport, prefills[1]._transport = prefills[1]._transport, None
        frontend = Frontend(dispatcher, load_tokenizer("byte"), "m", 4096, default_max_tokens=256)
        assert frontend.usable_context() == 512
        prepared = frontend.prepare_completion(CompletionRequest(model="m", prompt=[65] * 400))  # no max_tokens
        assert 0 < prepared.params.max_new_tokens <= 512 - 400
        request = dispatcher.router.request(prepared.input_ids, prepared.params.max_new_tokens)
        _, prefill, decode = dispatcher._select(request, set())  # served by the short prefill (it was a 503)
        assert prefill is prefills[0] and decode is decodes[0]
        generate, _ = frontend.prepare_generate(GenerateRequest(input_ids=[65] * 400))  # (SGLang's default: 128)
        assert 0 < generate.params.max_new_tokens <= 512 - 400
        prefills[1]._transport = transport
        assert frontend.prepare_completion(CompletionRequest(model="m", prompt=[65] * 400)).params.max_new_tokens \
            == 256  # (the long prefill back: the default budget is not cut)

    asyncio.run(main())
