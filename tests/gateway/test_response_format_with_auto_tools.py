"""Review of 3b2bc2b (5): a response_format with tools under tool_choice auto is served again, its grammar the
format's; docs/api.md: "the model answers in the format and calls no tool"."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest

from gateway.api import Frontend, decode_body
from gateway.api_models import ChatCompletionRequest
from gateway.errors import BadRequest
from gateway.tokenizer import ByteTokenizer
from gateway.tool_calls import ChoiceStream, shape_choices

TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def _prepared(fmt: dict[str, Any]) -> Any:
    pytest.importorskip("llguidance")
    body = {"model": "sim", "messages": [{"role": "user", "content": "hi"}], "tools": [TOOL], "response_format": fmt,
            "stream": True}
    frontend = Frontend(None, ByteTokenizer(), "sim", 4096)  # type: ignore[arg-type]
    return frontend.prepare_chat(decode_body(msgspec.json.encode(body), ChatCompletionRequest))


def test_a_streamed_answer_in_the_format_is_not_held_to_its_end() -> None:
    """Every answer the format admits starts with "{", which under auto is held back as a possible call
    (``_CALL_START``) until the answer ends: a streamed structured answer (the Agents SDK's ``run_streamed`` with
    ``output_type`` + tools) arrives as one chunk at the end. The format's grammar makes a call impossible (this
    schema admits no "name"/"arguments"), so nothing needs holding."""
    schema = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"],
              "additionalProperties": False}
    prep = _prepared({"type": "json_schema", "json_schema": {"name": "Answer", "schema": schema, "strict": True}})
    assert prep.params.grammar is not None and prep.params.grammar.param.startswith("response_format")
    if prep.tools is None:
        return  # (served as plain chat: nothing held)
    stream = ChoiceStream(prep.tools)
    deltas = [d for piece in ['{"answer": "', "It is ", "sunny", '"}'] for d in stream.feed(piece)]
    assert deltas, "nothing of the structured answer streamed before its end"


def test_a_json_object_answer_is_not_read_as_a_tool_call() -> None:
    """``response_format: json_object`` + auto tools on a template without <tool_call> blocks (ByteTokenizer,
    SmolLM2): the tool note asks for ``{"name": ..., "arguments": ...}``, which json_object admits, and that answer
    is reported as a call (finish_reason tool_calls): docs/api.md says the model 'calls no tool'."""
    prep = _prepared({"type": "json_object"})
    if prep.tools is None:
        return
    text = json.dumps({"name": "get_weather", "arguments": {"city": "Paris"}})
    result = {"choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}]}
    shape_choices(prep.tools, result)
    assert result["choices"][0]["finish_reason"] == "stop" and "tool_calls" not in result["choices"][0]["message"], \
        result


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}],
                         ids=["required", "named"])
def test_a_forced_call_with_a_response_format_is_constrained_to_the_call(tool_choice: Any) -> None:
    """The Agents SDK sends its ``output_type`` as ``response_format`` with ``tool_choice: required`` (a forced
    first call): that was a 400. ``response_format`` shapes a message's content, which a forced call has none of
    (OpenAI, vLLM): the turn is constrained to the call, and its answer read as one."""
    pytest.importorskip("llguidance")
    schema = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}
    body = {"model": "sim", "messages": [{"role": "user", "content": "hi"}], "tools": [TOOL],
            "tool_choice": tool_choice, "response_format": {"type": "json_schema",
                                                            "json_schema": {"name": "Answer", "schema": schema}}}
    frontend = Frontend(None, ByteTokenizer(), "sim", 4096)  # type: ignore[arg-type]
    prep = frontend.prepare_chat(decode_body(msgspec.json.encode(body), ChatCompletionRequest))
    assert prep.tools is not None and prep.params.grammar is prep.tools.grammar, prep.params.grammar


def test_a_forced_call_with_a_regex_is_still_refused() -> None:
    """A regex constrains the whole output, a call's too: it cannot give way to the call's grammar."""
    pytest.importorskip("llguidance")
    body = {"model": "sim", "messages": [{"role": "user", "content": "hi"}], "tools": [TOOL],
            "tool_choice": "required", "regex": "[a-z]+"}
    frontend = Frontend(None, ByteTokenizer(), "sim", 4096)  # type: ignore[arg-type]
    with pytest.raises(BadRequest) as err:
        frontend.prepare_chat(decode_body(msgspec.json.encode(body), ChatCompletionRequest))
    assert err.value.param == "tool_choice"
