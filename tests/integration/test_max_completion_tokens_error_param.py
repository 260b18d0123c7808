"""A chat request that sets ``max_completion_tokens`` (OpenAI's newer name, what the SDK sends) and asks for more than
every decode worker's KV pool holds is a 400 ``context_length_exceeded`` whose ``param`` names the field the client
sent, as the context-length check's does; it named ``max_tokens``, a field the request did not have."""

from __future__ import annotations

import openai


def test_the_kv_pool_refusal_names_max_completion_tokens(sim_cluster) -> None:  # type: ignore[no-untyped-def]
    cluster = sim_cluster()  # (256 pages of 4 tokens per decode: 1,024 tokens, far below the context length)
    client = openai.OpenAI(base_url=f"{cluster.base_url}/v1", api_key="none", max_retries=0, timeout=60)
    messages = [{"role": "user", "content": "hi"}]
    for stream in (False, True):
        try:
            client.chat.completions.create(model="default", messages=messages,  # type: ignore[call-overload]
                                           max_completion_tokens=2000, stream=stream)
            raise AssertionError("expected a 400")
        except openai.BadRequestError as exc:
            assert exc.code == "context_length_exceeded", exc
            assert exc.param == "max_completion_tokens", exc
    try:
        client.chat.completions.create(model="default", messages=messages, max_tokens=2000)  # type: ignore[call-overload]
        raise AssertionError("expected a 400")
    except openai.BadRequestError as exc:
        assert exc.param == "max_tokens", exc
    cluster.wait_pools_full()
