"""The gateway's persistent native connection to one worker.

Lifecycle:
1. ``WorkerClient(url, role)``; ``start()`` launches a named connect task: connect, ``Hello`` ->
   ``HelloAck`` (role checked), then wait for the connection to drop. Frames are parsed in the
   transport's ``data_received`` (``_FrameProtocol``): every whole frame of a read is decoded and
   dispatched in one synchronous pass, no reader coroutine per frame. On any disconnect every open
   request gets a ``WorkerGone`` event and the task reconnects with capped, jittered exponential backoff
   (``ReconnectBackoff``: at most ``max_backoff_s``, 0.5 s, apart for the first ``RECONNECT_FAST_FOR_S`` of an
   outage, so a restarted worker is found within half a second of listening; 2 s apart after that).
2. ``submit(msg, sink, tag)`` registers the request id and writes ``Submit``; each ``StepOutput`` /
   ``Error`` for that id goes to ``sink.put_nowait((tag, event))`` until the request ends (client
   writes made meanwhile go out when the frame's outputs have all been handed out: ``write_batch``); once
   ``set_lane(rid, lane)``, its outputs go to ``lane`` first (a stream's steady state: what it takes goes no
   further). ``abort(rid)`` sends ``Abort`` and forgets the id. Frames queued in one loop iteration go out in
   one write (``_send``/``_flush``), but a stream's ``Submit`` goes out at once (``urgent``).
3. ``LoadReport`` frames update ``state`` (a ``WorkerState``: what policies read; each request's
   prefill tokens and decode pages are counted there from ``submit`` until its part here ends).
   ``KVEvents`` frames go to ``on_kv_events`` (the gateway's prefix index).
4. While connected, a probe task sends ``Ping`` every ``probe_interval_s``; outcomes go to
   ``health`` (``gateway/health.py``). A worker failing its probes (frozen, or its scheduler
   stalled) is unhealthy: its open requests get ``WorkerGone`` (so the dispatcher fails them over
   or ends them) and are aborted on the worker, and it is not selected (``healthy``); passing probes
   bring it back. Its connection, and so its prefix cache as the gateway knows it, stays.
5. ``on_up`` / ``on_down`` are called when the worker's connection comes up / is lost (its KV events
   then start afresh from a snapshot), each exactly once per transition.
6. ``aclose()`` cancels the tasks and closes the connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import itertools
import logging
import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol
from urllib.parse import urlsplit

from gateway import write_batch
from gateway.health import HealthConfig, WorkerHealth, selectability_changed
from gateway.worker_state import DEFAULT_STALE_AFTER_S, WorkerState
from workers.protocol import (
    FRAME_HEADER,
    MAX_FRAME_BYTES,
    MAX_UNREAD_BYTES,
    PROTOCOL_VERSION,
    Abort,
    Error,
    FramedProtocol,
    Hello,
    HelloAck,
    KVEvents,
    LoadReport,
    Outputs,
    Ping,
    Pong,
    Rejected,
    StepOutput,
    Submit,
    gateway_codec,
)

log = logging.getLogger(__name__)

_pack_len = FRAME_HEADER.pack  # a frame's 4-byte length prefix
_unpack_len = FRAME_HEADER.unpack_from  # a frame's length at an offset of a buffer: (length,)


@dataclass
class WorkerGone:
    """The connection to the worker broke, or it failed its probes, while the request was open. One
    event goes to every request open then: it is one failure of the worker's, however many were open
    (``counted``: its breaker has heard of it, ``gateway.dispatch.Dispatcher._blame``)."""

    message: str
    counted: bool = False


Event = StepOutput | Error | WorkerGone


class Sink(Protocol):
    """Where a request's events go (``gateway.event_sink.EventSink``; an ``asyncio.Queue`` also fits)."""

    def put_nowait(self, item: tuple[Any, Event]) -> None: ...


class _FrameProtocol(FramedProtocol):
    """Splits the byte stream into frames and hands each decoded message to ``on_message``.

    Messages that arrive before ``on_message`` is set (the handshake) wait in ``backlog``. A handler
    error closes the connection; ``closed`` resolves with the reason when the connection is gone.
    """

    def __init__(self, decode: Callable[[Any], object]) -> None:
        super().__init__()
        self._decode = decode
        self.on_message: Callable[[object], None] | None = None
        self.backlog: list[object] = []
        self.arrived = asyncio.Event()  # something is in the backlog
        self.closed: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is not an asyncio.Transport subclass

    def _frames(self, buf: bytes | bytearray) -> int:
        pos, end = 0, len(buf)
        with memoryview(buf) as view:
            while end - pos >= 4:
                (size,) = _unpack_len(buf, pos)  # (one C call: cheaper per frame than slicing out the header)
                if size > MAX_FRAME_BYTES:
                    self._close(f"frame of {size} bytes exceeds the {MAX_FRAME_BYTES}-byte limit")
                    return end
                start = pos + 4
                stop = start + size
                if stop > end:
                    break
                try:
                    message = self._decode(view[start:stop])
                    if self.on_message is not None:
                        self.on_message(message)
                    else:
                        self.backlog.append(message)
                        self.arrived.set()
                except Exception as exc:  # a bad frame or an unexpected message: drop the connection
                    self._close(f"{type(exc).__name__}: {exc}")
                    return end
                pos = stop
        return pos

    def _close(self, reason: str) -> None:
        if not self.closed.done():
            self.closed.set_result(reason)
        if self.transport is not None:
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.closed.done():
            self.closed.set_result(f"{type(exc).__name__}: {exc}" if exc else "connection closed by the worker")
        self.arrived.set()


# A connection that stayed up this long starts the reconnect backoff over (one that keeps closing right
# after its handshake goes on backing off).
STAYED_UP_S = 1.0
RECONNECT_FIRST_S = 0.05  # the first pause after a loss; each next one doubles, up to the cap
# For this long into an outage the pauses are capped at ``max_backoff_s`` (0.5 s): a restarted worker is back within
# seconds (a prefill that moved re-registers ~5 s after its predecessor's last renewal) and is found within the cap
# of listening, not up to 2 s later. A refused connect costs the loop tens of µs; to a dead host each try waits its
# connect timeout anyway. A worker gone longer is tried every LONG_OUTAGE_BACKOFF_S, as before.
RECONNECT_FAST_FOR_S = 60.0
LONG_OUTAGE_BACKOFF_S = 2.0
RECONNECT_JITTER = 0.1  # each pause +-10%: gateways that lost a worker together do not reconnect in lockstep


class ReconnectBackoff:
    """The pauses between one worker's reconnect tries: ``RECONNECT_FIRST_S``, doubling up to ``max_backoff_s``
    while the outage is younger than ``fast_for_s``, then up to ``max(max_backoff_s, LONG_OUTAGE_BACKOFF_S)``; each
    jittered by +-``RECONNECT_JITTER``. ``reset()`` after a connection that served a while."""

    def __init__(self, max_backoff_s: float = 0.5, fast_for_s: float = RECONNECT_FAST_FOR_S) -> None:
        if not max_backoff_s > 0:
            raise ValueError(f"max_backoff_s must be > 0, got {max_backoff_s}")
        self.max_backoff_s = max_backoff_s
        self.fast_for_s = fast_for_s
        self._backoff_s = RECONNECT_FIRST_S

    def reset(self) -> None:
        self._backoff_s = RECONNECT_FIRST_S

    def next_pause_s(self, outage_s: float) -> float:
        """The pause before the next try, ``outage_s`` into the outage; the one after it doubles."""
        cap = self.max_backoff_s if outage_s < self.fast_for_s else max(self.max_backoff_s, LONG_OUTAGE_BACKOFF_S)
        pause = min(self._backoff_s, cap)
        self._backoff_s = min(pause * 2, cap)
        return pause * random.uniform(1 - RECONNECT_JITTER, 1 + RECONNECT_JITTER)


_HOST = re.compile(r"[A-Za-z0-9._:-]+")  # a name or an IPv4/IPv6 address (no spaces, escapes or controls)


def parse_worker_url(url: str) -> tuple[str, int]:
    """A native worker URL's (host, port): how two spellings of one worker (``pd://h:1``, ``h:1``,
    ``pd://H:1/``) are known to be the same."""
    parts = urlsplit(url if "://" in url else f"pd://{url}")
    try:
        port = parts.port
    except ValueError:  # (out of range, not a number)
        port = None
    if (not url.isprintable() or parts.scheme not in ("pd", "tcp")  # (urlsplit drops tabs and newlines: checked first)
            or not parts.hostname or not _HOST.fullmatch(parts.hostname)
            or not port or parts.path not in ("", "/") or parts.query or parts.fragment or parts.username is not None):
        raise ValueError(f"worker URL must look like pd://HOST:PORT (the native port), got {url!r}")
    return parts.hostname, port


class WorkerClient:
    def __init__(self, url: str, role: str, *, connect_timeout_s: float = 5.0, max_backoff_s: float = 0.5,
                 stale_after_s: float = DEFAULT_STALE_AFTER_S, health: HealthConfig | None = None,
                 max_unread_bytes: int = MAX_UNREAD_BYTES, key: str | None = None) -> None:
        """``key``: the worker's ``--api-key`` (sent in the handshake); ``max_backoff_s``: the longest pause between
        reconnect tries in the first ``RECONNECT_FAST_FOR_S`` of an outage (``ReconnectBackoff``)."""
        self.url = url
        self.key = key
        self.role = role  # what the gateway uses it as: prefill | decode | both
        self.host, self.port = parse_worker_url(url)
        self.info: HelloAck | None = None
        self.state = WorkerState(url, role, self, stale_after_s=stale_after_s)
        self.health = WorkerHealth(health or HealthConfig())
        self._draining = self._stopping = False  # (``is_draining``, ``is_stopping``)
        self._refusing = False  # ``is_draining or is_stopping``: one attribute for ``healthy`` to read per request
        self.last_error: str | None = None
        self.on_up: Callable[[WorkerClient], None] | None = None
        self.on_down: Callable[[WorkerClient], None] | None = None
        self.on_kv_events: Callable[[WorkerClient, KVEvents], None] | None = None
        # Asked of each handshake's ``HelloAck``: a reason to refuse the connection (e.g. the same worker
        # already connected under another URL), or None.
        self.vet: Callable[[HelloAck], str | None] | None = None
        self._connect_timeout_s = connect_timeout_s
        self.reconnect = ReconnectBackoff(max_backoff_s)
        self._up_since: float | None = None  # (the loop's time) when this connection's handshake completed
        self._max_unread = max_unread_bytes
        self._codec = gateway_codec()
        self._encode_body = self._codec.encode_body  # (bound once: per request)
        self._transport: asyncio.Transport | None = None
        self._open: dict[int, tuple[Sink, Any]] = {}
        # Requests whose outputs a lane takes first, from the frame's callback, before their sink (``set_lane``)
        self._lanes: dict[int, Callable[[StepOutput], bool]] = {}
        self._outbox: list[bytes] = []  # frames to write at the end of this loop iteration (one list, emptied)...
        self._queue = self._outbox.append  # (bound once: per request)
        # ...on this connection: set exactly while the outbox holds frames
        self._outbox_to: asyncio.Transport | None = None
        self._next_rid = itertools.count(1).__next__
        self._task: asyncio.Task[None] | None = None
        self._prober: asyncio.Task[None] | None = None
        self._pongs: dict[int, asyncio.Future[Pong]] = {}
        self._nonces = itertools.count(1)
        self._is_up = False  # announced through on_up (and not yet through on_down)
        self._failing_probes = False  # (told once per spell: its open requests failed over)
        # The loop it runs in, from ``start``. (``asyncio.get_running_loop()`` makes a ``getpid`` system
        # call on Python 3.11: the hot path uses this instead.)
        self.loop: asyncio.AbstractEventLoop | None = None
        self._ready = asyncio.Event()

    @property
    def is_draining(self) -> bool:
        """Removed through the admin API: no new requests, open ones finish."""
        return self._draining

    @is_draining.setter
    def is_draining(self, value: bool) -> None:
        self._draining = value
        self._refusing = value or self._stopping
        selectability_changed()

    @property
    def is_stopping(self) -> bool:
        """It said it is shutting down (an ``Error`` with that code): not selectable, and the loss of its connection
        is no failure of its own, until it connects again (a restart)."""
        return self._stopping

    @is_stopping.setter
    def is_stopping(self, value: bool) -> None:
        self._stopping = value
        self._refusing = self._draining or value
        selectability_changed()

    @property
    def num_active(self) -> int:
        """Requests this gateway has open on the worker."""
        return self.state.num_active

    @property
    def stops_at_strings(self) -> bool:
        """The worker ends a request at its stop strings itself (``HelloAck.stop_strings``)."""
        info = self.info
        return info is not None and info.stop_strings

    def stops_at_strings_as(self, digest: str) -> bool:
        """``stops_at_strings``, watching the text that a tokenizer of this ``tokenizer_digest`` makes
        (the same tokenizer file; assumed where either digest is unknown, e.g. an older worker)."""
        info = self.info
        return (info is not None and info.stop_strings
                and (not digest or not info.tokenizer_digest or info.tokenizer_digest == digest))

    @property
    def is_connected(self) -> bool:
        return self._transport is not None and not self._transport.is_closing() and self.info is not None

    @property
    def healthy(self) -> bool:
        """Selectable: connected, passing probes, breaker not open, not being removed."""
        # (read for every worker per request: ``is_connected`` and ``health.is_selectable`` inline, and as
        # if-tests, which run fewer opcodes than one boolean expression; the same checks in the same order)
        transport = self._transport
        if (transport is None or transport.is_closing() or self.info is None or self._refusing
                or not self.health.is_probe_healthy):
            return False
        if self.health.breaker.closed:
            return True
        return self.health.breaker.allows  # (half-open: room for another trial)

    @property
    def available(self) -> bool:
        """``healthy``, or only waiting for its breaker's half-open trials to end (readiness: not per request)."""
        return self.is_connected and not self.is_draining and not self.is_stopping and self.health.is_available

    def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        # (a context of its own: started by the admin API's request, the connection's tasks and callbacks would
        # otherwise log under that request's id for as long as the worker stays)
        self._task = asyncio.create_task(self._run(), name=f"worker-client {self.url}", context=contextvars.Context())

    async def wait_ready(self, timeout_s: float) -> bool:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                await self._ready.wait()
        return self.healthy

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        down_since = loop.time()  # (the outage: from the start, or from the loss of a connection that served)
        while True:
            self._up_since = None
            try:
                await self._connect_and_read()  # (returns only by raising: the connection ended)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # any failure: mark down, fail open requests, retry
                self.last_error = f"{type(exc).__name__}: {exc}"
            if self._up_since is not None:  # (a connection that was up: said once, not per reconnect try)
                log.warning("lost connection to %s worker %s: %s (%d requests open; reconnecting)", self.role,
                            self.url, self.last_error or "connection closed", len(self._open))
            if self._up_since is not None and loop.time() - self._up_since >= STAYED_UP_S:
                # a connection that served a while: the next try is soon (not after old failures'), and the
                # outage is a new one (one that keeps dropping right after its handshake is still the old one)
                self.reconnect.reset()
                down_since = loop.time()
            try:  # (a worker that said it is shutting down: its going is no failure of its own)
                self._mark_down(self.last_error or "connection closed", blameless=self.is_stopping)
            except Exception:  # (a bug in its bookkeeping must not end the reconnecting for good)
                log.exception("worker %s: marking it down failed", self.url)
            await asyncio.sleep(self.reconnect.next_pause_s(loop.time() - down_since))

    async def _connect_and_read(self) -> None:
        loop = asyncio.get_running_loop()
        proto = _FrameProtocol(self._codec.decode)
        # (``asyncio.timeout``, not ``wait_for``: on Python 3.11 ``wait_for`` returns the result when a cancellation
        # comes after it is in but before this task resumed, so ``aclose`` landing then was lost and hung for good)
        async with asyncio.timeout(self._connect_timeout_s):
            transport, _ = await loop.create_connection(lambda: proto, self.host, self.port)
        try:
            transport.write(self._codec.encode(Hello(PROTOCOL_VERSION, key=self.key or "")))
            async with asyncio.timeout(self._connect_timeout_s):
                ack = await self._first_message(proto)
            if isinstance(ack, Rejected):
                raise ConnectionError(f"worker rejected the handshake: {ack.reason}")
            if not isinstance(ack, HelloAck):
                raise ConnectionError(f"expected HelloAck, got {type(ack).__name__}")
            if ack.version != PROTOCOL_VERSION:
                raise ConnectionError(f"worker at {self.url} speaks protocol version {ack.version}, this gateway "
                                      f"{PROTOCOL_VERSION}")
            if min(ack.page_size, ack.num_pages, ack.max_context) < 1:
                raise ConnectionError(f"worker at {self.url} reported page_size {ack.page_size}, num_pages "
                                      f"{ack.num_pages}, max_context {ack.max_context}: each must be positive")
            if ack.role != self.role:
                raise ConnectionError(f"worker at {self.url} is a {ack.role} worker, not {self.role}")
            refusal = self.vet(ack) if self.vet is not None else None
            if refusal is not None:
                self._ready.set()  # (start-up waits for workers to be ready: this one has answered, no)
                raise ConnectionError(refusal)
            self.info, self._transport, self.last_error = ack, transport, None
            self.is_stopping = False
            self._up_since = loop.time()
            self.state.connected(ack)
            self.health.connected()
            self._failing_probes = False
            self._ready.set()
            log.info("connected to %s worker %s (%s)", ack.role, self.url, ack.worker_id)
            self._announce(True)
            self._prober = asyncio.create_task(self._probe_loop(), name=f"worker-probe {self.url}")
            for message in proto.backlog:  # what came in the same reads as the HelloAck
                self._dispatch(message)
            proto.backlog.clear()
            proto.on_message = self._dispatch
            raise ConnectionError(await proto.closed)
        finally:
            if self._prober is not None:
                self._prober.cancel()
                self._prober = None
            transport.close()

    @staticmethod
    async def _first_message(proto: _FrameProtocol) -> object:
        while not proto.backlog:
            if proto.closed.done():
                raise ConnectionError(proto.closed.result())
            proto.arrived.clear()
            await proto.arrived.wait()
        return proto.backlog.pop(0)

    def _announce(self, up: bool) -> None:
        selectability_changed()  # (its transport was set or cleared just before)
        if up == self._is_up:
            return
        self._is_up = up
        callback = self.on_up if up else self.on_down
        if callback is not None:
            callback(self)

    async def _probe_loop(self) -> None:
        config = self.health.config
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(config.probe_interval_s)
            writer = self._transport
            if writer is None or writer.is_closing():
                return
            nonce = next(self._nonces)
            future: asyncio.Future[Pong] = loop.create_future()
            self._pongs[nonce] = future
            writer.write(self._codec.encode(Ping(nonce)))
            try:
                async with asyncio.timeout(config.probe_timeout_s):  # (not ``wait_for``: see ``_connect_and_read``)
                    pong = await future
            except TimeoutError:
                self.health.probe_failed(f"no answer to a health probe within {config.probe_timeout_s:g}s")
            else:
                self.health.probe_passed(pong.stalled_s)
            finally:
                self._pongs.pop(nonce, None)
            if not self.health.is_probe_healthy and not self._failing_probes:
                self._failing_probes = True
                reason = self.health.last_probe_error or "failed health probes"
                log.warning("%s worker %s is unhealthy: %s", self.role, self.url, reason)
                self._fail_open(f"{self.role} worker {self.url} is unhealthy: {reason}", abort=True)
            elif self.health.is_probe_healthy and self._failing_probes:
                self._failing_probes = False
                log.warning("%s worker %s is healthy again", self.role, self.url)

    def _dispatch(self, msg: object) -> None:
        match msg:
            case Outputs(items=items):
                batch = write_batch.begin()  # the direct path's client writes go out together at the end
                try:
                    open_, lanes = self._open, self._lanes
                    trials = self.health.breaker.trials  # (one set for the breaker's life: emptied, never replaced)
                    for item in items:
                        if lanes:  # (a stream's steady state: its lane takes its non-final outputs, per token)
                            lane = lanes.get(item.rid)
                            if lane is not None and lane(item):
                                continue
                        # (a look-up that fails only for a request ended here meanwhile: fewer opcodes than ``get``)
                        try:
                            sink, tag = open_[item.rid]
                        except KeyError:
                            pass
                        else:
                            sink.put_nowait((tag, item))
                            if item.finish_reason is not None:  # its end: ``_forget``, inline
                                try:
                                    del open_[item.rid]
                                except KeyError:  # (the sink's consumer forgot it already)
                                    pass
                                else:
                                    self.state.ended(item.rid)
                                    if lanes:
                                        lanes.pop(item.rid, None)
                                    if trials:
                                        trials.discard(item.rid)
                    if trials:  # a half-open breaker's trial that produced tokens frees its place for the next
                        for item in items:
                            if item.token_ids:
                                trials.discard(item.rid)
                finally:
                    if batch:
                        write_batch.end()
            case Error(rid=rid) as err:
                if err.code == "shutting_down" and not self.is_stopping:
                    self.is_stopping = True  # (its retries and migrations go elsewhere: not back to it)
                    log.info("%s worker %s is shutting down: no new requests until it connects again", self.role,
                             self.url)
                entry = self._open.get(rid)
                if entry is not None:
                    entry[0].put_nowait((entry[1], err))
                    self._forget(rid)
            case LoadReport() as load:
                self.state.reported(load)
            case KVEvents() as events:
                if self.on_kv_events is not None:
                    self.on_kv_events(self, events)
            case Pong() as pong:
                future = self._pongs.get(pong.nonce)
                if future is not None and not future.done():
                    future.set_result(pong)
            case _:
                raise ConnectionError(f"unexpected message {type(msg).__name__}")

    def _mark_down(self, reason: str, *, blameless: bool = False) -> None:
        self._transport = None
        self._ready.clear()
        self._fail_open(f"lost connection to {self.role} worker {self.url}: {reason}", abort=False, blameless=blameless)
        self._announce(False)

    def _fail_open(self, message: str, *, abort: bool, blameless: bool = False) -> None:
        """Every open request gets ``WorkerGone`` (and, if the connection stands, an ``Abort``);
        ``blameless``: the gateway closed it (no failure of the worker's: its breaker and metrics hear nothing)."""
        gone = WorkerGone(message, counted=blameless)
        for rid in list(self._open):
            queue, tag = self._open[rid]
            queue.put_nowait((tag, gone))
            if abort:
                self.abort(rid, message)
            else:
                self._forget(rid)

    def _forget(self, rid: int) -> None:
        if self._open.pop(rid, None) is not None:
            self.state.ended(rid)
            if self._lanes:
                self._lanes.pop(rid, None)
            trials = self.health.breaker.trials
            if trials:
                trials.discard(rid)

    def submit(self, msg_without_rid: Submit, sink: Sink, tag: Any, *,
               prefill_tokens: int = 0, pages: int = 0, urgent: bool = False) -> int:
        """Send a request; its events go to ``sink``. Raises ConnectionError when not connected.

        ``prefill_tokens`` / ``pages`` are what the request costs this worker, counted in ``state``
        until the request's part here ends. ``urgent``: written at once (with whatever was queued
        before it) instead of with this loop iteration's other frames, which go out only after every
        callback of the iteration has run (a stream's first token waits on it).
        """
        writer = self._transport
        if writer is None or writer.is_closing():
            raise ConnectionError(f"{self.role} worker {self.url} is not connected")
        rid = self._next_rid()
        msg_without_rid.rid = rid
        # first: a message that cannot be encoded leaves nothing open (``FrameCodec.encode``, inline: per request)
        body = self._encode_body(msg_without_rid)
        frame = _pack_len(len(body)) + body
        self._open[rid] = (sink, tag)
        self.state.dispatched(rid, prefill_tokens, pages)
        if not self.health.breaker.closed:  # half-open: a trial, which ends with the rid (``_forget``)
            self.health.breaker.trial_started(rid)
        if urgent or self._outbox_to is not writer:
            self._send(writer, frame, urgent)
        else:  # ``_send``'s common case, inline (per request): frames already queued for this connection
            self._queue(frame)
        return rid

    def set_lane(self, rid: int, lane: Callable[[StepOutput], bool]) -> None:
        """From now on the outputs of open request ``rid`` go to ``lane`` first, in the frame's callback: one it
        takes (returns True) goes nowhere else; the rest (what it refuses, e.g. the final one) go to the request's
        sink as before. It ends with the request. (A stream's steady state: per token, no sink in between.) A lane
        must not raise: it is called in the connection's reader."""
        if rid in self._open:
            self._lanes[rid] = lane

    def _send(self, transport: asyncio.Transport, frame: bytes, urgent: bool = False) -> None:
        """Queue a frame; every frame queued in this loop iteration goes out in one write (``urgent``:
        the queue goes out now)."""
        if self._outbox and self._outbox_to is transport:
            self._outbox.append(frame)
        else:
            if self._outbox:  # queued for a connection that has since been replaced
                self._flush()
            self._outbox.append(frame)
            self._outbox_to = transport
            if not urgent:
                (self.loop or asyncio.get_running_loop()).call_soon(self._flush)
        if urgent:
            self._flush()  # (a flush already scheduled then finds nothing to write)

    def _flush(self) -> None:
        frames, transport = self._outbox, self._outbox_to
        if not frames or transport is None:
            return
        data = frames[0] if len(frames) == 1 else b"".join(frames)
        frames.clear()
        self._outbox_to = None
        if not transport.is_closing():
            transport.write(data)
            if (unread := transport.get_write_buffer_size()) > self._max_unread:
                # a worker that stopped reading (frozen, wedged): drop it rather than buffer for it;
                # its open requests fail over (retries, stream migration) and it is reconnected later
                log.warning("dropping the connection to %s: %d bytes of requests unread (limit %d)",
                            self.url, unread, self._max_unread)
                transport.abort()

    def abort(self, rid: int, reason: str = "aborted by gateway") -> None:
        if rid not in self._open:
            return
        self._forget(rid)
        writer = self._transport
        if writer is not None and not writer.is_closing():
            self._send(writer, self._codec.encode(Abort(rid, reason)))

    async def aclose(self, reason: str = "gateway shutting down") -> None:
        """Close the connection (the worker then drops what is still open); requests still open here go
        on elsewhere (``WorkerGone``, not held against the worker), told ``reason``."""
        if self._prober is not None:
            self._prober.cancel()
        try:
            if self._task is not None:
                self._task.cancel()
                try:
                    await self._task
                except asyncio.CancelledError:
                    current = asyncio.current_task()
                    if current is not None and current.cancelling():
                        raise  # (our caller was cancelled too, e.g. a shutdown's timeout: it must hear so)
        finally:
            if self._transport is not None:
                self._transport.close()
            self._mark_down(reason, blameless=True)
