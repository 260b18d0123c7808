"""The gateway's ASGI app: OpenAI routes, SGLang ``/generate``, health, metrics and the admin API.

Lifecycle (``create_app(config)`` + the Starlette lifespan):
1. Startup: the ``Gateway`` runtime (``gateway/runtime.py``) connects to every worker and loads the
   tokenizer. The app is wrapped in pure ASGI middleware (``gateway/middleware.py``): request id
   and context, drain refusal, API keys.
2. Requests: admission (a slot, or a bounded wait, or 429) -> decode and validate the body ->
   ``Frontend`` -> dispatcher -> SSE or JSON response; the slot is released when the response (or
   the stream) ends. Every error is one ``APIError`` mapped to an OpenAI-shaped body with its
   status code; once a stream has started, errors become an ``error`` event followed by ``[DONE]``.
3. ``/health``: the process is alive (200, with the workers' state); ``/readiness``: 200 only with
   a selectable prefill and decode (or combined) worker and not draining.
4. Shutdown (after the server's drain): close every worker connection (open requests are aborted
   worker-side when the connection drops).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

import msgspec
from prometheus_client import generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from gateway.admin import admin_routes
from gateway.api import SSE_DONE, Frontend, Prepared, decode_body, error_event, new_id, now_s, sse
from gateway.api_models import ChatCompletionRequest, CompletionRequest, GenerateRequest
from gateway.errors import APIError, PayloadTooLarge
from gateway.middleware import GatekeeperMiddleware, RequestContextMiddleware
from gateway.runtime import Gateway, GatewayConfig
from gateway.text import ChoiceState

log = logging.getLogger(__name__)
_json = msgspec.json.Encoder()
DISCONNECT_POLL_S = 0.5
T = TypeVar("T")


class ClientGone(APIError):
    """The client closed the connection before a non-streaming response was ready (nginx's 499)."""

    status = 499
    type = "client_closed_request"

    def __init__(self) -> None:
        super().__init__("client closed the connection")


def _usage(prompt_tokens: int, choices: list[ChoiceState]) -> dict[str, Any]:
    completion = sum(len(c.token_ids) for c in choices)
    cached = max((c.cached_tokens for c in choices), default=0)
    return {
        "prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


__all__ = ["Gateway", "GatewayConfig", "create_app"]


def create_app(config: GatewayConfig) -> Any:
    """The ASGI app (middleware around Starlette); ``app.state.gateway`` is the ``Gateway``."""
    gw = Gateway(config)

    async def read_body(request: Request) -> bytes:
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > config.max_body_bytes:
            raise PayloadTooLarge(f"request body exceeds {config.max_body_bytes} bytes")
        body = b""
        async for chunk in request.stream():
            body += chunk
            if len(body) > config.max_body_bytes:
                raise PayloadTooLarge(f"request body exceeds {config.max_body_bytes} bytes")
        return body

    def handler(route: str, run: Any, *, admit: bool = True) -> Any:
        async def endpoint(request: Request) -> Response:
            release = None
            try:
                if admit:
                    release = await gw.admission.admit()
                response: Response = await run(request)
            except APIError as exc:
                if release is not None:
                    release()
                gw.metrics.requests.labels(route, str(exc.status)).inc()
                log.log(logging.WARNING if exc.status >= 500 else logging.INFO, "%s -> %d %s: %s", route,
                        exc.status, exc.type, exc.message)
                return exc.to_response()
            except BaseException:
                if release is not None:
                    release()
                raise
            gw.metrics.requests.labels(route, str(response.status_code)).inc()
            if release is not None:
                if isinstance(response, StreamingResponse):  # the slot is held until the stream ends
                    response.body_iterator = _release_after(response.body_iterator, release)
                else:
                    release()
            return response

        return endpoint

    async def collect(request: Request, frontend: Frontend, prep: Prepared) -> list[ChoiceState]:
        """Run a non-streaming request to the end; a client that hangs up aborts it on both workers."""
        states: dict[int, ChoiceState] = {}

        async def run() -> None:
            async for state, _, _ in frontend.run_choices(prep):
                states[state.index] = state

        gw.metrics.active.inc()
        try:
            await until_disconnect(request, run())
        finally:
            gw.metrics.active.dec()
        return [states[i] for i in sorted(states)]

    def stream(prep: Prepared, events: Any) -> StreamingResponse:
        async def body() -> AsyncIterator[bytes]:
            gw.metrics.active.inc()
            try:
                async for chunk in events:
                    yield chunk
            except APIError as exc:
                yield error_event(exc)
            finally:
                gw.metrics.active.dec()
            yield SSE_DONE

        return StreamingResponse(body(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def first_event_or_error(request: Request, events: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        """Start the stream only after the first chunk, so early failures get a real status code.

        Until then no response exists and the server would not notice a client hanging up: watch.
        """
        try:
            first = await until_disconnect(request, events.__anext__())
        except StopAsyncIteration:
            first = b""

        async def chain() -> AsyncIterator[bytes]:
            yield first
            async for chunk in events:
                yield chunk

        return chain()

    # -- /v1/chat/completions -----------------------------------------------------------------
    async def chat(request: Request) -> Response:
        frontend = gw.require_frontend()
        req = decode_body(await read_body(request), ChatCompletionRequest)
        prep = frontend.prepare_chat(req)
        rid, created = new_id("chatcmpl"), now_s()
        if prep.stream:
            return stream(prep, await first_event_or_error(request, chat_events(frontend, prep, rid, created)))
        choices = await collect(request, frontend, prep)
        return _reply({
            "id": rid, "object": "chat.completion", "created": created, "model": frontend.model_name,
            "choices": [{
                "index": c.index, "message": {"role": "assistant", "content": c.text},
                "logprobs": {"content": c.logprobs} if prep.want_logprobs else None,
                "finish_reason": c.finish_reason,
            } for c in choices],
            "usage": _usage(len(prep.input_ids), choices),
        })

    async def chat_events(frontend: Frontend, prep: Prepared, rid: str, created: int) -> AsyncIterator[bytes]:
        def chunk(choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> bytes:
            payload: dict[str, Any] = {"id": rid, "object": "chat.completion.chunk", "created": created,
                                       "model": frontend.model_name, "choices": choices}
            if prep.include_usage:
                payload["usage"] = usage
            return sse(payload)

        states: dict[int, ChoiceState] = {}
        events = frontend.run_choices(prep)
        started: set[int] = set()
        async for state, text, entries in events:
            states[state.index] = state
            delta: dict[str, Any] = {"content": text}
            if state.index not in started:
                started.add(state.index)
                delta["role"] = "assistant"
            if text or entries or state.finish_reason is not None or delta.get("role"):
                yield chunk([{
                    "index": state.index, "delta": delta,
                    "logprobs": {"content": entries} if prep.want_logprobs else None,
                    "finish_reason": state.finish_reason,
                }])
        if prep.include_usage:
            yield chunk([], _usage(len(prep.input_ids), list(states.values())))

    # -- /v1/completions -----------------------------------------------------------------------
    async def completions(request: Request) -> Response:
        frontend = gw.require_frontend()
        req = decode_body(await read_body(request), CompletionRequest)
        prep = frontend.prepare_completion(req)
        rid, created = new_id("cmpl"), now_s()
        if prep.stream:
            return stream(prep, await first_event_or_error(request, completion_events(frontend, prep, rid, created)))
        choices = await collect(request, frontend, prep)
        prompt_text = frontend.tokenizer.decode(prep.input_ids) if prep.echo else ""
        return _reply({
            "id": rid, "object": "text_completion", "created": created, "model": frontend.model_name,
            "choices": [{
                "index": c.index, "text": prompt_text + c.text, "finish_reason": c.finish_reason,
                "logprobs": _legacy_logprobs(_echo_entries(frontend, prep, c) + c.logprobs)
                if prep.want_logprobs else None,
            } for c in choices],
            "usage": _usage(len(prep.input_ids), choices),
        })

    async def completion_events(frontend: Frontend, prep: Prepared, rid: str, created: int) -> AsyncIterator[bytes]:
        states: dict[int, ChoiceState] = {}
        prompt_text = frontend.tokenizer.decode(prep.input_ids) if prep.echo else ""
        async for state, text, entries in frontend.run_choices(prep):
            if state.index not in states:
                text = prompt_text + text
            states[state.index] = state
            if text or state.finish_reason is not None:
                payload: dict[str, Any] = {
                    "id": rid, "object": "text_completion", "created": created, "model": frontend.model_name,
                    "choices": [{"index": state.index, "text": text, "finish_reason": state.finish_reason,
                                 "logprobs": _legacy_logprobs(entries) if prep.want_logprobs else None}],
                }
                yield sse(payload)
        if prep.include_usage:
            yield sse({"id": rid, "object": "text_completion", "created": created, "model": frontend.model_name,
                       "choices": [], "usage": _usage(len(prep.input_ids), list(states.values()))})

    # -- /generate (SGLang native) ---------------------------------------------------------------
    async def generate(request: Request) -> Response:
        frontend = gw.require_frontend()
        req = decode_body(await read_body(request), GenerateRequest)
        prep, _ = frontend.prepare_generate(req)
        rid = req.rid or new_id("gen")

        def payload(state: ChoiceState) -> dict[str, Any]:
            meta: dict[str, Any] = {
                "id": rid, "prompt_tokens": len(prep.input_ids), "completion_tokens": len(state.token_ids),
                "cached_tokens": state.cached_tokens, "finish_reason": None,
            }
            if state.finish_reason is not None:
                if state.stop.matched is not None:
                    meta["finish_reason"] = {"type": "stop", "matched": state.stop.matched}
                elif state.finish_reason == "stop":
                    meta["finish_reason"] = {"type": "stop", "matched": state.token_ids[-1]}
                else:
                    meta["finish_reason"] = {"type": "length", "length": len(state.token_ids)}
            if prep.want_logprobs:
                meta["output_token_logprobs"] = [[e["logprob"], t, None] for e, t in
                                                 zip(state.logprobs, state.token_ids, strict=False)]
                if state.prompt_logprobs is not None:
                    meta["input_token_logprobs"] = [
                        [None if i == 0 or lp != lp else lp, t, None]  # lp != lp: NaN (no prefix row)
                        for i, (lp, t) in enumerate(zip(state.prompt_logprobs, prep.input_ids, strict=False))
                    ]
            return {"text": state.text, "output_ids": list(state.token_ids), "meta_info": meta}

        if prep.stream:
            async def events() -> AsyncIterator[bytes]:
                async for state, _, _ in frontend.run_choices(prep):
                    yield sse(payload(state))

            return stream(prep, await first_event_or_error(request, events()))
        return _reply(payload((await collect(request, frontend, prep))[0]))

    # -- models, health, metrics -----------------------------------------------------------------
    async def models(_: Request) -> Response:
        frontend = gw.require_frontend()
        return _reply({"object": "list", "data": [
            {"id": frontend.model_name, "object": "model", "created": now_s(), "owned_by": "pd-gateway"}]})

    def status() -> dict[str, Any]:
        ready = gw.dispatcher.is_ready() and not gw.is_draining
        return {
            "status": "draining" if gw.is_draining else "ok" if ready else "unavailable",
            "ready": ready,
            "policy": gw.router.name,
            "active_requests": gw.admission.num_active,
            "queued_requests": gw.admission.num_queued,
            "workers": [worker_status(gw, c) for c in gw.clients],
        }

    async def health(_: Request) -> Response:
        return _reply(status())  # liveness: this process answers

    async def readiness(_: Request) -> Response:
        body = status()
        return _reply(body, 200 if body["ready"] else 503)

    async def metrics(_: Request) -> Response:
        return Response(generate_latest(gw.metrics.registry), media_type="text/plain; version=0.0.4")

    async def http_error(request: Request, exc: Exception) -> Response:
        status = getattr(exc, "status_code", 500)
        kind = {404: "not_found_error", 405: "invalid_request_error"}.get(status, "internal_error")
        return _reply({"error": {"message": f"{getattr(exc, 'detail', 'error')}: {request.method} {request.url.path}",
                                 "type": kind, "param": None, "code": None}}, status)

    @contextlib.asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        await gw.start()
        try:
            yield
        finally:
            await gw.aclose()

    app = Starlette(
        routes=[
            Route("/v1/chat/completions", handler("chat", chat), methods=["POST"]),
            Route("/v1/completions", handler("completions", completions), methods=["POST"]),
            Route("/generate", handler("generate", generate), methods=["POST"]),
            Route("/v1/models", handler("models", models, admit=False), methods=["GET"]),
            Route("/health", health, methods=["GET"]),
            Route("/readiness", readiness, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
            *admin_routes(gw, lambda c: worker_status(gw, c)),
        ],
        exception_handlers={HTTPException: http_error},
        lifespan=lifespan,
    )
    app.state.gateway = gw
    guarded = GatekeeperMiddleware(app, api_keys=config.api_keys, admin_api_keys=config.admin_api_keys,
                                   metrics_require_admin=config.metrics_require_admin,
                                   is_draining=lambda: gw.is_draining)
    outer = RequestContextMiddleware(guarded)
    outer.state = app.state  # type: ignore[attr-defined]
    return outer


def worker_status(gw: Gateway, client: Any) -> dict[str, Any]:
    """One worker as ``/health`` and ``GET /workers`` show it."""
    return {**client.state.describe(), "healthy": client.healthy, "connected": client.is_connected,
            "draining": client.is_draining, **client.health.describe(), "error": client.last_error,
            "cached_pages": gw.router.index.num_pages(client.url)}


async def _release_after(body: Any, release: Any) -> AsyncIterator[Any]:
    try:
        async for chunk in body:
            yield chunk
    finally:
        release()


async def until_disconnect(request: Request, awaitable: Awaitable[T]) -> T:
    """Await ``awaitable``; if the client hangs up first, cancel it and raise ``ClientGone``."""
    task = asyncio.ensure_future(awaitable)
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if not task.done() and await request.is_disconnected():
                raise ClientGone()
        return task.result()
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


def _reply(body: Any, status: int = 200) -> Response:
    return Response(_json.encode(body), status_code=status, media_type="application/json")


def _legacy_logprobs(entries: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "tokens": [e["token"] for e in entries],
        "token_logprobs": [e["logprob"] for e in entries],
        "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]} if e["top_logprobs"] is not None
                         else None for e in entries],
    }


def _echo_entries(frontend: Frontend, prep: Prepared, choice: ChoiceState) -> list[dict[str, Any]]:
    """Prompt-token entries for ``echo`` + ``logprobs`` (the first token has no logprob)."""
    if not prep.echo:
        return []
    values = choice.prompt_logprobs or []
    entries = []
    for i, token_id in enumerate(prep.input_ids):
        lp = values[i] if i < len(values) else None
        entries.append({"token": frontend.tokenizer.decode([token_id]),
                        "logprob": None if i == 0 or lp is None or lp != lp else lp, "top_logprobs": None})
    return entries
