"""A tool whose ``parameters`` schema carries ``$id`` (a schema resource of its own: its local ``#/...`` references
resolve against it, wherever it is embedded) works under ``tool_choice: "required"`` as it does named."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from gateway.tool_calls import plan_tools

pytest.importorskip("llguidance")

PARAMS = {"$id": "https://example.com/schemas/weather.json", "type": "object",
          "properties": {"unit": {"$ref": "#/$defs/Unit"}}, "required": ["unit"],
          "$defs": {"Unit": {"enum": ["celsius", "fahrenheit"]}}}


@pytest.mark.parametrize("num_tools", [1, 2])
def test_required_accepts_a_parameters_schema_with_its_own_id(num_tools: int) -> None:
    tools = [{"type": "function", "function": {"name": f"f{i}", "parameters": PARAMS}} for i in range(num_tools)]
    named = plan_tools(SimpleNamespace(tools=tools, tool_choice={"type": "function", "function": {"name": "f0"}},
                                       parallel_tool_calls=None), None)
    assert named is not None and named.grammar is not None  # accepted when named...
    plan = plan_tools(SimpleNamespace(tools=tools, tool_choice="required", parallel_tool_calls=None), None)
    assert plan is not None and plan.grammar is not None  # ...and under required (was a 400: pointer not found)
    schema = json.loads(plan.grammar.source)
    options = [schema] if num_tools == 1 else schema["anyOf"]
    # its references still resolve against its own $id: left as they were
    assert all(o["properties"]["arguments"]["properties"]["unit"] == {"$ref": "#/$defs/Unit"} for o in options)


def test_required_rebases_a_schema_whose_id_is_empty() -> None:
    """An empty ``$id`` makes no resource of its own: its references are rebased like any other's (left as they
    were, they would point at the combined schema's root, where no ``$defs`` are)."""
    params = {**PARAMS, "$id": ""}
    tools = [{"type": "function", "function": {"name": f"f{i}", "parameters": params}} for i in range(2)]
    plan = plan_tools(SimpleNamespace(tools=tools, tool_choice="required", parallel_tool_calls=None), None)
    assert plan is not None and plan.grammar is not None
    options = json.loads(plan.grammar.source)["anyOf"]
    assert [o["properties"]["arguments"]["properties"]["unit"]["$ref"] for o in options] == [
        "#/anyOf/0/properties/arguments/$defs/Unit", "#/anyOf/1/properties/arguments/$defs/Unit"]
