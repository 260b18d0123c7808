"""The gateway's OpenAPI document: valid, loadable by schemathesis, covering every route, built once."""

from __future__ import annotations

import re
from typing import Any

import msgspec
import pytest
import schemathesis
from schemathesis.core.result import Ok
from starlette.routing import Route
from starlette.testclient import TestClient

from gateway.api_models import ChatCompletionRequest
from gateway.app import create_app
from gateway.runtime import GatewayConfig

REF = "#/components/schemas/{name}"
WORKERS = {"prefill": ("pd://127.0.0.1:1",), "decode": ("pd://127.0.0.1:2",)}


def document(**config: Any) -> dict[str, Any]:
    app = create_app(GatewayConfig(**WORKERS, **config))
    return msgspec.json.decode(app.state.openapi)


def served_routes(app: Any) -> dict[str, set[str]]:
    """path -> methods of the ASGI app ``create_app`` builds (raw generation routes and Starlette's)."""
    gateway_app = app.app.app  # RequestContextMiddleware -> GatekeeperMiddleware -> GatewayApp
    routes = {path: {"POST"} for path in gateway_app.responders}
    for route in gateway_app.rest.routes:
        assert isinstance(route, Route)
        path = re.sub(r":\w+}", "}", route.path)  # (a path parameter's convertor is not in the document)
        routes.setdefault(path, set()).update(m for m in (route.methods or ()) if m != "HEAD")
    return routes


def test_every_route_and_method_is_documented() -> None:
    app = create_app(GatewayConfig(**WORKERS))
    doc = msgspec.json.decode(app.state.openapi)
    assert doc["openapi"].startswith("3.1")
    documented = {path: {m.upper() for m in ops} for path, ops in doc["paths"].items()}
    assert documented == served_routes(app)


def test_schemathesis_loads_every_operation() -> None:
    schema = schemathesis.openapi.from_dict(document())
    results = list(schema.get_all_operations())
    assert results and all(isinstance(r, Ok) for r in results), [r for r in results if not isinstance(r, Ok)]


def test_request_bodies_are_the_decoders_schemas_and_errors_one_shape() -> None:
    doc = document()
    schemas = doc["components"]["schemas"]
    (_, decoder) = msgspec.json.schema_components([ChatCompletionRequest], ref_template=REF)
    chat, decoded = dict(schemas["ChatCompletionRequest"]), dict(decoder["ChatCompletionRequest"])
    assert chat.pop("required") == ["messages"]  # (a default stands in, for a clearer 400 than the decoder's)
    decoded.pop("required")
    assert chat == decoded
    assert schemas["ChatMessage"]["properties"]["role"]["enum"] == ["system", "developer", "user", "assistant", "tool"]
    for path, operations in doc["paths"].items():
        for method, operation in operations.items():
            for status, response in operation["responses"].items():
                if int(status) >= 400 and path != "/readiness":  # (its 503 is the status itself: not ready)
                    error = {"$ref": REF.format(name="Error")}
                    assert response["content"] == {"application/json": {"schema": error}}, (method, path, status)


def test_security_schemes_follow_the_configuration() -> None:
    assert "securitySchemes" not in document()["components"]
    doc = document(api_keys=("k",), admin_api_keys=("a",))
    assert set(doc["components"]["securitySchemes"]) == {"apiKey", "adminKey"}
    assert doc["paths"]["/v1/completions"]["post"]["security"] == [{"apiKey": []}]
    assert doc["paths"]["/workers"]["delete"]["security"] == [{"adminKey": []}]
    assert "401" in doc["paths"]["/workers"]["delete"]["responses"]
    assert "security" not in doc["paths"]["/health"]["get"]
    assert "security" not in doc["paths"]["/metrics"]["get"]


def test_the_document_is_served_as_built() -> None:
    app = create_app(GatewayConfig(**WORKERS))
    client = TestClient(app)  # no lifespan: nothing connects
    first, second = client.get("/openapi.json"), client.get("/openapi.json")
    assert first.status_code == 200 and first.headers["content-type"] == "application/json"
    assert first.content == second.content == app.state.openapi


def test_client_keys_guard_the_admin_api_without_an_admin_key() -> None:
    """``--api-key`` alone: the admin API takes a client key, not nobody's (anyone could otherwise add a
    "worker" of theirs and receive the clients' prompts); with neither key it stays open (localhost)."""
    from gateway.middleware import GatekeeperMiddleware

    def gate(api: tuple[str, ...], admin: tuple[str, ...]) -> GatekeeperMiddleware:
        return GatekeeperMiddleware(None, api_keys=api, admin_api_keys=admin,  # type: ignore[arg-type]
                                    metrics_require_admin=False, is_draining=lambda: False)

    bearer = lambda key: [(b"authorization", b"Bearer " + key)]  # noqa: E731
    only_client = gate(("k",), ())
    for path in ("/workers", "/add_worker", "/remove_worker", "/list_workers"):
        assert only_client.refusal(path, [])[0] == 401  # type: ignore[index]
        assert only_client.refusal(path, bearer(b"k")) is None
    assert gate(("k",), ("a",)).refusal("/workers", bearer(b"k"))[0] == 401  # type: ignore[index]
    assert gate(("k",), ("a",)).refusal("/workers", bearer(b"a")) is None
    assert gate((), ()).refusal("/workers", []) is None
    assert document(api_keys=("k",))["paths"]["/workers"]["get"]["security"] == [{"apiKey": []}]
    with pytest.raises(ValueError, match="metrics_require_admin needs an admin key"):
        GatewayConfig(**WORKERS, api_keys=("k",), metrics_require_admin=True)


def test_metrics_stay_readable_while_draining() -> None:
    """On SIGTERM new requests get 503, but a scraper's kept-alive connection still reads /metrics (the
    open requests falling to zero is what an operator watches then), behind the admin key if asked."""
    from gateway.middleware import GatekeeperMiddleware

    refused: list[str] = []

    def gate(**kwargs: object) -> GatekeeperMiddleware:
        return GatekeeperMiddleware(None, api_keys=(), is_draining=lambda: True,  # type: ignore[arg-type]
                                    on_refused=refused.append, **kwargs)

    assert gate(admin_api_keys=(), metrics_require_admin=False).refusal("/v1/completions", [])[0] == 503  # type: ignore[index]
    assert gate(admin_api_keys=(), metrics_require_admin=False).refusal("/metrics", []) is None
    guarded = gate(admin_api_keys=("a",), metrics_require_admin=True)
    assert guarded.refusal("/metrics", [])[0] == 401  # type: ignore[index]
    assert guarded.refusal("/metrics", [(b"authorization", b"Bearer a")]) is None
    assert refused == ["draining", "unauthorized"], "each refusal is counted (pd_gateway_rejected_requests)"


@pytest.mark.parametrize("value", ["\u00b2", "\u00b9\u2070"])
def test_a_retry_after_that_is_no_number_is_ignored_not_raised(value: str) -> None:
    """``str.isdigit()`` is True for superscripts, ``float()`` refuses them: a worker's odd Retry-After (aiohttp
    decodes header bytes as UTF-8) raised in ``_post`` (every prefill reply: the attempt failed) and in
    ``_settle`` (a decode's non-2xx: a 500)."""
    from gateway.sglang_relay import _retry_after_s

    assert _retry_after_s({"retry-after": value}) is None


def test_the_openapi_generate_schema_refuses_text_and_input_ids_together() -> None:
    """/generate with both text and input_ids is a 400: the document says so (it said anyOf: both allowed)."""
    from gateway.openapi import _REQUIRED

    rule = _REQUIRED["GenerateRequest"]
    body = {"text": "hi", "input_ids": [1, 2]}

    def matches(schema: dict[str, object]) -> bool:
        if "required" in schema:
            return all(k in body for k in schema["required"])  # type: ignore[attr-defined]
        if "not" in schema:
            return not matches(schema["not"])  # type: ignore[arg-type]
        if "anyOf" in schema:
            return any(matches(s) for s in schema["anyOf"])  # type: ignore[attr-defined]
        if "oneOf" in schema:
            return sum(matches(s) for s in schema["oneOf"]) == 1  # type: ignore[attr-defined]
        return True

    assert not matches(rule), rule
