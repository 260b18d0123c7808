"""``/v1/responses``' ``text.format`` of type ``json_schema`` needs its ``name`` (a-z, A-Z, 0-9, ``_``, ``-``, at most
64) and its ``schema`` (an object), as OpenAI's API requires (a 400 naming ``text.format.name`` /
``text.format.schema``): the response repeats ``text.format``, and without them it is not a response the SDK's own
model (``ResponseFormatTextJSONSchemaConfig``: ``name: str``, ``schema: Dict``) can read. They were passed on as
chat's ``response_format``, which does not require a name: a 200 on a worker with constrained decoding."""

from __future__ import annotations

from typing import Any

import httpx

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
REFUSALS: list[tuple[dict[str, Any], str]] = [
    ({"type": "json_schema", "schema": SCHEMA}, "text.format.name"),
    ({"type": "json_schema", "name": 7, "schema": SCHEMA}, "text.format.name"),
    ({"type": "json_schema", "name": "", "schema": SCHEMA}, "text.format.name"),
    ({"type": "json_schema", "name": "a city", "schema": SCHEMA}, "text.format.name"),
    ({"type": "json_schema", "name": "x" * 65, "schema": SCHEMA}, "text.format.name"),
    ({"type": "json_schema", "name": "city"}, "text.format.schema"),
    ({"type": "json_schema", "name": "city", "schema": '{"type": "object"}'}, "text.format.schema"),
]


def test_a_json_schema_format_needs_its_name_and_schema(sim_cluster) -> None:  # type: ignore[no-untyped-def]
    cluster = sim_cluster()
    for fmt, param in REFUSALS:
        for stream in (False, True):
            r = httpx.post(f"{cluster.base_url}/v1/responses", timeout=60,
                           json={"input": "Where?", "text": {"format": fmt}, "stream": stream})
            assert r.status_code == 400, (fmt, r.text)
            error = r.json()["error"]
            assert error["param"] == param and error["type"] == "invalid_request_error", (fmt, error)
            assert "worker" not in error["message"], error  # (the gateway's own refusal, before any worker)
    cluster.wait_pools_full()
