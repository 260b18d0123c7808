"""The SGLang relay's requests answered on the gateway's own HTTP cycle (``gateway/hot_cycle.py``'s ``send``, which
writes the relay's ASGI messages as uvicorn's cycle did): keep-alive and pipelining, a relayed stream chunked to an
HTTP/1.1 client and unframed to an HTTP/1.0 one, the worker's content type, the request id and the relay's
refusals, over the stand-in SGLang workers of ``test_gateway_sglang``."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

from pdtest import Procs, start_gateway
from test_gateway_sglang import Fleet, fleet, start_standin  # noqa: F401 (the module's fixture)
from test_hot_cycle import post, talk


def _port(of: Fleet) -> int:
    return int(of.base_url.rpartition(":")[2])


def _events(body: bytes) -> list[str]:
    return [line[6:] for line in body.decode().split("\n") if line.startswith("data: ")]


def test_pipelined_relayed_answers_whole_then_streamed_on_one_connection(fleet: Fleet) -> None:  # noqa: F811
    """Three requests in one write: two whole answers (with their length) and a stream (chunked, ended by the last
    chunk), each with its own request id, all on one kept-alive connection, in order."""
    data = (post("/v1/completions", {"prompt": "one"}, {"x-request-id": "req-one"})
            + post("/v1/chat/completions", {"messages": [{"role": "user", "content": "two"}]},
                   {"x-request-id": "req-two"})
            + post("/generate", {"text": "three", "stream": True}, {"x-request-id": "req-three"}))
    responses, raw = talk(_port(fleet), data, 3)
    assert [r[0] for r in responses] == [200, 200, 200], raw[-500:]
    (_, h1, b1), (_, h2, b2), (_, h3, b3) = responses
    assert [h["x-request-id"] for h in (h1, h2, h3)] == ["req-one", "req-two", "req-three"]
    assert h1["content-length"] == str(len(b1)) and json.loads(b1)["object"] == "text_completion"
    assert h2["content-type"].startswith("application/json") and json.loads(b2)["object"] == "chat.completion"
    assert "content-length" not in h3 and h3["transfer-encoding"] == "chunked"
    assert h3["content-type"].startswith("text/event-stream")
    events = _events(b3)
    assert events[-1] == "[DONE]" and json.loads(events[-2])["text"].startswith("decoded "), events
    assert raw.endswith(b"0\r\n\r\n")
    assert b"connection: close" not in raw.lower()


def test_a_relayed_stream_to_an_http_1_0_client_is_unframed_and_ends_with_the_connection(
        fleet: Fleet) -> None:  # noqa: F811
    responses, raw = talk(_port(fleet), post("/generate", {"text": "old client", "stream": True}, version="1.0"), 1)
    assert responses == [], "an HTTP/1.0 answer has no framing: it ends with the connection"
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 ") and b"transfer-encoding" not in head.lower(), head
    assert b"connection: close" in head.lower()
    events = _events(body)
    assert events[-1] == "[DONE]" and json.loads(events[-2])["text"].startswith("decoded "), body


def test_relayed_refusals_keep_their_shape_on_the_gateways_cycle(fleet: Fleet) -> None:  # noqa: F811
    """The relay's own refusals (not JSON, over the body limit declared) and a worker's 4xx, each with the request
    id, and the connection kept for the next request."""
    bad = b"POST /generate HTTP/1.1\r\nHost: x\r\nx-request-id: bad-json\r\nContent-Length: 5\r\n\r\nnope!"
    worker_400 = post("/generate", {"text": "PREFILL_400 refuse"}, {"x-request-id": "w400"})
    fine = post("/generate", {"text": "after refusals"}, {"x-request-id": "fine"})
    responses, raw = talk(_port(fleet), bad + worker_400 + fine, 3)
    assert [r[0] for r in responses] == [400, 400, 200], raw[-500:]
    (_, h1, b1), (_, h2, _), (_, h3, b3) = responses
    assert json.loads(b1)["error"]["type"] == "invalid_request_error" and "not valid JSON" in b1.decode()
    assert [h["x-request-id"] for h in (h1, h2, h3)] == ["bad-json", "w400", "fine"]
    assert json.loads(b3)["text"].startswith("decoded ")


def test_a_relayed_body_declared_too_large_is_a_413_while_the_queue_is_full(tmp_path: Path) -> None:
    """As on the native routes: a Content-Length over --max-body-bytes is a 413 at once, before the admission
    queue is looked at (with the queue full the relay answered 429: a client told to retry what can never pass)."""
    procs = Procs(tmp_path)
    try:
        prefill = start_standin(procs, "prefill", tmp_path / "prefill.jsonl")
        decode = start_standin(procs, "decode", tmp_path / "decode.jsonl")
        port = start_gateway(procs, "--prefill", f"http://127.0.0.1:{prefill}", "none",
                             "--decode", f"http://127.0.0.1:{decode}", "--max-concurrent-requests", "1",
                             "--max-queued-requests", "1", "--queue-timeout-s", "30", "--max-body-bytes", "4096")
        waiting = post("/generate", {"text": "DECODE_WAITS holds the slot"})  # (its decode waits up to 30 s)
        with socket.create_connection(("127.0.0.1", port), timeout=30) as held, \
                socket.create_connection(("127.0.0.1", port), timeout=30) as queued:
            held.sendall(waiting)
            time.sleep(0.5)  # (the one slot is taken)
            queued.sendall(post("/generate", {"text": "queued behind it"}))
            time.sleep(0.5)  # (the one queue place is taken)
            head = b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            ((status, _, body),), _ = talk(port, head + b"Content-Length: 10000000\r\n\r\n", 1)
        assert status == 413 and "exceeds 4096 bytes" in json.loads(body)["error"]["message"], (status, body)
    finally:
        procs.stop_all()
