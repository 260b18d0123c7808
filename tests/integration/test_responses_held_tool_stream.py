"""``/v1/responses`` streamed with function tools under ``tool_choice: auto``, when the answer starts like a call
(held back until it ends, to tell a call from a message): ``response.created`` and ``response.in_progress`` go out
with the first output, not at the end; the held text then comes out as what it turned out to be (a
``function_call`` item with its arguments events, or a message); a failure while it is held is a
``response.failed`` event, not an HTTP error. Every event is numbered in order and read by the installed openai
SDK's typed stream.

The sim engine writes letters only, never a call: these workers run ``ScriptedEngine`` (below), the sim engine
whose output starts with the text of its ``script`` option, then (``end=eos``) ends, or goes on as the sim's."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import httpx
import openai
import pydantic
from openai.types.responses import ResponseStreamEvent

from workers.engines.base import EngineOptions, SeqInput
from workers.engines.sim import SimEngine

if TYPE_CHECKING:  # (the workers import this module for its engine, without tests/ on their path)
    from pdtest import SimCluster

ENGINE = "tests.integration.test_responses_held_tool_stream:ScriptedEngine"
FN: Any = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'


class ScriptedEngine(SimEngine):
    """The sim engine, its first outputs the bytes of ``script`` (an engine option), then EOS (``end=eos``) or the
    sim's own letters."""

    def __init__(self, options: EngineOptions | None = None) -> None:
        super().__init__(options)
        extra = (options or EngineOptions()).extra
        self.script = str(extra.get("script", "")).encode()
        self.ends = extra.get("end") == "eos"

    def _pick(self, seq: SeqInput, crc: int) -> int:
        position = seq.num_generated + seq.params.output_offset
        if position < len(self.script):
            return self.script[position]
        if self.ends:
            return self.info.eos_token_ids[0]
        return super()._pick(seq, crc)


def _scripted(sim_cluster: Callable[..., SimCluster], script: str, *, ends: bool,
              decode_step_s: float = 0.0005) -> SimCluster:
    options = ("--engine", ENGINE, "--engine-option", f"script={script}", "--engine-option",
               f"end={'eos' if ends else 'sim'}")
    return sim_cluster(worker_args=options, decode_args=("--engine-option", f"decode_step_s={decode_step_s}"))


def _client(cluster: SimCluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{cluster.base_url}/v1", api_key="none", max_retries=0, timeout=60)


def _raw_events(cluster: SimCluster, body: dict[str, Any]) -> list[dict[str, Any]]:
    r = httpx.post(f"{cluster.base_url}/v1/responses", json={"model": "default", "stream": True, **body}, timeout=60)
    assert r.status_code == 200, r.text
    return [json.loads(block.split("\n")[-1][len("data: "):]) for block in r.text.split("\n\n") if block]


def _check_typed(events: list[dict[str, Any]]) -> None:
    """Every event validates strictly as the SDK's ``ResponseStreamEvent``, numbered 0, 1, 2... in order."""
    adapter: pydantic.TypeAdapter[Any] = pydantic.TypeAdapter(ResponseStreamEvent)
    for event in events:
        adapter.validate_python(event, strict=True)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))


def test_a_held_call_streams_as_a_function_call_item(sim_cluster: Callable[..., SimCluster]) -> None:
    cluster = _scripted(sim_cluster, CALL, ends=True)
    body = {"input": "Weather in Paris?", "tools": [FN], "max_output_tokens": 200}
    events = _raw_events(cluster, body)
    _check_typed(events)
    kinds = [e["type"] for e in events]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.function_call_arguments.delta", "response.function_call_arguments.done",
                     "response.output_item.done", "response.completed"], kinds
    added, done, final = events[2], events[5], events[-1]["response"]
    assert added["output_index"] == done["output_index"] == 0
    assert added["item"]["type"] == "function_call" and added["item"]["status"] == "in_progress"
    call = done["item"]
    assert call["id"] == added["item"]["id"] == events[3]["item_id"] == events[4]["item_id"]
    assert call["name"] == "get_weather" and call["status"] == "completed"
    assert json.loads(call["arguments"]) == {"city": "Paris"} and events[3]["delta"] == events[4]["arguments"]
    assert final["status"] == "completed" and final["output"] == [call]

    # the SDK's stream helper (its own accumulated snapshot, by output_index) and its plain typed stream agree
    client = _client(cluster)
    with client.responses.stream(model="default", input="Weather in Paris?", tools=[FN],
                                 max_output_tokens=200) as stream:
        typed = list(stream)
        accumulated = stream.get_final_response()
    [item] = accumulated.output
    assert item.type == "function_call" and item.name == "get_weather"
    assert json.loads(item.arguments) == {"city": "Paris"}
    assert [e.type for e in typed] == kinds
    whole = client.responses.create(model="default", input="Weather in Paris?", tools=[FN],
                                    max_output_tokens=200)
    [whole_call] = whole.output
    assert whole_call.type == "function_call" and whole_call.arguments == call["arguments"]
    cluster.wait_pools_full()


def test_held_text_that_is_no_call_streams_as_a_message(sim_cluster: Callable[..., SimCluster]) -> None:
    text = '{"note": "not a call"}'
    cluster = _scripted(sim_cluster, text, ends=True)
    events = _raw_events(cluster, {"input": "hi", "tools": [FN], "max_output_tokens": 200})
    _check_typed(events)
    kinds = [e["type"] for e in events]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", "response.output_text.delta", "response.output_text.done",
                     "response.content_part.done", "response.output_item.done", "response.completed"], kinds
    assert all(e["output_index"] == 0 for e in events if "output_index" in e)
    assert events[4]["delta"] == events[5]["text"] == text
    [message] = events[-1]["response"]["output"]
    assert message["type"] == "message" and message["content"][0]["text"] == text
    cluster.wait_pools_full()


def test_a_failure_while_the_call_is_held_is_response_failed(sim_cluster: Callable[..., SimCluster]) -> None:
    """The answer starts like a call and goes on (held, nothing to show yet) when its decode dies: the stream has
    started (created, in progress, with the first output) and ends with ``response.failed``, which the SDK's typed
    stream yields; no HTTP error status, no exception."""
    cluster = _scripted(sim_cluster, '{"name": "get_weather", "arguments": {"city": "', ends=False,
                        decode_step_s=0.05)
    client = _client(cluster)
    stream = client.responses.create(model="default", input="Weather?", tools=[FN],
                                     max_output_tokens=400, stream=True)
    events = []
    for event in stream:
        events.append(event)
        if event.type == "response.in_progress":
            break
    assert [e.type for e in events] == ["response.created", "response.in_progress"]
    os.kill(cluster.decodes[0].proc.pid, signal.SIGKILL)
    cluster.decodes[0].proc.wait(timeout=30)  # (reaped: the fixture's pool check passes over it)
    events += list(stream)  # (the failure is an event)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    failed = events[-1]
    assert failed.type == "response.failed", [e.type for e in events]
    pydantic.TypeAdapter(ResponseStreamEvent).validate_python(failed.to_dict(), strict=True)
    response = failed.response
    assert response.status == "failed" and response.id == events[0].response.id  # type: ignore[union-attr]
    assert response.error is not None and response.error.code == "server_error"
    assert response.output == []  # (nothing of the held answer went out as an item)
    # (the sim_cluster fixture checks the live workers' pools come back full: the prefill's)
