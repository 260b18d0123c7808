"""A decode worker's stream that sends bytes and no event boundary (``\\n\\n``): one endless ``data:`` line, or garbage.

The relay held every byte of the incomplete event, waiting for its end (memory until the request's timeout, minutes
by default, and each chunk copied the whole pending event again). It now holds at most ``MAX_EVENT_BYTES`` of one
event (patched down here): before the first event that is the decode's failure, a 502 once retried as a broken
stream is; after it the client's stream ends as a broken one's (its whole events, an error event, ``data: [DONE]``).
Either way the decode's connection is closed, so its bytes stop: the stub worker sees its writes fail.
"""

from __future__ import annotations

import asyncio
import json
import random
from dataclasses import dataclass
from typing import Any

import pytest
from aiohttp import web
from relay_harness import Exchange, Handler, call, jbody, relay

from gateway import sglang_relay
from gateway.sglang_fleet import RelayConfig

LIMIT = 64 << 10
EVENT = b'data: {"text": "a", "meta_info": {"finish_reason": null}}\n\n'
LAST = b'data: {"text": "ab", "meta_info": {"finish_reason": {"type": "length"}}}\n\n'
DONE = b"data: [DONE]\n\n"


@dataclass
class Decode:
    num_calls: int = 0
    num_closed: int = 0  # requests whose connection the gateway closed while the worker still wrote
    stop: asyncio.Event | None = None


async def prefill(request: web.Request) -> web.Response:
    await request.read()
    return web.json_response({"text": "", "meta_info": {}})


def _decode(state: Decode, first: bytes) -> Handler:
    async def decode(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        state.num_calls += 1
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        if body["text"] == "good":
            await response.write(EVENT + LAST + DONE)
            await response.write_eof()
            return response
        assert state.stop is not None
        sent = 0
        try:
            await response.write(first + b'data: {"text": "')
            # One event that never ends: fast up to 16 times the bound, then a byte at a time (a worker that keeps the
            # stream alive), until the gateway closes the connection or the test ends.
            while not state.stop.is_set():
                piece = b"x" * 4096 if sent < 16 * LIMIT else b"x"
                await response.write(piece)
                sent += len(piece)
                await asyncio.sleep(0 if sent < 16 * LIMIT else 0.02)
        except ConnectionError:
            state.num_closed += 1
        except asyncio.CancelledError:
            state.num_closed += 1
            raise
        return response

    return decode


def _run(first: bytes, monkeypatch: pytest.MonkeyPatch) -> tuple[Exchange, Exchange, Decode, int]:
    # (raising=False: without the bound, the test fails on what the relay does, not on the patch)
    monkeypatch.setattr(sglang_relay, "MAX_EVENT_BYTES", LIMIT, raising=False)
    state = Decode()

    async def main() -> tuple[Exchange, Exchange, Decode, int]:
        state.stop = asyncio.Event()
        config = RelayConfig(retry_backoff_s=0.01, max_retries=1, first_byte_timeout_s=60.0, read_timeout_s=60.0)
        async with relay(prefill, _decode(state, first), config=config) as (responder, fleet):
            try:
                bad = Exchange(jbody({"text": "bad", "stream": True}))
                await asyncio.wait_for(call(responder, bad), 20.0)  # (a hang guard: the timeouts above are longer)
                # The decode's writes fail once its connection is closed (its handler may also be cancelled).
                async with asyncio.timeout(10.0):
                    while state.num_closed < state.num_calls:
                        await asyncio.sleep(0.01)
                failures = fleet.decodes[0].health.breaker._failures  # (consecutive: the good request clears them)
                good = Exchange(jbody({"text": "good", "stream": True}))  # the gateway still serves
                await asyncio.wait_for(call(responder, good), 20.0)
            finally:
                state.stop.set()
            return bad, good, state, failures

    return asyncio.run(main())


def _error(content: bytes) -> dict[str, Any]:
    error = json.loads(content)["error"]
    assert isinstance(error, dict)
    return error


def test_an_endless_first_event_is_the_decodes_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    bad, good, decode, failures = _run(b"", monkeypatch)
    assert bad.status == 502, bad.content
    error = _error(bad.content)
    assert error["code"] == "worker_failed" and error["type"], error
    assert "one event" in error["message"] and f"{LIMIT}" in error["message"], error
    assert decode.num_calls == 3, "retried as a stream broken before its first event (max_retries=1), then good"
    assert decode.num_closed == 2, "each attempt's decode connection was closed"
    assert failures == 2, "held against the decode, as a broken stream"
    assert good.status == 200 and good.content == EVENT + LAST + DONE, good.content


def test_an_endless_event_after_the_first_ends_the_stream_with_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    bad, good, decode, failures = _run(EVENT, monkeypatch)
    assert bad.status == 200  # (the head went out with the first event)
    events = bad.content.split(b"\n\n")
    assert bad.content.startswith(EVENT), bad.content[:200]
    assert bad.content.endswith(DONE) and len(events) == 4, bad.content[:200]  # event, error, [DONE], ""
    assert b'"text": "x' not in bad.content, "no piece of the incomplete event"
    error = _error(events[1].removeprefix(b"data: "))
    assert error["type"] and "one event" in error["message"], error
    assert decode.num_calls == 2 and decode.num_closed == 1, "not retried once begun; its connection closed"
    assert failures == 1, "held against the decode, as a broken stream"
    assert good.status == 200 and good.content == EVENT + LAST + DONE, good.content


def _old_split(pending: bytes, chunks: list[bytes]) -> tuple[list[bytes], bytes]:
    """What the relay relayed before: events cut by ``(pending + chunk).rpartition(b"\\n\\n")``."""
    out = []
    for chunk in chunks:
        events, boundary, pending = (pending + chunk).rpartition(b"\n\n")
        out.append(events + boundary)
    return out, pending


def test_the_event_splitter_relays_what_the_old_one_did() -> None:
    rng = random.Random(7)
    for _ in range(3000):
        stream = bytes(rng.choice(b"ab\n\n:") for _ in range(rng.randrange(0, 60)))
        cuts = sorted(rng.sample(range(1, len(stream)), min(len(stream) - 1, rng.randrange(0, 8)))) \
            if len(stream) > 1 else []
        chunks = [stream[i:j] for i, j in zip([0, *cuts], [*cuts, len(stream)], strict=True) if stream[i:j]]
        first = rng.choice([b"", b"a", b"\n", b"ab\n"])  # (``_stream`` begins with what ``_first_events`` left)
        events = sglang_relay._Events(first)
        got = [events.feed(chunk) for chunk in chunks]
        expected, pending = _old_split(first, chunks)
        assert got == expected, (first, chunks)
        assert events.pending == pending and events.num_pending_bytes == len(pending), (first, chunks)
