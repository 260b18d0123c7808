"""SGLang router's ``GET /list_workers`` answers ``{"urls": [...]}`` (every version of its router, and the
routers written to stand in for it); the gateway serves that route as an alias of SGLang's, so a tool written
against SGLang's router (``requests.get(".../list_workers").json()["urls"]``) must find the URLs there."""

from __future__ import annotations

from starlette.testclient import TestClient

from gateway.app import create_app
from gateway.runtime import GatewayConfig


def test_list_workers_answers_sglang_routers_urls_list() -> None:
    prefill, decode = "pd://127.0.0.1:1", "pd://127.0.0.1:2"
    app = create_app(GatewayConfig(prefill=(prefill,), decode=(decode,)))
    client = TestClient(app)  # (no lifespan: nothing connects; the admin API lists the configured workers)
    body = client.get("/list_workers").json()
    assert body.get("urls") == [prefill, decode], body
    assert [w["url"] for w in body["workers"]] == [prefill, decode]  # (the gateway's own shape stays)
