"""``/v1/models``' ``max_model_len`` (``Frontend.usable_context``) is what a client may size prompt + output by and
be served: in a disaggregated fleet the prompt must also fit a prefill's KV pool, so a prefill pool smaller than
the decodes' bounds it too (a prompt past every prefill's pool is a 400 however the decodes are sized)."""

from __future__ import annotations

import asyncio

from test_kv_capacity import _fleet

from gateway.api import Frontend
from gateway.tokenizer import load_tokenizer


def test_max_model_len_is_within_the_largest_prefill_pool() -> None:
    async def main() -> None:
        # prefill 0 holds 256 tokens, prefill 1 512; the decode 4,096 (the model's context 4,096)
        dispatcher, prefills, _, _ = _fleet([64, 128], [1024])
        frontend = Frontend(dispatcher, load_tokenizer("byte"), "m", 4096)
        limit = frontend.usable_context()
        assert limit == 513, limit  # a 512-token prompt and one token to generate
        for prompt in (limit - 1, 100, 1):  # what a client sizing its requests by it sends is served
            request = dispatcher.router.request(list(range(prompt)), limit - prompt)
            dispatcher._select(request, set())
        prefills[1].is_draining = True  # (an unavailable prefill's pool does not count, as a decode's)
        assert frontend.usable_context() == 257
        for prefill in prefills:
            prefill.is_draining = True
        assert frontend.usable_context() == 513  # (none available: all of them, as before)

    asyncio.run(main())


def test_combined_workers_are_bounded_by_their_own_pools_only() -> None:
    async def main() -> None:
        dispatcher, _, _, _ = _fleet([], [64, 256], combined=True)
        assert Frontend(dispatcher, load_tokenizer("byte"), "m", 4096).usable_context() == 1024

    asyncio.run(main())
