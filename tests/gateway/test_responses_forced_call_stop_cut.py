"""``/v1/responses`` reads a forced call through chat's code (``split_answer``, ``ChoiceStream`` into ``ToolStream``):
one that a stop string (or stop token) cut is a message item with its text, not a ``function_call`` item with
arguments that do not parse, whole and streamed alike; max_tokens cutting it keeps the call (``incomplete``)."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

from gateway.responses_tools import ToolStream, split_answer
from gateway.tool_calls import ChoiceStream, plan_tools

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def _plan(choice: Any) -> Any:
    plan = plan_tools(SimpleNamespace(tools=[WEATHER], tool_choice=choice, parallel_tool_calls=None), None)
    assert plan is not None
    plan.hold = True  # (what ``prepare_chat`` sets for a forced call of a request with stop strings)
    return plan


def _streamed(plan: Any, text: str, reason: str) -> list[dict[str, Any]]:
    chat = ChoiceStream(plan)
    items = ToolStream(lambda kind, fields: json.dumps({"type": kind, **fields}).encode(),
                       lambda text, status: {"type": "message", "status": status,
                                             "content": [{"type": "output_text", "text": text}]}, "msg_1")
    for i in range(0, len(text), 3):
        items.feed(chat.feed(text[i : i + 3]))
    items.feed(chat.finish(reason)[0])
    items.finish()
    return items.items


def test_a_stop_cut_forced_call_is_a_message_whole_and_streamed() -> None:
    for choice, text in [({"type": "function", "function": {"name": "get_weather"}}, '{"city": "Pa'),
                         ("required", '{"name": "get_weather", "arguments": {"city": "')]:
        plan = _plan(choice)
        assert split_answer(plan, text, "stop") == (text, [], "stop")
        (item,) = _streamed(plan, text, "stop")
        assert item["type"] == "message" and item["content"][0]["text"] == text, item
        content, calls, reason = split_answer(plan, text, "length")  # (the budget: the call as far as it went)
        assert content is None and reason == "length" and calls[0]["function"]["name"] == "get_weather"
        (item,) = _streamed(plan, text, "length")
        assert item["type"] == "function_call" and item["arguments"] == calls[0]["function"]["arguments"], item
