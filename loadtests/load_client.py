"""The benchmark's load generator: a raw HTTP/1.1 client and a native-protocol driver, both asyncio.

The client must cost little, because it shares a core with the workers: so no HTTP library, just
``asyncio.Protocol`` connections (keep-alive, one request at a time each) parsed by ``httptools``
(the C parser uvicorn uses), and requests whose bytes are built once per point.

What it measures per request (``Result``), all with ``time.perf_counter`` on the client:
- ``latency_s``: from sending the request (open loop: from its scheduled arrival, so a late send
  counts against the server, not hidden by the client) to the last byte of the response.
- streams: ``ttft_s`` from the same start to the first SSE event that carries output text (or
  ``/generate`` output ids); ``itl_s``: the gaps between successive events that carry output.
  ``num_tokens``: characters of output text (with the byte tokenizer: tokens), or output ids.
- native driver: the same figures over the native protocol, with the gateway's own
  ``WorkerClient`` (``Submit`` to the first / each ``StepOutput`` carrying tokens).

Lifecycle: build a target (``HttpTarget`` / ``NativeTarget``), then ``closed_loop`` (fixed number of
requests in flight) or ``open_loop`` (Poisson arrivals at a fixed rate, HTTP only); each opens its
connections, runs, and closes them before returning.
"""

from __future__ import annotations

import asyncio
import math
import random
import secrets
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import httptools
import msgspec

from gateway.worker_client import WorkerClient, WorkerGone
from workers.protocol import BootstrapTarget, Error, SamplingParams, StepOutput, Submit

_now = time.perf_counter


@dataclass(slots=True)
class Result:
    latency_s: float = 0.0
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    num_tokens: int = 0
    error: str | None = None


# -- what the client reads of a response (msgspec skips every other field) -----------------------
class _Text(msgspec.Struct):
    content: str | None = None


class _Choice(msgspec.Struct):
    delta: _Text | None = None
    message: _Text | None = None
    text: str | None = None


class _Usage(msgspec.Struct):
    completion_tokens: int = 0


class _Body(msgspec.Struct):
    choices: list[_Choice] = []
    usage: _Usage | None = None
    meta_info: _Usage | None = None  # /generate: cumulative completion_tokens
    error: Any = None


_decode = msgspec.json.Decoder(_Body).decode


def _tokens_in(body: _Body, previous: int) -> int:
    """Output tokens new in this body (``/generate`` counts are cumulative)."""
    if body.meta_info is not None:
        return body.meta_info.completion_tokens - previous
    num = 0
    for choice in body.choices:
        if choice.delta is not None or choice.message is not None:
            text = (choice.delta or choice.message).content  # type: ignore[union-attr]
        else:
            text = choice.text
        num += len(text or "")
    return num


# -- HTTP ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class HttpTarget:
    """One route and one body; ``request`` holds the bytes sent for every request of the point."""

    host: str
    port: int
    path: str
    body: bytes
    stream: bool
    expected_tokens: int = 0  # 0: not checked

    @property
    def request(self) -> bytes:
        head = (f"POST {self.path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(self.body)}\r\n\r\n")
        return head.encode() + self.body


class _HttpConn(asyncio.Protocol):
    """A keep-alive connection; ``exchange`` sends one request and resolves with its ``Result``."""

    def __init__(self) -> None:
        self._parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self._future: asyncio.Future[Result] | None = None
        self._result = Result()
        self._t0 = 0.0
        self._stream = False
        self._expected = 0
        self._parts: list[bytes] = []
        self._rest = b""
        self._t_last = 0.0
        self._done = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is not an asyncio.Transport subclass

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self._finish(f"connection lost: {exc}")

    def exchange(self, request: bytes, t0: float, stream: bool, expected: int) -> asyncio.Future[Result]:
        assert self.transport is not None, "connection closed"
        self._future = asyncio.get_running_loop().create_future()
        self._result, self._t0, self._stream, self._expected = Result(), t0, stream, expected
        self._parts, self._rest, self._done = [], b"", False
        self.transport.write(request)
        return self._future

    def data_received(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._finish(f"bad HTTP response: {exc}")
            if self.transport is not None:
                self.transport.close()

    # httptools callbacks
    def on_body(self, body: bytes) -> None:
        if not self._stream or self._parser.get_status_code() != 200:
            self._parts.append(body)
            return
        now = _now()
        buf = self._rest + body if self._rest else body
        *events, self._rest = buf.split(b"\n\n")
        result = self._result
        for event in events:
            if not event.startswith(b"data: "):
                continue
            if event == b"data: [DONE]":
                self._done = True
                continue
            parsed = _decode(event[6:])
            if parsed.error is not None:
                result.error = f"error event: {parsed.error}"
                continue
            num = _tokens_in(parsed, result.num_tokens)
            if num <= 0:
                continue
            if result.ttft_s is None:
                result.ttft_s = now - self._t0
            else:
                result.itl_s.append(now - self._t_last)
            self._t_last = now
            result.num_tokens += num

    def on_message_complete(self) -> None:
        result = self._result
        result.latency_s = _now() - self._t0
        status = self._parser.get_status_code()
        if status != 200:
            self._finish(f"HTTP {status}: {b''.join(self._parts)[:200]!r}")
            return
        if self._stream:
            if not self._done and result.error is None:
                result.error = "stream ended without data: [DONE]"
        else:
            try:
                body = _decode(b"".join(self._parts))
            except msgspec.DecodeError as exc:
                self._finish(f"bad JSON body: {exc}")
                return
            usage = body.usage or body.meta_info
            result.num_tokens = usage.completion_tokens if usage is not None else _tokens_in(body, 0)
        if result.error is None and self._expected and result.num_tokens != self._expected:
            result.error = f"{result.num_tokens} tokens, expected {self._expected}"
        self._finish(None)

    def _finish(self, error: str | None) -> None:
        future, self._future = self._future, None
        if future is not None and not future.done():
            if error is not None:
                self._result.error = error
                self._result.latency_s = _now() - self._t0
            future.set_result(self._result)


async def _connect(target: HttpTarget) -> _HttpConn:
    loop = asyncio.get_running_loop()
    _, conn = await loop.create_connection(_HttpConn, target.host, target.port)
    return conn


def _close(conns: Sequence[_HttpConn]) -> None:
    for conn in conns:
        if conn.transport is not None:
            conn.transport.close()


# -- native protocol ---------------------------------------------------------------------------------
class _NativeCall:
    """One request's events from one or two workers (``WorkerClient`` calls ``put_nowait``)."""

    __slots__ = ("future", "num_open", "result", "t0", "t_last")

    def __init__(self, t0: float, num_sides: int) -> None:
        self.t0 = t0
        self.t_last = t0
        self.num_open = num_sides
        self.result = Result()
        self.future: asyncio.Future[Result] = asyncio.get_running_loop().create_future()

    def put_nowait(self, item: tuple[Any, Any]) -> None:
        side, event = item
        result = self.result
        if isinstance(event, StepOutput):
            if event.token_ids and side == "decode":  # a prefill's output is its KV hand-over, not text
                now = _now()
                if result.ttft_s is None:
                    result.ttft_s = now - self.t0
                else:
                    result.itl_s.append(now - self.t_last)
                self.t_last = now
                result.num_tokens += len(event.token_ids)
            if event.finish_reason is None:
                return
        elif isinstance(event, (Error, WorkerGone)):
            result.error = f"{type(event).__name__}: {event}"
        self.num_open -= 1
        if (self.num_open == 0 or result.error is not None) and not self.future.done():
            result.latency_s = _now() - self.t0
            self.future.set_result(result)


@dataclass
class NativeTarget:
    """Workers driven straight over the native protocol: decode (or combined) workers taken round robin,
    and with ``prefill_url`` a PD pair (a fresh bootstrap room per request, as the gateway does)."""

    decode_urls: list[str]
    input_ids: list[int]
    max_tokens: int
    prefill_url: str | None = None
    role: str = "both"  # the decode side's role: both (combined) or decode
    _decodes: list[WorkerClient] = field(default_factory=list)
    _prefill: WorkerClient | None = None
    _next: int = 0

    async def open(self) -> None:
        role = self.role if self.prefill_url is None else "decode"
        self._decodes = [WorkerClient(url, role) for url in self.decode_urls]
        self._prefill = WorkerClient(self.prefill_url, "prefill") if self.prefill_url is not None else None
        clients = [*self._decodes, *([self._prefill] if self._prefill is not None else [])]
        for client in clients:
            client.start()
        for client in clients:
            if not await client.wait_ready(10.0):
                raise ConnectionError(f"{client.url}: {client.last_error}")

    async def call(self) -> Result:
        decode = self._decodes[self._next % len(self._decodes)]
        self._next += 1
        prefill, target = self._prefill, None
        if prefill is not None:
            info = prefill.info
            assert info is not None and info.bootstrap_host is not None
            target = BootstrapTarget(info.bootstrap_host, info.bootstrap_port, secrets.randbits(63), info.instance_id)
        params = SamplingParams(max_new_tokens=self.max_tokens, ignore_eos=True)
        call = _NativeCall(_now(), 1 if prefill is None else 2)
        decode.submit(Submit(0, self.input_ids, params, target), call, "decode")
        if prefill is not None:
            prefill.submit(Submit(0, self.input_ids, params, target), call, "prefill")
        result = await call.future
        if result.error is None and result.num_tokens != self.max_tokens:
            result.error = f"{result.num_tokens} tokens, expected {self.max_tokens}"
        return result

    async def aclose(self) -> None:
        clients = [*self._decodes, *([self._prefill] if self._prefill is not None else [])]
        await asyncio.gather(*(c.aclose() for c in clients), return_exceptions=True)


# -- load shapes ------------------------------------------------------------------------------------
async def closed_loop(target: HttpTarget | NativeTarget, num_requests: int, concurrency: int,
                      stagger_s: float = 0.0) -> list[Result]:
    """``concurrency`` users, each sending its next request when its last one ends.

    ``stagger_s``: user i sends its first request ``i * stagger_s / concurrency`` after the start
    (otherwise all start at once, and equally long streams then stay in phase for ever).
    """
    results: list[Result] = []
    left = [num_requests]
    if isinstance(target, NativeTarget):
        async def native_user(i: int) -> None:
            await asyncio.sleep(i * stagger_s / concurrency)
            while left[0] > 0:
                left[0] -= 1
                results.append(await target.call())

        await asyncio.gather(*(native_user(i) for i in range(concurrency)))
        return results
    conns = await asyncio.gather(*(_connect(target) for _ in range(concurrency)))
    request, stream, expected = target.request, target.stream, target.expected_tokens

    async def user(i: int, conn: _HttpConn) -> None:
        await asyncio.sleep(i * stagger_s / concurrency)
        while left[0] > 0:
            left[0] -= 1
            if conn.transport is None:
                conn = await _connect(target)
                conns.append(conn)
            results.append(await conn.exchange(request, _now(), stream, expected))

    try:
        await asyncio.gather(*(user(i, c) for i, c in enumerate(list(conns))))
    finally:
        _close(conns)
    return results


async def open_loop(target: HttpTarget, num_requests: int, rate_per_s: float, *, seed: int = 0,
                    num_warm_conns: int = 64) -> tuple[list[Result], int]:
    """Poisson arrivals at ``rate_per_s``; returns the results and the peak number in flight.

    A request whose arrival finds no idle connection opens a new one (and keeps it).
    """
    loop = asyncio.get_running_loop()
    rng = random.Random(seed)
    conns = list(await asyncio.gather(*(_connect(target) for _ in range(num_warm_conns))))
    idle: deque[_HttpConn] = deque(conns)
    results: list[Result] = []
    in_flight = [0, 0]  # now, peak
    request, stream, expected = target.request, target.stream, target.expected_tokens
    tasks: list[asyncio.Task[None]] = []

    async def one(t_arrival: float) -> None:
        in_flight[0] += 1
        in_flight[1] = max(in_flight[1], in_flight[0])
        conn = idle.popleft() if idle else None
        if conn is None or conn.transport is None:
            conn = await _connect(target)
            conns.append(conn)
        results.append(await conn.exchange(request, t_arrival, stream, expected))
        in_flight[0] -= 1
        idle.append(conn)

    try:
        t_next = _now()
        for _ in range(num_requests):
            t_next += rng.expovariate(rate_per_s)
            delay = t_next - _now()
            if delay > 0.0005:
                await asyncio.sleep(delay)
            tasks.append(loop.create_task(one(t_next)))
        await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        _close(conns)
    return results, in_flight[1]


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in 0..100) of unsorted ``values``; NaN when empty."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]
