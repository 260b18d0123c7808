"""Tool definitions and tool turns are checked as OpenAI checks them, on ``/v1/chat/completions`` and ``/v1/responses``
alike: a 400 ``invalid_request_error`` naming the field, as the route spells it. They were accepted: ``strict: "yes"``
(read as true), ``description: 5``, names OpenAI refuses (``"a b"``, 1,000 characters, a NUL),
a ``tool`` message answering no call, two calls of one message with one id, and ``tool_calls: [{}]``."""

from __future__ import annotations

from typing import Any

import httpx

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}


def _tool(**fields: Any) -> dict[str, Any]:
    return {"type": "function", "function": {"name": "get_weather", **fields}}


BAD_TOOLS: list[tuple[dict[str, Any], str]] = [
    (_tool(strict="yes"), "tools[0].function.strict"),
    (_tool(strict=5), "tools[0].function.strict"),
    (_tool(description=5), "tools[0].function.description"),
    (_tool(description={"text": "x"}), "tools[0].function.description"),
    (_tool(parameters=[]), "tools[0].function.parameters"),
    (_tool(parameters="object"), "tools[0].function.parameters"),
    ({"type": "function", "function": {"name": "a b"}}, "tools[0].function.name"),
    ({"type": "function", "function": {"name": "x" * 1000}}, "tools[0].function.name"),
    ({"type": "function", "function": {"name": "a\x00b"}}, "tools[0].function.name"),
    ({"type": "function", "function": {"name": "get.weather"}}, "tools[0].function.name"),
    ({"type": "function", "function": {"name": "get_weather\n"}}, "tools[0].function.name"),
]
# (null is the field's absence: parameters null is a function without parameters, as vLLM and tests/gateway's
# test_null_parameters_is_a_function_without_parameters have it)
GOOD_TOOLS = [_tool(strict=None, description=None, parameters=None), _tool(strict=False, description="The weather."),
              {"type": "function", "function": {"name": "A-z_0-9" + "x" * 57}}]  # (64 characters)

QUESTION = {"role": "user", "content": "Weather in Paris?"}


def _calls(*ids: str) -> dict[str, Any]:
    return {"role": "assistant", "content": None, "tool_calls": [
        {"id": i, "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
        for i in ids]}


def _result(call_id: str) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": call_id, "content": "sunny"}


BAD_TURNS: list[tuple[list[dict[str, Any]], str]] = [
    ([QUESTION, _calls("call_1"), _result("call_2")], "messages[2].tool_call_id"),  # answers no call
    ([QUESTION, _calls("call_1"), _result("call_1"), _result("call_9")], "messages[3].tool_call_id"),
    ([QUESTION, _calls("call_1", "call_1"), _result("call_1")], "messages[1].tool_calls[1].id"),  # one id twice
    ([QUESTION, {"role": "assistant", "content": None, "tool_calls": [{}]}], "messages[1].tool_calls[0].id"),
    ([QUESTION, {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1"}]}],
     "messages[1].tool_calls[0].function"),
    ([QUESTION, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"arguments": "{}"}}]}],
     "messages[1].tool_calls[0].function.name"),
    ([QUESTION, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "retrieval", "function": {"name": "get_weather", "arguments": "{}"}}]}],
     "messages[1].tool_calls[0].type"),
]
GOOD_TURNS = [
    [QUESTION, _calls("call_1", "call_2"), _result("call_2"), _result("call_1")],
    # a later turn may reuse an id of an earlier one; a result may answer an earlier turn's call
    [QUESTION, _calls("call_1"), _result("call_1"), {"role": "user", "content": "And Rome?"}, _calls("call_1"),
     _result("call_1")],
]


def _check_400(r: httpx.Response, param: str, body: Any) -> None:
    assert r.status_code == 400, (body, r.status_code, r.text)
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, (body, error)


def test_chat_refuses_bad_tool_definitions_and_tool_turns(sim_cluster) -> None:  # type: ignore[no-untyped-def]
    cluster = sim_cluster()
    url = f"{cluster.base_url}/v1/chat/completions"
    for tool, param in BAD_TOOLS:
        body = {"model": "default", "messages": [QUESTION], "tools": [tool], "max_tokens": 4}
        _check_400(httpx.post(url, json=body, timeout=60), param, tool)
        _check_400(httpx.post(url, json={**body, "stream": True}, timeout=60), param, tool)
    for tool in GOOD_TOOLS:  # (tool_choice none: the sim engine has no constrained decoding, auto is not needed)
        r = httpx.post(url, json={"model": "default", "messages": [QUESTION], "tools": [tool], "tool_choice": "none",
                                  "max_tokens": 4}, timeout=60)
        assert r.status_code == 200, (tool, r.text)
    for messages, param in BAD_TURNS:
        for extra in ({}, {"tools": [WEATHER], "tool_choice": "none"}):
            body = {"model": "default", "messages": messages, "max_tokens": 4, **extra}
            _check_400(httpx.post(url, json=body, timeout=60), param, messages)
    for messages in GOOD_TURNS:
        r = httpx.post(url, json={"model": "default", "messages": messages, "max_tokens": 4}, timeout=60)
        assert r.status_code == 200, (messages, r.text)
    cluster.wait_pools_full()


def _flat(tool: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", **tool["function"]}


FN_CALL = {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'}


def test_responses_refuses_the_same_with_its_own_names(sim_cluster) -> None:  # type: ignore[no-untyped-def]
    cluster = sim_cluster()
    url = f"{cluster.base_url}/v1/responses"
    for tool, param in BAD_TOOLS:
        ours = param.replace(".function.", ".")
        body = {"model": "default", "input": "Weather in Paris?", "tools": [_flat(tool)], "max_output_tokens": 4}
        _check_400(httpx.post(url, json=body, timeout=60), ours, tool)
        _check_400(httpx.post(url, json={**body, "stream": True}, timeout=60), ours, tool)
    for tool in GOOD_TOOLS:
        r = httpx.post(url, json={"model": "default", "input": "Weather?", "tools": [_flat(tool)],
                                  "tool_choice": "none", "max_output_tokens": 4}, timeout=60)
        assert r.status_code == 200, (tool, r.text)
    # two function_call items of one turn with one call_id (chat's duplicate ids): the second item is at fault
    body = {"model": "default", "max_output_tokens": 4, "input": [
        QUESTION, FN_CALL, FN_CALL, {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}]}
    _check_400(httpx.post(url, json=body, timeout=60), "input[2].call_id", body)
    fmt = {"type": "json_schema", "name": "city", "schema": {"type": "object"}}
    for bad, param in [({"description": 5}, "text.format.description"), ({"strict": "yes"}, "text.format.strict")]:
        body = {"model": "default", "input": "x", "max_output_tokens": 4, "text": {"format": {**fmt, **bad}}}
        _check_400(httpx.post(url, json=body, timeout=60), param, bad)
    cluster.wait_pools_full()
