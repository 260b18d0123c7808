"""Review (openai SDK features): what ``client.chat.completions.parse`` and ``openai.pydantic_function_tool``
send, against what the gateway honours. Failing tests for the findings; no servers.

- ``strict: true`` on a tool is honoured only under a forced ``tool_choice`` (``required`` or named, where the
  grammar constrains the call). Under ``auto`` (the default, and what ``parse(tools=[...])`` sends) the flag is
  read and dropped: the schema is not even checked (a keyword the library lacks is a 400 under ``required``, a
  200 under ``auto``), and a call whose arguments do not validate is reported as that strict tool's call, on
  which the SDK's ``parse`` raises pydantic's ``ValidationError`` (OpenAI guarantees strict arguments validate).
- A structured output (``response_format``) next to tools under ``auto``: the grammar admits only the format,
  so no tool can ever be called; the request is silently answered as if it had no tools (the docs refuse the
  combination with ``required``/named, not with ``auto``).
"""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest

from gateway.api import Frontend, decode_body
from gateway.api_models import ChatCompletionRequest
from gateway.errors import BadRequest
from gateway.tokenizer import ByteTokenizer
from gateway.tool_calls import plan_tools, shape_choices

openai = pytest.importorskip("openai")
pydantic = pytest.importorskip("pydantic")


class GetWeather(pydantic.BaseModel):  # type: ignore[misc, name-defined]
    city: str
    days: int


def _request(body: dict[str, Any]) -> ChatCompletionRequest:
    return decode_body(msgspec.json.encode(body), ChatCompletionRequest)  # type: ignore[no-any-return]


def _strict_tool_with(keyword: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "function": {"name": "tag", "strict": True, "parameters": {
        "type": "object", "additionalProperties": False, "required": ["tags"],
        "properties": {"tags": {"type": "array", "items": {"type": "string"}, **keyword}}}}}


@pytest.mark.parametrize("tool_choice", ["auto", None, "required"])
def test_a_strict_tool_schema_the_library_rejects_is_a_400_whatever_the_tool_choice(tool_choice: Any) -> None:
    """``strict: true`` asks for arguments valid against the schema; a schema the gateway cannot enforce is refused
    under ``required`` (400 naming ``tools``) and must not be accepted silently under ``auto``."""
    pytest.importorskip("llguidance")
    body: dict[str, Any] = {"messages": [{"role": "user", "content": "hi"}],
                            "tools": [_strict_tool_with({"uniqueItems": True})]}
    if tool_choice is not None:
        body["tool_choice"] = tool_choice
    with pytest.raises(BadRequest) as caught:
        plan_tools(_request(body), None)
    assert (caught.value.param or "").startswith("tools"), caught.value.param


def test_an_auto_call_to_a_strict_tool_parses_in_the_sdk() -> None:
    """The SDK's ``chat.completions.parse(tools=[pydantic_function_tool(M)])`` (tool_choice auto) validates every
    call of a strict tool with ``M.model_validate_json``. An auto answer whose arguments do not validate against
    the strict schema (here ``days`` a string) is shaped into that tool's call anyway, and the SDK raises."""
    from openai.lib._parsing._completions import parse_chat_completion
    from openai.types.chat import ChatCompletion

    tool = openai.pydantic_function_tool(GetWeather)
    plan = plan_tools(_request({"messages": [{"role": "user", "content": "hi"}], "tools": [tool]}), None)
    assert plan is not None and plan.mode == "auto"
    text = '{"name": "GetWeather", "arguments": {"city": "Paris", "days": "three"}}'
    result: dict[str, Any] = {
        "id": "chatcmpl-x", "object": "chat.completion", "created": 0, "model": "m",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                     "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}
    shape_choices(plan, result)
    completion = ChatCompletion.model_validate(result)
    # (either the call is not reported as GetWeather's, or its arguments validate: never an exception)
    parse_chat_completion(response_format=openai.NOT_GIVEN, input_tools=[tool], chat_completion=completion)


def test_structured_output_with_auto_tools_constrains_the_answer_to_the_format() -> None:
    """``parse(response_format=Answer, tools=[...])`` (the Agents SDK's output_type + tools, tool_choice unset): the
    format's grammar constrains the answer, so the model answers in the format and calls no tool (as vLLM does;
    docs/api.md says so). Refusing it (a 400) broke such agents outright; a grammar admitting "a call or the
    format" is not built yet. The request is served, its grammar the format's."""
    pytest.importorskip("llguidance")
    from openai.lib._parsing._completions import type_to_response_format_param

    class Answer(pydantic.BaseModel):  # type: ignore[misc, name-defined]
        answer: str

    body = {"messages": [{"role": "user", "content": "Weather in Paris?"}],
            "tools": [openai.pydantic_function_tool(GetWeather)],
            "response_format": type_to_response_format_param(Answer)}
    frontend = Frontend(None, ByteTokenizer(), "sim", 4096)  # type: ignore[arg-type]
    prepared = frontend.prepare_chat(_request(body))
    grammar = prepared.params.grammar
    assert grammar is not None and grammar.param.startswith("response_format"), grammar
    assert "answer" in json.loads(grammar.source)["properties"]


def test_an_auto_call_to_a_strict_tool_whose_arguments_fit_is_a_call() -> None:
    tool = openai.pydantic_function_tool(GetWeather)
    plan = plan_tools(_request({"messages": [{"role": "user", "content": "hi"}], "tools": [tool]}), None)
    assert plan is not None and plan.validators is not None and "GetWeather" in plan.validators
    text = '{"name": "GetWeather", "arguments": {"city": "Paris", "days": 3}}'
    result: dict[str, Any] = {"choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                           "logprobs": None, "finish_reason": "stop"}]}
    shape_choices(plan, result)
    message = result["choices"][0]
    assert message["finish_reason"] == "tool_calls", message
    assert json.loads(message["message"]["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris", "days": 3}
