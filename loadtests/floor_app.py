"""The Python floor: a minimal raw ASGI app under the gateway's own uvicorn settings.

Whatever the gateway does per request on top of what this app does is the gateway's own cost; what
this app costs is what any Python server on uvicorn (uvloop + httptools) pays to answer at all.

Per request (any path, ``POST``): read the body, decode ``stream`` and ``max_tokens`` from it, then
- not streaming: one prebuilt chat-completion-shaped JSON body (``max_tokens`` characters of content,
  ``usage.completion_tokens == max_tokens``);
- streaming: ``max_tokens`` prebuilt SSE chunks of one character each, the first at once and one per
  tick of a shared ticker (every ``--token-gap-ms``; one timer for all streams, as the gateway is
  woken by one decode frame per step for all its streams), then ``data: [DONE]``.
The lifespan freezes the start-up objects out of the collector, as the gateway does.

    .venv/bin/python loadtests/floor_app.py --port 8100 [--token-gap-ms 2]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
import uvicorn

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

_JSON_HEADERS = [(b"content-type", b"application/json")]
_SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
                (b"x-accel-buffering", b"no")]
_ID = "chatcmpl-floor0000000000000000000000000000"
_json = msgspec.json.Encoder()


class _Body(msgspec.Struct):
    stream: bool = False
    max_tokens: int = 16


_decode_body = msgspec.json.Decoder(_Body).decode


def _completion(num_tokens: int) -> bytes:
    return _json.encode({
        "id": _ID, "object": "chat.completion", "created": 0, "model": "floor",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "a" * num_tokens},
                     "logprobs": None, "finish_reason": "length"}],
        "usage": {"prompt_tokens": 1, "completion_tokens": num_tokens, "total_tokens": num_tokens + 1},
    })


def _chunk(first: bool, last: bool) -> bytes:
    delta = {"content": "a", "role": "assistant"} if first else {"content": "a"}
    payload = {"id": _ID, "object": "chat.completion.chunk", "created": 0, "model": "floor",
               "choices": [{"index": 0, "delta": delta, "logprobs": None,
                            "finish_reason": "length" if last else None}]}
    return b"data: " + _json.encode(payload) + b"\n\n"


_FIRST, _MIDDLE, _LAST, _ONLY = _chunk(True, False), _chunk(False, False), _chunk(False, True), _chunk(True, True)
_DONE = b"data: [DONE]\n\n"


class Ticker:
    """One timer for every stream: ``next()`` is a future resolved at the next tick (fixed schedule)."""

    def __init__(self, gap_s: float) -> None:
        self.gap_s = gap_s
        self._future: asyncio.Future[None] | None = None
        self._next_t = 0.0

    def next(self) -> asyncio.Future[None]:
        if self._future is None:
            loop = asyncio.get_running_loop()
            self._future = loop.create_future()
            self._next_t = max(self._next_t + self.gap_s, loop.time())
            loop.call_at(self._next_t, self._fire)
        return self._future

    def _fire(self) -> None:
        future, self._future = self._future, None
        if future is not None and not future.done():
            future.set_result(None)


class FloorApp:
    def __init__(self, token_gap_ms: float) -> None:
        self.ticker = Ticker(token_gap_ms / 1000.0)
        self._bodies: dict[int, bytes] = {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        message = await receive()
        body = message.get("body", b"")
        while message.get("more_body", False):
            message = await receive()
            body += message.get("body", b"")
        try:
            req = _decode_body(body) if body else _Body()
        except msgspec.DecodeError:
            req = _Body()
        num_tokens = max(1, req.max_tokens)
        if not req.stream:
            data = self._bodies.get(num_tokens)
            if data is None:
                data = self._bodies[num_tokens] = _completion(num_tokens)
            await send({"type": "http.response.start", "status": 200,
                        "headers": [*_JSON_HEADERS, (b"content-length", b"%d" % len(data))]})
            await send({"type": "http.response.body", "body": data})
            return
        await send({"type": "http.response.start", "status": 200, "headers": _SSE_HEADERS})
        await send({"type": "http.response.body", "body": _ONLY if num_tokens == 1 else _FIRST, "more_body": True})
        for i in range(1, num_tokens):
            await self.ticker.next()
            await send({"type": "http.response.body", "body": _LAST if i == num_tokens - 1 else _MIDDLE,
                        "more_body": True})
        await send({"type": "http.response.body", "body": _DONE, "more_body": False})

    @staticmethod
    async def _lifespan(receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                gc.collect()
                gc.freeze()
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="floor_app", description=__doc__.splitlines()[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8100)
    p.add_argument("--token-gap-ms", type=float, default=2.0, help="streaming: one chunk per tick of this gap")
    p.add_argument("--log-level", default="warning")
    args = p.parse_args(argv)
    # The gateway's settings (gateway/cli.py): uvloop, httptools, no access log, no proxy headers.
    config = uvicorn.Config(FloorApp(args.token_gap_ms), host=args.host, port=args.port, loop="uvloop",
                            http="httptools", log_level=args.log_level, access_log=False, log_config=None,
                            proxy_headers=False)
    uvicorn.Server(config).run()


if __name__ == "__main__":
    main()
