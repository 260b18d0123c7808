"""The gateway's persistent native connection to one worker.

Lifecycle:
1. ``WorkerClient(url, role)``; ``start()`` launches a named connect task: connect, ``Hello`` ->
   ``HelloAck`` (role checked), then a reader loop. On any disconnect every open request gets a
   ``WorkerGone`` event and the task reconnects with capped exponential backoff.
2. ``submit(msg, sink, tag)`` registers the request id and writes ``Submit``; the reader puts each
   ``StepOutput`` / ``Error`` for that id into ``sink`` as ``(tag, event)`` until the request ends.
   ``abort(rid)`` sends ``Abort`` and forgets the id.
3. ``LoadReport`` frames update ``state`` (a ``WorkerState``: what policies read; each request's
   prefill tokens and decode pages are counted there from ``submit`` until its part here ends).
   ``KVEvents`` frames go to ``on_kv_events`` (the gateway's prefix index).
4. ``on_up`` / ``on_down`` are called when the connection becomes usable / is lost.
5. ``aclose()`` cancels the task and closes the connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from gateway.worker_state import DEFAULT_STALE_AFTER_S, WorkerState
from workers.protocol import (
    PROTOCOL_VERSION,
    Abort,
    Error,
    Hello,
    HelloAck,
    KVEvents,
    LoadReport,
    Outputs,
    Rejected,
    StepOutput,
    Submit,
    gateway_codec,
    read_frame,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerGone:
    """The connection to the worker broke while the request was open."""

    message: str


Event = StepOutput | Error | WorkerGone


def parse_worker_url(url: str) -> tuple[str, int]:
    parts = urlsplit(url if "://" in url else f"pd://{url}")
    if parts.scheme not in ("pd", "tcp") or not parts.hostname or parts.port is None:
        raise ValueError(f"worker URL must look like pd://HOST:PORT (the native port), got {url!r}")
    return parts.hostname, parts.port


class WorkerClient:
    def __init__(self, url: str, role: str, *, connect_timeout_s: float = 5.0, max_backoff_s: float = 2.0,
                 stale_after_s: float = DEFAULT_STALE_AFTER_S) -> None:
        self.url = url
        self.role = role  # what the gateway uses it as: prefill | decode | both
        self.host, self.port = parse_worker_url(url)
        self.info: HelloAck | None = None
        self.state = WorkerState(url, role, self, stale_after_s=stale_after_s)
        self.last_error: str | None = None
        self.on_up: Callable[[WorkerClient], None] | None = None
        self.on_down: Callable[[WorkerClient], None] | None = None
        self.on_kv_events: Callable[[WorkerClient, KVEvents], None] | None = None
        self._connect_timeout_s = connect_timeout_s
        self._max_backoff_s = max_backoff_s
        self._codec = gateway_codec()
        self._writer: asyncio.StreamWriter | None = None
        self._open: dict[int, tuple[asyncio.Queue[tuple[Any, Event]], Any]] = {}
        self._rids = itertools.count(1)
        self._task: asyncio.Task[None] | None = None
        self._ready = asyncio.Event()

    @property
    def num_active(self) -> int:
        """Requests this gateway has open on the worker."""
        return self.state.num_active

    @property
    def healthy(self) -> bool:
        return self._writer is not None and not self._writer.is_closing() and self.info is not None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"worker-client {self.url}")

    async def wait_ready(self, timeout_s: float) -> bool:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._ready.wait(), timeout_s)
        return self.healthy

    async def _run(self) -> None:
        backoff = 0.05
        while True:
            try:
                await self._connect_and_read()
                backoff = 0.05
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # any failure: mark down, fail open requests, retry
                self.last_error = f"{type(exc).__name__}: {exc}"
            self._mark_down(self.last_error or "connection closed")
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, self._max_backoff_s)

    async def _connect_and_read(self) -> None:
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(self.host, self.port), self._connect_timeout_s
        )
        try:
            writer.write(self._codec.encode(Hello(PROTOCOL_VERSION)))
            ack = self._codec.decode(await asyncio.wait_for(read_frame(reader), self._connect_timeout_s))
            if isinstance(ack, Rejected):
                raise ConnectionError(f"worker rejected the handshake: {ack.reason}")
            if not isinstance(ack, HelloAck):
                raise ConnectionError(f"expected HelloAck, got {type(ack).__name__}")
            if ack.role != self.role:
                raise ConnectionError(f"worker at {self.url} is a {ack.role} worker, not {self.role}")
            self.info, self._writer, self.last_error = ack, writer, None
            self.state.connected(ack)
            self._ready.set()
            log.info("connected to %s worker %s (%s)", ack.role, self.url, ack.worker_id)
            if self.on_up is not None:
                self.on_up(self)
            while True:
                self._dispatch(self._codec.decode(await read_frame(reader)))
        finally:
            writer.close()

    def _dispatch(self, msg: object) -> None:
        match msg:
            case Outputs(items=items):
                for item in items:
                    entry = self._open.get(item.rid)
                    if entry is not None:
                        entry[0].put_nowait((entry[1], item))
                        if item.finish_reason is not None:
                            self._forget(item.rid)
            case Error(rid=rid) as err:
                entry = self._open.get(rid)
                if entry is not None:
                    entry[0].put_nowait((entry[1], err))
                    self._forget(rid)
            case LoadReport() as load:
                self.state.reported(load)
            case KVEvents() as events:
                if self.on_kv_events is not None:
                    self.on_kv_events(self, events)
            case _:
                raise ConnectionError(f"unexpected message {type(msg).__name__}")

    def _mark_down(self, reason: str) -> None:
        was_up = self._ready.is_set()
        self._writer = None
        self._ready.clear()
        gone = WorkerGone(f"lost connection to {self.role} worker {self.url}: {reason}")
        for rid in list(self._open):
            queue, tag = self._open[rid]
            queue.put_nowait((tag, gone))
            self._forget(rid)
        if was_up and self.on_down is not None:
            self.on_down(self)

    def _forget(self, rid: int) -> None:
        if self._open.pop(rid, None) is not None:
            self.state.ended(rid)

    def submit(self, msg_without_rid: Submit, sink: asyncio.Queue[tuple[Any, Event]], tag: Any, *,
               prefill_tokens: int = 0, pages: int = 0) -> int:
        """Send a request; its events go to ``sink``. Raises ConnectionError when not connected.

        ``prefill_tokens`` / ``pages`` are what the request costs this worker, counted in ``state``
        until the request's part here ends.
        """
        writer = self._writer
        if writer is None or writer.is_closing():
            raise ConnectionError(f"{self.role} worker {self.url} is not connected")
        rid = next(self._rids)
        msg_without_rid.rid = rid
        self._open[rid] = (sink, tag)
        self.state.dispatched(rid, prefill_tokens, pages)
        writer.write(self._codec.encode(msg_without_rid))
        return rid

    def abort(self, rid: int, reason: str = "aborted by gateway") -> None:
        if rid not in self._open:
            return
        self._forget(rid)
        writer = self._writer
        if writer is not None and not writer.is_closing():
            writer.write(self._codec.encode(Abort(rid, reason)))

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._writer is not None:
            self._writer.close()
        self._mark_down("gateway shutting down")
