"""The generation routes as raw ASGI: one responder for chat, completions, responses and SGLang ``/generate``.

These three routes carry all the traffic, so they skip Starlette's request, routing and response
layers (the rest of the app stays on Starlette). A responder talks to its client through an
``Exchange``: the ASGI cycle (``AsgiExchange``: SGLang relays, a worker's SGLang API), or the
gateway's own cycle on the connection (``gateway.hot_cycle.HotCycle``: native workers). Per request
(``Responder.serve``):
1. Admission (a slot, a bounded wait, or 429), then the body (capped at ``max_body_bytes``, in
   ``body_timeout_s``: else 413 / 408),
   decoded by msgspec into the route's request struct; the route's ``Shape`` validates it into a
   ``Prepared`` (token ids + sampling parameters).
2. From then on the exchange watches for the client's disconnect (ASGI: a task waiting on
   ``receive()``; the gateway's own cycle: the connection's ``connection_lost``) and cancels the
   request's task; the cancellation is caught here and counted as 499, and the dispatcher's
   cleanup aborts the request on both workers.
3. Non-streaming: every choice runs to the end, then one JSON body. Streaming: the response starts
   only with the first chunk, so a failure before it gets a real status code. Chunks are built
   from per-request byte templates (per token only the new text is JSON-encoded); an error after
   the start becomes an ``error`` event; ``data: [DONE]`` ends the stream. On an exchange that can
   write from outside the task, every chunk but the last (the first one with the response's head) is
   written by the worker connection's callback (``_StreamEmitter``, ``Frontend.run_choices``'
   emitter) while the client's socket has room; otherwise, and for the last chunks, they go through
   the task.
4. The admission slot is released when the response has been sent (or the client left).

A ``Shape`` (``gateway/shapes.py``) is what differs between the routes: request struct, validation,
and the JSON of the whole response and of a stream chunk.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Protocol

import msgspec

from gateway.api import Frontend, Prepared, decode_body, error_event, new_id
from gateway.errors import APIError, BadRequest, NoWorkers, PayloadTooLarge, RequestTimeout, UnsupportedMediaType
from gateway.shapes import Run, Shape
from gateway.structured_output import CHECK_ON_LOOP, CheckOffLoop
from gateway.text import ChoiceState

if TYPE_CHECKING:
    from starlette.types import Message, Receive, Scope, Send

    from gateway.admission import Admission
    from gateway.metrics import GatewayMetrics
    from workers.protocol import StepOutput

log = logging.getLogger(__name__)
_json = msgspec.json.Encoder()
_encode = _json.encode
_JSON_HEADERS = (b"content-type", b"application/json")
SSE_HEADERS = ((b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
                (b"x-accel-buffering", b"no"))


# The status a request is counted with (``pd_gateway_requests_total``) when the gateway itself closed its connection
# before the response was complete (bytes pipelined behind it could not be parsed: ``gateway.http_protocol``),
# as nginx logs 444; 499 stays the client's own close.
CLOSED_BY_GATEWAY = 444
# An ASGI request's scope key where the gateway's HTTP protocol leaves the status it ended the request with itself
# (its own answer to a body it could not read, or ``CLOSED_BY_GATEWAY``); the gateway's own cycle has ``refused``.
REFUSED_KEY = "pd_gateway.refused"


class ClientGone(Exception):
    """The client closed the connection before the response was complete (``status`` 499), or the server's
    protocol ended the request itself while it was being read (its body's framing broken: ``status``; bytes
    pipelined behind it unparsable: ``CLOSED_BY_GATEWAY``)."""

    def __init__(self, status: int = 499) -> None:
        super().__init__(status)
        self.status = status


# A request body at least this long is prepared (parsed, templated, tokenized) on a thread, not on the
# event loop: tokenizing costs ~0.25 µs per byte of prompt not seen before (SmolLM2's tokenizer: ~12 ms
# for 5,000 tokens), which on the loop would hold up every stream it serves; the tokenizer lets the
# loop run meanwhile. (``--prepare-thread-bytes``; 0: always on the loop.)
PREPARE_THREAD_BYTES = 8192
_prepare_pool: ThreadPoolExecutor | None = None


def _prepare_threads() -> ThreadPoolExecutor:
    global _prepare_pool
    if _prepare_pool is None:  # (made on first use: most gateways never see such a prompt)
        _prepare_pool = ThreadPoolExecutor(min(4, os.cpu_count() or 1), thread_name_prefix="prepare")
    return _prepare_pool


# Logprob entries (each token's own and its alternatives, the prompt's with echo or prompt logprobs) above which a
# whole answer is shaped and encoded on the prepare threads, not the event loop: ~1 µs each (a chat answer of n 16
# x 2,000 tokens with top_logprobs 20 held the loop for 0.9 s).
LARGE_ANSWER_ENTRIES = 20_000


def _num_entries(prep: Prepared, choices: list[ChoiceState]) -> int:
    tokens = sum(len(c.token_ids) for c in choices)
    if prep.echo or prep.logprob_starts:
        tokens += sum(len(prep.prompt_of(c.index)) for c in choices)
    return tokens * (1 + prep.params.top_logprobs)


class Host(Protocol):
    """What a responder needs from the server it runs in: the gateway (``gateway.runtime.Gateway``)
    or a worker serving SGLang's HTTP protocol (``workers.sglang_api``)."""

    admission: Admission
    metrics: GatewayMetrics

    @property
    def max_body_bytes(self) -> int: ...

    @property
    def body_timeout_s(self) -> float: ...

    def require_frontend(self) -> Frontend: ...


class Exchange(Protocol):
    """One HTTP request/response as a responder sees it: the ASGI cycle (``AsgiExchange``) or the
    gateway's own cycle on the connection (``gateway.hot_cycle.HotCycle``)."""

    # The running loop. (``asyncio.get_running_loop()`` makes a ``getpid`` system call on Python 3.11:
    # on the hot path the loop is passed around instead.)
    loop: asyncio.AbstractEventLoop
    response_started: bool  # the response's status line has gone out (or to the server that writes it)

    @property
    def refused(self) -> int:
        """The status the server's protocol ended the request with itself, 0 if it did not (``ClientGone``)."""
        ...

    @property
    def headers(self) -> list[tuple[bytes, bytes]]:
        """The request's headers, as received (names lower case)."""
        ...

    def check_length(self, limit: int) -> None:
        """413 (``PayloadTooLarge``) at once when the request declares a body over ``limit`` bytes: before
        it waits for an admission slot (``read_body`` bounds what actually arrives)."""
        ...

    async def read_body(self, limit: int, timeout_s: float) -> bytes:
        """The whole body: at most ``limit`` bytes (else 413), within ``timeout_s`` (else 408); ClientGone."""
        ...

    def watch_disconnect(self, gone: list[bool]) -> None:
        """From now on the client leaving sets ``gone[0]`` and cancels the task answering the request
        (which may not exist yet when this is called: ``gateway.eager``)."""
        ...

    def stop_watching(self) -> None: ...

    async def send_json(self, body: bytes, status: int, headers: list[tuple[bytes, bytes]]) -> None: ...

    async def start_stream(self, first: bytes) -> None:
        """Status 200, the SSE headers and the first chunk."""
        ...

    async def send_chunk(self, chunk: bytes) -> None:
        """One more chunk of the stream (waits while the client's socket is full)."""
        ...

    async def end_stream(self, last: bytes) -> None: ...

    def is_writable(self) -> bool:
        """Can ``write_now`` write a chunk (the stream started and not ended, the client's socket has room)?"""
        ...

    def write_now(self, chunk: bytes) -> None:
        """One more chunk of the stream, written at once from outside the request's task (``is_writable``)."""
        ...

    def text_lane(self, accept: Callable[[StepOutput], str], encode: Callable[[str], bytes], before: bytes,
                  after: bytes) -> Callable[[StepOutput], bool] | None:
        """``is_writable`` then ``write_now(before + encode(accept(output)) + after)`` as one call (False when
        not writable, nothing accepted), for a started stream's middle chunks; None: not offered."""
        ...

    def can_start(self) -> bool:
        """Can ``start_now`` start the stream (nothing sent yet, the client there, its socket has room)?"""
        ...

    def start_now(self, first: bytes) -> None:
        """``start_stream`` at once, from outside the request's task (``can_start``)."""
        ...


class _StreamField(msgspec.Struct):
    stream: Any = None


def _asked_to_stream(body: bytes) -> bool:
    """The request body's ``stream`` is true (False for a body that is not a JSON object)."""
    try:
        return msgspec.json.decode(body, type=_StreamField).stream is True
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):  # (nested past what the decoder takes)
        return False


class Responder:
    """One generation route (``POST`` only): raw ASGI (``__call__``) or any ``Exchange`` (``serve``)."""

    def __init__(self, gw: Host, shape: Shape, prepare_thread_bytes: int = PREPARE_THREAD_BYTES, *,
                 refusals_as_events: bool = False) -> None:
        """``refusals_as_events``: a request that asked to stream and is refused (a 400) is answered as
        SGLang's server answers its ``/generate``: status 200, an error event, ``[DONE]`` (SGLang's Rust
        router turns a streamed non-2xx answer into a cut-off, unreadable body)."""
        self.gw = gw
        self.shape = shape
        self.prepare_thread_bytes = prepare_thread_bytes  # (see ``PREPARE_THREAD_BYTES``)
        self.refusals_as_events = refusals_as_events
        self._counters: dict[int, Any] = {}  # status -> the route's request counter child

    def _count(self, status: int) -> None:
        counter = self._counters.get(status)
        if counter is None:
            counter = self._counters[status] = self.gw.metrics.requests.labels(self.shape.route, str(status))
        counter.inc()

    def _prepare(self, frontend: Frontend, body: bytes) -> tuple[Prepared, str | None]:
        shape = self.shape
        try:
            return shape.prepare(frontend, decode_body(body, shape.body_type))
        except RecursionError:  # (a schema or tool parameters just shallow enough for the decoder, not for
            # what serializes or checks them: a 400, not the catch-all's 500)
            raise BadRequest("the request is nested too deeply") from None

    async def _prepare_off_loop(self, exchange: Exchange, frontend: Frontend, body: bytes) -> tuple[Prepared,
                                                                                                   str | None]:
        context = contextvars.copy_context()
        if self.prepare_thread_bytes <= 0:  # (no threads: its grammars are checked here after all)
            context.run(CHECK_ON_LOOP.set, True)
            return context.run(self._prepare, frontend, body)
        return await exchange.loop.run_in_executor(_prepare_threads(), context.run, self._prepare, frontend, body)

    def _encode_whole(self, run: Run, choices: list[ChoiceState]) -> bytes:
        return _json.encode(self.shape.whole(run, choices))

    def count(self, status: int) -> None:
        """Count one request of this route that the responder never served: the HTTP protocol answered it, or
        closed its connection, before it started."""
        self._count(status)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["method"] != "POST":
            self._count(405)
            await send_json(send, {"error": {"message": f"Method Not Allowed: {scope['method']} {scope['path']}",
                                             "type": "invalid_request_error", "param": None, "code": None}}, 405,
                            [(b"allow", b"POST")])
            return
        await self.serve(AsgiExchange(scope, receive, send))

    async def serve(self, exchange: Exchange) -> None:
        gw, shape = self.gw, self.shape
        release = None
        body = b""
        gone = [False]
        run: Run | None = None
        answering: APIError | None = None  # an error answer counted and going out (not counted again if cut)
        try:
            try:
                # The body before the slot (a client still uploading holds none), a full queue refused before the
                # upload; a client leaving while queued gives up its place: the disconnect is watched from before
                # admission (over ASGI only after the body, which the watcher would otherwise read).
                if isinstance(exchange, AsgiExchange):
                    gw.admission.check_room()
                    body = await exchange.read_body(gw.max_body_bytes, gw.body_timeout_s)
                    exchange.watch_disconnect(gone)
                    release = await gw.admission.admit()
                else:
                    exchange.watch_disconnect(gone)
                    limit = gw.max_body_bytes
                    exchange.check_length(limit)
                    gw.admission.check_room()
                    body = await exchange.read_body(limit, gw.body_timeout_s)
                    release = await gw.admission.admit()
                frontend = gw.require_frontend()
                try:
                    if len(body) >= self.prepare_thread_bytes > 0:  # a long prompt: tokenized off the event loop
                        prep, client_id = await self._prepare_off_loop(exchange, frontend, body)
                    else:
                        try:
                            prep, client_id = self._prepare(frontend, body)
                        except CheckOffLoop:  # a GBNF grammar (its check costs the square of its rules)
                            prep, client_id = await self._prepare_off_loop(exchange, frontend, body)
                except BadRequest as exc:
                    raise encoded_refusal(exc, exchange.headers) from None
                run = Run(frontend, prep, client_id or new_id(shape.id_prefix))
                if prep.stream:
                    await self._stream(run, exchange)
                else:
                    choices = await self._collect(run)
                    exchange.stop_watching()
                    if prep.want_logprobs and _num_entries(prep, choices) > LARGE_ANSWER_ENTRIES:
                        answer = await exchange.loop.run_in_executor(
                            _prepare_threads(), contextvars.copy_context().run, self._encode_whole, run, choices)
                    else:
                        answer = _json.encode(shape.whole(run, choices))
                    await exchange.send_json(answer, 200, [])
                counter = self._counters.get(200)  # (``_count(200)``, inline: the common case, once per request)
                if counter is None:
                    self._count(200)
                else:
                    counter.inc()
            except APIError as exc:
                self._count(exc.status)
                answering = exc
                log.log(logging.WARNING if exc.status >= 500 else logging.INFO, "%s -> %d %s: %s", shape.route,
                        exc.status, exc.type, exc.message)
                exchange.stop_watching()
                if self.refusals_as_events and exc.status == 400 and not exchange.response_started \
                        and _asked_to_stream(body):
                    await exchange.start_stream(error_event(exc))
                    await exchange.end_stream(self.shape.end)
                else:
                    await exchange.send_json(_json.encode(exc.body()), exc.status, exc.headers())
            except ClientGone:
                raise  # (below: not an error of ours)
            except Exception:
                if run is not None and run.started:
                    self._count(200)  # (the head went out with it)
                    raise  # mid-stream: nothing to answer with; the server closes the connection
                log.exception("%s failed", shape.route)
                self._count(500)
                exchange.stop_watching()
                answering = error = APIError("internal error in the gateway")
                await exchange.send_json(_json.encode(error.body()), error.status, error.headers())
        except asyncio.CancelledError:
            if not gone[0]:  # the server stopping past its drain timeout: tell the client why, if it can be told
                await self._cut(exchange, run, answering)
                raise
            task = asyncio.current_task(exchange.loop)
            assert task is not None
            task.uncancel()
            # (the protocol answered it itself, its body unreadable, or closed its connection: CLOSED_BY_GATEWAY)
            refused = getattr(exchange, "refused", 0)  # (an exchange of a test may lack it)
            if answering is None:
                self._count(refused or 499)
            if not refused:
                log.info("%s -> 499: the client closed the connection", shape.route)
            elif refused == CLOSED_BY_GATEWAY:
                log.info("%s -> %d: the gateway closed the connection (unparsable bytes behind it)", shape.route,
                         refused)
        except ClientGone as exc:
            self._count(exc.status)
            if exc.status == 499:
                log.info("%s -> 499: the client closed the connection while sending its request", shape.route)
        finally:
            exchange.stop_watching()
            if release is not None:
                release()

    async def _cut(self, exchange: Exchange, run: Run | None, answering: APIError | None) -> None:
        """A request cancelled by the server's shutdown (``--drain-timeout-s`` passed): a stream ends with an
        error event and ``[DONE]``, an answer not begun is a 503 (both at most a second's wait for the
        client's socket), rather than the connection closing mid-response. ``answering``: the error answer
        (counted) whose sending was cut: it is sent instead, and not counted again."""
        error = answering or shutdown_cut_error()
        if answering is None:  # (a stream whose head went out: its status was 200)
            self._count(200 if exchange.response_started else error.status)
        log.warning("%s cut by the gateway's shutdown", self.shape.route)
        with contextlib.suppress(Exception):  # (asyncio.timeout's TimeoutError, a socket already gone)
            async with asyncio.timeout(1.0):
                if exchange.response_started:  # a stream's head went out (a whole answer's: nothing to add)
                    if run is not None and run.started:
                        await exchange.send_chunk(self.shape.failure(run, error))
                        await exchange.end_stream(self.shape.end)
                else:  # (a stream whose head was still waiting for the client's socket included)
                    await exchange.send_json(_json.encode(error.body()), error.status,
                                             [*error.headers(), (b"connection", b"close")])

    async def _collect(self, run: Run) -> list[ChoiceState]:
        active = self.gw.metrics.active
        active.inc()
        try:
            if run.prep.n == 1:
                return [await run.frontend.complete_one(run.prep)]
            states: dict[int, ChoiceState] = {}  # (made only for several choices)
            async for state, _, _ in run.frontend.run_choices(run.prep):
                states[state.index] = state
        finally:
            active.dec()
        return [states[i] for i in sorted(states)]

    async def _stream(self, run: Run, exchange: Exchange) -> None:
        if not isinstance(exchange, AsgiExchange):  # (ASGI's send is a coroutine: no writes from outside)
            run.emitter = _StreamEmitter(run, self.shape, exchange)
        events = self.shape.events(run)
        active = self.gw.metrics.active
        active.inc()
        try:
            # The response starts with the first chunk, here or from the worker connection's callback
            # (``run.started``); from then on the status is 200 and errors are events in the stream.
            try:
                async for chunk in events:
                    if run.started:
                        await exchange.send_chunk(chunk)
                    else:
                        run.started = True
                        await exchange.start_stream(chunk)
            except APIError as exc:
                if not run.started:
                    raise
                log.warning("%s stream ended by %d %s: %s", self.shape.route, exc.status, exc.type, exc.message)
                await exchange.send_chunk(self.shape.failure(run, exc))
            if not run.started:
                run.started = True
                await exchange.start_stream(b"")
            exchange.stop_watching()  # the response is complete next; the client leaving now changes nothing
            await exchange.end_stream(self.shape.end)
        finally:
            active.dec()
            await events.aclose()
            if isinstance(run.emitter, _StreamEmitter):
                run.emitter.close()
            run.emitter = None  # (it refers to the run: freed by reference counting, not the collector)


def encoded_refusal(exc: BadRequest, headers: list[tuple[bytes, bytes]]) -> APIError:
    """A body that is not JSON because it came compressed (``Content-Encoding``, which no route decodes, as
    vLLM's and SGLang's do not): a 415 that says so, not "not valid JSON"; any other refusal as it is."""
    if exc.param is None and exc.message.startswith("request body is not valid"):
        for name, value in headers:
            if name == b"content-encoding" and value.strip().lower() not in (b"", b"identity"):
                return UnsupportedMediaType(f"the request body's Content-Encoding {value.decode('latin-1')!r} is not "
                                            "supported: send it uncompressed", code="unsupported_content_encoding")
    return exc


def shutdown_cut_error() -> APIError:
    """What a request the gateway's shutdown cuts past its drain timeout is told (503 ``shutting_down``)."""
    return NoWorkers("the gateway shut down before this request finished (its drain timeout passed)",
                     code="shutting_down", retry_after_s=1)


class AsgiExchange:
    """``Exchange`` over an ASGI ``(scope, receive, send)``: the body from ``receive``, a watcher task
    for the disconnect, every write through ``send``."""

    __slots__ = ("loop", "receive", "response_started", "scope", "send", "watcher")

    def __init__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.scope, self.receive, self.send = scope, receive, send
        self.response_started = False
        self.loop = asyncio.get_running_loop()
        self.watcher: asyncio.Task[None] | None = None

    @property
    def headers(self) -> list[tuple[bytes, bytes]]:
        return self.scope["headers"]

    @property
    def refused(self) -> int:
        return int(self.scope.get(REFUSED_KEY, 0))

    def check_length(self, limit: int) -> None:
        check_length(self.scope["headers"], limit)

    async def read_body(self, limit: int, timeout_s: float) -> bytes:
        try:
            return await read_body(self.scope, self.receive, limit, timeout_s)
        except ClientGone:
            raise ClientGone(self.refused or 499) from None

    def watch_disconnect(self, gone: list[bool]) -> None:
        task = asyncio.current_task(self.loop)
        assert task is not None
        self.watcher = asyncio.create_task(watch_disconnect(self.receive, task, gone))

    def stop_watching(self) -> None:
        if self.watcher is not None:
            self.watcher.cancel()
            self.watcher = None

    async def send_json(self, body: bytes, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        await self.send({"type": "http.response.start", "status": status,
                         "headers": [_JSON_HEADERS, (b"content-length", b"%d" % len(body)), *headers]})
        self.response_started = True
        await self.send({"type": "http.response.body", "body": body})

    async def start_stream(self, first: bytes) -> None:
        await self.send({"type": "http.response.start", "status": 200, "headers": list(SSE_HEADERS)})
        self.response_started = True
        await self.send({"type": "http.response.body", "body": first, "more_body": True})

    async def send_chunk(self, chunk: bytes) -> None:
        await self.send({"type": "http.response.body", "body": chunk, "more_body": True})

    async def end_stream(self, last: bytes) -> None:
        await self.send({"type": "http.response.body", "body": last, "more_body": False})

    def is_writable(self) -> bool:
        return False  # ASGI's send is a coroutine: every chunk goes through the request's task

    def write_now(self, chunk: bytes) -> None:
        raise RuntimeError("an ASGI stream is written through its task")

    def text_lane(self, accept: Callable[[StepOutput], str], encode: Callable[[str], bytes], before: bytes,
                  after: bytes) -> None:
        return None

    def can_start(self) -> bool:
        return False

    def start_now(self, first: bytes) -> None:
        raise RuntimeError("an ASGI stream is written through its task")


def _refuse(*_: object) -> bool:
    return False


class _StreamEmitter:
    """A stream's chunks from outside its task (``Frontend.run_choices``' ``emitter``): the first one
    with the response's head, then the middle ones. For the one choice it is given (``direct``), it is
    the dispatcher's ``DirectConsumer``: each output detokenized, shaped and written in one call."""

    __slots__ = ("after", "before", "exchange", "offer", "ready", "run", "shape", "state", "write")
    state: ChoiceState  # (set by ``direct``, before any ``take``)

    def __init__(self, run: Run, shape: Shape, exchange: Exchange) -> None:
        self.run, self.shape, self.exchange = run, shape, exchange
        # The shape's chunk around a middle output's text, once the first output is out (None for a
        # shape without one): ``take``'s short path, run once per streamed token.
        self.before: bytes | None = None
        self.after = b""
        self.write = exchange.write_now
        # Can ``take`` write now? Until the stream has started: can it start; then the exchange's
        # ``is_writable`` itself (one call less per token).
        self.ready: Callable[[], bool] = self._ready_to_start
        # ``take`` if ``ready()``, in one call (the direct path's steady state, once per token): until the
        # stream has started, ``_offer``; then the exchange's ``text_lane`` where it has one.
        self.offer: Callable[[StepOutput], bool] = self._offer

    def direct(self, state: ChoiceState) -> _StreamEmitter:
        self.state = state
        return self

    def close(self) -> None:
        """The stream is over: refuse what comes (nothing should), and drop the bound methods of its own it
        holds (``ready``, ``offer``), so that it is freed by reference counting, not the collector."""
        self.ready = self.offer = _refuse

    def _ready_to_start(self) -> bool:
        if self.run.started:  # (started by the task meanwhile: its first chunk went through it)
            self.ready = self.exchange.is_writable
            return self.ready()
        return self.exchange.can_start()

    def take(self, output: StepOutput) -> None:
        before = self.before
        if before is None:
            self._take(output)
            return
        text = self.state.accept_middle(output)  # (the short path, once the first output is out)
        if text:
            self.write(before + _encode(text) + self.after)

    def _offer(self, output: StepOutput) -> bool:
        if not self.ready():
            return False
        self.take(output)
        return True

    def _take(self, output: StepOutput) -> None:
        """``take`` for the first output, and for a shape without a template."""
        run, state, exchange = self.run, self.state, self.exchange
        text = state.accept_middle(output)
        if state.index in run.opened:
            chunk = self.shape.middle(run, state, text)
        else:
            run.opened.add(state.index)
            chunk = self.shape.first(run, state, text)
        if chunk:
            if run.started:
                exchange.write_now(chunk)
            else:
                run.started = True
                exchange.start_now(chunk)
        if run.started:  # the head and the first chunk are out: the next outputs are middle ones
            self.ready = exchange.is_writable
            template = self.shape.middle_template(run, state.index)
            if template is not None:
                self.before, self.after = template
                lane = exchange.text_lane(state.middle_accepter(), _encode, *template)
                if lane is not None:
                    self.offer = lane


async def watch_disconnect(receive: Receive, task: asyncio.Task[Any], gone: list[bool]) -> None:
    """Cancel ``task`` when the client disconnects (the request body has been read by then)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            gone[0] = True
            task.cancel()
            return


async def read_body(scope: Scope, receive: Receive, limit: int, timeout_s: float) -> bytes:
    """The whole request body: at most ``limit`` bytes (else 413), all of it within ``timeout_s`` (else 408)."""
    check_length(scope["headers"], limit)
    try:
        async with asyncio.timeout(timeout_s):
            return await _receive_body(receive, limit)
    except TimeoutError:
        raise RequestTimeout(f"the request body did not arrive within {timeout_s:g}s") from None


def check_length(headers: list[tuple[bytes, bytes]], limit: int) -> None:
    """413 when ``headers`` declare a body (``content-length``) over ``limit`` bytes."""
    for key, value in headers:
        if key == b"content-length":
            if value.isdigit() and int(value) > limit:
                raise PayloadTooLarge(f"request body exceeds {limit} bytes")
            return


async def _receive_body(receive: Receive, limit: int) -> bytes:
    message = await receive()
    body = message.get("body", b"")
    if not message.get("more_body", False):
        if message["type"] == "http.disconnect":
            raise ClientGone
        if len(body) > limit:
            raise PayloadTooLarge(f"request body exceeds {limit} bytes")
        return body
    parts = [body]
    size = len(body)
    while message.get("more_body", False):
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(f"request body exceeds {limit} bytes")
        parts.append(chunk)
    return b"".join(parts)


async def send_json(send: Send, body: Any, status: int = 200,
                    headers: list[tuple[bytes, bytes]] | None = None) -> None:
    data = _json.encode(body)
    start: Message = {"type": "http.response.start", "status": status,
                      "headers": [_JSON_HEADERS, (b"content-length", b"%d" % len(data)), *(headers or ())]}
    await send(start)
    await send({"type": "http.response.body", "body": data})


async def send_error(send: Send, exc: APIError) -> None:
    await send_json(send, exc.body(), exc.status, exc.headers())
