"""Review: a request that sets no budget (``max_tokens`` / ``max_new_tokens`` absent) gets the route's default
budget cut to the context length only, not to what the decode workers' KV pools hold. A prompt that fits the
pools, with a default budget that does not, is then a 400 ``context_length_exceeded`` naming ``max_tokens`` --
a field the client never sent -- where the same request with any small explicit ``max_tokens`` is served.
(SGLang's scheduler cuts the budget to its pool, ``max_req_len``; vLLM never starts with a pool smaller than
the context.) The sim workers here: a pool of 256 pages x 4 = 1,024 tokens, a context of 8,192."""

from __future__ import annotations

import httpx
import openai


def test_a_default_budget_is_cut_to_what_the_decode_pool_holds(sim_cluster) -> None:  # type: ignore[no-untyped-def]
    cluster = sim_cluster()
    base = cluster.base_url
    c = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=60)
    prompt = [65] * 900  # fits the 1,024-token pool; 900 + the default 256 does not
    # an explicit budget that fits is served
    out = c.completions.create(model="sim", prompt=prompt, max_tokens=100, extra_body={"ignore_eos": True})
    assert out.usage is not None and out.usage.completion_tokens == 100
    # no budget at all: served too, the default cut to what the pool holds (not a 400 naming max_tokens)
    out = c.completions.create(model="sim", prompt=prompt, extra_body={"ignore_eos": True})
    assert out.choices[0].finish_reason == "length"
    assert out.usage is not None and 0 < out.usage.completion_tokens <= 1024 - 900
    # SGLang's /generate without max_new_tokens (its default 128, cut as SGLang's scheduler cuts it)
    r = httpx.post(f"{base}/generate", json={"input_ids": [65] * 950, "sampling_params": {"ignore_eos": True}},
                   timeout=60)
    assert r.status_code == 200, r.text
    assert 0 < r.json()["meta_info"]["completion_tokens"] <= 1024 - 950
