"""Under tool_choice "required" two tools whose parameters schemas carry the same ``$id`` but differ
are embedded as two resources with one URI: their ``#/...`` references all resolve against one of them, so
one tool's arguments were held to the other's definitions (a valid call impossible, an invalid one forced).
Either such a request is refused (400) or each tool keeps its own schema."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from gateway.errors import BadRequest
from gateway.tool_calls import plan_tools

llguidance = pytest.importorskip("llguidance")

from workers.grammar import to_llguidance  # noqa: E402


class _ByteTokenizer:
    eos_token_id = 256
    bos_token_id = None
    tokens = [bytes([i]) for i in range(256)] + [b""]
    special_token_ids = [256]

    def __call__(self, s: bytes | str) -> list[int]:
        return list(s if isinstance(s, bytes) else s.encode())


def _accepts(grammar, text: str) -> bool:  # type: ignore[no-untyped-def]
    tok = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_ByteTokenizer()))
    matcher = llguidance.LLMatcher(tok, to_llguidance(grammar))
    assert not matcher.is_error(), matcher.get_error()
    ids = list(text.encode())
    return matcher.try_consume_tokens(ids) == len(ids) and matcher.is_accepting()


def _params(unit: dict[str, object]) -> dict[str, object]:
    return {"$id": "https://example.com/schemas/args.json", "type": "object",
            "properties": {"unit": {"$ref": "#/$defs/Unit"}}, "required": ["unit"], "$defs": {"Unit": unit}}


def test_two_tools_with_one_id_keep_their_own_schemas_under_required() -> None:
    tools = [{"type": "function", "function": {"name": "a", "parameters": _params({"enum": ["celsius"]})}},
             {"type": "function", "function": {"name": "b", "parameters": _params({"type": "integer"})}}]
    try:
        plan = plan_tools(SimpleNamespace(tools=tools, tool_choice="required", parallel_tool_calls=None), None)
    except BadRequest:
        return  # refused: fine
    assert plan is not None and plan.grammar is not None
    calls = {"a": (json.dumps({"unit": "celsius"}), json.dumps({"unit": 5})),
             "b": (json.dumps({"unit": 5}), json.dumps({"unit": "celsius"}))}
    for name, (valid, invalid) in calls.items():
        assert _accepts(plan.grammar, f'{{"name": "{name}", "arguments": {valid}}}'), f"{name}: its valid call"
        assert not _accepts(plan.grammar, f'{{"name": "{name}", "arguments": {invalid}}}'), \
            f"{name}: held to the other tool's schema"
