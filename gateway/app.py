"""The gateway's ASGI app: OpenAI routes, SGLang ``/generate``, health and metrics.

Lifecycle (``create_app(config)`` + the Starlette lifespan):
1. Startup: one ``WorkerClient`` per configured worker (persistent native connections), the
   router (policies, validated options, prefix index fed by the workers' KV events), the
   dispatcher; wait up to ``startup_timeout_s`` for workers, then load the tokenizer
   the first connected worker names.
2. Requests: decode and validate the body -> ``Frontend`` -> dispatcher -> SSE or JSON response.
   Every error is one ``APIError`` mapped to an OpenAI-shaped body with its status code; once a
   stream has started, errors become an ``error`` event followed by ``[DONE]``.
3. Shutdown: close every worker connection (open requests are aborted worker-side when the
   connection drops).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from gateway.api import SSE_DONE, Frontend, Prepared, decode_body, error_event, new_id, now_s, sse
from gateway.api_models import ChatCompletionRequest, CompletionRequest, GenerateRequest
from gateway.dispatch import DispatchConfig, Dispatcher
from gateway.errors import APIError, NoWorkers, PayloadTooLarge
from gateway.policies import parse_option_args
from gateway.router import Router
from gateway.text import ChoiceState
from gateway.tokenizer import load_tokenizer
from gateway.worker_client import WorkerClient
from gateway.worker_state import REFRESH_INTERVAL_S

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


@dataclass(frozen=True)
class GatewayConfig:
    prefill: tuple[str, ...] = ()
    decode: tuple[str, ...] = ()
    worker: tuple[str, ...] = ()  # combined (role both) workers, no disaggregation
    host: str = "127.0.0.1"
    port: int = 8000
    policy: str = "round_robin"
    prefill_policy: str | None = None  # default: ``policy``
    decode_policy: str | None = None  # default: ``policy``
    policy_options: tuple[str, ...] = ()  # K=V, prefill.K=V, decode.K=V
    load_stale_s: float = 1.0  # a worker's load report older than this is ignored (own counts used)
    assume_ttl_s: float = 2.0  # how long a routed prompt counts as cached on its prefill before events
    model_name: str | None = None
    tokenizer: str | None = None
    startup_timeout_s: float = 60.0
    first_token_timeout_s: float = 300.0
    stream_idle_timeout_s: float = 120.0
    request_timeout_s: float = 1800.0
    max_retries: int = 2
    max_body_bytes: int = 8 * 1024 * 1024
    default_max_tokens: int = 256

    def __post_init__(self) -> None:
        if self.worker and (self.prefill or self.decode):
            raise ValueError("worker: use either --worker (combined) or --prefill/--decode, not both")
        if not self.worker and not (self.prefill and self.decode):
            raise ValueError("prefill/decode: give at least one --prefill and one --decode URL (or --worker)")
        if not self.load_stale_s > 0:
            raise ValueError("load_stale_s must be positive")
        if not self.assume_ttl_s >= 0:
            raise ValueError("assume_ttl_s must be >= 0")


class Gateway:
    """Runtime state behind the app (separate from the frozen config)."""

    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        stale_s = config.load_stale_s
        self.prefills = [WorkerClient(u, "prefill", stale_after_s=stale_s) for u in config.prefill]
        self.decodes = [WorkerClient(u, "decode", stale_after_s=stale_s) for u in config.decode] or [
            WorkerClient(u, "both", stale_after_s=stale_s) for u in config.worker
        ]
        self.router = Router.build(config.prefill_policy or config.policy, config.decode_policy or config.policy,
                                   parse_option_args(config.policy_options), assume_ttl_s=config.assume_ttl_s)
        for client in self.prefills + self.decodes:
            client.on_up = lambda c: self.router.worker_added(c.state)
            client.on_down = lambda c: self.router.worker_removed(c.state)
            client.on_kv_events = lambda c, events: self.router.kv_events(c.state, events)
        self.dispatcher = Dispatcher(
            self.prefills, self.decodes, self.router,
            DispatchConfig(config.first_token_timeout_s, config.stream_idle_timeout_s, config.request_timeout_s,
                           config.max_retries),
        )
        self.frontend: Frontend | None = None
        self._refresher: asyncio.Task[None] | None = None
        self.registry = CollectorRegistry()
        self.requests = Counter("pd_gateway_requests", "Requests by route and status", ["route", "status"],
                                registry=self.registry)
        self.active = Gauge("pd_gateway_active_requests", "Requests in flight", registry=self.registry)
        self.registry.register(RoutingCollector(self))

    @property
    def clients(self) -> list[WorkerClient]:
        return self.prefills + self.decodes

    async def start(self) -> None:
        for client in self.clients:
            client.start()
        self._refresher = asyncio.create_task(self._refresh_load_states(), name="load-freshness")
        await asyncio.gather(*(c.wait_ready(self.config.startup_timeout_s) for c in self.clients))
        ready = [c for c in self.clients if c.info is not None]
        if not ready:
            log.warning("no worker answered within %.0fs; serving 503 until one does", self.config.startup_timeout_s)
            return
        self._init_frontend(ready[0])

    def _init_frontend(self, client: WorkerClient) -> None:
        info = client.info
        assert info is not None
        tokenizer = load_tokenizer(self.config.tokenizer or info.tokenizer)
        max_context = min(c.info.max_context for c in self.clients if c.info is not None)
        self.frontend = Frontend(self.dispatcher, tokenizer, self.config.model_name or info.model, max_context,
                                 self.config.default_max_tokens)

    def require_frontend(self) -> Frontend:
        if self.frontend is None:
            ready = [c for c in self.clients if c.info is not None]
            if not ready:
                raise NoWorkers("no worker is connected yet", retry_after_s=2.0)
            self._init_frontend(ready[0])
        assert self.frontend is not None
        return self.frontend

    async def _refresh_load_states(self) -> None:
        """Workers report on change; a silent one must still turn stale (then own counts are used)."""
        while True:
            await asyncio.sleep(REFRESH_INTERVAL_S)
            for client in self.clients:
                client.state.refresh()

    async def aclose(self) -> None:
        if self._refresher is not None:
            self._refresher.cancel()
            await asyncio.gather(self._refresher, return_exceptions=True)
        await asyncio.gather(*(c.aclose() for c in self.clients), return_exceptions=True)


def _usage(prompt_tokens: int, choices: list[ChoiceState]) -> dict[str, Any]:
    completion = sum(len(c.token_ids) for c in choices)
    cached = max((c.cached_tokens for c in choices), default=0)
    return {
        "prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def create_app(config: GatewayConfig) -> Starlette:
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

    def handler(route: str, run: Any) -> Any:
        async def endpoint(request: Request) -> Response:
            try:
                response: Response = await run(request)
            except APIError as exc:
                gw.requests.labels(route, str(exc.status)).inc()
                return exc.to_response()
            gw.requests.labels(route, str(response.status_code)).inc()
            return response

        return endpoint

    async def collect(request: Request, frontend: Frontend, prep: Prepared) -> list[ChoiceState]:
        """Run a non-streaming request to the end; a client that hangs up aborts it on both workers."""
        states: dict[int, ChoiceState] = {}

        async def run() -> None:
            async for state, _, _ in frontend.run_choices(prep):
                states[state.index] = state

        gw.active.inc()
        try:
            await until_disconnect(request, run())
        finally:
            gw.active.dec()
        return [states[i] for i in sorted(states)]

    def stream(prep: Prepared, events: Any) -> StreamingResponse:
        async def body() -> AsyncIterator[bytes]:
            gw.active.inc()
            try:
                async for chunk in events:
                    yield chunk
            except APIError as exc:
                yield error_event(exc)
            finally:
                gw.active.dec()
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

    async def health(_: Request) -> Response:
        prefills, decodes = gw.dispatcher.healthy_workers()
        ok = bool(decodes) and (bool(prefills) or not gw.dispatcher.is_disaggregated)
        body = {
            "status": "ok" if ok else "unavailable",
            "policy": gw.router.name,
            "workers": [{**c.state.describe(), "healthy": c.healthy, "error": c.last_error,
                         "cached_pages": gw.router.index.num_pages(c.url)} for c in gw.clients],
        }
        return _reply(body, 200 if ok else 503)

    async def metrics(_: Request) -> Response:
        return Response(generate_latest(gw.registry), media_type="text/plain; version=0.0.4")

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
            Route("/v1/models", handler("models", models), methods=["GET"]),
            Route("/health", health, methods=["GET"]),
            Route("/readiness", health, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
        ],
        exception_handlers={HTTPException: http_error},
        lifespan=lifespan,
    )
    app.state.gateway = gw
    return app


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


class RoutingCollector:
    """Prometheus collector read at scrape time: per-worker load as routing sees it, policy figures."""

    def __init__(self, gw: Gateway) -> None:
        self.gw = gw

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Any:
        from prometheus_client.core import GaugeMetricFamily

        gauges = {
            "prefill_tokens": "Prompt tokens queued or running (worker report + unacknowledged dispatches)",
            "running_seqs": "Sequences holding KV on the worker",
            "waiting_seqs": "Sequences admitted but waiting",
            "free_pages": "KV pages free after admitted and reserved requests",
            "active_requests": "Requests this gateway has open on the worker",
        }
        families = {k: GaugeMetricFamily(f"pd_gateway_worker_{k}", doc, labels=["worker", "role"])
                    for k, doc in gauges.items()}
        fresh = GaugeMetricFamily("pd_gateway_worker_load_fresh", "1 if the worker's load report is fresh",
                                  labels=["worker", "role"])
        for c in self.gw.clients:
            st, labels = c.state, [c.url, c.role]
            families["prefill_tokens"].add_metric(labels, st.num_prefill_tokens)
            families["running_seqs"].add_metric(labels, st.num_running_seqs)
            families["waiting_seqs"].add_metric(labels, st.num_waiting_seqs)
            families["free_pages"].add_metric(labels, st.num_free_pages)
            families["active_requests"].add_metric(labels, st.num_active)
            fresh.add_metric(labels, 1.0 if st.is_load_fresh else 0.0)
        yield from families.values()
        yield fresh
        stats = GaugeMetricFamily("pd_gateway_policy_stat", "Figures the routing policies report",
                                  labels=["stat"])
        for key, value in self.gw.router.stats().items():
            stats.add_metric([key], value)
        yield stats


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
