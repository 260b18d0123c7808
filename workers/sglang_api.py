"""SGLang's HTTP PD protocol on a worker's HTTP port: what SGLang's router (Rust or mini_lb) calls.

The native protocol stays the fast path; this is the compatibility path, on the same scheduler.

Lifecycle:
1. ``SGLangAPI(worker)`` with the worker; nothing is loaded or connected until a route needs it. The
   first request that does (``ensure_ready``) takes the tokenizer the engine names (the one a decode
   or combined worker holds for stop strings, else loaded now) and opens one native connection to
   the worker's own native port (a gateway ``WorkerClient``, so requests take exactly the path a
   gateway's do). A worker nobody drives over SGLang's protocol pays nothing: no tokenizer of its
   own, no extra connection getting load reports every few ms.
2. Per request (``POST /generate``, ``/v1/completions``, ``/v1/chat/completions``): the gateway's own
   responders and shapes (validation, chat template, detokenizing, stop strings, SSE and JSON), with
   ``RelayDispatcher`` in place of the gateway's dispatcher: no routing, this worker only, and the
   bootstrap room and the prefill's registry address taken from the body's ``bootstrap_host``,
   ``bootstrap_port`` and ``bootstrap_room`` (scalars, or lists with one item per choice; choice
   ``i`` of a scalar room uses ``room + i``, of a list shorter than the choices item ``i % len`` plus
   ``i // len``, on the prefill and the decode alike). A prefill worker
   answers once its KV is handed over (its text is the first token; ``meta_info`` carries the
   prompt logprobs a router merges); a decode worker answers with the whole generation, streamed
   or not. A combined worker (``--role both``) needs no bootstrap fields.
3. Metadata and admin routes: ``/health_generate``, ``/get_model_info`` (``/model_info``),
   ``/get_server_info`` (``/server_info``), ``/v1/models``, ``/get_load`` and ``/v1/loads`` (the
   scheduler's load report in SGLang's shapes), ``/flush_cache``.
4. ``aclose()`` (the worker stopping) closes the connection; requests still open end as the native protocol's
   do, ``shutting_down`` (a 503 with Retry-After, a stream's error event: a router retries them elsewhere without
   holding them against this worker), and one arriving after it is a 503 at once. With ``--drain-timeout-s`` S the
   worker first drains (``Worker._drain``): a request arriving meanwhile is refused by the scheduler, a 503
   ``shutting_down`` as above (its room ended on the peer's side, which answers 429), while the ones open run to
   their end (``RelayDispatcher.num_open``) for up to S seconds before ``aclose`` ends what is left.

A decode finds its prefill through the registry at ``bootstrap_host:bootstrap_port`` (null: 8998),
the only prefill instance registered there: start each prefill with ``--bootstrap-embedded PORT``
and give the router ``--prefill URL PORT``. SGLang's fake bootstrap host (``2.2.2.2``, its warm-up
requests run without a peer) is refused with a 400: our workers always move real KV.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import os
import re
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from gateway.admission import Admission
from gateway.api import ClientBootstrap, Frontend
from gateway.context import REQUEST_ID
from gateway.dispatch import SlowClient
from gateway.errors import APIError, BadGateway, BadRequest, NoWorkers, Overloaded, UpstreamTimeout, from_worker_error
from gateway.event_sink import EventSink, SinkOverflow
from gateway.metrics import GatewayMetrics
from gateway.middleware import request_id_of
from gateway.responder import Responder
from gateway.shapes import ChatShape, CompletionShape, GenerateShape
from gateway.tokenizer import load_tokenizer
from gateway.worker_client import WorkerClient
from transfer.netaddr import join_host_port
from workers.http_app import shows_details
from workers.protocol import BootstrapTarget, Error, SamplingParams, StepOutput, Submit

if TYPE_CHECKING:
    from starlette.types import Receive, Scope, Send

    from workers.config import WorkerConfig
    from workers.worker import Worker

log = logging.getLogger(__name__)
FAKE_BOOTSTRAP_HOST = "2.2.2.2"
MAX_BODY_BYTES = 8 * 1024 * 1024
BODY_TIMEOUT_S = 60.0  # a request body must arrive within this (else 408)
MAX_ROOM = 2**63 - 1
SERVER_VERSION = "pd-gateway-0.1.0"
_json = msgspec.json.Encoder()
FIRST_TOKEN_SLACK_S = 30.0  # (``SGLangAPIConfig.of``) past the scheduler's own stage timeouts


@dataclass(frozen=True)
class SGLangAPIConfig:
    """Deadlines of the worker's SGLang API (the gateway's relay to SGLang workers has its own)."""

    first_token_timeout_s: float = 300.0  # prefill: until its KV is handed over; decode: its first token
    stream_idle_timeout_s: float = 120.0
    request_timeout_s: float = 1800.0  # the scheduler's own deadline for the request

    @classmethod
    def of(cls, cfg: WorkerConfig) -> SGLangAPIConfig:
        """The worker's: ``--http-request-timeout-s`` for the request; before the first output, what the
        scheduler's own stage timeouts allow it (bootstrap, queue, transfer) and some slack, so that this
        backstop for a stalled scheduler never cuts a request its scheduler would still serve."""
        first = cfg.bootstrap_timeout_s + cfg.waiting_timeout_s + cfg.transfer_timeout_s + FIRST_TOKEN_SLACK_S
        return cls(min(first, cfg.http_request_timeout_s), cls.stream_idle_timeout_s, cfg.http_request_timeout_s)


class RelayDispatcher:
    """Runs a choice on this worker alone, with the room and prefill address the client sent."""

    def __init__(self, client: WorkerClient, role: str, config: SGLangAPIConfig | None = None) -> None:
        self.client = client
        self.role = role
        self.config = config or SGLangAPIConfig()
        self.closing = False  # the worker is stopping (``SGLangAPI.aclose``): its connection's end is no failure
        # generations submitted whose last output has not been taken yet: a draining worker (``--drain-timeout-s``)
        # closes this API only once none is left (its scheduler can hold none while their last output is on its way)
        self.num_open = 0

    async def generate(self, input_ids: list[int], params: SamplingParams, *, choice: int = 0,
                       bootstrap: ClientBootstrap | None = None, direct: Any = None, counts_prompt: bool = True,
                       served: Any = None, counts_output: bool = True,
                       ) -> AsyncGenerator[StepOutput, None]:  # (every output is yielded)
        target = self.target(bootstrap, choice)
        sink = EventSink()
        cfg = self.config
        try:
            rid = self.client.submit(Submit(0, input_ids, params, target, cfg.request_timeout_s, REQUEST_ID.get()),
                                     sink, "self")
        except ConnectionError as exc:
            if self.closing:
                raise self.stopping() from None
            raise BadGateway(str(exc), code="worker_gone") from None
        done = got_token = False
        self.num_open += 1
        try:
            while True:
                sink.set_deadline(cfg.stream_idle_timeout_s if got_token else cfg.first_token_timeout_s)
                try:
                    _, event = await sink.get()
                except TimeoutError:
                    stage = "between tokens" if got_token else "before the first token"
                    raise UpstreamTimeout(f"{self.role} worker: no progress {stage}") from None
                except SinkOverflow:  # (the generation is aborted below)
                    raise SlowClient(f"the client read its stream too slowly ({sink.limit} outputs unread); "
                                     "generation was stopped") from None
                if isinstance(event, StepOutput):
                    if event.finish_reason is None:
                        event = sink.merge_ready(event, "self")
                    got_token = got_token or bool(event.token_ids)
                    done = event.finish_reason is not None
                    yield event
                    if done:
                        return
                elif isinstance(event, Error):
                    done = True
                    raise from_worker_error(event.code, event.message, self.role, event.param)
                else:  # WorkerGone: our own scheduler's connection dropped
                    done = True
                    if self.closing:  # (closed by the worker's own stop: what a native peer is told, not a 502)
                        raise self.stopping()
                    raise BadGateway(f"{self.role} worker: {event.message}", code="worker_gone")
        finally:
            self.num_open -= 1
            sink.close()
            if not done:  # the client left, or a stop string ended the choice
                self.client.abort(rid)

    def stopping(self) -> APIError:
        return from_worker_error("shutting_down", "the worker is shutting down", self.role)

    def decode_capacity(self) -> int | None:
        """The tokens (prompt + max_new_tokens) this worker's KV pool holds, when it decodes (a decode, a combined
        worker): a default budget is cut to it (``Frontend._params``), as the gateway cuts it to its decodes' and
        SGLang's scheduler to its pool. A prefill holds the prompt alone: None (the context is its limit)."""
        if self.role == "prefill":
            return None
        return self.client.state.total_tokens or None  # (0 until its connection's handshake)

    def prompt_capacity(self) -> int | None:
        """The longest prompt this worker's KV pool holds, when it is a prefill (``Frontend.usable_context``: SGLang's
        PD router answers ``/v1/models`` from its first prefill); None otherwise (``decode_capacity`` bounds those)."""
        if self.role != "prefill":
            return None
        return self.client.state.capacity_tokens or None  # (0 until its connection's handshake)

    def target(self, bootstrap: ClientBootstrap | None, choice: int) -> BootstrapTarget | None:
        """This choice's bootstrap target from the client's fields (400 naming the bad one)."""
        if self.role == "both":
            return None
        if bootstrap is None or bootstrap.room is None:
            needs = "bootstrap_room" if self.role == "prefill" else "bootstrap_host and bootstrap_room"
            raise BadRequest(f"a {self.role} worker serves SGLang's PD protocol: the request needs {needs}",
                             param="bootstrap_room")
        host = _item(bootstrap.host, choice, "bootstrap_host")
        port = _item(bootstrap.port, choice, "bootstrap_port")
        room = _item(bootstrap.room, choice, "bootstrap_room")
        if type(room) is not int or not 0 <= room <= MAX_ROOM:
            raise BadRequest(f"bootstrap_room must be an integer in [0, 2^63-1], got {room!r}",
                             param="bootstrap_room")
        # A scalar room: choice i uses room + i. A list shorter than the choices (SGLang's Rust router sizes
        # it to n for a prompt array with n > 1; SGLang's server repeats it): choice i uses item i % len,
        # plus i // len so that no two choices share a room (prefill and decode compute the same).
        rooms = bootstrap.room
        offset = choice // len(rooms) if isinstance(rooms, list) else choice
        room = (room + offset) % (MAX_ROOM + 1)
        if port is not None and (type(port) is not int or not 0 < port < 65536):
            raise BadRequest(f"bootstrap_port must be a TCP port or null, got {port!r}", param="bootstrap_port")
        if host is not None and not isinstance(host, str):
            raise BadRequest(f"bootstrap_host must be a string, got {host!r}", param="bootstrap_host")
        if host and not _is_host(host.strip("[]")):  # (else a decode's registry look-up failed it as a 502)
            raise BadRequest(f"bootstrap_host must be a host name or an IP address, got {host!r}",
                             param="bootstrap_host")
        if host == FAKE_BOOTSTRAP_HOST:
            raise BadRequest("the fake bootstrap host (a peer-less warm-up) is not supported: our workers always "
                             "move real KV", param="bootstrap_host")
        if self.role == "decode" and not host:
            raise BadRequest("a decode worker needs bootstrap_host: the prefill's host", param="bootstrap_host")
        return BootstrapTarget(host.strip("[]") if host else "", port, room)


_HOST_NAME = re.compile(r"(?!-)[\w-]+(?:\.(?!-)[\w-]+)*\.?")
# an IPv6 zone: an interface name (at most 15 bytes) or index (``ipaddress`` takes any text after "%"; in the
# registry's URL, "@", "?", "#" or "/" there would read as credentials, a query, a fragment or a path)
_ZONE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,14}")


def _is_host(host: str) -> bool:
    """``host`` (its brackets taken off) is a host name, an IPv4 address or an IPv6 literal (with a zone, if any):
    nothing a registry URL built from it would read as a port, a path, a query or credentials."""
    if ":" in host:
        try:
            zone = ipaddress.IPv6Address(host).scope_id
        except ValueError:
            return False
        return zone is None or _ZONE.fullmatch(zone) is not None
    return len(host) <= 253 and _HOST_NAME.fullmatch(host) is not None


def _item(value: Any, choice: int, name: str) -> Any:
    """Choice ``choice``'s item of a bootstrap field: the scalar, or a list's item (a short list repeats)."""
    if not isinstance(value, list):
        return value
    if not value:
        raise BadRequest(f"{name} is an empty list", param=name)
    return value[choice % len(value)]


class SGLangAPI:
    """The host of the SGLang-protocol responders on one worker (see the module docstring)."""

    def __init__(self, worker: Worker, config: SGLangAPIConfig | None = None) -> None:
        cfg = worker.config
        self.worker = worker
        self.metrics = GatewayMetrics()
        self.admission = Admission(0, 0, 1.0, self.metrics)  # the scheduler's own queue limits apply
        host = {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}.get(cfg.host, cfg.host)
        self.client = WorkerClient(f"pd://{join_host_port(host, worker.native_port)}", cfg.role, key=cfg.api_key)
        self.dispatcher = RelayDispatcher(self.client, cfg.role, config or SGLangAPIConfig.of(cfg))
        self.frontend: Frontend | None = None
        self._unavailable: str | None = None  # why the API cannot serve (a tokenizer it cannot load)
        self._started = False
        self._lock = asyncio.Lock()

    @property
    def max_body_bytes(self) -> int:
        return MAX_BODY_BYTES

    @property
    def body_timeout_s(self) -> float:
        return BODY_TIMEOUT_S

    def require_frontend(self) -> Frontend:
        if self.dispatcher.closing:
            raise self.dispatcher.stopping()
        if self.frontend is None or not self.client.is_connected:
            why = self._unavailable or "starting or stopping"
            raise NoWorkers(f"the worker's SGLang HTTP API is not available: {why}", retry_after_s=1.0)
        return self.frontend

    async def ensure_ready(self, timeout_s: float = 30.0) -> None:
        """Load the tokenizer and connect, once; a failure leaves ``require_frontend`` answering 503."""
        if (self.frontend is not None and self.client.is_connected) or self.dispatcher.closing:
            return  # (closing: ``require_frontend`` answers 503 at once, rather than after a wait for a connection)
        async with self._lock:
            if self.frontend is None and self._unavailable is None:
                engine = self.worker.engine
                assert engine is not None
                info = engine.info
                scheduler = self.worker.scheduler
                try:
                    tokenizer = (scheduler.stop_tokenizer if scheduler is not None and scheduler.stop_tokenizer
                                 else await asyncio.to_thread(load_tokenizer, info.tokenizer))
                except Exception as exc:  # e.g. a plugin engine naming a tokenizer we cannot load
                    self._unavailable = f"cannot load the engine's tokenizer {info.tokenizer!r}: {exc}"
                    log.warning("SGLang HTTP API off: %s", self._unavailable)
                    return
                self.frontend = Frontend(self.dispatcher, tokenizer, info.name, info.max_context, any_model=True)
            if self.frontend is not None and not self._started:
                self._started = True
                self.client.start()
        if self.frontend is not None:  # (outside the lock: concurrent requests wait side by side, not in turn)
            await self.client.wait_ready(timeout_s)

    async def aclose(self) -> None:
        self.dispatcher.closing = True
        await self.client.aclose("the worker is shutting down")

    def routes(self) -> list[BaseRoute]:
        chat, completions, generate = (_WhenReady(self, Responder(self, ChatShape())),
                                       _WhenReady(self, Responder(self, CompletionShape())),
                                       _WhenReady(self, Responder(self, GenerateShape(), refusals_as_events=True)))
        return [
            Route("/generate", generate, methods=["POST"]),
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/chat/completions", chat, methods=["POST"]),
            Route("/health_generate", self.health_generate, methods=["GET"]),
            Route("/get_model_info", self.model_info, methods=["GET"]),
            Route("/model_info", self.model_info, methods=["GET"]),
            Route("/get_server_info", self.server_info, methods=["GET"]),
            Route("/server_info", self.server_info, methods=["GET"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/get_load", self.get_load, methods=["GET"]),
            Route("/v1/loads", self.loads, methods=["GET"]),
            _without_head(Route("/flush_cache", self.flush_cache, methods=["POST", "GET"])),
        ]

    # -- metadata and admin ------------------------------------------------------------------
    async def health_generate(self, request: Request) -> Response:
        """200 while the scheduler runs and makes progress: in PD mode SGLang's check runs a peer-less
        generation, which our workers do not have; a combined worker runs a real one-token one (one too full to
        take it, at its ``--max-requests``, is busy, not unhealthy, as in SGLang's check). Open (no key
        needed): why it fails (a tokenizer's path, a worker's error) only to a request with the key, if any."""
        sched = self.worker.scheduler
        if sched is None or not sched.is_alive or sched.stalled_s > 60.0:
            return _reply({"status": "unhealthy"}, 503)
        if self.dispatcher.closing or getattr(self.worker, "stopping", False):  # (as ``/health``: SIGTERM on)
            return _reply({"status": "stopping"}, 503)
        await self.ensure_ready()
        if not self.client.is_connected:
            return _reply({"status": "unhealthy", "error": self._unavailable if shows_details(request) else None}, 503)
        if self.worker.config.role == "both":
            try:
                async for _event in self.dispatcher.generate([0], SamplingParams(max_new_tokens=1, temperature=0)):
                    pass
            except Overloaded:  # full (at its --max-requests), not broken: its progress was checked above, and
                pass  # SGLang's own check counts a busy server's progress as health
            except APIError as exc:
                return _reply({"status": "unhealthy", "error": exc.message if shows_details(request) else None}, 503)
        return _reply({"status": "ok"})

    async def model_info(self, _: Request) -> Response:
        engine = self.worker.engine
        assert engine is not None
        info = engine.info
        return _reply({
            "model_path": _model_path(self.worker.config.model, info), "tokenizer_path": info.tokenizer,
            "is_generation": True, "model_type": self.worker.config.engine, "architectures": None,
            "weight_version": "default", "served_model_name": info.name,
        })

    async def server_info(self, _: Request) -> Response:
        w = self.worker
        engine, pool = w.engine, w.pool
        assert engine is not None and pool is not None
        cfg, info = w.config, engine.info
        return _reply({
            "model_path": _model_path(cfg.model, info), "served_model_name": info.name,
            "tokenizer_path": info.tokenizer,
            "version": SERVER_VERSION, "disaggregation_mode": cfg.role if cfg.role != "both" else "null",
            "disaggregation_bootstrap_port": w.embedded_registry_port,
            "disaggregation_transfer_backend": cfg.transfer, "dp_size": 1, "tp_size": 1, "pp_size": 1,
            "page_size": pool.page_size, "max_total_num_tokens": pool.num_pages * pool.page_size,
            "max_running_requests": cfg.max_running, "context_length": info.max_context,
            "internal_states": [{"last_gen_throughput": 0.0, "avg_spec_accept_length": None}],
        })

    async def models(self, _: Request) -> Response:
        await self.ensure_ready()
        frontend = self.require_frontend()
        return _reply({"object": "list", "data": [{"id": frontend.model_name, "object": "model", "created": 0,
                                                   "owned_by": "pd-gateway", "root": frontend.model_name,
                                                   "max_model_len": frontend.usable_context()}]})

    def _load(self) -> dict[str, Any]:
        """The scheduler's load in ``/v1/loads``' per-rank shape (tokens = pages x page size)."""
        sched, pool = self.worker.scheduler, self.worker.pool
        assert sched is not None and pool is not None
        report = sched.load_report()
        total = report.num_total_pages * pool.page_size
        used = (report.num_total_pages - report.num_free_pages) * pool.page_size
        return {
            "dp_rank": 0, "num_running_reqs": report.num_running + report.num_transfer_seqs,
            "num_waiting_reqs": report.num_waiting, "num_used_tokens": used,
            "num_total_tokens": used + report.num_prefill_tokens, "max_total_num_tokens": total,
            "token_usage": used / total if total else 0.0, "gen_throughput": 0.0,
            "cache_hit_rate": 0.0, "utilization": report.busy_fraction,
            "max_running_requests": report.max_running,
        }

    async def get_load(self, _: Request) -> Response:
        """SGLang's ``/get_load``: a list with one entry per data-parallel rank (ours: one), its requests
        (running and waiting) and tokens (occupied plus queued), as SGLang's router reads it."""
        load = self._load()
        return _reply([{"dp_rank": 0, "num_reqs": load["num_running_reqs"] + load["num_waiting_reqs"],
                        "num_waiting_reqs": load["num_waiting_reqs"], "num_tokens": load["num_total_tokens"]}])

    async def loads(self, _: Request) -> Response:
        """SGLang's ``/v1/loads`` (the ``core`` fields, one rank)."""
        return _reply({"timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "version": SERVER_VERSION,
                       "loads": [self._load()]})

    async def flush_cache(self, _: Request) -> Response:
        sched = self.worker.scheduler
        if sched is None or not sched.is_alive:
            return _reply({"status": "unhealthy"}, 503)
        try:
            freed = await asyncio.wait_for(asyncio.wrap_future(sched.flush_cache()), 10.0)
        except TimeoutError:
            return _reply({"status": "unhealthy", "error": "the scheduler did not answer"}, 503)
        return _reply({"status": "ok", "num_freed_pages": freed})


class _WhenReady:
    """An ASGI app run once the API is ready (``ensure_ready``; if it cannot be, the app answers 503)."""

    def __init__(self, api: SGLangAPI, app: Responder) -> None:
        self.api, self.app = api, app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        REQUEST_ID.set(request_id_of(scope["headers"]))  # (the router's id, in this worker's log lines)
        await self.api.ensure_ready()
        await self.app(scope, receive, send)


def _reply(body: Any, status: int = 200) -> Response:
    return Response(_json.encode(body), status_code=status, media_type="application/json")


def _without_head(route: Route) -> Route:
    """``route`` without the ``HEAD`` Starlette adds to every ``GET`` route: a mutating route (``/flush_cache``, whose
    ``GET`` is SGLang's) must not act on a safe method that probes and link checkers send (405 instead)."""
    assert route.methods is not None
    route.methods.discard("HEAD")
    return route


def _model_path(model: str | None, info: Any) -> str:
    """``model_path`` as SGLang reports it, where its router loads the tokenizer from: the model's resolved
    directory (``--model default`` is a name only we know) where the engine has one, else what was given."""
    tokenizer = info.tokenizer
    if isinstance(tokenizer, str) and os.path.isdir(tokenizer):
        return tokenizer
    return str(model or info.name)
