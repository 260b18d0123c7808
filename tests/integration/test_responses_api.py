"""OpenAI's Responses API (``POST /v1/responses``) through the PD path, with the real openai client: the whole
response, its stream of typed events, and the 400s for what the gateway does not implement. (The sim engine never
ends on EOS: a completed answer, and structured output, are in tests/integration/test_real_model.py and
test_structured_output.py, on SmolLM2.)"""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
import openai


def _client(cluster: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{cluster.base_url}/v1", api_key="none", max_retries=0, timeout=60)


def test_a_whole_response_and_its_stream(sim_cluster) -> None:  # type: ignore[no-untyped-def]
    cluster = sim_cluster()
    client = _client(cluster)
    response = client.responses.create(model="default", input="Hello there", max_output_tokens=12,
                                       instructions="Answer briefly.", metadata={"ticket": "42"})
    assert response.object == "response" and response.id.startswith("resp_")
    # the sim never emits EOS: the budget ends it, an incomplete response that says why
    assert response.status == "incomplete" and response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens"
    [message] = response.output
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert response.output_text and response.output_text == message.content[0].text
    assert response.usage is not None and response.usage.output_tokens == 12
    assert response.usage.total_tokens == response.usage.input_tokens + 12
    assert response.instructions == "Answer briefly." and response.metadata == {"ticket": "42"}
    assert response.max_output_tokens == 12 and response.store is False
    # instructions are a system message in front of the input: the prompt is longer with them
    bare = client.responses.create(model="default", input="Hello there", max_output_tokens=1)
    assert bare.usage is not None and bare.usage.input_tokens < response.usage.input_tokens

    # a list of messages with text parts, streamed: the typed events, numbered in order, no [DONE]
    events = list(client.responses.create(
        model="default", max_output_tokens=9, stream=True,
        input=[{"role": "system", "content": "Be brief."},
               {"role": "user", "content": [{"type": "input_text", "text": "hi"}]},
               {"role": "assistant", "content": [{"type": "output_text", "text": "Hello!"}]},
               {"type": "message", "role": "user", "content": "and again"}]))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"], kinds
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"], kinds
    assert set(kinds[4:-4]) == {"response.output_text.delta"}, kinds
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response  # type: ignore[union-attr]
    assert text and final.output_text == text == events[-4].text  # type: ignore[union-attr]
    assert final.usage is not None and final.usage.output_tokens == 9 and final.id == events[0].response.id  # type: ignore[union-attr]
    cluster.wait_pools_full()


def test_the_raw_stream_names_each_event_and_ends_without_done(sim_cluster) -> None:  # type: ignore[no-untyped-def]
    cluster = sim_cluster()
    with httpx.stream("POST", f"{cluster.base_url}/v1/responses", timeout=60,
                      json={"model": "default", "input": "hi", "max_output_tokens": 5, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        body = r.read().decode()
    blocks = [b for b in body.split("\n\n") if b]
    assert blocks and "[DONE]" not in body
    for block in blocks:  # every event is an ``event:`` line naming the ``type`` of its ``data:`` line
        event_line, data_line = block.split("\n")
        assert event_line.startswith("event: ") and data_line.startswith("data: ")
        assert json.loads(data_line[6:])["type"] == event_line[7:]
    cluster.wait_pools_full()


REFUSALS: list[tuple[dict[str, Any], str]] = [
    ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": "x", "conversation": "conv_1"}, "conversation"),
    ({"input": "x", "tools": [{"type": "function", "name": "f", "parameters": {}}]}, "tools"),
    ({"input": "x", "tool_choice": "required"}, "tool_choice"),
    ({"input": "x", "reasoning": {"effort": "high"}}, "reasoning"),
    ({"input": "x", "include": ["message.output_text.logprobs"]}, "include"),
    ({"input": "x", "background": True}, "background"),
    ({"input": "x", "top_logprobs": 3}, "top_logprobs"),
    ({"input": "x", "truncation": "auto"}, "truncation"),
    ({"input": "x", "text": {"format": {"type": "yaml"}}}, "text.format.type"),
    ({"input": "x", "text": {"verbosity": "low"}}, "text.verbosity"),
    ({"input": ""}, "input"),
    ({"input": []}, "input"),
    ({}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]},
     "input[0].content[0].type"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": "1"}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": "a"}, {"role": "tool", "content": "b"}]}, "input[1].role"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x", "temperature": 3}, "temperature"),
    ({"input": "x", "metadata": {str(i): "v" for i in range(17)}}, "metadata"),
    ({"input": "x", "max_output_tokens": 100_000}, "max_output_tokens"),  # past the context length
    ({"input": "x", "max_output_tokens": 2000}, "max_output_tokens"),  # past every decode's KV pool
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "t", "schema": {"type": "object"}}}},
     "text.format.schema"),  # (the sim engine has no constrained decoding: its worker's refusal, in our names)
]


def test_refusals_name_the_field(sim_cluster) -> None:  # type: ignore[no-untyped-def]
    cluster = sim_cluster()
    for body, param in REFUSALS:
        for stream in (False, True):
            r = httpx.post(f"{cluster.base_url}/v1/responses", json={"model": "default", **body, "stream": stream},
                           timeout=60)
            assert r.status_code == 400, (body, r.text)
            error = r.json()["error"]
            assert error["param"] == param and error["type"] == "invalid_request_error", (body, error)
            assert "max_completion_tokens" not in error["message"], error
            assert "response_format" not in error["message"], error
    r = httpx.post(f"{cluster.base_url}/v1/responses", json={"model": "gpt-9", "input": "x"}, timeout=60)
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    cluster.wait_pools_full()


def test_a_client_leaving_mid_stream_returns_the_pages(sim_cluster) -> None:  # type: ignore[no-untyped-def]
    cluster = sim_cluster(decode_args=("--engine-option", "decode_step_s=0.01"))
    with httpx.stream("POST", f"{cluster.base_url}/v1/responses", timeout=60,
                      json={"input": "hi", "max_output_tokens": 500, "stream": True}) as r:
        assert r.status_code == 200
        seen = 0
        for line in r.iter_lines():
            seen += line.startswith("event: response.output_text.delta")
            if seen >= 3:
                break
    time.sleep(0.2)
    cluster.wait_pools_full()
