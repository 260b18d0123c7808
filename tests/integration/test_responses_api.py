"""OpenAI's Responses API (``POST /v1/responses``) through the PD path, with the real openai client: the whole
response, its stream of typed events, and the 400s for what the gateway does not implement. (The sim engine never
ends on EOS: a completed answer, and structured output, are in tests/integration/test_real_model.py and
test_structured_output.py, on SmolLM2.)"""

from __future__ import annotations

import json
import os
import signal
import time
from typing import Any

import httpx
import openai
import pytest


def _client(cluster: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{cluster.base_url}/v1", api_key="none", max_retries=0, timeout=60)


def test_a_whole_response_and_its_stream(sim_cluster) -> None:  # type: ignore[no-untyped-def]
    cluster = sim_cluster()
    client = _client(cluster)
    response = client.responses.create(model="default", input="Hello there", max_output_tokens=12,
                                       instructions="Answer briefly.", metadata={"ticket": "42"},
                                       safety_identifier="user-7", prompt_cache_key="faq")
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
    assert response.safety_identifier == "user-7" and response.prompt_cache_key == "faq"  # (repeated, as OpenAI)
    assert response.max_output_tokens == 12 and response.store is True  # (stored: tests/.../test_responses_store.py)
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


FN = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
      "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
REFUSALS: list[tuple[dict[str, Any], str]] = [
    ({"input": "x", "conversation": "conv_1"}, "conversation"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": "x", "tools": [{"type": "function", "name": "f", "parameters": {"type": "string"}}]},
     "tools[0].parameters"),
    ({"input": "x", "tools": [FN], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice.name"),
    ({"input": "x", "tools": [FN], "tool_choice": "required"}, "tools"),  # (the sim: no constrained decoding)
    ({"input": "x", "tool_choice": "required"}, "tool_choice"),
    ({"input": "x", "max_tool_calls": 2}, "max_tool_calls"),
    ({"input": [{"type": "function_call_output", "output": "1"}]}, "input[0].call_id"),
    ({"input": [{"type": "function_call", "call_id": "c", "arguments": "{}"}]}, "input[0].name"),
    ({"input": [{"role": "user", "content": "a"}, {"type": "function_call_output", "call_id": "c", "output": "1"}]},
     "input[1].call_id"),  # (an output that answers no call)
    ({"input": [{"role": "assistant", "content": [{"type": "refusal"}]}]}, "input[0].content[0].refusal"),
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


def test_function_calls_and_their_outputs_continue_the_conversation(sim_cluster) -> None:  # type: ignore[no-untyped-def]
    """A conversation replayed with its calls (``function_call``) and their results (``function_call_output``), and
    an assistant's refusal: the model sees them all (a longer prompt), the tools and the answer come back."""
    cluster = sim_cluster()
    client = _client(cluster)
    turns: list[Any] = [{"role": "user", "content": "Weather in Paris?"}]
    plain = client.responses.create(model="default", input=turns, max_output_tokens=2, tools=[FN])
    turns += [{"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
              {"type": "function_call_output", "call_id": "call_1", "output": '{"sky": "sunny"}'},
              {"role": "assistant", "content": [{"type": "refusal", "refusal": "I cannot say more."}]},
              {"role": "user", "content": "Thanks"}]
    longer = client.responses.create(model="default", input=turns, max_output_tokens=2, tools=[FN])
    assert plain.usage is not None and longer.usage is not None
    assert longer.usage.input_tokens > plain.usage.input_tokens + 20
    assert [t.name for t in longer.tools] == ["get_weather"]  # type: ignore[union-attr]
    assert longer.output and longer.output[0].type == "message"  # (the sim wrote no call: text)
    events = list(client.responses.create(model="default", input=turns, max_output_tokens=3, tools=[FN],
                                          stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[-1].type == "response.incomplete"
    assert events[-1].response.output_text == "".join(  # type: ignore[union-attr]
        e.delta for e in events if e.type == "response.output_text.delta")
    cluster.wait_pools_full()


def broken_stream(client: openai.OpenAI, cluster: Any, **extra: Any) -> list[Any]:
    """The events of a stream whose (only) decode is killed after its first text delta: to its end (no exception:
    the failure is an event)."""
    stream = client.responses.create(model="default", input="hi", max_output_tokens=400, stream=True, **extra)
    events = []
    for event in stream:
        events.append(event)
        if event.type == "response.output_text.delta":
            break
    os.kill(cluster.decodes[0].proc.pid, signal.SIGKILL)
    return events + list(stream)


@pytest.mark.parametrize("tools", [False, True], ids=["text", "with-tools"])
def test_a_stream_that_breaks_ends_with_response_failed(sim_cluster, tools: bool) -> None:  # type: ignore[no-untyped-def]
    """A stream whose decode dies mid-answer (no other decode to move to) ends as OpenAI ends one that failed: a
    ``response.failed`` event, numbered in order, whose response is ``failed`` with an ``error`` and the output as far
    as it went, its message ``incomplete``; not chat's untyped ``data: {"error": ...}``, which the SDK's typed
    stream cannot read as an event. The prefill's pages come back."""
    cluster = sim_cluster(decode_args=("--engine-option", "decode_step_s=0.05"))
    client = _client(cluster)
    events = broken_stream(client, cluster, **({"tools": [FN]} if tools else {}))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    failed = events[-1]
    assert failed.type == "response.failed", [e.type for e in events[-3:]]
    from openai.types.responses import ResponseFailedEvent

    ResponseFailedEvent.model_validate(failed.to_dict())  # (every field as the API types it: strictly)
    response = failed.response  # type: ignore[union-attr]
    assert response.status == "failed" and response.id == events[0].response.id  # type: ignore[union-attr]
    assert response.error is not None and response.error.code == "server_error"
    assert "decode" in response.error.message
    [message] = response.output
    assert message.type == "message" and message.status == "incomplete"
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text and message.content[0].text == text  # type: ignore[union-attr]
    deadline = time.monotonic() + 20
    while (load := cluster.prefills[0].get("/load"))["num_free_pages"] != load["num_total_pages"]:
        assert time.monotonic() < deadline, f"the prefill's pages did not come back: {load}"
        time.sleep(0.1)
