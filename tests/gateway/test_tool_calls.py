"""Unit tests of gateway/tool_calls.py: plans, answer parsing and the streamed deltas, text fed in pieces."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest

from gateway.api_models import ChatCompletionRequest
from gateway.errors import BadRequest
from gateway.tool_calls import ChoiceStream, parse_calls, plan_tools, shape_choices

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}
HERMES_TEMPLATE = "{% for m in messages %}...{% endfor %}<tool_call>"


def req(tools: Any = None, tool_choice: Any = None, parallel_tool_calls: bool | None = None) -> Any:
    return SimpleNamespace(tools=tools, tool_choice=tool_choice, parallel_tool_calls=parallel_tool_calls)


def feed(stream: ChoiceStream, text: str, finish: str = "stop", size: int = 3) -> tuple[list[dict[str, Any]], Any]:
    deltas: list[dict[str, Any]] = []
    for i in range(0, len(text), size):
        deltas += stream.feed(text[i : i + size])
    more, reason = stream.finish(finish)
    return deltas + more, reason


def merged_calls(deltas: list[dict[str, Any]]) -> dict[int, dict[str, str]]:
    calls: dict[int, dict[str, str]] = {}
    for delta in deltas:
        for call in delta.get("tool_calls", []):
            merged = calls.setdefault(call["index"], {"name": "", "arguments": "", "id": ""})
            merged["id"] = merged["id"] or call.get("id", "")
            merged["name"] += call["function"].get("name", "")
            merged["arguments"] += call["function"].get("arguments", "")
    return calls


def test_plans() -> None:
    pytest.importorskip("llguidance")
    assert plan_tools(req(), None) is None
    none = plan_tools(req([WEATHER], "none"), None)
    assert none is not None and none.mode == "none" and none.grammar is None
    auto = plan_tools(req([WEATHER]), HERMES_TEMPLATE)
    assert auto is not None and auto.mode == "auto" and auto.grammar is None and auto.hermes
    named = plan_tools(req([WEATHER, TIME], {"type": "function", "function": {"name": "get_weather"}}), None)
    assert named is not None and named.grammar is not None
    assert json.loads(named.grammar.source) == WEATHER["function"]["parameters"]  # type: ignore[index]
    required = plan_tools(req([WEATHER, TIME], "required"), None)
    assert required is not None and "anyOf" in json.loads(required.grammar.source)  # type: ignore[union-attr]
    for bad, param in [((None, "required"), "tool_choice"), (([WEATHER], "maybe"), "tool_choice"),
                       (([WEATHER], {"type": "function", "function": {"name": "x"}}), "tool_choice.function.name"),
                       (([{"type": "function", "function": {}}], None), "tools[0].function.name"),
                       (([WEATHER, WEATHER], None), "tools")]:
        with pytest.raises(BadRequest) as info:
            plan_tools(req(*bad), None)
        assert info.value.param == param


def test_streamed_required_call_equals_the_whole_answer() -> None:
    plan = plan_tools(req([WEATHER, TIME], "required"), None)
    assert plan is not None
    text = '{"name": "get_weather", "arguments": {"city": "Paris \\"15e\\""}}'
    deltas, reason = feed(ChoiceStream(plan), text)
    assert reason == "tool_calls"
    calls = merged_calls(deltas)
    assert list(calls) == [0] and calls[0]["name"] == "get_weather" and calls[0]["id"].startswith("call_")
    assert json.loads(calls[0]["arguments"]) == {"city": 'Paris "15e"'}
    assert len([d for d in deltas if "tool_calls" in d]) > 3, "arguments arrive in pieces"
    result = {"choices": [{"message": {"role": "assistant", "content": text}, "finish_reason": "stop"}]}
    shape_choices(plan, result)
    (whole,) = result["choices"][0]["message"]["tool_calls"]  # type: ignore[index]
    assert whole["function"]["arguments"] == calls[0]["arguments"]


def test_a_required_call_cut_before_its_arguments_streams_what_the_whole_answer_has() -> None:
    plan = plan_tools(req([WEATHER, TIME], "required"), None)
    assert plan is not None
    text = '{"name": "get_wea'
    deltas, reason = feed(ChoiceStream(plan), text, finish="length")
    result = {"choices": [{"message": {"role": "assistant", "content": text}, "finish_reason": "length"}]}
    shape_choices(plan, result)
    assert reason == "length" == result["choices"][0]["finish_reason"]
    assert "".join(d.get("content") or "" for d in deltas) == result["choices"][0]["message"]["content"] == text
    compact = '{"name":"get_time","arguments":{}}'  # not the grammar's spacing: still the call a whole answer has
    deltas, reason = feed(ChoiceStream(plan), compact)
    assert reason == "tool_calls" and merged_calls(deltas)[0]["name"] == "get_time"
    assert json.loads(merged_calls(deltas)[0]["arguments"]) == {}


def test_named_call_streams_its_arguments_and_a_cut_answer_keeps_length() -> None:
    plan = plan_tools(req([WEATHER], {"type": "function", "function": {"name": "get_weather"}}), None)
    assert plan is not None
    deltas, reason = feed(ChoiceStream(plan), '{"city": "Oslo"}')
    assert reason == "tool_calls" and merged_calls(deltas)[0]["arguments"] == '{"city": "Oslo"}'
    _, reason = feed(ChoiceStream(plan), '{"city": "Os', finish="length")
    assert reason == "length"


def whole(plan: Any, text: str, finish: str) -> dict[str, Any]:
    result = {"choices": [{"message": {"role": "assistant", "content": text}, "finish_reason": finish}]}
    shape_choices(plan, result)
    return result["choices"][0]  # type: ignore[no-any-return]


def test_a_forced_call_cut_short_is_not_reported_complete() -> None:
    """max_tokens cutting a forced call's arguments: the call as far as it went, streamed and whole alike, with
    finish_reason length, never tool_calls (its arguments do not parse). A stop string cutting it: no call at all
    (nothing would say its arguments were cut): its text is the content, finish_reason stop, streamed (the request
    has stop strings: ``hold``) and whole alike."""
    named = plan_tools(req([WEATHER], {"type": "function", "function": {"name": "get_weather"}}), None)
    required = plan_tools(req([WEATHER, TIME], "required"), None)
    assert named is not None and required is not None
    for plan, text, args in [(named, '{"city": "Paris"', '{"city": "Paris"'),
                             (required, '{"name": "get_weather", "arguments": {"city": "Pa', '{"city": "Pa')]:
        for hold in (False, True):
            plan.hold = hold
            deltas, reason = feed(ChoiceStream(plan), text, finish="length")
            choice = whole(plan, text, "length")
            assert reason == "length" == choice["finish_reason"], plan.mode
            assert merged_calls(deltas)[0]["arguments"] == args, plan.mode
            (call,) = choice["message"]["tool_calls"]
            assert call["function"] == {"name": "get_weather", "arguments": args}, plan.mode
        plan.hold = True
        for size in (1, 3, 7):
            deltas, reason = feed(ChoiceStream(plan), text, finish="stop", size=size)
            assert reason == "stop" and not merged_calls(deltas), (plan.mode, deltas)
            assert "".join(d.get("content") or "" for d in deltas) == text, (plan.mode, deltas)
        choice = whole(plan, text, "stop")
        assert choice["finish_reason"] == "stop" and choice["message"] == {"role": "assistant", "content": text}
        plan.hold = False
    complete = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    assert whole(required, complete, "stop")["finish_reason"] == "tool_calls"
    for plan, text in [(named, '{"city": "Paris"}'), (required, complete + "\n")]:  # held, whole: as it would be
        plan.hold = True
        deltas, reason = feed(ChoiceStream(plan), text, size=4)
        assert reason == "tool_calls" and json.loads(merged_calls(deltas)[0]["arguments"]) == {"city": "Paris"}
        assert next(d for d in deltas if "tool_calls" in d)["tool_calls"][0]["function"]["name"] == "get_weather"
        plan.hold = False
    # Cut right after a complete call (max_tokens ran out on its last token), or white space after it: the
    # streamed arguments are the call's, never with the outer object's closing brace
    for text, finish, reason in [(complete, "length", "length"), (complete + "\n", "stop", "tool_calls"),
                                 (complete + " \n", "length", "length")]:
        for size in (1, 3, 7):
            deltas, got = feed(ChoiceStream(required), text, finish=finish, size=size)
            choice = whole(required, text, finish)
            assert got == reason == choice["finish_reason"], (text, finish, size)
            assert merged_calls(deltas)[0]["arguments"] == '{"city": "Paris"}', (text, finish, size)
            assert json.loads(choice["message"]["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris"}


def test_tool_parameters_are_an_object_and_keep_their_references() -> None:
    """Parameters ``{}`` constrain the arguments to an object; a tool's ``$defs`` references (every pydantic
    model with an enum or a nested model) still resolve when ``required`` nests it in the call's schema."""
    pytest.importorskip("llguidance")
    anything = {"type": "function", "function": {"name": "lookup", "parameters": {}}}
    named = plan_tools(req([anything], {"type": "function", "function": {"name": "lookup"}}), None)
    assert named is not None and json.loads(named.grammar.source) == {"type": "object"}  # type: ignore[union-attr]
    with pytest.raises(BadRequest) as info:
        plan_tools(req([{"type": "function", "function": {"name": "s", "parameters": {"type": "string"}}}]), None)
    assert info.value.param == "tools[0].function.parameters"
    with pytest.raises(BadRequest):
        plan_tools(req([{"type": "function", "function": {"name": "s", "parameters": {"type": ["string", "null"]}}}]),
                   None)
    # An object that may also be null (as some schema generators write an optional model): the arguments
    # of a call are an object, so the schema is narrowed to one.
    nullable = {"type": "function", "function": {"name": "maybe", "parameters": {
        "type": ["object", "null"], "properties": {"q": {"type": "string"}}}}}
    plan = plan_tools(req([nullable], "required"), None)
    assert plan is not None and plan.grammar is not None
    arguments = json.loads(plan.grammar.source)["properties"]["arguments"]
    assert arguments == {"type": "object", "properties": {"q": {"type": "string"}}}
    item = {"type": "function", "function": {"name": "add_item", "parameters": {
        "type": "object", "properties": {"color": {"$ref": "#/$defs/Color"}, "next": {"$ref": "#"}},
        "required": ["color"], "$defs": {"Color": {"enum": ["red", "blue"]}}}}}
    for tools in ([item], [WEATHER, item]):
        plan = plan_tools(req(tools, "required"), None)
        assert plan is not None and plan.grammar is not None
        schema = json.loads(plan.grammar.source)
        option = schema["anyOf"][1] if len(tools) == 2 else schema
        root = "#/anyOf/1/properties/arguments" if len(tools) == 2 else "#/properties/arguments"
        props = option["properties"]["arguments"]["properties"]
        assert props == {"color": {"$ref": f"{root}/$defs/Color"}, "next": {"$ref": root}}


def test_auto_parses_the_models_own_format_and_streams_plain_text() -> None:
    plan = plan_tools(req([WEATHER, TIME]), HERMES_TEMPLATE)
    assert plan is not None
    text = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>\n'
            '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>')
    calls = parse_calls(plan, text)
    assert calls is not None and [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    deltas, reason = feed(ChoiceStream(plan), text)
    assert reason == "tool_calls" and [c["name"] for c in merged_calls(deltas).values()] == ["get_weather",
                                                                                             "get_time"]
    deltas, reason = feed(ChoiceStream(plan), "It is sunny in Rome.")
    assert reason == "stop" and "".join(d.get("content") or "" for d in deltas) == "It is sunny in Rome."
    assert len(deltas) > 2, "plain text streams as it comes"
    deltas, reason = feed(ChoiceStream(plan), "<tool_call>{not json</tool_call>")
    assert reason == "stop" and deltas[-1]["content"] == "<tool_call>{not json</tool_call>"
    assert parse_calls(plan, '{"name": "unknown", "arguments": {}}') is None


def test_parallel_tool_calls_false_answers_the_first_call_alone() -> None:
    """``parallel_tool_calls: false`` (OpenAI: at most one call): an answer with several blocks gives its first,
    whole and streamed alike; the default and true give them all. (It used to be ignored.)"""
    text = ('<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>\n'
            '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>')
    for parallel, names in ((False, ["get_weather"]), (True, ["get_weather", "get_time"]),
                            (None, ["get_weather", "get_time"])):
        plan = plan_tools(req([WEATHER, TIME], None, parallel), HERMES_TEMPLATE)
        assert plan is not None
        result: dict[str, Any] = {"choices": [{"message": {"role": "assistant", "content": text},
                                               "finish_reason": "stop"}]}
        shape_choices(plan, result)
        choice = result["choices"][0]
        assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == names
        assert choice["finish_reason"] == "tool_calls"
        deltas, reason = feed(ChoiceStream(plan), text)
        assert reason == "tool_calls" and [c["name"] for c in merged_calls(deltas).values()] == names
    with pytest.raises(msgspec.ValidationError):  # (a 400 naming it on the route)
        msgspec.convert({"messages": [], "parallel_tool_calls": "no"}, ChatCompletionRequest)


@pytest.mark.parametrize("size", [1, 3, 7])
@pytest.mark.parametrize(("text", "finish"), [
    ('Let me look that up. <tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>', "stop"),
    ('Two <tool words, then <tool_call>{"name": "get_time", "arguments": {}}</tool_call>\n', "stop"),
    ('Checking.\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>', "length"),
    ("Some text <tool_call>{broken</tool_call>", "stop"),
    ("Just an answer, with a < sign.", "stop"),
    # an answer that starts like a JSON call (held from its start), then text and a block: that text is content
    ('{"plan": 1} then\n<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>', "stop"),
    # the last block without its closing tag (the model ended there): a call that parses is kept...
    ('<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>\n'
     '<tool_call>\n{"name": "get_time", "arguments": {}}\n', "stop"),
    # ...one that does not makes the whole answer content (no call reported while one was lost)
    ('<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>\n<tool_call>{"name": "get_t',
     "stop"),
])
def test_auto_hermes_text_before_a_call_streams_as_the_whole_answer_has_it(text: str, finish: str, size: int) -> None:
    """Content before a ``<tool_call>`` block: the stream sends it as content and the call as tool_calls,
    exactly what the whole answer holds (content, calls, finish reason)."""
    plan = plan_tools(req([WEATHER, TIME]), HERMES_TEMPLATE)
    assert plan is not None
    deltas, reason = feed(ChoiceStream(plan), text, finish=finish, size=size)
    result: dict[str, Any] = {"choices": [{"message": {"role": "assistant", "content": text},
                                           "finish_reason": finish}]}
    shape_choices(plan, result)
    choice = result["choices"][0]
    assert reason == choice["finish_reason"]
    streamed = "".join(d.get("content") or "" for d in deltas)
    assert streamed == (choice["message"]["content"] or "")
    whole = [(c["function"]["name"], json.loads(c["function"]["arguments"]))
             for c in choice["message"].get("tool_calls", [])]
    assert [(c["name"], json.loads(c["arguments"])) for c in merged_calls(deltas).values()] == whole
    assert bool(whole) == (reason == "tool_calls")
    if text.startswith('{"plan"'):
        assert streamed == '{"plan": 1} then\n' and len(whole) == 1
    if text.endswith("{}}\n"):  # (the unclosed last call)
        assert [name for name, _ in whole] == ["get_weather", "get_time"]
    if text.endswith('"get_t'):
        assert not whole and streamed == text


@pytest.mark.parametrize("answer", ["<", "<tool", " <tool_c", "\n"])
def test_auto_an_answer_that_only_looked_like_a_call_start_is_not_lost(answer: str) -> None:
    """Held back while it could still become ``<tool_call>``, then the answer ended: it is the content."""
    for hermes in (HERMES_TEMPLATE, None):
        plan = plan_tools(req([WEATHER]), hermes)
        assert plan is not None
        deltas, reason = feed(ChoiceStream(plan), answer, size=1)
        assert reason == "stop" and "".join(d.get("content") or "" for d in deltas) == answer


def test_the_legacy_function_role_is_refused_pointing_at_tool() -> None:
    """Tool messages are supported now: a 'function' message's 400 says to use 'tool', not that tool calls
    are unsupported."""
    import msgspec

    from gateway.api import Frontend, decode_body
    from gateway.api_models import ChatCompletionRequest
    from gateway.tokenizer import ByteTokenizer

    frontend = Frontend(None, ByteTokenizer(), "sim", 4096)  # type: ignore[arg-type]
    body = {"messages": [{"role": "user", "content": "hi"}, {"role": "function", "content": "{}", "name": "f"}]}
    with pytest.raises(BadRequest) as info:
        frontend.prepare_chat(decode_body(msgspec.json.encode(body), ChatCompletionRequest))
    assert info.value.param == "messages[1].role"
    assert "use 'tool'" in info.value.message and "not supported" not in info.value.message


def test_streamed_logprobs_of_held_back_text_are_not_lost() -> None:
    """Every token's logprob entry reaches the client, also those of text held back (auto: an answer that
    starts like a call), as the whole response has them all."""
    import asyncio

    from gateway.tool_calls import tool_events

    plan = plan_tools(req([WEATHER]), None)
    pieces = ['{"name": ', '"get_weather", ', '"arguments": {"city": ', '"Rome"}}']

    class Frontend:
        async def run_choices(self, prep: Any, emitter: Any) -> Any:
            for i, piece in enumerate(pieces):
                state = SimpleNamespace(index=0, finish_reason="stop" if i == len(pieces) - 1 else None)
                yield state, piece, [{"token": piece, "logprob": -float(i)}]

    prep = SimpleNamespace(tools=plan, want_logprobs=True, include_usage=False, input_ids=[1])
    run = SimpleNamespace(prep=prep, frontend=Frontend())

    async def collect() -> list[dict[str, Any]]:
        return [c async for c in tool_events(run, lambda _run, choices, *_: choices, lambda *_: {})]

    chunks = asyncio.run(collect())
    entries = [e["token"] for c in chunks for choice in c for e in ((choice["logprobs"] or {}).get("content") or [])]
    assert entries == pieces
    assert chunks[-1][0]["finish_reason"] == "tool_calls"


def test_rebasing_moves_pointer_references_only() -> None:
    """``required`` nests each tool's parameters under the call's ``arguments``: references that are JSON
    pointers into the parameters move along; a plain-name anchor, a "$ref" inside data (``const``,
    ``default``...), and keys of name maps that happen to be keywords are left as they are."""
    from gateway.tool_calls import _rebased

    schema = {"type": "object",
              "properties": {"default": {"$ref": "#/$defs/X"}, "anchor": {"$ref": "#node"},
                             "fixed": {"const": {"$ref": "#/x"}}, "self": {"$ref": "#"}},
              "$defs": {"X": {"$anchor": "node", "default": {"$ref": "#"}, "items": [{"$ref": "#/$defs/X"}]}},
              "dependencies": {"default": {"$ref": "#/$defs/X"}, "anchor": ["self"]}}
    moved = _rebased(schema, "#/anyOf/1/properties/arguments")
    assert moved == {"type": "object",
                     "properties": {"default": {"$ref": "#/anyOf/1/properties/arguments/$defs/X"},
                                    "anchor": {"$ref": "#node"}, "fixed": {"const": {"$ref": "#/x"}},
                                    "self": {"$ref": "#/anyOf/1/properties/arguments"}},
                     "$defs": {"X": {"$anchor": "node", "default": {"$ref": "#"},
                                     "items": [{"$ref": "#/anyOf/1/properties/arguments/$defs/X"}]}},
                     "dependencies": {"default": {"$ref": "#/anyOf/1/properties/arguments/$defs/X"},
                                      "anchor": ["self"]}}


def test_a_required_call_with_non_ascii_arguments_reads_the_same_whole_and_streamed() -> None:
    """The arguments are the model's own text in both (a whole answer re-serialized them: "Z\\u00fcrich"
    against the stream's "Zürich"; a number such as 1e400 became Infinity, which is not JSON)."""
    plan = plan_tools(req([WEATHER, TIME], "required"), None)
    assert plan is not None
    text = '{"name": "get_weather", "arguments": {"city": "Zürich", "n": 1e400, "k": 1.50}}'
    deltas, reason = feed(ChoiceStream(plan), text)
    streamed = merged_calls(deltas)[0]["arguments"]
    result = {"choices": [{"message": {"role": "assistant", "content": text}, "finish_reason": "stop"}]}
    shape_choices(plan, result)
    (whole,) = result["choices"][0]["message"]["tool_calls"]  # type: ignore[index]
    assert reason == "tool_calls" and whole["function"]["arguments"] == streamed
    assert streamed == '{"city": "Zürich", "n": 1e400, "k": 1.50}'
    auto = plan_tools(req([WEATHER, TIME]), HERMES_TEMPLATE)
    assert auto is not None
    (call,) = parse_calls(auto, '<tool_call>{"arguments": {"city": "Zürich"}, "name": "get_weather"}</tool_call>') or []
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Zürich"}'}
    for not_a_call in ('{"name": "get_weather", "arguments": "{}"}', '{"name": 7, "arguments": {}}',
                       '["get_weather", {}]', '{"name": "get_weather"}'):
        assert parse_calls(auto, not_a_call) is None, not_a_call


def test_null_parameters_is_a_function_without_parameters() -> None:
    pytest.importorskip("llguidance")
    plan = plan_tools(req([{"type": "function", "function": {"name": "f", "description": None, "parameters": None}}],
                          "required"), None)
    assert plan is not None and plan.tools[0]["parameters"] == {"type": "object", "properties": {}}


def test_content_parts_render_as_their_text_with_tools() -> None:
    """A system message or an assistant's tool-calling turn given as content parts renders as its text, not
    as Python's printout of the list (templates without tools of their own get a system note)."""
    from gateway.tokenizer import ByteTokenizer
    from gateway.tool_calls import render_prompt

    tokenizer = ByteTokenizer()
    plan = plan_tools(req([TIME]), None)
    call = {"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}

    def prompt(system: Any, assistant: Any) -> str:
        messages = [{"role": "system", "content": system}, {"role": "user", "content": "hi"},
                    {"role": "assistant", "content": assistant, "tool_calls": [call]},
                    {"role": "tool", "tool_call_id": "c1", "content": "noon"}]
        return tokenizer.decode(render_prompt(tokenizer, messages, plan))

    as_strings = prompt("Be terse.", "Let me check.")
    assert as_strings == prompt([{"type": "text", "text": "Be terse."}],
                                [{"type": "text", "text": "Let me "}, {"type": "text", "text": "check."}])
    assert "Be terse.\n\nYou can call" in as_strings and "Let me check.\n{" in as_strings and "'type'" not in as_strings


def test_tool_choice_none_shows_the_tools_to_a_template_that_takes_them_and_reads_no_call() -> None:
    """As vLLM and OpenAI: the model sees the tools (the conversation may refer to them) but answers in text;
    a template without tools of its own gets no tool note (it would invite a call)."""
    from gateway.api import Frontend
    from gateway.api_models import ChatCompletionRequest
    from gateway.tokenizer import ByteTokenizer
    from gateway.tool_calls import render_prompt

    class TemplateWithTools(ByteTokenizer):
        chat_template = "{% if tools %}{{ tools }}{% endif %}{% for m in messages %}{{ m.content }}{% endfor %}"

        def __init__(self) -> None:
            self.given: list[Any] = []

        def apply_chat_template(self, messages: list[dict[str, Any]], tools: Any = None, **kwargs: Any) -> list[int]:
            self.given.append(tools)
            return super().apply_chat_template(messages, **kwargs)

    messages = [{"role": "user", "content": "What time is it?"}]
    native = TemplateWithTools()
    render_prompt(native, messages, plan_tools(req([TIME], "none"), native.chat_template))
    assert [t["function"]["name"] for t in native.given[0]] == ["get_time"]
    plain = ByteTokenizer()
    assert render_prompt(plain, messages, plan_tools(req([TIME], "none"), None)) == plain.apply_chat_template(messages)
    body = {"messages": messages, "tools": [TIME], "tool_choice": "none"}
    prepared = Frontend(None, native, "m", 4096).prepare_chat(  # type: ignore[arg-type]
        msgspec.convert(body, ChatCompletionRequest))
    assert prepared.tools is None and prepared.params.grammar is None and native.given[-1] is not None
