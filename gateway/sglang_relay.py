"""Our gateway in front of SGLang PD workers, over SGLang's HTTP protocol (``http://`` worker URLs).

The request body goes through as the client sent it (the workers tokenize and apply the chat
template; the gateway needs no model files), with the three bootstrap fields added; the decode's
response is the client's.

Lifecycle (the workers, their health, load and HTTP connections: ``gateway/sglang_fleet.py``):
1. ``SGLangResponder(fleet, route, path, ...)``, one per generation route, made with the app.
2. Per request (``SGLangResponder``, raw ASGI for chat, completions and ``/generate``): the body
   (capped) as a JSON object, admission (a client that leaves while queued gives up its place), a
   pair from the router's policies (the workers' ``/v1/loads`` plus the gateway's own open
   requests; with ``--tokenizer``, the prompt's tokens for prefix matching,
   ``gateway/sglang_routing.py``), a fresh ``bootstrap_room`` per item (a list for batched
   ``/generate`` and for ``n > 1``, else a scalar), POSTed to the prefill and the decode at the same
   time.
3. Failure coupling before the decode's first event (a stream's client gets its response head
   with it; SGLang's decode sends its own head at once, then waits for the KV): a prefill that fails
   (non-2xx, connection error) cancels the decode request (closing its connection aborts it on the
   worker); a decode that fails cancels the prefill request. A 4xx goes to the client as the worker
   wrote it; a 5xx or a connection error is retried on a new pair and new rooms (``max_retries``,
   jittered backoff; all within the request's ``request_timeout_s``, which its attempts share), else a
   502. After the first event the decode's stream is relayed, whole events only, to its end or to an
   error event. An event still incomplete past ``MAX_EVENT_BYTES`` is the decode's failure, as a broken
   stream's (before the first event: retried; after it: an error event), and its connection is closed.
   A request that broke before any answer because it crossed its worker's close of the idle pooled
   connection it went out on (the worker's keep-alive ending, or its connection cap closing its
   longest-idle connection) was never read there: it is sent once more to the same worker on a fresh
   connection (``_open``), no failure and no retry.
4. The prefill's body is always read to the end (it frees the connection); with ``return_logprob``
   its ``meta_info.input_token_logprobs`` are put in front of the decode's, from a JSON or an SSE
   prefill reply, in the whole response or in every streamed event.
5. Metrics (``_Figures``), as the native path's where the relay can tell: end-to-end latency of every
   answered request; time to first token of streams (the first event relayed: SGLang's decode sends
   none before its first token); prompt, cached and generated tokens from the reply's ``usage`` (OpenAI
   routes) or ``meta_info`` (``/generate``), in a whole reply or a stream's last event (a chat or
   completions stream has them only with ``stream_options.include_usage``; a stream of several items,
   only then too). No inter-token latency: an event may carry several tokens.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import secrets
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec

from gateway.api import SSE_DONE, ModelNotFound, error_event
from gateway.api_models import MAX_N
from gateway.context import REQUEST_ID, REQUEST_T0
from gateway.errors import APIError, BadGateway, BadRequest, NoWorkers, Overloaded, UpstreamTimeout
from gateway.request_checks import check_batch_choices
from gateway.responder import (
    AsgiExchange,
    ClientGone,
    Exchange,
    encoded_refusal,
    send_error,
    shutdown_cut_error,
)
from gateway.sglang_fleet import HttpWorker, SGLangFleet
from gateway.sglang_routing import dispatch_cost, routing_request
from gateway.worker_http import HttpClientError, ReadIdle, Reply, crossed_idle_close, header_lines

if TYPE_CHECKING:
    from starlette.types import Receive, Scope, Send

    from gateway.admission import Admission
    from gateway.hot_cycle import HotCycle
    from gateway.metrics import GatewayMetrics

log = logging.getLogger(__name__)
_json = msgspec.json.Encoder()
MAX_BACKOFF_S = 2.0
DONE_GRACE_S = 1.0  # a stream's body end waited for past its [DONE] (``_stream``)
RETRY_STATUSES = frozenset({408, 429, 500, 502, 503, 504})
NO_VERDICT = -1  # ``_stream``'s outcome for a stream cut by the request's own deadline: nothing for its breaker
# The bytes of one incomplete event (no ``\n\n`` yet) the relay holds for a decode's stream; past it the decode is
# misbehaving and its stream is ended (``_first_events``, ``_stream``). Generous: a ``/generate`` event can carry the
# logprobs of the whole answer so far, item by item (a 32k-token answer with ``top_logprobs_num`` 20 is about 24 MiB of
# JSON); an OpenAI route's chunk carries one delta. Without a bound a decode sending bytes and no blank line held them
# all, until the request's timeout.
MAX_EVENT_BYTES = 32 << 20


class _Details(msgspec.Struct):
    cached_tokens: int | None = None


class _Usage(msgspec.Struct):
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    prompt_tokens_details: _Details | None = None


class _MetaInfo(msgspec.Struct):
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None


class _Counted(msgspec.Struct):
    """What a reply (or a streamed event) says it counted; everything else in it is skipped."""

    usage: _Usage | None = None
    meta_info: _MetaInfo | None = None


_counted = msgspec.json.Decoder(_Counted | list[_Counted])


class _Figures:
    """One relayed request's latency and token figures for the gateway's metrics (see the module doc)."""

    __slots__ = ("metrics", "per_prompt", "several", "t0")

    def __init__(self, metrics: GatewayMetrics, several: bool, per_prompt: int = 1) -> None:
        """``several``: the reply has several items (a batch, ``n`` > 1); ``per_prompt``: items per prompt
        (``/generate``'s ``sampling_params.n``: each item reports the same prompt, counted once)."""
        self.metrics, self.several, self.per_prompt = metrics, several or per_prompt > 1, per_prompt
        self.t0 = REQUEST_T0.get() or time.monotonic()

    def first_event(self) -> None:
        self.metrics.ttft.observe(time.monotonic() - self.t0)

    def answered(self, data: bytes | None, streamed: bool = False) -> None:
        """A 200 answer relayed to its end; ``data``: the whole reply, or (``streamed``) its last event's JSON."""
        metrics = self.metrics
        metrics.e2e.observe(time.monotonic() - self.t0)
        if not data:
            return
        try:
            replies = _counted.decode(data)
        except (msgspec.DecodeError, UnicodeDecodeError):
            return
        usage = replies.usage if type(replies) is _Counted else None
        if usage is not None:  # (the usual: one OpenAI reply's usage, its figures as they are)
            details = usage.prompt_tokens_details
            metrics.prompt_tokens.inc(usage.prompt_tokens or 0)
            metrics.cached_tokens.inc((details.cached_tokens or 0) if details is not None else 0)
            metrics.generation_tokens.inc(usage.completion_tokens or 0)
            return
        prompt = cached = generated = 0
        for reply in replies if isinstance(replies, list) else [replies]:
            usage, meta = reply.usage, reply.meta_info
            if usage is not None:
                details = usage.prompt_tokens_details
                prompt += usage.prompt_tokens or 0
                generated += usage.completion_tokens or 0
                cached += (details.cached_tokens or 0) if details is not None else 0
            elif meta is not None and not (streamed and self.several):  # (one item's, of several)
                prompt += meta.prompt_tokens or 0
                generated += meta.completion_tokens or 0
                cached += meta.cached_tokens or 0
        if isinstance(replies, list):  # (``/generate``: an item per choice, each with its prompt's figures)
            prompt, cached = prompt // self.per_prompt, cached // self.per_prompt
        metrics.prompt_tokens.inc(prompt)
        metrics.cached_tokens.inc(cached)
        metrics.generation_tokens.inc(generated)


class _Events:
    """A stream's bytes cut at its event boundaries (``\n\n``), as they come: ``feed`` returns the whole events a
    chunk completes (``b""`` for none), the incomplete last event's bytes wait (``pending``, ``num_pending_bytes``).
    Each chunk is searched once (a boundary across two chunks included) and the waiting bytes are joined once, when
    their event completes: linear in the stream's bytes, where joining them to every chunk was quadratic in an event's
    size."""

    __slots__ = ("_parts", "num_pending_bytes")

    def __init__(self, pending: bytes = b"") -> None:
        self._parts = [pending] if pending else []
        self.num_pending_bytes = len(pending)

    def feed(self, chunk: bytes) -> bytes:
        parts = self._parts
        end = chunk.rfind(b"\n\n")
        if end >= 0:
            end += 2
        elif parts and chunk[:1] == b"\n" and parts[-1][-1:] == b"\n":  # (the boundary across the two)
            end = 1
        else:  # (the pending bytes hold no boundary: none can end before this chunk)
            if chunk:
                parts.append(chunk)
                self.num_pending_bytes += len(chunk)
            return b""
        events = b"".join((*parts, chunk[:end])) if parts else chunk[:end]
        rest = chunk[end:]
        self._parts = [rest] if rest else []
        self.num_pending_bytes = len(rest)
        return events

    @property
    def pending(self) -> bytes:
        return b"".join(self._parts)


class _EventTooLarge(Exception):
    """A decode's stream holds an incomplete event over ``MAX_EVENT_BYTES`` (``_stream``)."""


def _too_large(num_bytes: int) -> str:
    return f"sent {num_bytes} bytes of one event, over the relay's {MAX_EVENT_BYTES} (no event boundary)"


def _last_event(events: bytes) -> bytes | None:
    """The JSON of the last ``data:`` event of ``events`` other than ``[DONE]``."""
    for event in reversed(events.split(b"\n\n")):
        for line in event.split(b"\n"):
            if line.startswith(b"data:"):
                payload = line[5:].strip()
                if payload and payload != b"[DONE]":
                    return payload
    return None


class MethodNotAllowed(APIError):
    status = 405
    type = "invalid_request_error"

    def headers(self) -> list[tuple[bytes, bytes]]:
        return [*super().headers(), (b"allow", b"POST")]


def batch_size(route: str, body: dict[str, Any]) -> int | None:
    """How many rooms the request needs as a list (None: one scalar room), as SGLang's routers count. A
    400 for more choices than the gateway's own routes take (``MAX_N``, ``MAX_BATCH_CHOICES``): the room
    lists are built, encoded and sent to both workers before either could refuse them."""
    if route == "chat" and body.get("n") is None:  # (the usual: one choice, no batch; ``_choices``' 1)
        return None
    if route == "generate":
        text, ids = body.get("text"), body.get("input_ids")
        sampling = body.get("sampling_params")
        n = _choices(sampling.get("n") if isinstance(sampling, dict) else None, "sampling_params.n")
        if isinstance(text, list):
            return _batch(len(text), n, "text")
        if isinstance(ids, list) and ids and isinstance(ids[0], list):
            return _batch(len(ids), n, "input_ids")
        return None
    n = _choices(body.get("n"), "n")
    if route == "completions" and isinstance(body.get("prompt"), list) and body["prompt"] \
            and isinstance(body["prompt"][0], (str, list)):
        return _batch(len(body["prompt"]), n, "prompt") * n
    return n if n > 1 else None


def _choices(n: object, name: str) -> int:
    if n is None:
        return 1
    if type(n) is not int or not 1 <= n <= MAX_N:
        raise BadRequest(f"{name} must be an integer from 1 to {MAX_N}", param=name)
    return n


def _batch(items: int, n: int, name: str) -> int:
    if not items:
        raise BadRequest(f"{name} is an empty batch", param=name)
    check_batch_choices(items, n, name)
    return items


class SGLangResponder:
    """Raw ASGI endpoint relaying one generation route to a prefill + decode pair (see the module doc)."""

    def __init__(self, fleet: SGLangFleet, route: str, path: str, admission: Admission, metrics: GatewayMetrics,
                 max_body_bytes: int, body_timeout_s: float, served_model: Callable[[], str | None] | None = None,
                 ) -> None:
        """``served_model``: the model name the gateway answers to (None while unknown): a request naming another
        (but ``default``) is the 404 the native routes answer, whichever kind of worker would serve it."""
        self.fleet, self.route, self.path = fleet, route, path
        self.served_model = served_model
        self.admission, self.metrics, self.max_body_bytes = admission, metrics, max_body_bytes
        self.body_timeout_s = body_timeout_s
        self._background: set[asyncio.Task[_PrefillReply]] = set()  # prefill replies trailing an answer
        self._counters: dict[int, Any] = {}  # status -> the route's request counter child

    def count(self, status: int) -> None:
        """Count one request of this route (``pd_gateway_requests_total``), also one the HTTP protocol answered or
        closed before it started (the counter's child per status kept, as ``Responder._count`` keeps it)."""
        counter = self._counters.get(status)
        if counter is None:
            counter = self._counters[status] = self.metrics.requests.labels(self.route, str(status))
        counter.inc()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Over ASGI: another method than ``POST`` (the gateway's own cycle takes ``POST``s alone), or an app
        served without the gateway's HTTP protocol."""
        if scope["method"] != "POST":
            error = MethodNotAllowed(f"Method Not Allowed: {scope['method']} {scope['path']}")
            log.info("%s -> %d %s: %s", self.route, error.status, error.type, error.message)
            self.count(error.status)
            await send_error(send, error)
            return
        await self._serve(AsgiExchange(scope, receive, send), send)

    async def serve(self, exchange: HotCycle) -> None:
        """On the gateway's own cycle (``gateway.hot_cycle``), whose ``send`` writes the relay's ASGI messages."""
        await self._serve(exchange, exchange.send, getattr(exchange, "fields", None))

    async def _serve(self, exchange: Exchange, send: Send, fields: Mapping[bytes, bytes] | None = None) -> None:
        """One request: ``exchange`` for its body, headers and disconnect, ``send`` for the answer; ``fields``: its
        headers by name, where the exchange has them (a request with no trace context then makes no dict walk)."""
        release = None
        gone = [False]
        status = 500
        sent = _Sent(send)
        send = sent
        try:
            try:
                exchange.check_length(self.max_body_bytes)  # (a 413 before a full queue's 429: it can never pass)
                self.admission.check_room()  # (a full queue refuses before the body is uploaded)
                raw = await exchange.read_body(self.max_body_bytes, self.body_timeout_s)
                try:
                    body = msgspec.json.decode(raw)
                except (msgspec.DecodeError, UnicodeDecodeError, RecursionError) as exc:
                    raise encoded_refusal(BadRequest(f"request body is not valid JSON: {exc}"),
                                          exchange.headers) from None
                if not isinstance(body, dict):
                    raise BadRequest("the request body must be a JSON object")
                model = body.get("model")
                if isinstance(model, str) and model != "default" and self.served_model is not None:
                    served = self.served_model()
                    # (SGLang's "<served>:<adapter>" picks one of its LoRA adapters: the worker judges the adapter)
                    if served is not None and model != served and not model.startswith(served + ":"):
                        raise ModelNotFound(f"The model {model!r} does not exist here; use {served!r}",
                                            param="model", code="model_not_found")
                if body.get("custom_logit_processor") is not None:  # (the native routes refuse it too)
                    raise BadRequest("custom_logit_processor is not accepted: it is code for the worker to run",
                                     param="custom_logit_processor")
                # The client leaving cancels this task: while queued for admission (it gives up its place),
                # or later (the workers' requests are closed, which aborts them).
                exchange.watch_disconnect(gone)
                release = await self.admission.admit()
                active = self.metrics.active
                active.inc()
                try:
                    trace = {} if fields is not None and b"traceparent" not in fields and b"tracestate" not in fields \
                        else _trace_headers(exchange.headers)
                    status = await self._relay(body, send, trace)
                finally:
                    active.dec()
            except APIError as exc:
                status = exc.status
                log.log(logging.WARNING if exc.status >= 500 else logging.INFO, "%s -> %d %s: %s", self.route,
                        exc.status, exc.type, exc.message)
                await send_error(send, exc)
        except asyncio.CancelledError:
            if not gone[0]:  # the server stopping past its drain timeout: tell the client why, if it can be told
                status = await sent.cut(self.route)
                raise
            task = asyncio.current_task()
            assert task is not None
            task.uncancel()
            status = exchange.refused or 499  # (the gateway's protocol ended it itself: its status)
        except ClientGone as exc:
            status = exc.status
        finally:
            exchange.stop_watching()
            self.count(status)
            if release is not None:
                release()

    async def _relay(self, body: dict[str, Any], send: Send, trace: dict[str, str]) -> int:
        """``trace``: the client's W3C trace context headers, passed on to both workers."""
        fleet, cfg, route = self.fleet, self.fleet.config, self.route
        num_items = batch_size(route, body)
        stream = bool(body.get("stream"))
        request = routing_request(fleet.router, fleet.tokenizer, route, body)
        if route == "generate":
            merge_logprobs = bool(body.get("return_logprob"))
            sampling = body.get("sampling_params")
            n = sampling.get("n") if isinstance(sampling, dict) else None
            figures = _Figures(self.metrics, num_items is not None, n if type(n) is int and n > 1 else 1)
        else:  # (no logprobs to merge, one item per prompt)
            merge_logprobs, figures = False, _Figures(self.metrics, num_items is not None)
        avoid: set[HttpWorker] = set()
        attempt = 0
        loop = asyncio.get_running_loop()
        ends_at = loop.time() + cfg.request_timeout_s  # (the request's, over every attempt, as the native path's)
        while True:
            pair, prefill, decode = fleet.select(request, avoid)
            if num_items is None:
                # (``secrets.randbits(63)``'s draw, without its Python frame)
                payload = {**body, "bootstrap_host": prefill.bootstrap_host,
                           "bootstrap_port": prefill.bootstrap_port,
                           "bootstrap_room": int.from_bytes(os.urandom(8)) >> 1}
            else:
                payload = {**body, "bootstrap_host": [prefill.bootstrap_host] * num_items,
                           "bootstrap_port": [prefill.bootstrap_port] * num_items,
                           "bootstrap_room": [secrets.randbits(63) for _ in range(num_items)]}
            result = "cancelled"
            data = _json.encode(payload)
            cost = dispatch_cost(request, prefill.state, num_items, len(data))
            try:
                outcome = await self._attempt(prefill, decode, data, stream, merge_logprobs, send, trace, figures,
                                              cost, ends_at)
                result = "finished" if isinstance(outcome, int) and outcome < 400 else "failed"
            except APIError:
                result = "failed"
                raise
            finally:
                fleet.router.finished(pair, request, result)
            if isinstance(outcome, int):
                return outcome
            delay = min(cfg.retry_backoff_s * 2 ** attempt * random.uniform(0.5, 1.5), MAX_BACKOFF_S)
            if attempt >= cfg.max_retries or loop.time() + delay >= ends_at:  # (no time left: the failure's error)
                raise outcome.error
            attempt += 1
            self.metrics.retries.labels(outcome.error.code or outcome.error.type).inc()
            avoid.add(outcome.worker)
            await asyncio.sleep(delay)

    async def _attempt(self, prefill: HttpWorker, decode: HttpWorker, data: bytes, stream: bool,
                       merge_logprobs: bool, send: Send, trace: dict[str, str], figures: _Figures,
                       cost: tuple[int, int], ends_at: float) -> int | _Retry:
        """One pair: the client's status once answered, or what to retry. ``cost``: (prefill tokens, decode
        pages) it adds to their load counts while open (``dispatch_cost``); ``ends_at``: the request's deadline
        (loop time), which its attempts share."""
        cfg = self.fleet.config
        loop = asyncio.get_running_loop()
        # (the pool's own carry the content type; these go out once per request, on both)
        request_id = REQUEST_ID.get()
        if not trace and request_id.isprintable():  # (the usual: no trace context, and no line break or NUL to refuse)
            headers = b"x-request-id: %b\r\n" % request_id.encode("latin-1")
        else:
            headers = header_lines({"x-request-id": request_id, **trace})
        # A stream's first event is due within the first-token timeout, a whole answer at its end, both by the
        # request's deadline at the latest. (The pool times only the whole request, no single read: a read timeout
        # would bound the wait for the response head too, which our own workers send with the first token; a
        # stream's reads are timed in ``_first_events`` and ``_stream``.)
        wait_s = cfg.first_byte_timeout_s if stream else cfg.request_timeout_s
        deadline = min(loop.time() + wait_s, ends_at)
        p_rid, d_rid = prefill.opened(cost[0]), decode.opened(0, cost[1])  # (prefill tokens, decode pages)
        decode_asked: asyncio.Future[None] = loop.create_future()
        prefill_asked: asyncio.Future[None] = loop.create_future()
        # (each counts in its worker's load reports once it has gone out: ``HttpWorker.last_rid``)
        decode_asked.add_done_callback(decode.sent_callback(d_rid))
        prefill_asked.add_done_callback(prefill.sent_callback(p_rid))
        # (``loop.create_task``: ``asyncio.create_task``'s, without its Python frame)
        d_task = loop.create_task(_open(self.fleet, decode, f"{decode.url}/{self.path}", data, headers,
                                           decode_asked, ends_at))
        p_task = loop.create_task(_post(self.fleet, prefill, f"{prefill.url}/{self.path}", data, headers,
                                           merge_logprobs, decode_asked, prefill_asked, ends_at))
        metrics = self.metrics
        p_task.add_done_callback(lambda task: _prefill_done(task, prefill, p_rid, metrics))
        answered = False
        try:
            await _first_done(loop, deadline, p_task, d_task)
            if p_task.done() and not d_task.done():
                failure = _failure(p_task, prefill)
                if failure is not None:  # the prefill failed first: the decode would wait for KV in vain
                    d_task.cancel()
                    return await self._failed(failure, send)
                await _first_done(loop, deadline, d_task)
            # (``_answered``, inline: the decode's 2xx head when it has come, else None)
            decode_reply_or_failure: Reply | _Failure | None = None
            if d_task.done() and not d_task.cancelled() and d_task.exception() is None:
                head = d_task.result()
                if 200 <= head.status < 300:
                    decode_reply_or_failure = head
            if decode_reply_or_failure is None:  # (not done, failed, or not a 2xx: its body is read within the wait)
                try:  # (``timeout_at``, not ``wait_for``: on Python 3.11 that can lose the client's leaving, gh-86296)
                    async with asyncio.timeout_at(deadline):
                        decode_reply_or_failure = await _settle(d_task, decode)
                except TimeoutError:  # (the wait for the decode's head, or the pool's deadline: the request's own)
                    if deadline >= ends_at:  # (the wait was cut short by the request's deadline: no one's fault)
                        raise _request_timed_out(cfg.request_timeout_s) from None
                    _blame_silent_decode(decode, p_task, metrics)
                    raise UpstreamTimeout(f"the SGLang decode worker did not answer within {wait_s:g}s") from None
            assert decode_reply_or_failure is not None
            if isinstance(decode_reply_or_failure, _Failure):
                # (a prefill's refusal ends the decode's room too: the decode may fail first, for no fault of its own)
                refusal = _failure(p_task, prefill) if p_task.done() else None
                if refusal is not None and _is_request_fault(refusal.status):
                    return await self._failed(refusal, send)
                p_task.cancel()
                _record(decode, d_rid, decode_reply_or_failure.status, metrics)
                return await self._failed(decode_reply_or_failure, send)
            reply = decode_reply_or_failure
            try:
                if stream and reply.headers.get("content-type", "").startswith("text/event-stream"):
                    first = await self._first_events(reply, p_task, prefill, decode, deadline, wait_s, ends_at)
                    if isinstance(first, _Failure):  # nothing sent yet: retried like a failure before the head
                        reply.close()  # (aborts the decode's request)
                        if first.worker is decode:
                            _failed_worker(decode, "worker_gone", metrics)
                        return await self._failed(first, send)
                    decode.health.breaker.trials.discard(d_rid)  # (a half-open trial that streams: its place is free)
                    status: int | None = await self._stream(reply, first, p_task, merge_logprobs, send, figures)
                else:
                    whole = await self._whole(reply, decode, p_task, merge_logprobs, send, figures)
                    if isinstance(whole, _Failure):  # nothing sent yet: retried like a failure before the head
                        _failed_worker(decode, "worker_gone", metrics)
                        return await self._failed(whole, send)
                    status = whole
            finally:
                reply.release()
            if status != NO_VERDICT:
                _record(decode, d_rid, status, metrics)  # (a stream broken after its head: the decode's failure...)
            answered = True
            return reply.status  # (...but the client's status is the head's: what the request counter counts)
        finally:
            if not d_task.done():
                d_task.cancel()
            elif not answered and not d_task.cancelled() and d_task.exception() is None:
                # (a head that came in as this attempt was cancelled or timed out, never taken: its request is
                # aborted; a no-op for a reply released above)
                d_task.result().close()
            decode.closed(d_rid)
            if answered and not p_task.done():
                # The prefill's reply may trail its KV hand-over: let it end on its own (request timeout).
                self._background.add(p_task)
                p_task.add_done_callback(self._background.discard)
            elif not p_task.done():
                p_task.cancel()  # closing its connection aborts it on the worker

    async def _failed(self, failure: _Failure, send: Send) -> int | _Retry:
        """A side failed before the client got anything: its 4xx is the client's, the rest is retried
        (a busy worker's 429, past the retries, is the client's 429)."""
        worker, status = failure.worker, failure.status
        if status is not None and _is_request_fault(status):
            # (a streamed refusal goes out as the worker wrote it, a 200 with its error event; counted as the 400)
            await _send_whole(send, failure.relayed_status or status, failure.content_type, failure.body)
            return status
        message = f"SGLang {worker.role} worker {worker.url}: {failure.reason}"
        if status in (401, 403):
            message += " (it refused the gateway's key: start the gateway with the workers' --api-key as " \
                       "--worker-api-key)"
        log.warning("%s", message)
        if status == 429:  # (the client is told when to come back: the worker's own figure, else 1 s)
            return _Retry(Overloaded(message, code="worker_overloaded", retry_after_s=failure.retry_after_s or 1.0),
                          worker)
        if status == 503:  # (unavailable for now, e.g. its request queue full: SGLang's answer to that)
            return _Retry(NoWorkers(message, code="worker_unavailable", retry_after_s=failure.retry_after_s or 1.0),
                          worker)
        return _Retry(BadGateway(message, code="worker_failed"), worker)

    async def _whole(self, reply: Reply, decode: HttpWorker, p_task: asyncio.Task[_PrefillReply],
                     merge_logprobs: bool, send: Send, figures: _Figures) -> int | _Failure:
        """A whole answer relayed: the client's status; or, when the decode's body broke off (nothing was
        sent to the client yet), the failure, retried. One that did not come within the request's timeout
        is a 504, not retried (another run would take as long) and no failure of the decode's."""
        content_type = reply.headers.get("content-type", "application/json")
        try:
            data = await reply.read()
        except TimeoutError:
            raise UpstreamTimeout(f"the SGLang decode worker's answer did not come within "
                                  f"{self.fleet.config.request_timeout_s:g}s", code="request_timeout",
                                  final=True) from None
        except OSError as exc:  # (HttpClientError)
            return _Failure(decode, f"its response broke: {type(exc).__name__}: {exc}")
        if merge_logprobs and reply.status == 200:
            data = _merge_whole(await _prefill_logprobs(p_task, self.fleet.config.read_timeout_s, self.route), data)
        await _send_whole(send, reply.status, content_type, data)
        if reply.status == 200:
            figures.answered(data)
        return reply.status

    async def _first_events(self, reply: Reply, p_task: asyncio.Task[_PrefillReply],
                            prefill: HttpWorker, decode: HttpWorker, deadline: float, wait_s: float,
                            ends_at: float) -> tuple[bytes, bytes] | _Failure:
        """A stream's first complete events and the bytes after them, before the client gets its head.

        SGLang's decode sends its head at once and then waits for the KV: until its first event the
        stream can still fail over to a new pair, which it does when the prefill fails meanwhile (the
        KV will never come) or the decode's connection breaks. No event within the first-token
        timeout is a 504. A first event over ``MAX_EVENT_BYTES`` is the decode's failure, as a broken stream."""
        loop = asyncio.get_running_loop()
        buffer = _Events()
        read: asyncio.Future[bytes] = loop.create_task(reply.readany())  # (``ensure_future``'s, without its frames)
        try:
            while True:
                if p_task.done():
                    failure = _failure(p_task, prefill)
                    if failure is not None:
                        return failure
                # (``asyncio.wait``'s ``FIRST_COMPLETED`` up to ``deadline``, without its sets and frames)
                prefill_waited = not p_task.done()
                if prefill_waited:
                    await _first_done(loop, deadline, read, p_task)
                else:
                    await _first_done(loop, deadline, read)
                if not read.done():
                    if prefill_waited and p_task.done():
                        continue  # (judged above)
                    if deadline >= ends_at:  # (the request's own deadline cut the wait short: no one's fault)
                        raise _request_timed_out(self.fleet.config.request_timeout_s)
                    _blame_silent_decode(decode, p_task, self.metrics)
                    raise UpstreamTimeout(f"the SGLang decode worker sent no event within {wait_s:g}s")
                try:
                    chunk = read.result()
                except TimeoutError:  # (the request's own deadline, the pool's: no worker's fault, final)
                    raise _request_timed_out(self.fleet.config.request_timeout_s) from None
                except OSError as exc:
                    return _Failure(decode, f"its stream broke before its first event: {type(exc).__name__}: {exc}")
                if not chunk:
                    return buffer.pending, b""  # ended without a complete event: relayed as it is
                events = buffer.feed(chunk)
                if events:
                    return events, buffer.pending
                if buffer.num_pending_bytes > MAX_EVENT_BYTES:  # (a misbehaving decode: retried as a broken one)
                    return _Failure(decode, f"its stream {_too_large(buffer.num_pending_bytes)} before its first "
                                            f"event")
                read = loop.create_task(reply.readany())
        finally:
            if not read.done():
                read.cancel()
            elif not read.cancelled():
                read.exception()  # (retrieved: a read that failed as the prefill's failure was judged logs nothing)

    async def _stream(self, reply: Reply, first: tuple[bytes, bytes],
                      p_task: asyncio.Task[_PrefillReply], merge_logprobs: bool, send: Send,
                      figures: _Figures) -> int | None:
        """Relay the stream from its first events on, whole events only: a decode that breaks off
        mid-event leaves the client a clean error event, not a line of two events run together; so does one whose
        incomplete event grows past ``MAX_EVENT_BYTES`` (its connection closed, its failure as a broken one's).
        Returns the decode's outcome for ``_record``: its status, 504 for a stream silent too long, None for one
        broken off, ``NO_VERDICT`` for one cut by the request's own timeout (the client's status is the head's)."""
        content_type = reply.headers.get("content-type", "text/event-stream")
        await send({"type": "http.response.start", "status": reply.status,
                    "headers": [(b"content-type", content_type.encode("latin-1")), (b"cache-control", b"no-cache"),
                                (b"x-accel-buffering", b"no")]})
        idle_s = self.fleet.config.read_timeout_s
        # (the head is out: the prefill's reply is waited for no longer than a gap between events)
        logprobs = await _prefill_logprobs(p_task, idle_s, self.route) if merge_logprobs else None
        events, pending = first
        buffer = _Events(pending)
        status = reply.status
        if status == 200:
            figures.first_event()
        last = None  # (the newest events other than a lone [DONE]: the figures' source)
        ended = False  # its ``[DONE]`` was relayed: the answer is whole, whatever its connection does next
        try:
            while True:
                if events:
                    if events.strip() != b"data: [DONE]":
                        last = events
                    await send({"type": "http.response.body", "more_body": True,
                                "body": events if logprobs is None else _merge_events(logprobs, events)})
                    ended = ended or events.rstrip().endswith(b"data: [DONE]")
                if buffer.num_pending_bytes > MAX_EVENT_BYTES:
                    reply.close()  # (its bytes stop here: the decode's request is aborted, its connection not reused)
                    raise _EventTooLarge(_too_large(buffer.num_pending_bytes))
                # (after its [DONE], the body's end is waited for only briefly: it keeps the connection reusable)
                chunk = await reply.readany(min(idle_s, DONE_GRACE_S) if ended else idle_s)
                if not chunk:
                    break
                events = buffer.feed(chunk)
        except (HttpClientError, TimeoutError, _EventTooLarge) as exc:
            if ended:  # (broken or silent after its [DONE]: no error event after the end, no failure of the decode's)
                log.debug("%s: the SGLang decode worker's stream did not end cleanly after its [DONE]: %r",
                          self.route, exc)
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                figures.answered(_last_event(last) if last is not None else None, streamed=True)
                return status
            timed_out = isinstance(exc, TimeoutError)
            if timed_out and not isinstance(exc, ReadIdle):
                # The request's own deadline (the pool's ``request_timeout_s``), not a silent decode: final, and no
                # worker's fault, as on the native path (``dispatch._request_timed_out``).
                error: APIError = _request_timed_out(self.fleet.config.request_timeout_s)
                log.warning("%s: %s", self.route, error.message)
                outcome: int | None = NO_VERDICT
            else:
                why = f"sent nothing for {idle_s:g}s" if timed_out else str(exc) if isinstance(exc, _EventTooLarge) \
                    else f"broke: {type(exc).__name__}: {exc}"
                log.warning("%s: the SGLang decode worker's stream %s", self.route, why)
                error = (UpstreamTimeout if timed_out else BadGateway)(f"the SGLang decode worker's stream {why}")
                outcome = error.status if timed_out else None  # (broken off: worker_gone, not its own error)
            # (whole events only, then the error event and [DONE], as the native path ends a broken stream)
            pending, status = error_event(error) + SSE_DONE, error.status
        else:
            pending, outcome = buffer.pending, status
        await send({"type": "http.response.body", "body": pending, "more_body": False})
        if status == 200:
            figures.answered(_last_event(last + pending if last is not None else pending), streamed=True)
        return outcome


class _Sent:
    """The ASGI ``send`` of one relayed request, minding how far the response got (for ``cut``)."""

    __slots__ = ("complete", "head", "send", "started", "status")

    def __init__(self, send: Send) -> None:
        self.send, self.started, self.complete = send, False, False
        self.status = 0  # the response head's, once ``started``
        self.head: Any = ()  # its header list, once ``started`` (read by ``cut`` alone)

    @property
    def stream(self) -> bool:
        """The response begun is a stream (judged when asked: only a cut request asks)."""
        return any(name == b"content-type" and value.startswith(b"text/event-stream") for name, value in self.head)

    async def __call__(self, message: Any) -> None:
        if message["type"] == "http.response.start":
            self.started, self.status, self.head = True, message["status"], message.get("headers", ())
        elif not message.get("more_body", False):
            self.complete = True
        await self.send(message)

    async def cut(self, route: str) -> int:
        """A request cancelled by the server's shutdown: a stream ends with an error event and ``[DONE]``,
        an answer not begun is a 503 (at most a second's wait), rather than the connection closing.
        Returns the status the client got (a stream's head went out with its own)."""
        error = shutdown_cut_error()
        log.warning("%s cut by the gateway's shutdown", route)
        status = error.status if not self.started else self.status
        with contextlib.suppress(Exception):
            async with asyncio.timeout(1.0):
                if not self.started:
                    await send_error(self.send, error)
                elif self.stream and not self.complete:
                    await self.send({"type": "http.response.body", "more_body": False,
                                     "body": error_event(error) + SSE_DONE})
        return status


def _request_timed_out(timeout_s: float) -> UpstreamTimeout:
    """The request ran past its ``request_timeout_s`` (its attempts' shared deadline): final, no worker's fault."""
    return UpstreamTimeout(f"the request ran past its timeout ({timeout_s:g}s)", code="request_timeout", final=True)


def _prefill_done(task: asyncio.Task[_PrefillReply], prefill: HttpWorker, rid: int,
                  metrics: GatewayMetrics | None = None) -> None:
    """The prefill's request ended: it leaves the worker's view, its outcome feeds the breaker (a 4xx is
    the request's fault, a cancellation nobody's)."""
    prefill.closed(rid)
    if task.cancelled():
        return
    exc = task.exception()
    if isinstance(exc, TimeoutError):  # (the request's own deadline: no verdict)
        return
    _record(prefill, rid, task.result().status if exc is None else None, metrics)


def _record(worker: HttpWorker, rid: int, status: int | None, metrics: GatewayMetrics | None = None) -> None:
    """A worker's answer for its breaker: a 2xx or the request's own 4xx is a success, a busy worker's
    408/429/503 neither (overload is not a fault, as on the native path: SGLang answers a full request queue with
    a 503; a worker that stays unavailable fails its health checks), no answer or another 5xx a failure."""
    if status is not None and 200 <= status < 300:  # (the usual, first)
        worker.health.breaker.record_success(rid)
        return
    if status in (408, 429, 503):
        return
    if status is not None and _is_request_fault(status):
        worker.health.breaker.record_success(rid)
    else:
        _failed_worker(worker, "worker_gone" if status is None else "timeout" if status == 504 else "internal",
                       metrics)


def _blame_silent_decode(decode: HttpWorker, p_task: asyncio.Task[_PrefillReply],
                         metrics: GatewayMetrics | None = None) -> None:
    """The decode sent nothing in time: its failure if its prefill is done (the KV was there to take);
    while the prefill still works, a slow or frozen prefill may be why, and neither is blamed."""
    if p_task.done() and _failure(p_task, decode) is None:  # (the prefill answered 2xx)
        _failed_worker(decode, "timeout", metrics)


def _failed_worker(worker: HttpWorker, code: str, metrics: GatewayMetrics | None) -> None:
    """A failure held against ``worker``: its breaker hears of it, and ``pd_gateway_worker_failures_total`` counts
    it under ``code`` as the native path counts its workers' (``worker_gone``: no answer, or its answer broke off;
    ``timeout``: silent past a deadline; ``internal``: an error status of its own)."""
    worker.health.breaker.record_failure()
    if metrics is not None:
        metrics.worker_failures.labels(worker.url, worker.role, code).inc()


def _is_request_fault(status: int | None) -> bool:
    """A 4xx (other than the retryable 408/429, and 401/403: the worker refused the gateway's own key, which
    SGLang does not ask of its probes): the request's fault, not the worker's; the client's answer."""
    return status is not None and 400 <= status < 500 and status not in RETRY_STATUSES and status not in (401, 403)


@dataclass
class _PrefillReply:
    status: int
    content_type: str
    body: bytes
    retry_after_s: float | None = None
    refusal: str | None = None  # a 2xx stream whose event is an error: the worker refused the request (its message)


@dataclass
class _Failure:
    worker: HttpWorker
    reason: str
    status: int | None = None  # the worker's own status when it answered (a streamed refusal: 400)
    content_type: str = "application/json"
    body: bytes = b""
    retry_after_s: float | None = None  # its ``Retry-After`` (seconds), when it gave one
    relayed_status: int | None = None  # the status the client gets with ``body``, when not ``status``


MAX_RETRY_AFTER_S = 300.0  # (a worker's ``Retry-After`` passed on is capped: the client's wait is ours to bound)


def _retry_after_s(headers: Mapping[str, str]) -> float | None:
    """A reply's ``Retry-After`` in seconds (the delta-seconds form; an HTTP date is not read)."""
    value = headers.get("retry-after", "").strip()
    return min(float(value), MAX_RETRY_AFTER_S) if value.isascii() and value.isdigit() else None  # (not "²")


@dataclass
class _Retry:
    error: APIError
    worker: HttpWorker


async def _post(fleet: SGLangFleet, worker: HttpWorker, url: str, data: bytes, headers: bytes,
                keep_body: bool, decode_asked: asyncio.Future[None],
                asked: asyncio.Future[None] | None, ends_at: float) -> _PrefillReply:
    """The prefill's request, read to its end (SSE or JSON): its connection is then free again. It goes out
    once the decode's has (``decode_asked``): a decode request waiting for a free connection to its worker
    (``max_connections_per_worker``) would leave the prefill holding the prompt's KV for nobody. (A decode
    request that fails before it went out is the caller's to see: this one is then cancelled unsent.) ``asked`` is
    set once its own head has gone out."""
    await decode_asked
    reply = await _open(fleet, worker, url, data, headers, asked, ends_at)
    try:  # (``async with reply``'s release, without its two coroutines)
        body = await reply.read()
        content_type = reply.headers.get("content-type", "application/json")
        status = reply.status
        refusal = _stream_refusal(body) if 200 <= status < 300 and content_type.startswith(
            "text/event-stream") else None
        return _PrefillReply(status, content_type, body if keep_body or status >= 300 or refusal is not None else b"",
                             # (a 2xx's is never read: ``_failure`` reads a failed answer's alone)
                             _retry_after_s(reply.headers) if not 200 <= status < 300 else None, refusal)
    finally:
        reply.release()


def _stream_refusal(body: bytes) -> str | None:
    """The message of a stream whose first event is ``data: {"error": ...}``: how SGLang's server (and our workers)
    refuse a streamed request, with status 200 (the prefill handed no KV over: its decode would wait for it in
    vain). An error event after other events is no refusal: the stream had begun (a choice handed over), and what
    failed after (another choice's transfer, say) is the worker's, retried as any failure."""
    if b'"error"' not in body:
        return None
    for line in body.split(b"\n"):
        if not line.startswith(b"data:"):
            continue
        try:  # (the first event alone)
            event = msgspec.json.decode(line[5:])
        except msgspec.DecodeError:
            return None
        if isinstance(event, dict) and isinstance(event.get("error"), dict):
            return str(event["error"].get("message"))
        return None
    return None


async def _open(fleet: SGLangFleet, worker: HttpWorker, url: str, data: bytes, headers: bytes,
                asked: asyncio.Future[None] | None, ends_at: float) -> Reply:
    """A request to ``worker`` up to its response headers (the caller reads or relays the body); ``asked`` is
    set once the request has gone out.

    On a pooled connection; one that crossed the worker's close of that idle connection (``crossed_idle_close``:
    the worker never read it) is sent once more, on a fresh connection, and only that one's failure is the
    worker's."""
    assert fleet.pool is not None
    try:
        return await fleet.pool.post(url, data, headers, asked, ends_at)
    except HttpClientError as exc:
        if not crossed_idle_close(exc):
            raise
        worker.num_resent += 1
        log.debug("SGLang %s worker %s closed the idle connection a request went out on (%s: %s); sent again on a "
                  "fresh one", worker.role, worker.url, type(exc).__name__, exc)
    return await fleet.pool.post(url, data, headers, asked, ends_at, fresh=True)


def _failure(task: asyncio.Task[_PrefillReply], worker: HttpWorker) -> _Failure | None:
    if task.cancelled():
        return _Failure(worker, "cancelled")
    exc = task.exception()
    if exc is not None:
        return _Failure(worker, f"{type(exc).__name__}: {exc}")
    reply = task.result()
    if reply.refusal is not None:  # (the request's fault, as a 400: its events are the client's answer as they are)
        return _Failure(worker, f"refused the request: {reply.refusal}", 400, reply.content_type, reply.body,
                        relayed_status=reply.status)
    if 200 <= reply.status < 300:
        return None
    return _Failure(worker, f"answered {reply.status}", reply.status, reply.content_type, reply.body,
                    reply.retry_after_s)


async def _first_done(loop: asyncio.AbstractEventLoop, deadline: float, *futures: asyncio.Future[Any]) -> None:
    """Until one of ``futures`` is done, or loop time ``deadline`` (``asyncio.wait``'s ``FIRST_COMPLETED``, without
    its sets, its timer and its waiter's bookkeeping: twice per relayed request)."""
    for future in futures:
        if future.done():
            return
    waiter = loop.create_future()

    def wake(_: object) -> None:
        if not waiter.done():
            waiter.set_result(None)

    for future in futures:
        future.add_done_callback(wake)
    timer = loop.call_at(deadline, wake, None)
    try:
        await waiter
    finally:
        timer.cancel()
        for future in futures:
            future.remove_done_callback(wake)


async def _settle(task: asyncio.Task[Reply], worker: HttpWorker) -> Reply | _Failure:
    """The decode's reply, or its failure; a ``TimeoutError`` (the pool's deadline, the request's) is the caller's."""
    try:
        reply = await task
    except TimeoutError:
        raise
    except OSError as exc:
        return _Failure(worker, f"{type(exc).__name__}: {exc}")
    if 200 <= reply.status < 300:
        return reply
    try:
        body = await reply.read()
    except TimeoutError:
        raise
    except OSError as exc:  # no whole answer to pass on: retried
        return _Failure(worker, f"answered {reply.status}, then its response broke: {type(exc).__name__}: {exc}")
    finally:
        reply.release()
    return _Failure(worker, f"answered {reply.status}", reply.status,
                    reply.headers.get("content-type", "application/json"), body, _retry_after_s(reply.headers))


LogprobsByItem = dict[int, list[Any]]


_TRACE_HEADERS = (b"traceparent", b"tracestate")  # W3C trace context, as SGLang's router passes it on


def _trace_headers(headers: list[tuple[bytes, bytes]]) -> dict[str, str]:
    return {name.decode(): value.decode("latin-1") for name, value in headers if name in _TRACE_HEADERS}


async def _prefill_logprobs(task: asyncio.Task[_PrefillReply], timeout_s: float, route: str) -> LogprobsByItem | None:
    """The prefill's ``meta_info.input_token_logprobs`` per item of the request (0 for a single one; a
    batch's by its position, or its events' ``index``), from its JSON reply or its SSE events; None when
    there are none, or when the reply has not come within ``timeout_s`` (answered without them)."""
    done, _ = await asyncio.wait({task}, timeout=timeout_s)
    if not done:
        log.warning("%s: the SGLang prefill worker's reply did not come within %gs; answering without its prompt "
                    "logprobs", route, timeout_s)
        return None
    try:
        reply = task.result()
    except (TimeoutError, OSError):
        return None
    items: list[tuple[int | None, Any]] = []
    try:
        if reply.content_type.startswith("text/event-stream"):
            for line in reply.body.split(b"\n"):
                data = line[5:].strip() if line.startswith(b"data:") else b""
                if data and data != b"[DONE]":
                    items.append((None, msgspec.json.decode(data)))
        else:
            whole = msgspec.json.decode(reply.body)
            items = list(enumerate(whole)) if isinstance(whole, list) else [(0, whole)]
    except msgspec.DecodeError:
        return None
    found: LogprobsByItem = {}
    for position, item in items:
        if not isinstance(item, dict):
            continue
        index = item.get("index", 0) if position is None else position
        meta = item.get("meta_info")
        values = meta.get("input_token_logprobs") if isinstance(meta, dict) else None
        if isinstance(index, int) and isinstance(values, list) and index not in found:  # (a stream's first event)
            found[index] = values
    return found or None


def _merge_one(prefill_logprobs: LogprobsByItem | None, item: Any, position: int | None = None) -> Any:
    """``item`` (a decode answer, or a stream event: ``position`` None, its ``index`` says which) with the
    prefill's prompt logprobs of the same item in front of its own."""
    if prefill_logprobs is None or not isinstance(item, dict) or not isinstance(item.get("meta_info"), dict):
        return item
    values = prefill_logprobs.get(item.get("index", 0) if position is None else position)
    if values is None:
        return item
    meta = item["meta_info"]
    own = meta.get("input_token_logprobs")
    meta["input_token_logprobs"] = values + (own if isinstance(own, list) else [])
    return item


def _merge_whole(prefill_logprobs: LogprobsByItem | None, data: bytes) -> bytes:
    if prefill_logprobs is None:
        return data
    try:
        out = msgspec.json.decode(data)
    except msgspec.DecodeError:
        return data
    out = [_merge_one(prefill_logprobs, item, i) for i, item in enumerate(out)] if isinstance(out, list) else \
        _merge_one(prefill_logprobs, out, 0)
    return _json.encode(out)


def _merge_events(prefill_logprobs: LogprobsByItem, events: bytes) -> bytes:
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
                "headers": [(b"content-type", content_type.encode("latin-1")), (b"content-length", b"%d" % len(data))]})
    await send({"type": "http.response.body", "body": data})
