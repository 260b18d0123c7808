"""One worker process: engine + KV pool + transfer + scheduler thread + native and HTTP servers.

Lifecycle:
1. ``Worker(config)``; ``await start()`` settles the address it advertises (``workers/addresses.py``:
   ``--advertise-host``, else ``--host``, else the route to the registry; clear errors for one that
   cannot work) and checks ``--transfer-option`` against the backend, then builds the engine (may
   take seconds), sizes the KV pool from the model shape, binds them, creates the transfer backend
   and KV manager (prefill and decode roles), starts the scheduler thread, the native server and the
   HTTP side (with SGLang's HTTP API, ``workers/sglang_api.py``, which connects to the native port on
   first use), and, for a prefill worker, registers its KV control endpoint with the bootstrap registry
   (heartbeats); a prefill's native port accepts connections only once it is registered.
2. ``await serve_forever()`` until cancelled or a signal.
3. ``await aclose()``: without a drain, deregister. With ``--drain-timeout-s`` S > 0, a prefill's registry entry
   turns draining instead (``BootstrapRegistrar.drain``: decodes holding rooms for it can still look it up, listings
   flag it as leaving; a registry that knows no such state gets the goodbye at once, as before), then the worker
   drains (``_drain``: new requests are refused ``shutting_down``, the ones held run on until none is left, S has
   passed or ``end_drain`` is called, a second signal) and deregisters at its end; then close the SGLang API, stop
   the scheduler (live requests fail ``shutting_down``), close the KV manager, close the servers. Idempotent.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any, Literal, TypeVar
from urllib.parse import urlsplit

import uvicorn

from gateway.http_protocol import ClientLimits
from gateway.tokenizer import Tokenizer, load_tokenizer, tokenizer_digest
from transfer.netaddr import is_loopback, is_wildcard, join_host_port, listener
from workers.addresses import advertised_host
from workers.config import WorkerConfig
from workers.engines import EngineOptions, create_engine
from workers.engines.base import Engine
from workers.http_app import create_http_app
from workers.http_connections import ConnectionCap, capped_protocol_class, fitted_cap, raise_open_file_limit
from workers.kv_pool import KVPool
from workers.protocol import (
    PROTOCOL_VERSION,
    TOKENIZER_FILE_NAMES,
    TOKENIZER_FILES_VERSION,
    HelloAck,
    TokenizerFiles,
)
from workers.scheduler import Scheduler, SchedulerConfig
from workers.server import NativeServer
from workers.sglang_api import SGLangAPI

log = logging.getLogger(__name__)
T = TypeVar("T")

# A prefill renews its registry entry at least this often, whatever --heartbeat-interval-s says: the
# registry's lease (``BootstrapConfig.ttl_s``, 10 s by default, always in an embedded registry) must
# see a few renewals, or its entry lapses between them and decodes' look-ups fail meanwhile.
MAX_REGISTRY_BEAT_S = 2.5
# A prefill's entry is taken as lapsed (its /health says "unregistered": decodes cannot look it up) after
# this many renewals failed in a row, or once failing renewals leave it unrenewed for the registry's default
# lease (a registry that times out makes each failure last seconds).
LAPSED_AFTER_FAILURES = 3
DEFAULT_LEASE_S = 10.0
DRAIN_CHECK_S = 0.05  # a draining worker looks this often whether its scheduler still holds requests


async def _on_daemon_thread(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` on a thread of its own that does not hold the process: a worker told to stop while it
    loads a model exits at once (``asyncio.to_thread``'s pool thread would keep it until the load ends)."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def settle(result: Any, exc: BaseException | None) -> None:
        if future.done():  # (cancelled: the worker is stopping)
            return
        if exc is not None:
            future.set_exception(exc)
        else:
            future.set_result(result)

    def run() -> None:
        try:
            result, exc = fn(*args), None
        except BaseException as error:  # (handed to the awaiting task)
            result, exc = None, error
        with contextlib.suppress(RuntimeError):  # (the loop has closed meanwhile)
            loop.call_soon_threadsafe(settle, result, exc)

    threading.Thread(target=run, name=f"load-{getattr(fn, '__name__', 'engine')}", daemon=True).start()
    return await future


class Worker:
    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self.worker_id = f"{config.role}-{uuid.uuid4().hex[:8]}"
        self.engine: Engine | None = None
        self.pool: KVPool | None = None
        self.kv: Any = None
        self.scheduler: Scheduler | None = None
        self.server: NativeServer | None = None
        self._http: uvicorn.Server | None = None
        self.http_connections: ConnectionCap | None = None  # (the HTTP port's counts: ``/metrics``)
        self.sglang: SGLangAPI | None = None
        self._http_task: asyncio.Task[None] | None = None
        self._registrar: Any = None
        self.started = False  # every server up (and a prefill registered)
        self.tokenizer_digest = ""  # of the tokenizer watching stop strings (``HelloAck.tokenizer_digest``)
        self._embedded: Any = None
        self.bootstrap_url = config.bootstrap
        self._resolver: Any = None
        self._closed = False
        # set: the drain ends now (``end_drain``: a second signal, maybe before it began), or it is over
        self._drain_cut = asyncio.Event()
        self.advertise_host = config.advertise_host or config.host  # settled in start()

    # -- assembly ----------------------------------------------------------------------------
    async def start(self) -> None:
        cfg = self.config
        registry = cfg.bootstrap
        if cfg.bootstrap_embedded is not None and not is_wildcard(cfg.host):  # (an embedded one on every interface
            registry = f"http://{join_host_port(cfg.host, cfg.bootstrap_embedded)}"  # is local: no route to pick)
        if cfg.role == "both" and not cfg.advertise_host:  # no peers: only the gateway, at the bound address
            self.advertise_host = "127.0.0.1" if is_wildcard(cfg.host) else cfg.host
        else:
            self.advertise_host = advertised_host(cfg.host, cfg.advertise_host, registry)
        if cfg.role != "both":
            from transfer.registry import check_options

            check_options(cfg.transfer, cfg.transfer_options)  # before the engine takes its seconds to load
        options = EngineOptions(
            model=cfg.model, device=cfg.device, dtype=cfg.dtype, attention=cfg.attention,
            num_threads=cfg.num_threads, extra=dict(cfg.engine_options),
        )
        if cfg.bootstrap_embedded is not None:
            from bootstrap import BootstrapConfig
            from bootstrap.client import serve_embedded

            # (reads open, as SGLang's own prefills serve them: decodes send the token only to their own --bootstrap)
            registry_config = BootstrapConfig(token=cfg.bootstrap_token, token_scope="writes")
            self._embedded = await serve_embedded(cfg.host, cfg.bootstrap_embedded, registry_config)
            self.bootstrap_url = self._embedded.url
        elif cfg.role == "decode" and self.bootstrap_url:  # (a prefill's registration checks its token itself)
            from bootstrap.client import check_read_access

            await check_read_access(self.bootstrap_url, cfg.bootstrap_token)
        self.engine = await _on_daemon_thread(create_engine, cfg.engine, options)
        # the tokenizer for stop strings loads on a thread while the pool and the KV manager are set up
        loading = asyncio.ensure_future(_on_daemon_thread(self._stop_tokenizer)) if cfg.role != "prefill" else None
        info = self.engine.info
        self.pool = KVPool(
            num_layers=info.num_layers, num_pages=cfg.num_pages, page_size=cfg.page_size,
            num_kv_heads=info.num_kv_heads, head_dim=info.head_dim, dtype=info.kv_dtype,
            num_aux_slots=max(256, cfg.max_running * 4),
            device=cfg.device,  # cuda: K and V pages in GPU memory (aux slots stay on the host)
            shared=self._same_host() and cfg.role == "decode",  # co-located prefills copy into it
        )
        self.engine.bind(self.pool)
        if cfg.role != "both":
            self.kv = self._create_kv_manager(self.pool)
        sched_cfg = SchedulerConfig(role=cfg.role, chunk_size=cfg.chunk_size, max_running=cfg.max_running,
                                    max_requests=cfg.max_requests, grammar_timeout_s=cfg.grammar_timeout_s)
        stop_tokenizer = await loading if loading is not None else None
        self.scheduler = Scheduler(sched_cfg, self.engine, self.pool, self._deliver, self.kv, stop_tokenizer)
        self.server = NativeServer(self.scheduler, self._hello_ack, cfg.host, cfg.port, api_key=cfg.api_key,
                                   peer_timeout_s=cfg.gateway_timeout_s,
                                   max_unread_bytes=cfg.max_unread_bytes, tokenizer_files=self._tokenizer_files)
        # A prefill takes requests only once registered: a decode asked to fetch from it must find it at
        # this address, not the one a previous run of it on this port registered (refused)
        await self.server.start(serve=cfg.role != "prefill")
        self.scheduler.start()
        self.sglang = SGLangAPI(self)  # loads and connects on first use
        raise_open_file_limit()
        self.http_connections = ConnectionCap(fitted_cap(cfg.max_http_connections or cfg.max_requests + 256))
        http_config = uvicorn.Config(
            create_http_app(self), host=cfg.host, port=cfg.http_port, log_level="warning",
            lifespan="off", access_log=False,
            # the gateway's limits on slow or huge requests and slow readers, under a cap on the connections
            http=capped_protocol_class(ClientLimits(), self.http_connections),
            timeout_keep_alive=cfg.http_keep_alive_timeout_s,  # type: ignore[arg-type]
        )
        self._http = uvicorn.Server(http_config)
        # The worker owns SIGTERM/SIGINT (graceful close); uvicorn must not capture them.
        self._http.capture_signals = contextlib.nullcontext  # type: ignore[method-assign,assignment]
        # Bound here: a port in use is an OSError for the caller (uvicorn binding it would sys.exit(3) from its
        # task, past this worker's clean-up).
        http_socket = listener(cfg.host, cfg.http_port)
        self._http_task = asyncio.create_task(self._http.serve(sockets=[http_socket]), name="worker-http")
        while not self._http.started:
            if self._http_task.done():
                self._http_task.result()
                raise RuntimeError("worker HTTP server stopped during startup")
            await asyncio.sleep(0.01)
        if cfg.role == "prefill":
            await self._register()
            await self.server.start_serving()
        self.started = True  # (``/health`` answers 200 from here on)
        log.info("worker %s ready: native %s:%d http %d (advertised as %s)", self.worker_id, cfg.host,
                 self.native_port, self.http_port, self.advertise_host)

    def _same_host(self) -> bool:
        """Whether KV may move through shared memory with co-located peers (``--same-host-kv auto``)."""
        return self.config.same_host_kv == "auto" and self.config.transfer != "fake"

    def _create_kv_manager(self, pool: KVPool) -> Any:
        from transfer import KVArgs, KVManager, KVTimeouts
        from transfer.registry import build_backend

        cfg = self.config
        args = KVArgs.from_pool(pool)
        timeouts = KVTimeouts(
            bootstrap_s=cfg.bootstrap_timeout_s, waiting_s=cfg.waiting_timeout_s,
            transfer_s=cfg.transfer_timeout_s, heartbeat_interval_s=cfg.heartbeat_interval_s,
            heartbeat_timeout_s=3 * cfg.heartbeat_interval_s, quarantine_s=cfg.quarantine_timeout_s,
        )
        resolver = None
        if cfg.role == "decode":
            resolver = self._make_resolver()
        role: Literal["prefill", "decode"] = "prefill" if cfg.role == "prefill" else "decode"
        backend = build_backend(cfg.transfer, host=cfg.host, advertise_host=self.advertise_host,
                                options=cfg.transfer_options)
        if cfg.transfer not in ("shm", "fake"):
            # always wrapped (inert when off), so workers with and without the same-host path still pair
            from transfer.shm import create_shm_backend

            backend = create_shm_backend(backend, same_host=self._same_host())
        return KVManager(role, args, backend, host=cfg.host, advertise_host=self.advertise_host,
                         timeouts=timeouts, resolver=resolver, auth_key=cfg.api_key)

    def _make_resolver(self) -> _RegistryResolver:
        from bootstrap.client import BootstrapResolver

        # (its own registry in full: a prefill announcing the same host:port is looked up there, https or a path
        # included; SGLang's prefills, and any other registry, over plain http://)
        resolver = BootstrapResolver(token=self.config.bootstrap_token,
                                     registries=(self.bootstrap_url,) if self.bootstrap_url else ())
        self._resolver = resolver
        assert self.pool is not None
        return _RegistryResolver(resolver, self.pool.page_size, self.pool.dtype)

    async def _register(self) -> None:
        from bootstrap.client import BootstrapRegistrar, RankRegistration

        cfg = self.config
        assert self.bootstrap_url and self.pool is not None
        host, port = self.kv.control_address
        registration = RankRegistration(
            rank_ip=host, rank_port=port, page_size=self.pool.page_size, kv_cache_dtype=self.pool.dtype,
            instance_id=self.instance_id, prefill_http_port=self.http_port, registrant=uuid.uuid4().hex,
        )
        self._registrar = BootstrapRegistrar(
            self.bootstrap_url, registration, interval_s=min(cfg.heartbeat_interval_s, MAX_REGISTRY_BEAT_S),
            token=cfg.bootstrap_token, start_timeout_s=cfg.registry_wait_s or math.inf,
        )
        await self._registrar.start()

    # -- views -------------------------------------------------------------------------------
    @property
    def registration_error(self) -> str | None:
        """Why a prefill's registry entry has lapsed (its renewals keep failing), or None."""
        registrar = self._registrar
        if registrar is None or not registrar.num_failures:
            return None
        unrenewed_s = time.monotonic() - registrar.last_success
        if registrar.num_failures < LAPSED_AFTER_FAILURES and unrenewed_s < DEFAULT_LEASE_S:
            return None
        return (f"{registrar.num_failures} registry renewals failed in a row, none succeeded for {unrenewed_s:.0f}s: "
                f"{registrar.last_error}")

    @property
    def embedded_registry_port(self) -> int | None:
        """The port of the registry this worker serves (``--bootstrap-embedded``; 0 there: the one it got)."""
        return self._embedded.port if self._embedded is not None else self.config.bootstrap_embedded

    @property
    def native_port(self) -> int:
        assert self.server is not None
        return self.server.port

    @property
    def http_port(self) -> int:
        assert self._http is not None
        return int(self._http.servers[0].sockets[0].getsockname()[1])

    @property
    def instance_id(self) -> str:
        if self.config.instance_id:
            return self.config.instance_id
        host = self.advertise_host
        return f"ip6-{host}:{self.native_port}" if ":" in host else f"{host}:{self.native_port}"  # registry charset

    def _hello_ack(self) -> HelloAck:
        assert self.engine is not None and self.pool is not None
        info = self.engine.info
        boot_host = boot_port = None
        if self.bootstrap_url:
            url = urlsplit(self.bootstrap_url)
            boot_host, boot_port = url.hostname, url.port or 8998
            # Our embedded registry on every interface; or, with an --advertise-host given for peers on other
            # hosts, one on this host's loopback, which they would look for on their own: both are reached at
            # the advertised address (the registry must listen there). Without it, a loopback registry means
            # one host: its decodes reach it where we do.
            if boot_host is None or is_wildcard(boot_host) or (is_loopback(boot_host) and self.config.advertise_host
                                                              and not is_loopback(self.advertise_host)):
                boot_host = self.advertise_host
        return HelloAck(
            version=PROTOCOL_VERSION, worker_id=self.worker_id, role=self.config.role,
            engine=self.config.engine, model=info.name, tokenizer=info.tokenizer,
            page_size=self.pool.page_size, max_context=info.max_context, num_pages=self.pool.num_pages,
            bootstrap_host=boot_host if self.config.role == "prefill" else None,
            bootstrap_port=boot_port if self.config.role == "prefill" else None,
            instance_id=self.instance_id if self.config.role == "prefill" else None,
            transfer=self.config.transfer if self.config.role != "both" else "",
            tokenizer_files=TOKENIZER_FILES_VERSION,
            stop_strings=self.scheduler is not None and self.scheduler.stop_tokenizer is not None,
            tokenizer_digest=self.tokenizer_digest,
        )

    def _stop_tokenizer(self) -> Tokenizer | None:
        """The engine's tokenizer, for stop strings (``workers.stop_strings``); None if it cannot load
        (the gateway then aborts at a stop string it finds itself, as with any worker without them)."""
        assert self.engine is not None
        spec = self.engine.info.tokenizer
        try:
            tokenizer = load_tokenizer(spec)
            self.tokenizer_digest = tokenizer_digest(spec)
            return tokenizer
        except Exception as exc:  # (any loader failure: the worker serves on without this ability)
            log.warning("cannot load the tokenizer %s for stop strings (the gateway will stop requests at "
                        "them instead): %s: %s", spec, type(exc).__name__, exc)
            return None

    def _tokenizer_files(self) -> TokenizerFiles:
        """The tokenizer directory's files for a gateway that has no copy (``GetTokenizer``)."""
        assert self.engine is not None
        spec = self.engine.info.tokenizer
        if spec == "byte":
            return TokenizerFiles(spec)
        files: dict[str, bytes] = {}
        try:
            for name in TOKENIZER_FILE_NAMES:
                path = os.path.join(spec, name)
                if os.path.isfile(path):
                    with open(path, "rb") as f:
                        files[name] = f.read()
        except OSError as exc:
            return TokenizerFiles(spec, error=f"cannot read the tokenizer at {spec}: {exc}")
        if "tokenizer.json" not in files:
            return TokenizerFiles(spec, error=f"{spec} has no tokenizer.json")
        return TokenizerFiles(spec, files)

    def info(self) -> dict[str, Any]:
        ack = self._hello_ack()
        return {
            "worker_id": self.worker_id, "role": ack.role, "engine": ack.engine, "model": ack.model,
            "native_port": self.native_port, "http_port": self.http_port, "page_size": ack.page_size,
            "num_pages": ack.num_pages, "max_context": ack.max_context, "transfer": ack.transfer,
            "instance_id": ack.instance_id, "pid": os.getpid(), "tokenizer": ack.tokenizer,
            "stop_strings": ack.stop_strings, "tokenizer_digest": ack.tokenizer_digest,
        }

    def _deliver(self, messages: list[Any]) -> None:
        if self.server is not None:
            self.server.deliver(messages)

    # -- run / close -------------------------------------------------------------------------
    async def serve_forever(self) -> None:
        assert self._http_task is not None
        await self._http_task

    @property
    def stopping(self) -> bool:
        """``aclose`` has begun: ``/health`` answers 503 from now on (``/liveness`` stays 200)."""
        return self._closed

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        draining = self.config.drain_timeout_s > 0 and self.scheduler is not None and self.started
        if draining:
            assert self.scheduler is not None
            self.scheduler.drain()  # (new requests are refused from now on, not after the registry answered)
        if self._registrar is not None and draining:
            try:  # (findable for the rooms it holds until the drain ends; not chosen for new ones: /health 503)
                await self._registrar.drain()
            except Exception:
                log.exception("marking the registry entry draining failed; deregistering now")
        await self._deregister()
        if draining:
            try:
                await self._drain(self.config.drain_timeout_s)
            finally:  # (however the drain ended: the registry entry it kept goes now)
                self._drain_cut.set()
                await self._deregister()
        if self.sglang is not None:
            await self.sglang.aclose()
        stopped = True
        if self.scheduler is not None:
            stopped = await asyncio.to_thread(self.scheduler.stop)
            if not stopped:
                log.error("scheduler step still running after 60s; leaving the KV manager and engine open")
        if self.server is not None:
            await self.server.aclose()
        if self.kv is not None and stopped:
            await asyncio.to_thread(self.kv.close)
        if self.pool is not None:
            self.pool.close()  # a shared pool's file is unlinked (its memory lives while mapped)
        if self._resolver is not None:
            self._resolver.close()
        if self._http is not None:
            self._http.should_exit = True
            if self._http_task is not None:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await asyncio.wait_for(self._http_task, 5.0)
        if self._embedded is not None:
            with contextlib.suppress(Exception):
                await self._embedded.aclose()
        if self.engine is not None and stopped:
            self.engine.close()

    async def _deregister(self) -> None:
        """Say goodbye to the registry, unless the entry is kept draining (the drain under way needs it)."""
        registrar = self._registrar
        if registrar is None or (registrar.is_draining and not self._drain_cut.is_set()):
            return
        self._registrar = None
        with contextlib.suppress(Exception):
            await registrar.aclose()

    async def _drain(self, timeout_s: float) -> None:
        """New requests are refused ``shutting_down`` (``Scheduler.drain``: through the native port and SGLang's
        HTTP API alike, the rooms of refused ones ended on the peer's side) while the ones held run on: until
        none is left, ``timeout_s`` has passed, or ``end_drain`` is called. Each request keeps its own deadline."""
        scheduler = self.scheduler
        assert scheduler is not None
        cut = self._drain_cut
        scheduler.drain()
        held = scheduler.num_held
        log.info("worker %s draining: %d requests held, for up to %gs (new ones are refused)", self.worker_id, held,
                 timeout_s)
        deadline = time.monotonic() + timeout_s
        # (checked a few times a second: only while stopping, and the scheduler's thread owns the request table)
        while (scheduler.num_held or self._num_open_http()) and scheduler.is_alive and not cut.is_set():
            remaining_s = deadline - time.monotonic()
            if remaining_s <= 0:
                break
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(cut.wait(), min(DRAIN_CHECK_S, remaining_s))
        left = scheduler.num_held
        why = "cut short" if cut.is_set() else "timed out" if left else "done"
        log.log(logging.WARNING if left else logging.INFO, "worker %s drain %s: %d of %d requests still held end "
                "shutting_down", self.worker_id, why, left, held)
        cut.set()  # (a later signal only says it is already stopping)

    def _num_open_http(self) -> int:
        """Generations open on SGLang's HTTP API (their last output may still be on its way from the scheduler)."""
        return self.sglang.dispatcher.num_open if self.sglang is not None else 0

    def end_drain(self) -> bool:
        """End a drain under way now (a second SIGTERM/SIGINT): whether one was."""
        cut = self._drain_cut
        if self.config.drain_timeout_s <= 0 or not self.started or cut.is_set():
            return False
        cut.set()
        return True


class _RegistryResolver:
    """The decode's KV resolver: a prefill's control address from the bootstrap registry, once its KV
    layout checked out against ours. ``cached`` answers from the registry client's cache alone (a
    ``transfer.decode.CachingResolver``: the KV manager then skips its bootstrap thread); ``invalidate``
    drops it when the address failed (a ``transfer.decode.InvalidatingResolver``)."""

    def __init__(self, resolver: Any, page_size: int, kv_cache_dtype: str) -> None:
        from bootstrap.client import check_compatible
        from bootstrap.exceptions import BootstrapError
        from bootstrap.messages import DEFAULT_BOOTSTRAP_PORT
        from transfer import TransferError, TransferErrorKind

        self._resolver = resolver  # bootstrap.client.BootstrapResolver
        self._check = check_compatible
        self._layout_error = BootstrapError  # what check_compatible raises
        self._transfer_error = TransferError
        self._protocol = TransferErrorKind.PROTOCOL
        self._default_port = DEFAULT_BOOTSTRAP_PORT
        self._page_size = page_size
        self._dtype = kv_cache_dtype

    def __call__(self, host: str, port: int | None, instance_id: str | None) -> tuple[str, int]:
        topology = self._resolver.topology(host, port or self._default_port, instance_id)
        self._check_layout(topology)
        address: tuple[str, int] = self._resolver.resolve(host, port, instance_id)
        return address

    def _check_layout(self, topology: Any) -> None:
        """Incompatible KV layouts are a shape mismatch of the pair (PROTOCOL, held against this decode),
        not a registry failure (BOOTSTRAP, held against no worker)."""
        try:
            self._check(topology, page_size=self._page_size, kv_cache_dtype=self._dtype)
        except self._layout_error as exc:
            raise self._transfer_error(self._protocol, str(exc)) from None

    def invalidate(self, host: str, port: int | None, instance_id: str | None) -> None:
        """The prefill's address failed (``transfer.decode.InvalidatingResolver``): ask the registry next time."""
        self._resolver.invalidate(host, port, instance_id)
        self._resolver.invalidate(host, port or self._default_port, instance_id)

    def cached(self, host: str, port: int | None, instance_id: str | None) -> tuple[str, int] | None:
        topology = self._resolver.cached_topology(host, port or self._default_port, instance_id)
        if topology is None:
            return None
        self._check_layout(topology)
        address: tuple[str, int] | None = self._resolver.cached_address(host, port, instance_id)
        return address
