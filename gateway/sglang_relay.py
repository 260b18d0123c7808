"""Our gateway in front of SGLang PD workers, over SGLang's HTTP protocol (``http://`` worker URLs).

The request body goes through as the client sent it (the workers tokenize and apply the chat
template; the gateway needs no model files), with the three bootstrap fields added; the decode's
response is the client's.

Lifecycle:
1. ``SGLangFleet(config, router, metrics)``; ``await start()`` opens one aiohttp session (keep-alive
   pool bounded per worker, TCP_NODELAY, connect/read timeouts; aiohttp measured ~4-8x cheaper per
   request than httpx here, ``loadtests/bench_http_client.py``) and one probe task per worker:
   ``GET /health`` every ``probe_interval_s``, unhealthy after ``unhealthy_after`` failures, healthy
   after ``healthy_after`` passes; the router hears joins and leaves. After each passed probe,
   ``GET /v1/loads`` (where the worker serves it) becomes the worker's load report for the
   policies. The served model name is the first worker's ``/get_model_info`` ``model_path`` (or
   ``--model-name``).
2. Per request (``SGLangResponder``, raw ASGI for chat, completions and ``/generate``): admission,
   the body (capped) as a JSON object, a pair from the router's policies (the workers' ``/v1/loads``
   plus the gateway's own open requests; no tokenizer, so no prefix matching), a fresh
   ``bootstrap_room`` per item (a list for batched ``/generate`` and for ``n > 1``, else a scalar),
   POSTed to the prefill and the decode at the same time.
3. Failure coupling before the decode's first byte: a prefill that fails (non-2xx, connection
   error) cancels the decode request (closing its connection aborts it on the worker); a decode
   that fails cancels the prefill request. A 4xx goes to the client as the worker wrote it; a 5xx
   or a connection error is retried on a new pair and new rooms (``max_retries``, jittered backoff),
   else a 502. After the first byte the decode's stream is relayed to its end.
4. The prefill's body is always read to the end (it frees the connection); with ``return_logprob``
   its ``meta_info.input_token_logprobs`` are put in front of the decode's, from a JSON or an SSE
   prefill reply, in the whole response or in every streamed event.
5. ``aclose()``: stop the probes, close the session.
"""

from __future__ import annotations

import asyncio
import logging
import random
import secrets
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import aiohttp
import msgspec

from gateway.context import REQUEST_ID
from gateway.errors import APIError, BadGateway, BadRequest, NoWorkers, UpstreamTimeout
from gateway.health import HealthConfig, WorkerHealth
from gateway.responder import ClientGone, read_body, send_error, watch_disconnect
from gateway.worker_state import WorkerState
from workers.protocol import LoadReport

if TYPE_CHECKING:
    from starlette.types import Receive, Scope, Send

    from gateway.admission import Admission
    from gateway.metrics import GatewayMetrics
    from gateway.router import Router

log = logging.getLogger(__name__)
_json = msgspec.json.Encoder()
MAX_ROOM = 2**63 - 1
MAX_BACKOFF_S = 2.0
RETRY_STATUSES = frozenset({408, 429, 500, 502, 503, 504})
STREAM_READ_BYTES = 64 * 1024


class MethodNotAllowed(APIError):
    status = 405
    type = "invalid_request_error"


def is_http_url(url: str) -> bool:
    return url.startswith(("http://", "https://"))


def check_http_url(url: str) -> None:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"SGLang worker URL must look like http://HOST:PORT, got {url!r}")


@dataclass(frozen=True)
class RelayConfig:
    first_byte_timeout_s: float = 300.0  # streams: until the decode's response starts
    read_timeout_s: float = 120.0  # streams: between reads of the decode's body
    request_timeout_s: float = 1800.0  # the whole request (a non-streamed decode answers at its end)
    connect_timeout_s: float = 10.0
    max_retries: int = 2
    retry_backoff_s: float = 0.05
    max_connections_per_worker: int = 256


class HttpWorker:
    """One SGLang worker: its URL, role, bootstrap port (prefill), health and the router's view."""

    def __init__(self, url: str, role: str, bootstrap_port: int | None, health: HealthConfig) -> None:
        check_http_url(url)
        self.url = url.rstrip("/")
        self.role = role
        self.bootstrap_port = bootstrap_port
        host = urlsplit(url).hostname or ""
        self.bootstrap_host = f"[{host}]" if ":" in host else host
        self.state = WorkerState(self.url, role, self)
        self.health = WorkerHealth(health)
        self.is_up = False  # passing /health probes
        self.has_loads: bool | None = None  # serves /v1/loads (None: not known yet)
        self.is_draining = False  # (the admin API does not manage SGLang workers yet)
        self.last_error: str | None = None
        self._rids = 0

    @property
    def healthy(self) -> bool:
        return self.is_up and self.health.is_selectable

    @property
    def is_connected(self) -> bool:
        return self.is_up

    @property
    def last_rid(self) -> int:
        return self._rids

    def opened(self) -> int:
        self._rids += 1
        self.state.dispatched(self._rids, 0, 0)
        return self._rids

    def closed(self, rid: int) -> None:
        self.state.ended(rid)


class SGLangFleet:
    """The SGLang workers behind the gateway and the one HTTP session to them."""

    def __init__(self, prefills: list[tuple[str, int | None]], decodes: list[str], router: Router,
                 health: HealthConfig, config: RelayConfig | None = None) -> None:
        self.prefills = [HttpWorker(url, "prefill", port, health) for url, port in prefills]
        self.decodes = [HttpWorker(url, "decode", None, health) for url in decodes]
        self.router = router
        self.config = config or RelayConfig()
        self.model_name: str | None = None
        self.session: aiohttp.ClientSession | None = None
        self._probes: list[asyncio.Task[None]] = []

    @property
    def workers(self) -> list[HttpWorker]:
        return self.prefills + self.decodes

    def is_ready(self) -> bool:
        return any(w.healthy for w in self.prefills) and any(w.healthy for w in self.decodes)

    async def start(self, timeout_s: float) -> None:
        cfg = self.config
        connector = aiohttp.TCPConnector(limit=0, limit_per_host=cfg.max_connections_per_worker,
                                         keepalive_timeout=30.0, enable_cleanup_closed=True)
        self.session = aiohttp.ClientSession(
            connector=connector, auto_decompress=False, skip_auto_headers=("User-Agent",),
            timeout=aiohttp.ClientTimeout(total=cfg.request_timeout_s, sock_connect=cfg.connect_timeout_s))
        self._probes = [asyncio.create_task(self._probe_loop(w), name=f"sglang-probe {w.url}") for w in self.workers]
        deadline = time.monotonic() + timeout_s
        while not self.is_ready() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if not self.is_ready():
            log.warning("no SGLang prefill + decode pair answered /health within %.0fs; serving 503 until one does",
                        timeout_s)

    async def aclose(self) -> None:
        for task in self._probes:
            task.cancel()
        await asyncio.gather(*self._probes, return_exceptions=True)
        if self.session is not None:
            await self.session.close()

    async def _probe_loop(self, worker: HttpWorker) -> None:
        assert self.session is not None
        config = worker.health.config
        while True:
            try:
                async with self.session.get(f"{worker.url}/health",
                                            timeout=aiohttp.ClientTimeout(total=config.probe_timeout_s)) as reply:
                    await reply.read()
                    ok, reason = reply.status == 200, f"/health answered {reply.status}"
            except (aiohttp.ClientError, TimeoutError, OSError) as exc:
                ok, reason = False, f"/health failed: {type(exc).__name__}: {exc}"
            if ok:
                worker.health.probe_passed(0.0)
                worker.last_error = None
                if self.model_name is None:
                    await self._learn_model(worker)
                if worker.has_loads is not False:
                    await self._poll_load(worker)
            else:
                worker.health.probe_failed(reason)
                worker.last_error = reason
            healthy = worker.health.is_probe_healthy if worker.is_up else worker.health.is_probe_healthy and ok
            if healthy != worker.is_up:
                worker.is_up = healthy
                log.log(logging.INFO if healthy else logging.WARNING, "SGLang %s worker %s is %s", worker.role,
                        worker.url, "up" if healthy else f"unhealthy: {reason}")
                (self.router.worker_added if healthy else self.router.worker_removed)(worker.state)
            await asyncio.sleep(config.probe_interval_s)

    async def _poll_load(self, worker: HttpWorker) -> None:
        """``GET /v1/loads`` into the worker's routing view, where the worker has it (a 404 stops asking)."""
        assert self.session is not None
        last_rid = worker.last_rid  # our requests sent before this poll are counted in its answer
        try:
            async with self.session.get(f"{worker.url}/v1/loads?include=core",
                                        timeout=aiohttp.ClientTimeout(total=worker.health.config.probe_timeout_s)) \
                    as reply:
                if reply.status in (404, 405):
                    worker.has_loads = False
                    return
                loads = msgspec.json.decode(await reply.read()).get("loads") if reply.status == 200 else None
        except (aiohttp.ClientError, TimeoutError, OSError, msgspec.DecodeError, AttributeError):
            return
        report = load_report_of(loads, last_rid)
        if report is not None:
            worker.has_loads = True
            state = worker.state
            state.page_size, state.num_total_pages = 1, report.num_total_pages  # (no handshake to say so)
            state.reported(report)

    async def _learn_model(self, worker: HttpWorker) -> None:
        assert self.session is not None
        try:
            async with self.session.get(f"{worker.url}/get_model_info",
                                        timeout=aiohttp.ClientTimeout(total=5)) as reply:
                info = msgspec.json.decode(await reply.read()) if reply.status == 200 else {}
        except (aiohttp.ClientError, TimeoutError, OSError, msgspec.DecodeError):
            return
        name = info.get("served_model_name") or info.get("model_path") if isinstance(info, dict) else None
        if isinstance(name, str) and name:
            self.model_name = name

    def select(self, num_items: int, avoid: set[HttpWorker]) -> tuple[HttpWorker, HttpWorker]:
        def pick(pool: list[HttpWorker]) -> list[WorkerState]:
            healthy = [w for w in pool if w.healthy]
            return [w.state for w in healthy if w not in avoid] or [w.state for w in healthy]

        prefills, decodes = pick(self.prefills), pick(self.decodes)
        if not prefills or not decodes:
            raise NoWorkers(f"no healthy SGLang {'decode' if prefills else 'prefill'} worker", retry_after_s=1.0)
        pair = self.router.select(prefills, decodes, self.router.request([], 0))
        assert pair.prefill is not None
        return pair.prefill.client, pair.decode.client  # type: ignore[attr-defined]


def load_report_of(loads: Any, last_rid: int) -> LoadReport | None:
    """``/v1/loads``' ranks summed into one ``LoadReport`` (tokens stand for pages: page size 1)."""
    if not isinstance(loads, list) or not loads or not all(isinstance(r, dict) for r in loads):
        return None

    def total(key: str) -> int:
        return sum(int(r.get(key) or 0) for r in loads)

    try:
        capacity, used = total("max_total_num_tokens"), total("num_used_tokens")
        return LoadReport(num_running=total("num_running_reqs"), num_waiting=total("num_waiting_reqs"),
                          num_free_pages=max(0, capacity - used), num_total_pages=capacity,
                          num_prefill_tokens=max(0, total("num_total_tokens") - used), last_rid=last_rid,
                          max_running=total("max_running_requests"))
    except (TypeError, ValueError):
        return None


def batch_size(route: str, body: dict[str, Any]) -> int | None:
    """How many rooms the request needs as a list (None: one scalar room), as SGLang's routers count."""
    if route == "generate":
        text, ids = body.get("text"), body.get("input_ids")
        if isinstance(text, list):
            return len(text)
        if isinstance(ids, list) and ids and isinstance(ids[0], list):
            return len(ids)
        return None
    n = body.get("n")
    if route == "completions" and isinstance(body.get("prompt"), list) and body["prompt"] \
            and isinstance(body["prompt"][0], (str, list)):
        return len(body["prompt"]) * (n if type(n) is int and n > 1 else 1)
    return n if type(n) is int and n > 1 else None


class SGLangResponder:
    """Raw ASGI endpoint relaying one generation route to a prefill + decode pair (see the module doc)."""

    def __init__(self, fleet: SGLangFleet, route: str, path: str, admission: Admission, metrics: GatewayMetrics,
                 max_body_bytes: int) -> None:
        self.fleet, self.route, self.path = fleet, route, path
        self.admission, self.metrics, self.max_body_bytes = admission, metrics, max_body_bytes
        self._background: set[asyncio.Task[_PrefillReply]] = set()  # prefill replies trailing an answer

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        release = None
        watcher: asyncio.Task[None] | None = None
        task = asyncio.current_task()
        assert task is not None
        gone = [False]
        status = 500
        try:
            try:
                if scope["method"] != "POST":
                    raise MethodNotAllowed(f"Method Not Allowed: {scope['method']} {scope['path']}")
                release = await self.admission.admit()
                raw = await read_body(scope, receive, self.max_body_bytes)
                try:
                    body = msgspec.json.decode(raw)
                except (msgspec.DecodeError, UnicodeDecodeError) as exc:
                    raise BadRequest(f"request body is not valid JSON: {exc}") from None
                if not isinstance(body, dict):
                    raise BadRequest("the request body must be a JSON object")
                # The client leaving cancels this task: the workers' requests are closed, which aborts them.
                watcher = asyncio.create_task(watch_disconnect(receive, task, gone))
                status = await self._relay(body, send)
            except APIError as exc:
                status = exc.status
                log.log(logging.WARNING if exc.status >= 500 else logging.INFO, "%s -> %d %s: %s", self.route,
                        exc.status, exc.type, exc.message)
                await send_error(send, exc)
        except asyncio.CancelledError:
            if not gone[0]:
                raise
            task.uncancel()
            status = 499
        except ClientGone:
            status = 499
        finally:
            if watcher is not None:
                watcher.cancel()
            self.metrics.requests.labels(self.route, str(status)).inc()
            if release is not None:
                release()

    async def _relay(self, body: dict[str, Any], send: Send) -> int:
        fleet, cfg = self.fleet, self.fleet.config
        num_items = batch_size(self.route, body)
        stream = bool(body.get("stream"))
        merge_logprobs = self.route == "generate" and bool(body.get("return_logprob"))
        avoid: set[HttpWorker] = set()
        attempt = 0
        while True:
            prefill, decode = fleet.select(num_items or 1, avoid)
            rooms = [secrets.randbits(63) for _ in range(num_items or 1)]
            payload = dict(body)
            if num_items is None:
                payload.update(bootstrap_host=prefill.bootstrap_host, bootstrap_port=prefill.bootstrap_port,
                               bootstrap_room=rooms[0])
            else:
                payload.update(bootstrap_host=[prefill.bootstrap_host] * num_items,
                               bootstrap_port=[prefill.bootstrap_port] * num_items, bootstrap_room=rooms)
            outcome = await self._attempt(prefill, decode, _json.encode(payload), stream, merge_logprobs, send)
            if isinstance(outcome, int):
                return outcome
            if attempt >= cfg.max_retries:
                raise outcome.error
            attempt += 1
            avoid.add(outcome.worker)
            delay = cfg.retry_backoff_s * 2 ** (attempt - 1) * random.uniform(0.5, 1.5)
            await asyncio.sleep(min(delay, MAX_BACKOFF_S))

    async def _attempt(self, prefill: HttpWorker, decode: HttpWorker, data: bytes, stream: bool,
                       merge_logprobs: bool, send: Send) -> int | _Retry:
        """One pair: the client's status once answered, or what to retry."""
        session = self.fleet.session
        assert session is not None
        cfg = self.fleet.config
        loop = asyncio.get_running_loop()
        headers = {"content-type": "application/json", "x-request-id": REQUEST_ID.get()}
        # A stream's decode answers when its first token is out, a whole one at its end.
        wait_s = cfg.first_byte_timeout_s if stream else cfg.request_timeout_s
        deadline = loop.time() + wait_s
        read = aiohttp.ClientTimeout(total=cfg.request_timeout_s, sock_connect=cfg.connect_timeout_s,
                                     sock_read=cfg.read_timeout_s if stream else None)
        p_rid, d_rid = prefill.opened(), decode.opened()
        p_task = asyncio.create_task(_post(session, f"{prefill.url}/{self.path}", data, headers, merge_logprobs))
        p_task.add_done_callback(lambda task: _prefill_done(task, prefill, p_rid))
        d_task = asyncio.create_task(_open(session, f"{decode.url}/{self.path}", data, headers, read))
        answered = False
        try:
            done, _ = await asyncio.wait({p_task, d_task}, timeout=wait_s, return_when=asyncio.FIRST_COMPLETED)
            if p_task in done and not d_task.done():
                failure = _failure(p_task, prefill)
                if failure is not None:  # the prefill failed first: the decode would wait for KV in vain
                    d_task.cancel()
                    return await self._failed(failure, send)
            try:
                decode_reply_or_failure = await asyncio.wait_for(_settle(d_task, decode),
                                                                 max(0.0, deadline - loop.time()))
            except TimeoutError:
                raise UpstreamTimeout(f"the SGLang decode worker did not answer within {wait_s:g}s") from None
            if isinstance(decode_reply_or_failure, _Failure):
                p_task.cancel()
                breaker = decode.health.breaker
                (breaker.record_success if _is_request_fault(decode_reply_or_failure.status)
                 else breaker.record_failure)()
                return await self._failed(decode_reply_or_failure, send)
            reply = decode_reply_or_failure
            try:
                status = await self._answer(reply, p_task, stream, merge_logprobs, send)
            finally:
                reply.release()
            decode.health.breaker.record_success()
            answered = True
            return status
        finally:
            if not d_task.done():
                d_task.cancel()
            decode.closed(d_rid)
            if answered and not p_task.done():
                # The prefill's reply may trail its KV hand-over: let it end on its own (request timeout).
                self._background.add(p_task)
                p_task.add_done_callback(self._background.discard)
            elif not p_task.done():
                p_task.cancel()  # closing its connection aborts it on the worker

    async def _failed(self, failure: _Failure, send: Send) -> int | _Retry:
        """A side failed before the client got anything: its 4xx is the client's, the rest is retried."""
        worker, status = failure.worker, failure.status
        if status is not None and _is_request_fault(status):
            await _send_whole(send, status, failure.content_type, failure.body)
            return status
        message = f"SGLang {worker.role} worker {worker.url}: {failure.reason}"
        log.warning("%s", message)
        return _Retry(BadGateway(message, code="worker_failed"), worker)

    async def _answer(self, reply: aiohttp.ClientResponse, p_task: asyncio.Task[_PrefillReply], stream: bool,
                      merge_logprobs: bool, send: Send) -> int:
        content_type = reply.headers.get("content-type", "application/json")
        if not stream or not content_type.startswith("text/event-stream"):
            try:
                data = await reply.read()
            except (aiohttp.ClientError, TimeoutError) as exc:
                raise BadGateway(f"the SGLang decode worker's response broke: {type(exc).__name__}: {exc}") from None
            if merge_logprobs and reply.status == 200:
                data = _merge_whole(await _prefill_logprobs(p_task), data)
            await _send_whole(send, reply.status, content_type, data)
            return reply.status
        await send({"type": "http.response.start", "status": reply.status,
                    "headers": [(b"content-type", content_type.encode()), (b"cache-control", b"no-cache"),
                                (b"x-accel-buffering", b"no")]})
        logprobs = await _prefill_logprobs(p_task) if merge_logprobs else None
        pending = b""
        try:
            async for chunk in reply.content.iter_any():
                if logprobs is None:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                    continue
                pending += chunk
                events, _, pending = pending.rpartition(b"\n\n")
                if events:
                    await send({"type": "http.response.body", "body": _merge_events(logprobs, events + b"\n\n"),
                                "more_body": True})
        except (aiohttp.ClientError, TimeoutError) as exc:
            log.warning("%s: the decode's stream broke: %s", self.route, exc)
            error = BadGateway(f"SGLang decode worker stream broke: {type(exc).__name__}")
            pending += b"data: " + _json.encode(error.body()) + b"\n\n"
        await send({"type": "http.response.body", "body": pending, "more_body": False})
        return reply.status


def _prefill_done(task: asyncio.Task[_PrefillReply], prefill: HttpWorker, rid: int) -> None:
    """The prefill's request ended: it leaves the worker's view, its outcome feeds the breaker (a 4xx is
    the request's fault, a cancellation nobody's)."""
    prefill.closed(rid)
    if task.cancelled():
        return
    exc = task.exception()
    status = task.result().status if exc is None else None
    if status is not None and (200 <= status < 300 or _is_request_fault(status)):
        prefill.health.breaker.record_success()
    else:
        prefill.health.breaker.record_failure()


def _is_request_fault(status: int | None) -> bool:
    """A 4xx (other than the retryable 408/429): the request's fault, not the worker's; the client's answer."""
    return status is not None and 400 <= status < 500 and status not in RETRY_STATUSES


@dataclass
class _PrefillReply:
    status: int
    content_type: str
    body: bytes


@dataclass
class _Failure:
    worker: HttpWorker
    reason: str
    status: int | None = None  # the worker's own status when it answered
    content_type: str = "application/json"
    body: bytes = b""


@dataclass
class _Retry:
    error: APIError
    worker: HttpWorker


async def _post(session: aiohttp.ClientSession, url: str, data: bytes, headers: dict[str, str],
                keep_body: bool) -> _PrefillReply:
    """The prefill's request, read to its end (SSE or JSON): its connection is then free again."""
    async with session.post(url, data=data, headers=headers) as reply:
        body = await reply.read()
        content_type = reply.headers.get("content-type", "application/json")
        return _PrefillReply(reply.status, content_type, body if keep_body or reply.status >= 300 else b"")


async def _open(session: aiohttp.ClientSession, url: str, data: bytes, headers: dict[str, str],
                timeout: aiohttp.ClientTimeout) -> aiohttp.ClientResponse:
    """The decode's request up to its response headers (the caller reads or relays the body)."""
    return await session.post(url, data=data, headers=headers, timeout=timeout)


def _failure(task: asyncio.Task[_PrefillReply], worker: HttpWorker) -> _Failure | None:
    if task.cancelled():
        return _Failure(worker, "cancelled")
    exc = task.exception()
    if exc is not None:
        return _Failure(worker, f"{type(exc).__name__}: {exc}")
    reply = task.result()
    if 200 <= reply.status < 300:
        return None
    return _Failure(worker, f"answered {reply.status}", reply.status, reply.content_type, reply.body)


async def _settle(task: asyncio.Task[aiohttp.ClientResponse], worker: HttpWorker) -> aiohttp.ClientResponse | _Failure:
    try:
        reply = await task
    except (aiohttp.ClientError, TimeoutError, OSError) as exc:
        return _Failure(worker, f"{type(exc).__name__}: {exc}")
    if 200 <= reply.status < 300:
        return reply
    body = await reply.read()
    reply.release()
    return _Failure(worker, f"answered {reply.status}", reply.status,
                    reply.headers.get("content-type", "application/json"), body)


async def _prefill_logprobs(task: asyncio.Task[_PrefillReply]) -> list[Any] | None:
    """The prefill's ``meta_info.input_token_logprobs``, from its JSON reply or its first SSE event."""
    try:
        reply = await task
    except (aiohttp.ClientError, TimeoutError, OSError):
        return None
    body = reply.body
    if reply.content_type.startswith("text/event-stream"):
        first = next((line[5:].strip() for line in body.split(b"\n") if line.startswith(b"data:")), b"")
        body = first if first and first != b"[DONE]" else b""
    try:
        meta = msgspec.json.decode(body).get("meta_info") if body else None
    except (msgspec.DecodeError, AttributeError):
        return None
    values = meta.get("input_token_logprobs") if isinstance(meta, dict) else None
    return values if isinstance(values, list) else None


def _merge_one(prefill_logprobs: list[Any] | None, item: Any) -> Any:
    if prefill_logprobs is None or not isinstance(item, dict) or not isinstance(item.get("meta_info"), dict):
        return item
    meta = item["meta_info"]
    own = meta.get("input_token_logprobs")
    meta["input_token_logprobs"] = prefill_logprobs + (own if isinstance(own, list) else [])
    return item


def _merge_whole(prefill_logprobs: list[Any] | None, data: bytes) -> bytes:
    if prefill_logprobs is None:
        return data
    try:
        out = msgspec.json.decode(data)
    except msgspec.DecodeError:
        return data
    out = [_merge_one(prefill_logprobs, item) for item in out] if isinstance(out, list) else \
        _merge_one(prefill_logprobs, out)
    return _json.encode(out)


def _merge_events(prefill_logprobs: list[Any], events: bytes) -> bytes:
    out = []
    for event in events.split(b"\n\n"):
        if event.startswith(b"data:") and event[5:].strip() != b"[DONE]":
            try:
                event = b"data: " + _json.encode(_merge_one(prefill_logprobs, msgspec.json.decode(event[5:])))
            except msgspec.DecodeError:
                pass
        out.append(event)
    return b"\n\n".join(out)


async def _send_whole(send: Send, status: int, content_type: str, data: bytes) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", content_type.encode()), (b"content-length", b"%d" % len(data))]})
    await send({"type": "http.response.body", "body": data})
