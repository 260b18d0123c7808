"""Review of 3b2bc2b (4): strict tools' validators cached (``gateway.tool_calls._validator``, an LRU of 256)."""

from __future__ import annotations

import gc
import json
import os
from types import SimpleNamespace

import pytest

from gateway import tool_calls
from gateway.tool_calls import plan_tools


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def test_cached_validators_of_large_strict_schemas_do_not_pin_hundreds_of_mib() -> None:
    """The LRU keeps any schema up to ``MAX_GRAMMAR_CHARS`` (256 KiB), unlike the grammar check's cache, which keeps
    only small sources so that its 256 keys hold at most 16 MiB. A compiled jsonschema-rs validator is ~19x its
    source here: 256 distinct 179 KB strict tools (one per request, under auto) pinned 870 MiB of the gateway
    (6 MiB when built per request). 64 of them here: HEAD keeps ~220 MiB."""
    pytest.importorskip("llguidance")
    pytest.importorskip("jsonschema_rs")
    tool_calls._validator.cache_clear()
    gc.collect()
    before = _rss_mib()
    for k in range(64):
        props = {f"p{k}_{i}": {"type": "string", "description": "x" * 40, "enum": ["a", "b", "c"]} for i in range(1500)}
        tool = {"type": "function", "function": {"name": "f", "strict": True, "parameters": {
            "type": "object", "properties": props, "required": [], "additionalProperties": False}}}
        assert len(json.dumps(tool)) < 256 * 1024
        plan_tools(SimpleNamespace(tool_choice="auto", tools=[tool], parallel_tool_calls=None), None)
    gc.collect()
    grown = _rss_mib() - before
    tool_calls._validator.cache_clear()
    assert grown < 64, f"{grown:.0f} MiB held after 64 requests with one large strict tool each"
