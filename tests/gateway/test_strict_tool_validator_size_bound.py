"""Review of a2af4c0: strict tools' validators were cached for schemas up to ``MAX_CACHED_SOURCE`` (64 KiB) each,
256 of them: a validator is ~20x its source, so ~320 MiB could stay pinned (measured: 64 distinct 60 KB strict
tools, +91 MiB RSS cached against +16 MiB uncached). Now only small schemas' validators are kept."""

from __future__ import annotations

import json
from typing import Any

import pytest

from gateway import tool_calls


def test_the_validator_cache_bound_is_small() -> None:
    worst_mib = tool_calls._validator.cache_info().maxsize * tool_calls.MAX_CACHED_SCHEMA_CHARS * 20 / 2**20
    assert worst_mib <= 64, f"validator LRU may hold ~{worst_mib:.0f} MiB"


def test_a_schema_past_the_bound_is_not_cached() -> None:
    pytest.importorskip("jsonschema_rs")
    pytest.importorskip("llguidance")
    big = {"type": "object", "additionalProperties": False, "required": ["p0"],
           "properties": {f"p{i}": {"type": "string", "description": "x" * 40} for i in range(200)}}
    tool: dict[str, Any] = {"name": "big", "description": "", "parameters": big, "strict": True}
    assert len(json.dumps(big)) > tool_calls.MAX_CACHED_SCHEMA_CHARS
    tool_calls._validator.cache_clear()
    validators = tool_calls._strict_validators([tool])
    assert validators is not None and "big" in validators
    assert tool_calls._validator.cache_info().currsize == 0
