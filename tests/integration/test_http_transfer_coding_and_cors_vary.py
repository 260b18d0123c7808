"""Review (area A, 2026-12-06), against a real gateway over sim workers, each failing before its fix:

1. A request body in a transfer coding the gateway does not speak (``Transfer-Encoding: gzip, chunked``) was read
   as plain chunked (httptools only undoes the chunked framing) and served: the app got the still-coded bytes as
   the body. RFC 9112 6.1: a server that does not understand a transfer coding answers 501; and the connection
   closes, since the rest of the body cannot be told from a next request.
2. With ``--cors-allow-origin``, only an answer to an allowed origin carried ``Vary: Origin``: an answer to another
   origin, or to a request without one, did not, so a shared cache could give it to the allowed origin's page
   (which then cannot read it), on the generation routes' own cycle and on the ASGI routes alike.
"""

from __future__ import annotations

import gzip
import json
import socket
from collections.abc import Callable

import httpx
from pdtest import SimCluster
from test_hot_cycle import PROMPT, _Responses, post, talk

PAGE = "https://chat.example.com"
OTHER = "https://evil.example.net"


def chunked(body: bytes) -> bytes:
    return b"%x\r\n%b\r\n0\r\n\r\n" % (len(body), body)


def test_a_body_in_an_unknown_transfer_coding_is_a_501_and_the_connection_closes(
        sim_cluster: Callable[..., SimCluster]) -> None:
    cluster = sim_cluster()
    port = cluster.gateway_port
    body = json.dumps({"prompt": PROMPT, "max_tokens": 2}).encode()
    behind = post("/v1/completions", {"prompt": PROMPT, "max_tokens": 2})
    for path in ("/v1/completions", "/v1/models"):  # the generation routes' own cycle; an ASGI route
        for codings in (b"Transfer-Encoding: gzip, chunked\r\n", b"Transfer-Encoding: x-custom,chunked\r\n",
                        b"Transfer-Encoding: gzip\r\nTransfer-Encoding: chunked\r\n"):
            coded = gzip.compress(body) if b"gzip" in codings else body
            head = b"POST %b HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n%b\r\n" % (path.encode(), codings)
            answers, raw = talk(port, head + chunked(coded) + behind, 2)
            assert [a[0] for a in answers] == [501], (path, codings, raw[:400])
            _, headers, error = answers[0]
            assert headers["connection"] == "close", headers
            assert json.loads(error)["error"]["code"] == "transfer_coding_not_supported", error
    # The body in a read of its own, after the head (a request already waiting for it), and a coded body behind a
    # plain chunked request on one connection: each request's codings are read
    gz = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip, chunked\r\n"
    answers, raw = talk(port, gz + b"Expect: 100-continue\r\n\r\n", 1, then=chunked(gzip.compress(body)))
    assert [a[0] for a in answers] == [501], raw[:400]
    plain = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n" + chunked(body)
    parsed = _Responses()
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        for request, num_answers in ((plain, 1), (gz + b"\r\n" + chunked(gzip.compress(body)), 2)):
            sock.sendall(request)  # (the next one once the answer before it came: not pipelined)
            while len(parsed.done) < num_answers:
                data = sock.recv(65536)
                assert data, parsed.done
                parsed.parser.feed_data(data)
    assert [a[0] for a in parsed.done] == [200, 501], parsed.done
    # Plain chunked is still read, and what the parser itself refuses is still a 400
    (ok,), raw = talk(port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                      + chunked(body), 1)
    assert ok[0] == 200, raw[:400]
    (bad,), raw = talk(port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked, gzip\r\n\r\n"
                       + body, 1)
    assert bad[0] == 400, raw[:400]
    assert httpx.post(f"{cluster.base_url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 2},
                      timeout=30).status_code == 200


def _varies_on_origin(response: httpx.Response) -> bool:
    return "origin" in [v.strip().lower() for v in ",".join(response.headers.get_list("vary")).split(",")]


def test_every_answer_varies_on_origin_when_cors_is_on(sim_cluster: Callable[..., SimCluster]) -> None:
    for allow in (PAGE, "*"):
        cluster = sim_cluster(gateway_args=("--cors-allow-origin", allow, "--api-key", "k1"))
        key = {"authorization": "Bearer k1"}
        chat = {"max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
        with httpx.Client(base_url=cluster.base_url, timeout=60) as http:
            for origin in ({"origin": PAGE}, {"origin": OTHER}, {}):
                answers = [
                    http.post("/v1/chat/completions", json=chat, headers={**key, **origin}),  # (own cycle)
                    http.post("/v1/chat/completions", json={**chat, "stream": True}, headers={**key, **origin}),
                    http.post("/v1/chat/completions", json=chat, headers=origin),  # a refusal: 401
                    http.get("/v1/models", headers={**key, **origin}),  # ASGI
                    http.get("/health", headers=origin),
                ]
                for r in answers:
                    assert _varies_on_origin(r), (allow, origin, r.request.url, r.status_code, r.headers)
                allowed = bool(origin) and (allow == "*" or origin["origin"] == PAGE)
                assert ("access-control-allow-origin" in answers[0].headers) == allowed, (allow, origin)
