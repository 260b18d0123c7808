"""The admin API refuses, with a 400 naming ``url``, an SGLang worker URL it could never probe nor relay to (a port
that is not one, a query, a fragment: its routes are appended to the URL), as it refuses such a native URL; and a
native (pd://) URL given to a gateway that relays to SGLang workers only is refused as a wrong ``url``, not ``role``."""

from __future__ import annotations

import pytest
from starlette.testclient import TestClient

from gateway.app import create_app
from gateway.runtime import GatewayConfig


@pytest.fixture
def sglang_gateway():  # type: ignore[no-untyped-def]
    app = create_app(GatewayConfig(prefill=("http://127.0.0.1:1",), decode=("http://127.0.0.1:2",),
                                   startup_timeout_s=0))
    with TestClient(app, raise_server_exceptions=False) as client:
        yield client


@pytest.mark.parametrize("url", ["http://127.0.0.1:99999", "http://127.0.0.1:abc", "http://127.0.0.1:0",
                                 "http://127.0.0.1:", "http://127.0.0.1:5?x=1", "http://127.0.0.1:5#f",
                                 "http://127.0.0.1:5/?", "http://[::1", "http://[::1]:x"])
def test_an_sglang_url_that_cannot_be_a_worker_is_a_400(sglang_gateway, url: str) -> None:  # type: ignore[no-untyped-def]
    before = {w["url"] for w in sglang_gateway.get("/workers").json()["workers"]}
    for reply in (sglang_gateway.post("/workers", json={"url": url, "role": "decode"}),
                  sglang_gateway.post("/add_worker", params={"url": url, "worker_type": "decode"})):
        assert reply.status_code == 400, (url, reply.text)
        assert reply.json()["error"]["param"] == "url", reply.text
    assert {w["url"] for w in sglang_gateway.get("/workers").json()["workers"]} == before  # nothing added


def test_good_sglang_urls_are_still_added(sglang_gateway) -> None:  # type: ignore[no-untyped-def]
    for url in ("http://127.0.0.1:5", "http://[::1]:6/", "http://localhost", "https://127.0.0.1:7/sglang"):
        reply = sglang_gateway.post("/workers", json={"url": url, "role": "decode"})
        assert reply.status_code == 201, (url, reply.text)


def test_a_native_url_on_an_sglang_only_gateway_names_the_url(sglang_gateway) -> None:  # type: ignore[no-untyped-def]
    reply = sglang_gateway.post("/workers", json={"url": "pd://127.0.0.1:5", "role": "decode"})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "url", reply.text


@pytest.mark.parametrize("url", ["http://127.0.0.1:0", "http://127.0.0.1:", "http://127.0.0.1:5?x=1", "http://[::1"])
def test_such_a_url_on_the_command_line_stops_the_gateway(url: str) -> None:
    """One check for both ways in (``sglang_fleet.check_http_url``): a configured worker is refused at start too."""
    with pytest.raises(ValueError, match="http://HOST:PORT"):
        GatewayConfig(prefill=("http://127.0.0.1:1",), decode=(url,))
