"""``/v1/responses`` with function tools: a 400 names the field and its path as this route spells them
(``tools[i].parameters``, ``tool_choice.name``, a ``function_call_output`` item), never chat's."""

from __future__ import annotations

from typing import Any

import httpx

FN = {"type": "function", "name": "get_weather",
      "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}
CALL = {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'}
OUT = {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}

CASES: list[tuple[dict[str, Any], str]] = [
    ({"input": "x", "tools": [{"type": "function", "name": "f", "parameters": {"type": "string"}}]},
     "tools[0].parameters"),
    ({"input": "x", "tools": [{"type": "function", "parameters": {}}]}, "tools[0].name"),
    # an output after the conversation moved on (a user turn between the call and it): the item is at fault,
    # and it has no role
    ({"input": [{"role": "user", "content": "Weather?"}, CALL, OUT, {"role": "user", "content": "again"}, OUT]},
     "input[4].call_id"),
]


def test_tool_refusals_use_this_routes_names(sim_cluster) -> None:  # type: ignore[no-untyped-def]
    cluster = sim_cluster()
    for body, param in CASES:
        r = httpx.post(f"{cluster.base_url}/v1/responses", json={"model": "default", **body}, timeout=60)
        assert r.status_code == 400, (body, r.text)
        error = r.json()["error"]
        assert error["param"] == param, (body, error)
        for chat_word in (".function.", "tool_calls", "role 'tool'"):  # (chat's spelling)
            assert chat_word not in error["message"], error
    cluster.wait_pools_full()
