"""A forced call (``tool_choice`` named or ``required``) that a stop string cuts is no call: its text comes back as
the content with ``finish_reason: "stop"``, streamed and whole alike. It came back as ``tool_calls[0]`` with
arguments such as ``{"`` (which do not parse) and ``finish_reason: "stop"``: nothing said the call was cut, and an
agent loop would run it. A call the stop strings do not cut is the call it was, its arguments streamed."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from pdtest import Procs, SmolDeployment, start_smollm2, wait_pools_full

pytestmark = pytest.mark.slow
pytest.importorskip("llguidance")

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 24}}, "required": ["city"],
    "additionalProperties": False}}}
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SmolDeployment]:
    procs = Procs(tmp_path_factory.mktemp("forced_stop"))
    try:
        yield start_smollm2(procs, chunk_size=64)
    finally:
        procs.stop_all()


def _body(**fields: Any) -> dict[str, Any]:
    return {"model": "default", "temperature": 0, "max_tokens": 48, "tools": [WEATHER],
            "messages": [{"role": "user", "content": "What is the weather like in Paris?"}], **fields}


def _whole(url: str, **fields: Any) -> dict[str, Any]:
    r = httpx.post(f"{url}/v1/chat/completions", json=_body(**fields), timeout=180)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]  # type: ignore[no-any-return]


def _streamed(url: str, **fields: Any) -> tuple[str, dict[str, str], str | None]:
    """(the content, the call's merged name and arguments, the finish reason) of a streamed answer."""
    content, call, finish = "", {"name": "", "arguments": ""}, None
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=_body(stream=True, **fields), timeout=180) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            for choice in json.loads(line[6:])["choices"]:
                delta = choice["delta"]
                content += delta.get("content") or ""
                for piece in delta.get("tool_calls") or ():
                    call["name"] += piece["function"].get("name") or ""
                    call["arguments"] += piece["function"].get("arguments") or ""
                finish = choice["finish_reason"] or finish
    return content, call, finish


@pytest.mark.parametrize(("choice", "stop"), [(NAMED, '"'), ("required", "Paris"), ("required", ["zz", '"city'])])
def test_a_forced_call_cut_by_a_stop_string_is_content(deployment: SmolDeployment, choice: Any, stop: Any) -> None:
    whole = _whole(deployment.pd_url, tool_choice=choice, stop=stop)
    assert whole["finish_reason"] == "stop", whole
    assert "tool_calls" not in whole["message"] or not whole["message"]["tool_calls"], whole
    text = whole["message"]["content"]
    assert isinstance(text, str) and text.startswith("{"), whole  # (the call's text as far as it went)
    content, call, finish = _streamed(deployment.pd_url, tool_choice=choice, stop=stop)
    assert (content, finish) == (text, "stop") and call == {"name": "", "arguments": ""}, (content, call, finish)


@pytest.mark.parametrize("choice", [NAMED, "required"])
def test_a_call_the_stop_strings_do_not_cut_is_the_call(deployment: SmolDeployment, choice: Any) -> None:
    whole = _whole(deployment.pd_url, tool_choice=choice, stop=["never-in-the-answer"])
    assert whole["finish_reason"] == "tool_calls", whole
    (call,) = whole["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather" and isinstance(json.loads(call["function"]["arguments"]), dict)
    content, streamed, finish = _streamed(deployment.pd_url, tool_choice=choice, stop=["never-in-the-answer"])
    assert finish == "tool_calls" and content == ""
    assert streamed == {"name": "get_weather", "arguments": call["function"]["arguments"]}
    # max_tokens cutting it (no stop string): the call as far as it went, finish_reason length, as before
    cut = _whole(deployment.pd_url, tool_choice=choice, max_tokens=12 if choice == "required" else 3)
    assert cut["finish_reason"] == "length" and cut["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
    wait_pools_full(deployment.workers)
