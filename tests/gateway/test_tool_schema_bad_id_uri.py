"""``tool_choice: required`` joins every tool's parameters into one schema and first collects their ``$id``
resources (``_check_shared_ids``), resolving nested ``$id``s against their parent's with ``urljoin``. A ``$id``
Python's URL parser cannot read (an unclosed IPv6 host, "http://[::1") raised ValueError out of the request's
preparation: the gateway's catch-all answered 500 "internal error" (and logged a traceback) for a client's bad
schema, which is a 400 naming the tool's parameters."""

from __future__ import annotations

import msgspec
import pytest

from gateway.api import Frontend, decode_body
from gateway.api_models import ChatCompletionRequest
from gateway.errors import BadRequest
from gateway.tokenizer import ByteTokenizer

GOOD = {"type": "function", "function": {"name": "get_time"}}
BAD = {"type": "function", "function": {"name": "lookup", "parameters": {
    "type": "object", "$id": "http://[::1", "properties": {"key": {"$id": "key", "type": "string"}}}}}


@pytest.mark.parametrize("tool_choice", ["required", "auto"])
def test_an_unreadable_id_uri_is_a_400_naming_the_tool(tool_choice: str) -> None:
    body = {"model": "sim", "messages": [{"role": "user", "content": "hi"}], "tools": [GOOD, BAD],
            "tool_choice": tool_choice}
    frontend = Frontend(None, ByteTokenizer(), "sim", 4096)  # type: ignore[arg-type]
    req = decode_body(msgspec.json.encode(body), ChatCompletionRequest)
    if tool_choice == "auto":  # (nothing joins the schemas: served as given)
        frontend.prepare_chat(req)
        return
    pytest.importorskip("llguidance")
    with pytest.raises(BadRequest) as info:
        frontend.prepare_chat(req)
    assert info.value.param == "tools[1].function.parameters", info.value.message
    assert "http://[::1" in info.value.message
