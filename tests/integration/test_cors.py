"""CORS (``--cors-allow-origin``): a browser page of an allowed origin may call the gateway; others may not.

What a browser does (the Fetch standard): a cross-origin ``POST`` with ``Authorization`` or a JSON
``Content-Type`` is first asked about in a preflight ``OPTIONS`` without credentials; the page may then
read an answer only if it carries ``Access-Control-Allow-Origin`` for it. Checked over a real gateway and
sim workers, on the generation routes' own cycle and on the ASGI routes.
"""

from __future__ import annotations

import httpx
import pytest

from gateway.cors import CorsPolicy, check_origins

PAGE = "https://chat.example.com"
CHAT = {"model": "default", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}


def _preflight(http: httpx.Client, origin: str, path: str = "/v1/chat/completions") -> httpx.Response:
    return http.options(path, headers={"origin": origin, "access-control-request-method": "POST",
                                       "access-control-request-headers": "authorization, content-type"})


def test_an_allowed_origin_is_served_and_others_are_not(sim_cluster) -> None:  # type: ignore[no-untyped-def]
    cluster = sim_cluster(gateway_args=("--cors-allow-origin", PAGE, "--api-key", "k1"))
    key = {"authorization": "Bearer k1"}
    with httpx.Client(base_url=cluster.base_url, timeout=60) as http:
        r = _preflight(http, PAGE)  # (no key: a browser sends none with a preflight)
        assert r.status_code == 204, r.text
        assert r.headers["access-control-allow-origin"] == PAGE
        assert "POST" in r.headers["access-control-allow-methods"]
        assert r.headers["access-control-allow-headers"] == "authorization, content-type"
        assert int(r.headers["access-control-max-age"]) > 0
        r = _preflight(http, "https://evil.example.net")
        assert r.status_code == 403 and "access-control-allow-origin" not in r.headers, r.headers
        assert r.json()["error"]["code"] == "cors_origin_not_allowed"

        for body in (CHAT, {**CHAT, "stream": True}):  # the generation routes' own cycle
            r = http.post("/v1/chat/completions", json=body, headers={**key, "origin": PAGE})
            assert r.status_code == 200, r.text
            assert r.headers["access-control-allow-origin"] == PAGE, r.headers
            assert "Origin" in r.headers.get("vary", ""), r.headers
            assert "x-request-id" in r.headers["access-control-expose-headers"]
            assert r.headers["x-request-id"]
        r = http.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2}},
                      headers={**key, "origin": PAGE})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == PAGE, r.headers
        # Refusals too: the page can read why (the key's 401 here, before any route)
        r = http.post("/v1/chat/completions", json=CHAT, headers={"origin": PAGE})
        assert r.status_code == 401 and r.headers["access-control-allow-origin"] == PAGE, r.headers
        r = http.get("/v1/models", headers={**key, "origin": PAGE})  # an ASGI route
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == PAGE, r.headers
        # Another origin is answered as before, without the header its page would need to read it
        r = http.post("/v1/chat/completions", json=CHAT, headers={**key, "origin": "https://evil.example.net"})
        assert r.status_code == 200 and "access-control-allow-origin" not in r.headers, r.headers
        r = http.get("/v1/models", headers={**key, "origin": "https://evil.example.net"})
        assert r.status_code == 200 and "access-control-allow-origin" not in r.headers, r.headers
        # Not a preflight (no Access-Control-Request-Method): the routes answer it, as without CORS
        r = http.options("/v1/chat/completions", headers={"origin": PAGE, **key})
        assert r.status_code == 405, r.text


def test_any_origin_and_no_cors_by_default(sim_cluster) -> None:  # type: ignore[no-untyped-def]
    anyone = sim_cluster(gateway_args=("--cors-allow-origin", "*"))
    plain = sim_cluster()
    with httpx.Client(base_url=anyone.base_url, timeout=60) as http:
        r = _preflight(http, "http://localhost:3000")
        assert r.status_code == 204 and r.headers["access-control-allow-origin"] == "*", r.headers
        r = http.post("/v1/chat/completions", json={**CHAT, "stream": True}, headers={"origin": "http://a.test"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*", r.headers
        assert r.text.rstrip().endswith("data: [DONE]")
        r = http.post("/v1/chat/completions", json=CHAT)  # no Origin: not a browser's cross-origin call
        assert r.status_code == 200 and "access-control-allow-origin" not in r.headers, r.headers
    with httpx.Client(base_url=plain.base_url, timeout=60) as http:
        r = _preflight(http, PAGE)
        assert r.status_code == 405 and "access-control-allow-origin" not in r.headers, r.headers
        r = http.post("/v1/chat/completions", json=CHAT, headers={"origin": PAGE})
        assert r.status_code == 200 and "access-control-allow-origin" not in r.headers, r.headers


@pytest.mark.parametrize("origin", ["https://chat.example.com/", "chat.example.com", "https://a.com/path",
                                    "https://user@a.com", "", "https://a.com:99999"])
def test_what_is_not_an_origin_is_refused_at_start(origin: str) -> None:
    with pytest.raises(ValueError, match="cors_allow_origin"):
        check_origins([origin])


def test_the_policy_echoes_only_plain_header_lists() -> None:
    policy = CorsPolicy(["HTTPS://Chat.Example.com", "http://localhost:3000"])
    asked = [(b"origin", b"https://chat.example.com"), (b"access-control-request-method", b"POST")]
    answer = policy.preflight([*asked, (b"access-control-request-headers", b"x-a\r\nset-cookie: 1")])
    assert answer is not None and answer[0] == 204
    assert not any(name == b"access-control-allow-headers" for name, _ in answer[2])
    assert policy.preflight([(b"origin", b"http://localhost:3000")]) is None  # (no method asked: not one)
    assert policy.response_headers([(b"origin", b"http://localhost:3001")]) == []
