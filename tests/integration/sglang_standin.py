"""A stand-in SGLang PD worker, written from SGLang's HTTP protocol, for the gateway's SGLang path tests.

It speaks only HTTP (no native protocol, no KV): ``GET /health``, ``GET /get_model_info``, and
``POST /generate``, ``/v1/completions``, ``/v1/chat/completions``. Every request's bootstrap fields
are appended as one JSON line to ``--log`` (``{"event": "request", "route", "bootstrap_host",
"bootstrap_port", "bootstrap_room", "text", "stream", "traceparent", "tracestate"}``), and a decode
whose client went away before it answered logs ``{"event": "cancelled", "bootstrap_room"}``.

Behaviour, chosen by the prompt (``text``, ``prompt`` or the last message's ``content``):
- contains ``PREFILL_400`` / ``PREFILL_500`` / ``DECODE_500``: that side answers with that status (a
  400 after 0.5 s, so that the decode, asked concurrently, has received the request by then);
- contains ``DECODE_WAITS`` or ``PREFILL_``: the decode waits up to 30 s before answering (a decode
  left waiting for KV that never comes); with ``HEAD_FIRST`` too, a streaming decode sends its
  response head at once and waits after it, as SGLang's does (logging ``waiting``, then
  ``cancelled`` when its stream is closed);
- contains ``DECODE_429``: the decode answers 429 with ``Retry-After: 7`` (busy); ``DECODE_503``: 503 with
  ``Retry-After: 7`` (its request queue full, as SGLang's server answers it);
- contains ``DECODE_SLOW_HEAD``: the decode answers after 2 s (our workers send a stream's head with
  its first token);
- contains ``DECODE_BREAKS``: a streaming decode sends one event and half of the next, then its
  connection breaks; with ``DECODE_500`` too, it answers 500 and breaks off in the middle of its body;
- contains ``SLOW_PREFILL``: the prefill answers after 5 s;
- ``/generate`` with a list of ``text`` (a batch): each side answers one item per prompt (a JSON list, or
  one event per item with its ``index``), the prefill's with its prompt's logprobs, the decode's with
  ``[[-1.0, i, None]]`` for item ``i``;
- otherwise the prefill answers at once with ``meta_info.input_token_logprobs`` (one entry per
  prompt character; as SSE when streaming), and the decode answers ``"decoded <room>"`` (streamed as
  one event per word for ``/generate``, cumulative; OpenAI chunks for the OpenAI routes).

With ``--api-key KEY`` every request, ``/health`` included (stricter than SGLang, which lets its health
checks through), needs ``Authorization: Bearer KEY``; others get 401 and are logged as
``{"event": "unauthorized", "path"}``.

    python tests/integration/sglang_standin.py --role prefill|decode --port N --log FILE [--api-key KEY]
"""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route


def prompt_of(body: dict[str, Any]) -> str:
    if isinstance(body.get("text"), str):
        return body["text"]
    if isinstance(body.get("text"), list):  # a batch: its behaviour is chosen by all its prompts together
        return " ".join(str(t) for t in body["text"])
    if isinstance(body.get("prompt"), str):
        return body["prompt"]
    messages = body.get("messages") or [{}]
    return str(messages[-1].get("content", ""))


def log_to(log_path: Path, **entry: Any) -> None:
    with log_path.open("a") as f:
        f.write(json.dumps(entry) + "\n")


def with_api_key(app: Any, key: str, log_path: Path) -> Any:
    """``app`` behind ``Authorization: Bearer KEY`` (401 otherwise)."""
    expected = f"Bearer {key}".encode()

    async def guarded(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and dict(scope["headers"]).get(b"authorization") != expected:
            log_to(log_path, event="unauthorized", path=scope["path"])
            await JSONResponse({"error": "Unauthorized"}, 401)(scope, receive, send)
            return
        await app(scope, receive, send)

    return guarded


def make_app(role: str, log_path: Path) -> Starlette:
    def log(**entry: Any) -> None:
        log_to(log_path, **entry)

    async def health(_: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def model_info(_: Request) -> Response:
        return JSONResponse({"model_path": "standin-model", "tokenizer_path": "standin-model", "is_generation": True})

    async def generate(request: Request) -> Response:
        body = await request.json()
        route = request.url.path.strip("/")
        text = prompt_of(body)
        room = body.get("bootstrap_room")
        log(event="request", route=route, bootstrap_host=body.get("bootstrap_host"),
            bootstrap_port=body.get("bootstrap_port"), bootstrap_room=room, text=text, stream=body.get("stream"),
            traceparent=request.headers.get("traceparent"), tracestate=request.headers.get("tracestate"))
        if f"{role.upper()}_400" in text:
            await asyncio.sleep(0.5)  # refuse after a moment, so the concurrent decode surely holds the request
            return JSONResponse({"error": {"message": f"{role} refuses", "type": "invalid_request_error"}}, 400)
        stream = bool(body.get("stream"))
        if role == "decode" and "DECODE_BREAKS" in text:
            async def broken() -> Any:
                yield 'data: {"text": "one"}\n\n' if "DECODE_500" not in text else '{"error": {"message": "de'
                await asyncio.sleep(0.05)
                yield 'data: {"text": "one tw'
                await asyncio.sleep(0.05)
                raise ConnectionError("the decode died")  # the server drops the connection mid-body

            return StreamingResponse(broken(), 500 if "DECODE_500" in text else 200, media_type="text/event-stream")
        if f"{role.upper()}_500" in text:
            return JSONResponse({"error": {"message": f"{role} broke", "type": "internal_error"}}, 500)
        if f"{role.upper()}_429" in text:
            return JSONResponse({"error": {"message": f"{role} is busy", "type": "overloaded"}}, 429,
                                headers={"retry-after": "7"})
        if f"{role.upper()}_503" in text:
            return JSONResponse({"error": {"message": "The request queue is full."}}, 503, headers={"retry-after": "7"})
        batch = body["text"] if route == "generate" and isinstance(body.get("text"), list) else None
        if batch is not None:  # one item per prompt (SGLang's batched /generate), each with its own logprobs
            rooms = room if isinstance(room, list) else [room] * len(batch)
            items = [{"index": i, "text": "" if role == "prefill" else f"decoded {rooms[i]}",
                      "meta_info": {"input_token_logprobs": [[-0.5, ord(c), None] for c in str(t)]
                                    if role == "prefill" else [[-1.0, i, None]]}} for i, t in enumerate(batch)]
            if not stream:
                return JSONResponse([{k: v for k, v in item.items() if k != "index"} for item in items])
            return Response("".join(f"data: {json.dumps(item)}\n\n" for item in items) + "data: [DONE]\n\n",
                            media_type="text/event-stream")
        if role == "prefill" and "SLOW_PREFILL" in text:
            await asyncio.sleep(5.0)  # (its reply comes long after the decode's stream began)
        if role == "prefill":
            meta = {"input_token_logprobs": [[-0.5, ord(c), None] for c in text]}
            if stream:
                event = json.dumps({"text": "", "meta_info": meta})
                return Response(f"data: {event}\n\ndata: [DONE]\n\n", media_type="text/event-stream")
            return JSONResponse({"text": "", "meta_info": meta})
        if role == "decode" and "DECODE_LONG" in text and stream:
            async def long() -> Any:  # one event, then a long pause (a long generation)
                yield 'data: {"text": "one"}\n\n'
                await asyncio.sleep(30)
                yield "data: [DONE]\n\n"

            return StreamingResponse(long(), media_type="text/event-stream")
        if role == "decode" and "DECODE_SLOW_HEAD" in text:
            await asyncio.sleep(2.0)
        if ("DECODE_WAITS" in text or "PREFILL_" in text) and "HEAD_FIRST" in text and stream:
            async def waiting() -> Any:  # the head is out; the KV never comes
                log(event="waiting", bootstrap_room=room)
                try:
                    await asyncio.sleep(30)
                    yield "data: [DONE]\n\n"
                finally:
                    log(event="cancelled", bootstrap_room=room)

            return StreamingResponse(waiting(), media_type="text/event-stream")
        if "DECODE_WAITS" in text or "PREFILL_" in text:  # its KV would never come
            for _ in range(300):
                if await request.is_disconnected():
                    log(event="cancelled", bootstrap_room=room)
                    return Response(status_code=499)
                await asyncio.sleep(0.1)
        words = ["decoded", str(room)]
        if route == "generate":
            if not stream:
                return JSONResponse({"text": " ".join(words), "meta_info": {"input_token_logprobs": []}})

            async def events() -> Any:
                for i in range(len(words)):
                    event = {"text": " ".join(words[: i + 1]), "meta_info": {"input_token_logprobs": []}}
                    yield f"data: {json.dumps(event)}\n\n"
                    await asyncio.sleep(0.01)
                yield "data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")
        chat = route.endswith("chat/completions")
        if not stream:
            choice = {"index": 0, "finish_reason": "stop",
                      **({"message": {"role": "assistant", "content": " ".join(words)}} if chat
                         else {"text": " ".join(words)})}
            return JSONResponse({"id": "standin", "object": "chat.completion" if chat else "text_completion",
                                 "model": "standin-model", "choices": [choice]})

        async def chunks() -> Any:
            for i, word in enumerate(words):
                piece = word if i == 0 else " " + word
                choice = {"index": 0, "finish_reason": "stop" if i == len(words) - 1 else None,
                          **({"delta": {"content": piece}} if chat else {"text": piece})}
                yield f"data: {json.dumps({'id': 'standin', 'choices': [choice]})}\n\n"
                await asyncio.sleep(0.01)
            yield "data: [DONE]\n\n"

        return StreamingResponse(chunks(), media_type="text/event-stream")

    return Starlette(routes=[
        Route("/health", health), Route("/get_model_info", model_info),
        Route("/generate", generate, methods=["POST"]), Route("/v1/completions", generate, methods=["POST"]),
        Route("/v1/chat/completions", generate, methods=["POST"]),
    ])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--role", choices=["prefill", "decode"], required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--log", required=True)
    ap.add_argument("--api-key", default=None)
    args = ap.parse_args()
    app: Any = make_app(args.role, Path(args.log))
    if args.api_key:
        app = with_api_key(app, args.api_key, Path(args.log))
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
