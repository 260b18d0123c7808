"""Structured output and tool calls through real P->D processes with SmolLM2.

The prefill samples the first token under the grammar; the decode rebuilds the matcher, advances it by
that token and continues. Greedy answers through P->D equal those of a ``--role both`` worker, streamed
or not; a grammar the library rejects is a 400 naming the field and no KV page is ever taken. A forced
tool call (named, or ``required``) is constrained to the function's parameters, so even this small
model answers with arguments that validate; streamed, they arrive as OpenAI ``tool_calls`` deltas.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from pdtest import Procs, SmolDeployment, start_smollm2, wait_pools_full

pytestmark = pytest.mark.slow
pytest.importorskip("llguidance")
jsonschema_rs = pytest.importorskip("jsonschema_rs")

CITY_SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 24},
        "country": {"type": "string", "maxLength": 24},
        "population_millions": {"type": "integer", "minimum": 0, "maximum": 100},
    },
    "required": ["city", "country", "population_millions"],
    "additionalProperties": False,
}
CITY_FORMAT = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY_SCHEMA, "strict": True}}
CITY_QUESTION = "Give the capital of France as JSON with its country and population in millions."
REGEX = r"The capital of France is (Paris|Lyon|Nice)\."


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SmolDeployment]:
    procs = Procs(tmp_path_factory.mktemp("structured"))
    try:
        yield start_smollm2(procs, chunk_size=64)
    finally:
        procs.stop_all()


def client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=180)


def chat(base: str, question: str, **kw: Any) -> Any:
    return client(base).chat.completions.create(model="default", messages=[{"role": "user", "content": question}],
                                                **kw)


def streamed_chat(base: str, question: str, **kw: Any) -> tuple[str, str | None]:
    chunks = list(chat(base, question, stream=True, **kw))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    finish = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    return text, finish[-1] if finish else None


def generate(base: str, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(f"{base}/generate", json=body, timeout=180)
    assert r.status_code == 200, r.text
    return r.json()  # type: ignore[no-any-return]


def generate_streamed(base: str, body: dict[str, Any]) -> str:
    text = ""
    with httpx.stream("POST", f"{base}/generate", json={**body, "stream": True}, timeout=180) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text = json.loads(line[6:])["text"]  # SGLang streams the text so far
    return text


def test_json_schema_answer_parses_validates_and_crosses_the_split(deployment: SmolDeployment) -> None:
    kw = {"max_tokens": 60, "temperature": 0, "response_format": CITY_FORMAT}
    pd = chat(deployment.pd_url, CITY_QUESTION, **kw)
    text = pd.choices[0].message.content
    jsonschema_rs.validate(CITY_SCHEMA, json.loads(text))
    assert pd.choices[0].finish_reason == "stop"
    both = chat(deployment.both_url, CITY_QUESTION, **kw)
    assert both.choices[0].message.content == text, "P->D equals one worker, token for token"
    assert pd.usage.completion_tokens == both.usage.completion_tokens
    assert streamed_chat(deployment.pd_url, CITY_QUESTION, **kw) == (text, "stop")


def test_json_object_mode(deployment: SmolDeployment) -> None:
    kw = {"max_tokens": 60, "temperature": 0, "response_format": {"type": "json_object"}}
    pd = chat(deployment.pd_url, "Describe a cat as a JSON object with two fields.", **kw)
    text = pd.choices[0].message.content
    assert pd.choices[0].finish_reason == "stop", text
    assert isinstance(json.loads(text), dict)


def test_regex_generate_crosses_the_split(deployment: SmolDeployment) -> None:
    body = {"text": "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
            "sampling_params": {"max_new_tokens": 20, "temperature": 0, "regex": REGEX}}
    pd = generate(deployment.pd_url, body)
    assert re.fullmatch(REGEX, pd["text"]), pd["text"]
    assert pd["meta_info"]["finish_reason"]["type"] == "stop"
    assert generate(deployment.both_url, body)["text"] == pd["text"]
    assert generate_streamed(deployment.pd_url, body) == pd["text"]
    completion = client(deployment.pd_url).completions.create(  # the same field on /v1/completions
        model="default", prompt=body["text"], max_tokens=20, temperature=0, extra_body={"regex": REGEX})
    assert completion.choices[0].text == pd["text"]


def test_ebnf_generate(deployment: SmolDeployment) -> None:
    ebnf = 'root ::= "Answer: " ("yes" | "no") "."'
    body = {"text": "Is Paris in France? ", "sampling_params": {"max_new_tokens": 10, "temperature": 0.7,
                                                                  "sampling_seed": 3, "ebnf": ebnf}}
    pd = generate(deployment.pd_url, body)
    assert re.fullmatch(r"Answer: (yes|no)\.", pd["text"]), pd["text"]
    assert generate(deployment.both_url, body)["text"] == pd["text"], "seeded sampling: P->D equals one worker"


def test_vllm_structured_output_fields(deployment: SmolDeployment) -> None:
    """vLLM's spellings (``guided_*`` and ``structured_outputs``) constrain as SGLang's do; a choice
    with the regex syntax's own characters is matched literally; completions take response_format."""
    question = "What is the capital of France? Answer in one word."
    choices = ["Paris (FR)", "Lyon.", "a+b?"]
    kw: dict[str, Any] = {"max_tokens": 12, "temperature": 0}
    for extra in ({"guided_choice": choices}, {"structured_outputs": {"choice": choices}}):
        answer = chat(deployment.pd_url, question, extra_body=extra, **kw).choices[0].message.content
        assert answer in choices, (extra, answer)
    regex = chat(deployment.pd_url, "What is the capital of France?", **kw,
                 extra_body={"guided_regex": REGEX}).choices[0].message.content
    assert re.fullmatch(REGEX, regex), regex
    assert chat(deployment.pd_url, "What is the capital of France?", **kw,
                extra_body={"structured_outputs": {"regex": REGEX}}).choices[0].message.content == regex
    kw["max_tokens"] = 60
    for extra in ({"guided_json": CITY_SCHEMA}, {"structured_outputs": {"json": CITY_SCHEMA}}):
        text = chat(deployment.pd_url, CITY_QUESTION, extra_body=extra, **kw).choices[0].message.content
        jsonschema_rs.validate(CITY_SCHEMA, json.loads(text))
    grammar = 'root ::= "Answer: " ("yes" | "no") "."'
    said = chat(deployment.pd_url, "Is Paris in France?", extra_body={"guided_grammar": grammar},
                **kw).choices[0].message.content
    assert re.fullmatch(r"Answer: (yes|no)\.", said), said
    completion = client(deployment.pd_url).completions.create(
        model="default", prompt="A cat, as a JSON object:", extra_body={"response_format": {"type": "json_object"}},
        max_tokens=60, temperature=0)
    assert isinstance(json.loads(completion.choices[0].text), dict), completion.choices[0].text
    for extra, param in (({"guided_choice": []}, "guided_choice"),
                         ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag"),
                         ({"guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
                         ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex")):
        r = httpx.post(f"{deployment.pd_url}/v1/chat/completions", timeout=60,
                       json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **extra})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (extra, r.text)


def test_rejected_grammars_are_a_400_naming_the_field(deployment: SmolDeployment) -> None:
    cases = [
        ("/generate", {"text": "hi", "sampling_params": {"regex": "(unclosed"}}, "sampling_params.regex"),
        ("/generate", {"text": "hi", "sampling_params": {"ebnf": "root ::= ("}}, "sampling_params.ebnf"),
        ("/generate", {"text": "hi", "sampling_params": {"json_schema": "{nope"}}, "sampling_params.json_schema"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "response_format": {
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {
                "a": {"type": "no-such-type"}}}}}}, "response_format.json_schema.schema"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                  "response_format": {"type": "xml"}}, "response_format.type"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "regex": "a+",
                                  "response_format": {"type": "json_object"}}, "regex"),
    ]
    for route, body, param in cases:
        r = httpx.post(f"{deployment.pd_url}{route}", json={**body, "max_tokens": 4}, timeout=60)
        assert r.status_code == 400, (route, body, r.text)
        err = r.json()["error"]
        assert err["param"] == param and err["type"] == "invalid_request_error", (body, err)
    # Compiled, but past what the matcher can follow (its lexer's limits, met at the first token): a 400
    # naming the field, not an empty answer whose finish reason says it ended.
    r = httpx.post(f"{deployment.pd_url}/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "guided_regex": "a{99999999}"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "guided_regex" and "could not be followed" in r.json()["error"]["message"]


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.", "strict": True,
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 24},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
TIME_TOOL = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}},
                   "required": ["city"], "additionalProperties": False}}}
WEATHER_QUESTION = "What is the weather like in Paris right now?"


def _streamed_calls(chunks: list[Any]) -> tuple[dict[int, dict[str, Any]], str | None]:
    """Tool-call deltas merged by index, as OpenAI clients do; and the finish reason."""
    calls: dict[int, dict[str, Any]] = {}
    finish = None
    for ch in chunks:
        if not ch.choices:
            continue
        delta = ch.choices[0].delta
        for call in delta.tool_calls or []:
            merged = calls.setdefault(call.index, {"id": None, "name": "", "arguments": ""})
            merged["id"] = merged["id"] or call.id
            if call.function and call.function.name:
                merged["name"] += call.function.name
            if call.function and call.function.arguments:
                merged["arguments"] += call.function.arguments
        finish = ch.choices[0].finish_reason or finish
    return calls, finish


@pytest.mark.parametrize("tool_choice", [{"type": "function", "function": {"name": "get_weather"}}, "required"])
def test_forced_tool_call_validates_across_the_split(deployment: SmolDeployment, tool_choice: Any) -> None:
    kw = {"max_tokens": 40, "temperature": 0, "tools": [WEATHER_TOOL, TIME_TOOL], "tool_choice": tool_choice}
    pd = chat(deployment.pd_url, WEATHER_QUESTION, **kw)
    choice = pd.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    if isinstance(tool_choice, dict):
        assert call.function.name == "get_weather"
    schema = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER_TOOL, TIME_TOOL)}
    jsonschema_rs.validate(schema[call.function.name], json.loads(call.function.arguments))
    both = chat(deployment.both_url, WEATHER_QUESTION, **kw).choices[0].message.tool_calls
    assert [(c.function.name, c.function.arguments) for c in both] == [(call.function.name, call.function.arguments)]
    calls, finish = _streamed_calls(list(chat(deployment.pd_url, WEATHER_QUESTION, stream=True, **kw)))
    assert finish == "tool_calls" and list(calls) == [0]
    assert calls[0]["name"] == call.function.name and calls[0]["arguments"] == call.function.arguments
    assert calls[0]["id"].startswith("call_")


def test_auto_tool_choice_crosses_the_split(deployment: SmolDeployment) -> None:
    """Unconstrained: the answer is a call only when the model wrote one; P->D equals one worker either way."""
    kw = {"max_tokens": 40, "temperature": 0, "tools": [WEATHER_TOOL, TIME_TOOL]}
    pd = chat(deployment.pd_url, WEATHER_QUESTION, **kw).choices[0]
    both = chat(deployment.both_url, WEATHER_QUESTION, **kw).choices[0]
    assert pd.message.content == both.message.content and pd.finish_reason == both.finish_reason

    def calls(choice: Any) -> list[tuple[str, str]]:
        return [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]

    assert calls(pd) == calls(both)
    if pd.message.tool_calls:
        assert pd.finish_reason == "tool_calls" and pd.message.content is None
        assert all(isinstance(json.loads(arguments), dict) for _, arguments in calls(pd))
    else:
        assert pd.message.content
    streamed = list(chat(deployment.pd_url, WEATHER_QUESTION, stream=True, **kw))
    merged, finish = _streamed_calls(streamed)
    assert finish == pd.finish_reason
    assert [(c["name"], c["arguments"]) for c in merged.values()] == calls(pd)
    text = "".join(ch.choices[0].delta.content or "" for ch in streamed if ch.choices)
    assert text == (pd.message.content or "")


def test_tool_results_continue_the_conversation(deployment: SmolDeployment) -> None:
    messages = [
        {"role": "user", "content": WEATHER_QUESTION},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21, "sky": "sunny"}'},
    ]
    c = client(deployment.pd_url)
    out = c.chat.completions.create(model="default", messages=messages, tools=[WEATHER_TOOL], tool_choice="none",
                                    max_tokens=24, temperature=0)
    assert out.choices[0].finish_reason in ("stop", "length") and out.choices[0].message.content
    r = httpx.post(f"{deployment.pd_url}/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "tool", "tool_call_id": "x", "content": "21"}], "max_tokens": 4})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].role"
    for bad, param in [({"tool_choice": {"type": "function", "function": {"name": "nope"}}},
                        "tool_choice.function.name"),
                       ({"tool_choice": "sometimes"}, "tool_choice"),
                       ({"tools": [{"type": "retrieval"}]}, "tools[0].type")]:
        body = {"messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER_TOOL], "max_tokens": 4, **bad}
        r = httpx.post(f"{deployment.pd_url}/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_pools_back_to_full(deployment: SmolDeployment) -> None:
    wait_pools_full(deployment.workers, 30)


def test_responses_api_text_format_is_structured_output(deployment: SmolDeployment) -> None:
    """``/v1/responses``' flat ``text.format`` json_schema constrains the answer as chat's ``response_format`` does:
    the same greedy text, which the SDK's ``responses.parse`` reads into the caller's model."""
    from pydantic import BaseModel, Field

    class City(BaseModel):
        city: str = Field(max_length=24)
        country: str = Field(max_length=24)
        population_millions: int = Field(ge=0, le=100)

    kw = {"max_tokens": 60, "temperature": 0, "response_format": CITY_FORMAT}
    expected = chat(deployment.pd_url, CITY_QUESTION, **kw).choices[0].message.content
    fmt = {"type": "json_schema", "name": "city", "schema": CITY_SCHEMA, "strict": True}
    response = client(deployment.pd_url).responses.create(model="default", input=CITY_QUESTION, temperature=0,
                                                          max_output_tokens=60, text={"format": fmt})
    assert response.status == "completed" and response.output_text == expected
    assert response.text is not None and response.text.format.type == "json_schema"
    parsed = client(deployment.pd_url).responses.parse(model="default", input=CITY_QUESTION, temperature=0,
                                                       max_output_tokens=60, text_format=City)
    assert isinstance(parsed.output_parsed, City), parsed.output_text
    jsonschema_rs.validate(CITY_SCHEMA, json.loads(parsed.output_text))
    wait_pools_full(deployment.workers)


RESPONSE_TOOLS = [{"type": "function", **t["function"]} for t in (WEATHER_TOOL, TIME_TOOL)]  # (flat, as /v1/responses)


@pytest.mark.parametrize("tool_choice", [{"type": "function", "name": "get_weather"}, "required"])
def test_responses_api_forced_function_call(deployment: SmolDeployment, tool_choice: Any) -> None:
    """``/v1/responses`` with function tools runs chat's: a forced call is chat's call, as a ``function_call`` output
    item (whole, and streamed as its arguments come); its output fed back continues as chat's conversation does."""
    chat_choice = {"type": "function", "function": {"name": tool_choice["name"]}} \
        if isinstance(tool_choice, dict) else tool_choice
    expected = chat(deployment.pd_url, WEATHER_QUESTION, max_tokens=40, temperature=0, tools=[WEATHER_TOOL, TIME_TOOL],
                    tool_choice=chat_choice).choices[0].message.tool_calls[0]
    c = client(deployment.pd_url)
    kw: dict[str, Any] = {"model": "default", "input": WEATHER_QUESTION, "max_output_tokens": 40, "temperature": 0,
                          "tools": RESPONSE_TOOLS, "tool_choice": tool_choice}
    whole = c.responses.create(**kw)
    assert whole.status == "completed" and [t.name for t in whole.tools] == ["get_weather", "get_time"]
    (call,) = [item for item in whole.output if item.type == "function_call"]
    assert (call.name, call.arguments) == (expected.function.name, expected.function.arguments)
    assert call.call_id.startswith("call_") and call.id.startswith("fc_") and call.status == "completed"
    events = list(c.responses.create(**kw, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"], kinds
    assert kinds[-3:] == ["response.function_call_arguments.done", "response.output_item.done",
                          "response.completed"], kinds
    streamed = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert streamed == events[-3].arguments == call.arguments  # type: ignore[union-attr]
    final_calls = [item for item in events[-1].response.output if item.type == "function_call"]  # type: ignore[union-attr]
    assert [(f.name, f.arguments) for f in final_calls] == [(call.name, call.arguments)]
    with c.responses.stream(**kw) as stream:  # the SDK's accumulator (it checks item ids and indexes as it goes)
        for _ in stream:
            pass
        assembled = stream.get_final_response()
    assert [(f.name, f.arguments) for f in assembled.output if f.type == "function_call"] == \
        [(call.name, call.arguments)]

    # the call and its result fed back: the answer chat gives the same conversation
    result = '{"temperature": 21, "sky": "sunny"}'
    messages = [{"role": "user", "content": WEATHER_QUESTION},
                {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
                    "name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": result}]
    as_chat = client(deployment.pd_url).chat.completions.create(
        model="default", messages=messages, tools=[WEATHER_TOOL], tool_choice="none", max_tokens=24, temperature=0)
    follow = c.responses.create(model="default", tools=[RESPONSE_TOOLS[0]], tool_choice="none", max_output_tokens=24,
                                temperature=0, input=[
                                    {"role": "user", "content": WEATHER_QUESTION},
                                    {"type": "function_call", "call_id": "call_1", "name": "get_weather",
                                     "arguments": '{"city": "Paris", "unit": "celsius"}'},
                                    {"type": "function_call_output", "call_id": "call_1", "output": result}])
    assert follow.output_text == as_chat.choices[0].message.content and follow.output_text
    wait_pools_full(deployment.workers)


def test_responses_api_auto_tools_answer_as_chat(deployment: SmolDeployment) -> None:
    """Unconstrained (``auto``): whatever the model wrote, the Responses answer is chat's (text, or calls)."""
    pd = chat(deployment.pd_url, WEATHER_QUESTION, max_tokens=40, temperature=0,
              tools=[WEATHER_TOOL, TIME_TOOL]).choices[0]
    c = client(deployment.pd_url)
    kw: dict[str, Any] = {"model": "default", "input": WEATHER_QUESTION, "max_output_tokens": 40, "temperature": 0,
                          "tools": RESPONSE_TOOLS}
    for response in (c.responses.create(**kw), list(c.responses.create(**kw, stream=True))[-1].response):
        calls = [(i.name, i.arguments) for i in response.output if i.type == "function_call"]
        assert calls == [(t.function.name, t.function.arguments) for t in pd.message.tool_calls or []]
        assert response.output_text == (pd.message.content or "")
