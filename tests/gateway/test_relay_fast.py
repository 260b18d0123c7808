"""The SGLang relay's shortcuts answer as the longer ways they replace (``gateway/sglang_relay.py``,
``gateway/worker_http.py``, ``gateway/sglang_fleet.py``)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from gateway import sglang_relay
from gateway.errors import BadRequest
from gateway.health import HealthConfig
from gateway.sglang_fleet import HttpWorker
from gateway.worker_http import _headers


def _one_at_a_time(lines: list[tuple[bytes, bytes]]) -> dict[str, str]:
    """How ``on_header`` made the headers before: a line at a time, the first of each name kept."""
    headers: dict[str, str] = {}
    for name, value in lines:
        headers.setdefault(name.decode("latin-1").lower(), value.decode("latin-1"))
    return headers


@pytest.mark.parametrize("lines", [
    [],
    [(b"Content-Type", b"text/event-stream"), (b"Content-Length", b"12")],
    [(b"X-A", b"1"), (b"x-a", b"2"), (b"X-B", b""), (b"x-A", b"3")],  # (a name again: its first value kept)
    [(b"Retry-After", b"\xe9t\xe9"), (b"SERVER", b"uvicorn")],  # (a value's bytes above 0x7f, as latin-1)
])
def test_headers_made_at_once_are_those_made_line_by_line(lines: list[tuple[bytes, bytes]]) -> None:
    made = _headers(lines)
    assert made == _one_at_a_time(lines)
    assert list(made) == list(_one_at_a_time(lines))  # (in the same order)


def test_a_response_head_is_a_stream_only_with_an_event_stream_content_type() -> None:
    async def main() -> None:
        got: list[Any] = []

        async def send(message: Any) -> None:
            got.append(message)

        sent = sglang_relay._Sent(send)
        assert not sent.stream
        await sent({"type": "http.response.start", "status": 200,
                    "headers": [(b"cache-control", b"no-cache"), (b"content-type", b"text/event-stream")]})
        assert sent.started and sent.status == 200 and sent.stream and not sent.complete
        await sent({"type": "http.response.body", "body": b"x", "more_body": False})
        assert sent.complete and len(got) == 2

        whole = sglang_relay._Sent(send)
        await whole({"type": "http.response.start", "status": 502,
                     "headers": [(b"content-type", b"application/json")]})
        assert whole.started and whole.status == 502 and not whole.stream

    asyncio.run(main())


def test_a_sent_callback_is_sent() -> None:
    worker = HttpWorker("http://127.0.0.1:1", "decode", None, HealthConfig())
    first, second = worker.opened(), worker.opened()
    assert worker.last_rid == first - 1
    worker.sent_callback(first)(object())  # (called as a future's done callback: with the future)
    assert worker.last_rid == second - 1
    worker.sent_callback(first)(object())  # (again: nothing)
    worker.sent(second)
    assert worker.last_rid == second


def test_a_chat_request_without_n_needs_one_scalar_room() -> None:
    assert sglang_relay.batch_size("chat", {"messages": []}) is None
    assert sglang_relay.batch_size("chat", {"messages": [], "n": 1}) is None
    assert sglang_relay.batch_size("chat", {"messages": [], "n": 3}) == 3
    with pytest.raises(BadRequest):
        sglang_relay.batch_size("chat", {"messages": [], "n": 0})
