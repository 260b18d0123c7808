"""Review findings on the loop-stall / CORS / strict-tools / SDK changes (test-only; each fails on HEAD)."""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Any

import pytest

from gateway import structured_output
from gateway.responder import PREPARE_THREAD_BYTES, Responder
from gateway.shapes import ChatShape
from tests.gateway.test_loop_blocking import _Exchange, _gbnf, _Host
from workers import grammar as grammars


@pytest.mark.parametrize("field", ["guided_grammar", "structured_outputs"])
def test_a_gbnf_grammar_under_its_other_names_is_not_checked_on_the_event_loop(monkeypatch: Any, field: str) -> None:
    """``guided_grammar`` (vLLM) and ``structured_outputs.grammar`` are GBNF too (``kind == "ebnf"``), but the
    responder only looks for the bytes ``"ebnf"`` in the body: the same 300-rule grammar (0.2 s of
    ``gbnf_to_lark``) is checked on the event loop when sent under these names."""
    threads: list[int] = []
    monkeypatch.setattr(grammars, "is_available", lambda: True)
    monkeypatch.setattr(grammars, "check", lambda grammar: threads.append(threading.get_ident()))
    structured_output._library_says.cache_clear()
    value: Any = _gbnf(300) if field == "guided_grammar" else {"grammar": _gbnf(300)}

    async def main() -> None:
        responder = Responder(_Host(), ChatShape())
        body = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, field: value}).encode()
        assert len(body) < PREPARE_THREAD_BYTES and b'"ebnf"' not in body
        exchange = _Exchange(body)
        await responder.serve(exchange)  # type: ignore[arg-type]
        assert [answer[0] for answer in exchange.answers] == [503], exchange.answers
        assert threads and threading.get_ident() not in threads, "the grammar was checked on the event loop"

    try:
        asyncio.run(main())
    finally:
        structured_output._library_says.cache_clear()


def test_a_run_of_skipped_special_tokens_keeps_the_next_texts_leading_space() -> None:
    """``HFIncrementalDecoder`` treats more than ``MAX_HELD_IDS`` ids without new text as a held run of bytes and
    cuts the window past it (``_past_held``), even when the run is special tokens that decode to nothing (no
    U+FFFD: EOS under ``ignore_eos``, any skipped special token). With a SentencePiece-style decoder that strips
    a window's leading space (Llama 2, Mistral), the window then starts at the next text, whose leading space is
    lost: 'a b' streamed, 'a  b' decoded whole (8 special tokens: as before). The worker's StopWatch reads the
    same decoder. Fix: cut past a held run only when its text ends in U+FFFD (keep the DecodeStream otherwise)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engines"))
    from test_hf_tokenizer import _llama_style_tokenizer  # type: ignore[import-not-found]

    tok = _llama_style_tokenizer()

    def enc(text: str) -> list[int]:
        return tok._tok.encode(text, add_special_tokens=False).ids

    for run in (8, 9, 20):
        ids = enc("a") + [2] * run + enc(" b")  # (2: </s>, skipped)
        decoder = tok.decoder([])
        streamed = "".join([decoder.push([i]) for i in ids]) + decoder.flush()
        assert streamed == tok.decode(ids), (run, streamed, tok.decode(ids))


def test_the_cors_headers_expose_x_should_retry() -> None:
    """A 504 ``request_timeout`` says ``x-should-retry: false`` so that OpenAI's SDKs do not run it three times;
    the JS SDK in a browser page (``dangerouslyAllowBrowser``) reads response headers through CORS, which exposes
    only ``x-request-id`` and ``retry-after``: the page's SDK sees no ``x-should-retry`` and retries anyway."""
    from gateway.cors import CorsPolicy

    for origins in (["https://chat.example.com"], ["*"]):
        headers = dict(CorsPolicy(origins).response_headers([(b"origin", b"https://chat.example.com")]))
        exposed = [h.strip() for h in headers[b"access-control-expose-headers"].split(b",")]
        assert b"x-should-retry" in exposed, exposed


def test_strict_arguments_nested_past_the_recursion_limit_are_content_not_a_crash() -> None:
    """Arguments nested ~1,100+ deep (a few KB of brackets the model wrote) raise ``RecursionError`` out of
    ``parse_calls`` (the whole answer's 500, or a stream's error event): already before this diff from
    ``_call_decoder.decode`` (msgspec raises RecursionError, only DecodeError/ValidationError are caught), and
    now also from the new ``_passes`` (``json.loads``, only ``ValueError`` caught). Such an answer is content."""
    from types import SimpleNamespace

    from gateway.tool_calls import parse_calls, plan_tools

    tool = {"type": "function", "function": {"name": "f", "strict": True, "parameters": {
        "type": "object", "properties": {"a": {"type": "array"}}, "required": ["a"], "additionalProperties": False}}}
    plan = plan_tools(SimpleNamespace(tool_choice="auto", tools=[tool], parallel_tool_calls=None), None)
    assert plan is not None
    depth = 1500
    answer = '{"name": "f", "arguments": {"a": ' + "[" * depth + "]" * depth + "}}"
    parse_calls(plan, answer)  # (content or a call; not an exception)


def test_strict_tool_validators_are_not_rebuilt_for_every_request(monkeypatch: Any) -> None:
    """Under ``tool_choice`` auto every strict tool (the OpenAI SDK's ``pydantic_function_tool`` and the Agents SDK
    mark every tool strict) costs ``json.dumps`` + the grammar check's cache look-up + ``jsonschema_rs.validator_for``
    on each request, on the event loop (~80 us a tool measured here; 4 tools: ~0.3 ms against ~4 us without strict).
    The same tools come with every turn of a conversation: a validator per distinct schema text (an LRU, as the
    grammar check has) makes it one dict look-up."""
    from types import SimpleNamespace

    import jsonschema_rs

    from gateway.tool_calls import plan_tools

    built = [0]
    real = jsonschema_rs.validator_for

    def counting(schema: Any, *args: Any, **kwargs: Any) -> Any:
        built[0] += 1
        return real(schema, *args, **kwargs)

    monkeypatch.setattr(jsonschema_rs, "validator_for", counting)
    tool = {"type": "function", "function": {"name": "f", "strict": True, "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False}}}
    for _ in range(3):
        plan_tools(SimpleNamespace(tool_choice="auto", tools=[json.loads(json.dumps(tool))], parallel_tool_calls=None),
                   None)
    assert built[0] <= 1, f"{built[0]} validators built for 3 requests with the same tool"
