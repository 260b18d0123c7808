"""A forced call (``tool_choice: required``) on a model whose chat template has Hermes ``<tool_call>`` blocks (Qwen,
Hermes...): the answer is the grammar's ``{"name", "arguments"}`` object, never blocks, yet it was read as Hermes
blocks whenever its arguments held the literal text "<tool_call>" (a tool that writes docs or prompts). The call
came back with the outer object's "}" appended to its arguments (invalid JSON) and finish_reason "stop", whole and
streamed alike."""

from __future__ import annotations

import json
from types import SimpleNamespace

from gateway.tool_calls import ChoiceStream, plan_tools, shape_choices

NOTE = {"type": "function", "function": {"name": "write_note", "parameters": {
    "type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}
HERMES_TEMPLATE = "{% for m in messages %}...{% endfor %}<tool_call>"
ARGS = {"text": "Wrap each call in <tool_call></tool_call> tags."}


def test_a_required_call_whose_arguments_mention_tool_call_tags_is_that_call() -> None:
    plan = plan_tools(SimpleNamespace(tools=[NOTE, TIME], tool_choice="required", parallel_tool_calls=None),
                      HERMES_TEMPLATE)
    assert plan is not None and plan.mode == "required" and plan.hermes
    text = json.dumps({"name": "write_note", "arguments": ARGS})  # (the grammar's spacing: ", " and ": ")
    result = {"choices": [{"message": {"role": "assistant", "content": text}, "finish_reason": "stop"}]}
    shape_choices(plan, result)
    choice = result["choices"][0]
    (call,) = choice["message"]["tool_calls"]  # type: ignore[index]
    assert call["function"]["name"] == "write_note"
    assert json.loads(call["function"]["arguments"]) == ARGS, call
    assert choice["finish_reason"] == "tool_calls", choice

    for size in (1, 4, 9):
        stream = ChoiceStream(plan)
        deltas = [d for i in range(0, len(text), size) for d in stream.feed(text[i : i + size])]
        more, reason = stream.finish("stop")
        pieces = [c for d in deltas + more for c in d.get("tool_calls", [])]
        assert reason == "tool_calls", size
        assert {c["index"] for c in pieces} == {0}
        arguments = "".join(c["function"]["arguments"] for c in pieces)
        assert arguments == call["function"]["arguments"], (size, arguments)
