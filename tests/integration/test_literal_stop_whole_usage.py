"""``skip_special_tokens: false`` with ``stop``: the gateway alone watches the stop strings (the decode is sent none,
``gateway.api._literal_stops``). A whole (non-streamed) answer of one choice must then not let the decode gather
its outputs (``Submit.gather_s``): it would run on past the stop string for the gather window, and every token of
that window was counted in ``usage.completion_tokens`` (and given logprob entries) though its text is cut."""

from __future__ import annotations

import openai


def test_whole_answer_counts_no_tokens_past_a_gateway_only_stop(sim_cluster) -> None:  # type: ignore[no-untyped-def]
    cluster = sim_cluster()
    client = openai.OpenAI(base_url=f"{cluster.base_url}/v1", api_key="none", max_retries=0, timeout=60)
    prompt = "hello world"
    text = client.completions.create(model="default", prompt=prompt, max_tokens=200, temperature=0).choices[0].text
    stop = text[40:43]
    end = text.find(stop) + len(stop)  # the sim's byte tokenizer: one token per character of this text
    assert 0 < end < 150, text
    extra = {"skip_special_tokens": False}
    whole = client.completions.create(model="default", prompt=prompt, max_tokens=200, temperature=0, stop=[stop],
                                      extra_body=extra)
    assert whole.choices[0].text == text[:end - len(stop)]
    assert whole.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model="default", prompt=prompt, max_tokens=200, temperature=0, stop=[stop],
                                         extra_body=extra, stream=True, stream_options={"include_usage": True})
    usage = [chunk.usage for chunk in streamed if chunk.usage is not None]
    assert usage[0].completion_tokens == end
    assert whole.usage.completion_tokens == end, "tokens generated past the stop string were counted"
    cluster.wait_pools_full()
