"""``grammar_for``'s short path (``_none_set``: one C call when a request sets no structured-output
field) must agree with its full look-up: every field the look-up reads is in ``_FIELDS``, and setting
any of them on any route's request takes the full path."""

from __future__ import annotations

from typing import Any

import pytest

from gateway import structured_output
from gateway.api_models import ChatCompletionRequest, CompletionRequest, GenerateSampling
from gateway.errors import BadRequest


class _Recorder:
    """Not a struct (so the full look-up runs); records every attribute read, all unset."""

    def __init__(self) -> None:
        self.read: set[str] = set()

    def __getattr__(self, name: str) -> Any:
        self.read.add(name)
        return None


def test_every_field_the_full_look_up_reads_is_in_the_short_paths_list() -> None:
    recorder = _Recorder()
    assert structured_output.grammar_for(recorder) is None
    assert recorder.read, "the full look-up read nothing: the recorder is not exercising it"
    assert recorder.read <= set(structured_output._FIELDS), recorder.read - set(structured_output._FIELDS)


@pytest.mark.parametrize("kind", [ChatCompletionRequest, CompletionRequest, GenerateSampling],
                         ids=lambda k: k.__name__)
def test_setting_any_field_takes_the_full_path(kind: type) -> None:
    base: dict[str, Any] = {"messages": []} if kind is ChatCompletionRequest else {}
    assert structured_output.grammar_for(kind(**base)) is None
    fields = [name for name in structured_output._FIELDS if name in kind.__struct_fields__]
    assert len(fields) >= 3, fields
    for name in fields:
        request = kind(**base, **{name: 12345})  # (a struct built in code is not validated: a bad value)
        with pytest.raises(BadRequest) as caught:
            structured_output.grammar_for(request)
        assert name in (caught.value.param or ""), (name, caught.value.param)


def _deep_schema(levels: int) -> str:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}}
    import json
    import sys

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(levels * 4 + 1000)  # (to write it; the gateway reads it under the default limit)
    try:
        return json.dumps(schema)
    finally:
        sys.setrecursionlimit(limit)


@pytest.mark.parametrize("field", ["guided_json", "json_schema", "response_format"])
def test_a_schema_text_nested_too_deeply_is_a_400_naming_it(field: str) -> None:
    text = _deep_schema(2000)
    value: Any = text if field != "response_format" else {"type": "json_schema",
                                                          "json_schema": {"name": "x", "schema": text}}
    with pytest.raises(BadRequest) as err:
        structured_output.grammar_for(ChatCompletionRequest(messages=[], **{field: value}))
    assert "nested too deeply" in err.value.message
    assert err.value.param == (field if field != "response_format" else "response_format.json_schema.schema")


@pytest.mark.parametrize("strict", ["false", 1, {}])
def test_a_strict_that_is_not_a_boolean_is_a_400(strict: Any) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}, "strict": strict}}
    with pytest.raises(BadRequest) as err:
        structured_output.grammar_for(ChatCompletionRequest(messages=[], response_format=fmt))
    assert err.value.param == "response_format.json_schema.strict"


def test_strict_true_false_and_null_are_read_as_they_say() -> None:
    for strict, want in ((True, True), (False, False), (None, False)):
        fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}, "strict": strict}}
        grammar = structured_output.grammar_for(ChatCompletionRequest(messages=[], response_format=fmt))
        assert grammar is not None and grammar.strict is want


@pytest.mark.parametrize("field", ["response_format", "regex", "tool"])
def test_a_grammar_past_its_bound_is_a_400_naming_its_field(field: str) -> None:
    """Each of a request's n choices carries its grammar's text to both of its workers: a 3 MB schema with
    n=64 made ~180 MB of frames, past the worker connections' unread limit, which the gateway then dropped
    with every request open on them. Past ``MAX_GRAMMAR_CHARS``: a 400 naming the field; at it, accepted
    by the bound (the library then judges it)."""
    from gateway.tool_calls import plan_tools

    bound = structured_output.MAX_GRAMMAR_CHARS

    def schema(size: int) -> dict[str, Any]:  # (a JSON text of exactly ``size`` characters)
        base = {"type": "object", "description": ""}
        base["description"] = "d" * (size - len(structured_output._schema_text(base, "x")))
        return base

    def run(size: int) -> Any:
        if field == "response_format":
            fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema(size)}}
            return structured_output.grammar_for(ChatCompletionRequest(messages=[], response_format=fmt))
        if field == "regex":
            return structured_output.grammar_for(CompletionRequest(prompt="p", regex="a" * size))
        tools = [{"type": "function", "function": {"name": "f", "parameters": schema(size)}}]
        return plan_tools(ChatCompletionRequest(messages=[], tools=tools,
                                                tool_choice={"type": "function", "function": {"name": "f"}}), None)

    with pytest.raises(BadRequest) as err:
        run(bound + 1)
    assert "too large" in err.value.message and err.value.param in (
        "response_format.json_schema.schema", "regex", "tools[0].function.parameters"), err.value
    try:
        run(bound)
    except BadRequest as exc:
        assert "too large" not in exc.message
