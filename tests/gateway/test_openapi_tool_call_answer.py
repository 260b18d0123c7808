"""``/openapi.json`` states what a chat answer looks like: also one whose message is a tool call (``content`` null,
``tool_calls`` set, as OpenAI writes it and ``gateway/tool_calls.py`` shapes it)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import jsonschema_rs
import msgspec

from gateway.app import create_app
from gateway.runtime import GatewayConfig
from gateway.tool_calls import plan_tools, shape_choices

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def chat_completion_validator() -> Any:
    doc = msgspec.json.decode(create_app(GatewayConfig(prefill=("pd://127.0.0.1:1",), decode=("pd://127.0.0.1:2",))).state.openapi)
    schema = {"$ref": "#/components/schemas/ChatCompletion", "components": doc["components"]}
    return jsonschema_rs.Draft202012Validator(schema)


def answer(content: str | None, finish: str = "stop") -> dict[str, Any]:
    return {"id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "sim",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": content}, "logprobs": None,
                         "finish_reason": finish}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8,
                      "prompt_tokens_details": {"cached_tokens": 0}}}


def test_a_tool_call_answer_meets_the_documented_chat_completion() -> None:
    validator = chat_completion_validator()
    validator.validate(answer("plain words"))
    plan = plan_tools(SimpleNamespace(tools=[WEATHER], tool_choice="required", parallel_tool_calls=None), None)
    assert plan is not None
    result = answer('{"name": "get_weather", "arguments": {"city": "Paris"}}')
    shape_choices(plan, result)
    message = result["choices"][0]["message"]
    assert message["content"] is None and message["tool_calls"][0]["function"]["name"] == "get_weather"
    errors = [str(e) for e in validator.iter_errors(result)]
    assert not errors, errors
    # and what the document says of a tool call is what the answer has
    message["tool_calls"][0]["function"]["arguments"] = {"city": "Paris"}  # (a string in OpenAI's shape)
    assert not validator.is_valid(result)
