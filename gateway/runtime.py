"""The gateway's configuration and its runtime state (workers, router, dispatcher, admission, metrics).

Lifecycle (``Gateway``, owned by the app's lifespan; event loop only):
1. ``Gateway(config)``: one ``WorkerClient`` per configured worker, the router (policies, validated
   options), the dispatcher, admission control, metrics. Nothing connects yet.
2. ``await start()``: connect to every worker (each client reconnects by itself for ever after),
   start the load-freshness task, wait up to ``startup_timeout_s``, load the tokenizer the first
   connected worker names (fetched from that worker, ``gateway/remote_tokenizer.py``, when its
   directory is not on this machine).
3. Running: ``add_worker`` / ``remove_worker`` (admin API; a removed worker drains: no new
   requests, open ones finish, then its connection closes); ``begin_drain()`` on SIGTERM.
4. ``await aclose()``: stop the tasks, close every worker connection (workers abort what was open).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
from dataclasses import dataclass, field

from gateway.admission import Admission
from gateway.api import Frontend
from gateway.cors import check_origins
from gateway.dispatch import DispatchConfig, Dispatcher
from gateway.errors import NoWorkers
from gateway.health import HealthConfig, selectability_changed
from gateway.metrics import GatewayMetrics, WorkerCollector
from gateway.policies import parse_option_args
from gateway.policies.loader import load_policy_class
from gateway.remote_tokenizer import RemoteTokenizerError, fetch_tokenizer, needs_fetch
from gateway.router import Router
from gateway.sglang_fleet import RelayConfig, SGLangFleet, check_http_url, is_http_url
from gateway.tokenizer import load_tokenizer, tokenizer_digest
from gateway.worker_client import WorkerClient, parse_worker_url
from gateway.worker_state import REFRESH_INTERVAL_S, WorkerState
from workers.protocol import HelloAck

log = logging.getLogger(__name__)

# A worker's tokenizer files, fetched by a gateway without a copy of the model: their whole transfer.
TOKENIZER_FETCH_TIMEOUT_S = 60.0
FETCH_RETRY_S = 1.0  # after a failed fetch, the next one starts no sooner than this
ROLES = ("prefill", "decode", "both")


@dataclass(frozen=True)
class GatewayConfig:
    prefill: tuple[str, ...] = ()
    decode: tuple[str, ...] = ()
    # SGLang prefills (http:// URLs): each one's bootstrap port (None: the worker's default, 8998)
    prefill_bootstrap_ports: tuple[int | None, ...] = ()
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
    retry_backoff_s: float = 0.05
    max_migrations: int = 2  # a stream whose decode failed mid-way continues on a new pair (0: off)
    max_body_bytes: int = 8 * 1024 * 1024
    body_timeout_s: float = 60.0  # a request body must arrive within this once reading starts (else 408)
    max_header_bytes: int = 64 * 1024  # a request head (request line + headers) larger than this: 431
    header_timeout_s: float = 20.0  # a request head must arrive within this (else 408)
    write_timeout_s: float = 60.0  # a client whose response is stuck unread this long is disconnected
    keep_alive_timeout_s: float = 5.0  # an idle kept-alive client connection is closed after this
    max_unread_events: int = 4096  # worker events a slow streaming client may leave unread (then it ends)
    gather_s: float = 0.05  # a whole response's decode outputs after the first: sent gathered this often
    prepare_thread_bytes: int = 8192  # a request body this long is prepared (tokenized) on a thread (0: never)
    default_max_tokens: int = 256
    # /v1/responses' store (gateway/response_store.py): at most this many responses (0: none stored), each gone once
    # unused this long
    responses_store_max: int = 1000
    responses_store_max_mib: int = 256  # (and at most this many MiB: what they hold in memory)
    responses_store_ttl_s: float = 3600.0
    # Operations
    max_concurrent_requests: int = 0  # 0 = no limit
    max_queued_requests: int = 256
    # Client connections served at once (gateway/http_connections.py: at the cap an idle one is closed for a new
    # one, else probes only); 0: max_concurrent_requests + max_queued_requests + 256 (with a concurrency limit),
    # in any case at most three quarters of ulimit -n (gateway.cli.client_connection_cap)
    max_client_connections: int = 0
    queue_timeout_s: float = 30.0
    drain_timeout_s: float = 30.0
    api_keys: tuple[str, ...] = field(default=(), repr=False)
    admin_api_keys: tuple[str, ...] = field(default=(), repr=False)
    metrics_require_admin: bool = False
    # Origins whose browser pages may call the gateway (CORS, gateway/cors.py): "https://host[:port]" or "*"
    cors_allow_origins: tuple[str, ...] = ()
    # the workers' --api-key: SGLang workers get 'Authorization: Bearer KEY', native ones it in their handshake
    worker_api_key: str | None = field(default=None, repr=False)
    health: HealthConfig = field(default_factory=HealthConfig)

    def __post_init__(self) -> None:
        if self.worker and (self.prefill or self.decode):
            raise ValueError("worker: use either --worker (combined) or --prefill/--decode, not both")
        if not self.worker and not (self.prefill and self.decode):
            raise ValueError("prefill/decode: give at least one --prefill and one --decode URL (or --worker)")
        urls = (*self.prefill, *self.decode, *self.worker)
        if any(is_http_url(url) for url in self.worker):
            raise ValueError("worker: SGLang workers run disaggregated here: give --prefill and --decode URLs")
        for url in urls:
            check_http_url(url) if is_http_url(url) else parse_worker_url(url)
        if self.prefill_bootstrap_ports and len(self.prefill_bootstrap_ports) != len(self.prefill):
            raise ValueError("prefill_bootstrap_ports: one per prefill URL")
        for url, port in zip(self.prefill, self.prefill_bootstrap_ports, strict=False):
            if port is not None and not is_http_url(url):
                raise ValueError(f"prefill: a bootstrap port follows only an SGLang (http://) prefill URL, not {url} "
                                 "(ours report theirs in the handshake)")
        for kind, is_kind in (("SGLang (http://)", is_http_url), ("native (pd://)", lambda u: not is_http_url(u))):
            if any(map(is_kind, self.prefill)) != any(map(is_kind, self.decode)):
                raise ValueError(f"prefill/decode: {kind} workers need at least one prefill and one decode of "
                                 "their kind (a prefill and its decode must speak the same KV protocol)")
        if len({url.rstrip("/") if is_http_url(url) else parse_worker_url(url) for url in urls}) != len(urls):
            raise ValueError("prefill/decode/worker: a worker URL is listed twice")
        for name in ("load_stale_s", "queue_timeout_s", "drain_timeout_s", "body_timeout_s", "header_timeout_s",
                     "write_timeout_s", "keep_alive_timeout_s", "first_token_timeout_s", "stream_idle_timeout_s",
                     "request_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive")
        if not self.startup_timeout_s >= 0 or not self.retry_backoff_s >= 0:
            raise ValueError("startup_timeout_s and retry_backoff_s must be >= 0")
        if not 0 <= self.assume_ttl_s < math.inf:  # (an assumption never expiring: the index only grows)
            raise ValueError("assume_ttl_s must be >= 0 and finite")
        if self.default_max_tokens < 1 or self.max_body_bytes < 1:
            raise ValueError("default_max_tokens and max_body_bytes must be at least 1")
        if self.tokenizer and self.tokenizer != "byte" \
                and not os.path.isfile(os.path.join(self.tokenizer, "tokenizer.json")):
            raise ValueError(f"tokenizer: {self.tokenizer} is neither 'byte' nor a directory with a tokenizer.json")
        if not 0 <= self.gather_s <= 10:
            raise ValueError("gather_s must be in [0, 10]")
        if self.prepare_thread_bytes < 0:
            raise ValueError("prepare_thread_bytes must be >= 0 (0: every request is prepared on the event loop)")
        if self.responses_store_max < 0 or not self.responses_store_ttl_s > 0 or self.responses_store_max_mib < 1:
            raise ValueError("responses_store_max must be >= 0 (0: nothing stored), responses_store_ttl_s positive, "
                             "responses_store_max_mib at least 1")
        if self.max_unread_events < 1:
            raise ValueError("max_unread_events must be at least 1")
        if min(self.max_retries, self.max_migrations, self.max_concurrent_requests, self.max_queued_requests,
               self.max_client_connections) < 0:
            raise ValueError("max_retries, max_migrations, max_concurrent_requests, max_queued_requests and "
                             "max_client_connections must be >= 0")
        if self.max_header_bytes < 1024:
            raise ValueError("max_header_bytes must be at least 1024")
        if any(not k for k in self.api_keys + self.admin_api_keys):
            raise ValueError("api_key: empty keys are not allowed")
        if any(k != k.strip() or not k.isprintable() for k in self.api_keys + self.admin_api_keys):
            # (a request's key is read without the white space around it: such a key could never match)
            raise ValueError("api_key: a key must not start or end with white space, nor hold control characters")
        if self.worker and (self.prefill_policy or self.decode_policy or any(
                o.startswith(("prefill.", "decode.")) for o in self.policy_options)):
            raise ValueError("prefill_policy/decode_policy: combined workers (--worker) are chosen by one policy; "
                             "use --policy and unprefixed --policy-option")
        if self.worker_api_key is not None and (
                not self.worker_api_key or any(c.isspace() or not c.isprintable() for c in self.worker_api_key)):
            raise ValueError("worker_api_key: must be non-empty, without white space or control characters")
        check_origins(self.cors_allow_origins)
        if self.metrics_require_admin and not self.admin_api_keys:
            raise ValueError("metrics_require_admin needs an admin key (--admin-api-key or --admin-api-key-file)")


class Gateway:
    """Runtime state behind the app (separate from the frozen config)."""

    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        self.metrics = GatewayMetrics()
        if config.prefill_policy and config.decode_policy:
            load_policy_class(config.policy)  # (overridden on both sides, a misspelled --policy is still an error)
        self.router = Router.build(config.prefill_policy or config.policy, config.decode_policy or config.policy,
                                   parse_option_args(config.policy_options), assume_ttl_s=config.assume_ttl_s)
        self.is_combined = bool(config.worker)
        self.prefills: list[WorkerClient] = []
        self.decodes: list[WorkerClient] = []
        self.fleet: SGLangFleet | None = None  # SGLang workers over HTTP (gateway/sglang_fleet.py)
        ports = config.prefill_bootstrap_ports or (None,) * len(config.prefill)
        http_prefills = [(url, port) for url, port in zip(config.prefill, ports, strict=True) if is_http_url(url)]
        if http_prefills:
            self.fleet = SGLangFleet(http_prefills, [url for url in config.decode if is_http_url(url)], self.router,
                                     config.health, RelayConfig(
                                         first_byte_timeout_s=config.first_token_timeout_s,
                                         read_timeout_s=config.stream_idle_timeout_s,
                                         request_timeout_s=config.request_timeout_s,
                                         max_retries=config.max_retries, retry_backoff_s=config.retry_backoff_s,
                                         worker_api_key=config.worker_api_key),
                                     load_stale_s=config.load_stale_s)
            self.fleet.on_forgotten = lambda url: self.metrics.worker_failures.forget("worker", url)
        self.dispatcher = Dispatcher(
            self.prefills, self.decodes, self.router,
            DispatchConfig(config.first_token_timeout_s, config.stream_idle_timeout_s, config.request_timeout_s,
                           config.max_retries, config.retry_backoff_s, config.max_migrations,
                           config.max_unread_events, config.gather_s),
            self.metrics, combined=self.is_combined,
        )
        for url in config.prefill:
            if not is_http_url(url):
                self._new_client(url, "prefill")
        for url in config.decode:
            if not is_http_url(url):
                self._new_client(url, "decode")
        for url in config.worker:
            self._new_client(url, "both")
        # The generation routes serve native workers (set once: a gateway started with SGLang workers
        # only relays its routes to them, and native workers added later would get no traffic).
        self.serves_native = bool(self.clients) or self.fleet is None
        self.admission = Admission(config.max_concurrent_requests, config.max_queued_requests,
                                   config.queue_timeout_s, self.metrics)
        self.metrics.add_collector(WorkerCollector(
            lambda: [*self.clients, *(self.fleet.workers if self.fleet is not None else ())], self.router.stats,
            lambda: self.router.num_hook_errors))
        self.frontend: Frontend | None = None
        self._tokenizer_dir: str | None = None  # the worker's tokenizer, fetched (no local copy of the model)
        self._tokenizer_fetch: asyncio.Task[None] | None = None
        self._fetch_failed_from: str | None = None  # the worker whose tokenizer fetch failed last (tried last)
        self._fetch_again_at = 0.0  # (the loop's time) no new fetch before this, after one failed
        self._load_error: str | None = None  # the tokenizer that failed to load last, and why (logged once)
        self.is_draining = False
        self._started = False
        self._tasks: set[asyncio.Task[None]] = set()
        self._refresher: asyncio.Task[None] | None = None

    @property
    def clients(self) -> list[WorkerClient]:
        return self.prefills + self.decodes

    def _new_client(self, url: str, role: str) -> WorkerClient:
        client = WorkerClient(url, role, stale_after_s=self.config.load_stale_s, health=self.config.health,
                              key=self.config.worker_api_key)
        client.on_up = self._worker_up
        client.on_down = self._worker_down
        client.on_kv_events = lambda c, events: self.router.kv_events(c.state, events)
        client.vet = lambda ack: self._same_worker_elsewhere(client, ack)
        # The dispatcher holds these same lists: a worker added here is selectable once it connects.
        (self.prefills if role == "prefill" else self.decodes).append(client)
        selectability_changed()
        return client

    def _same_worker_elsewhere(self, client: WorkerClient, ack: HelloAck) -> str | None:
        """A worker process listed under two URLs that are not the same text (``localhost`` and
        ``127.0.0.1``, a DNS name and its address) is used through the first one that connects: the
        other would double its share of requests and of the fleet's free pages."""
        for other in self.clients:
            if other is not client and other.is_connected and other.info is not None \
                    and other.info.worker_id == ack.worker_id:
                why = f"{client.url} is worker {ack.worker_id}, already connected as {other.url}: not used twice"
                if not (client.last_error or "").endswith(why):  # (once, not at every reconnect)
                    log.warning("%s; remove one of the two URLs", why)
                return why
        return None

    def _check_transfer(self, client: WorkerClient) -> None:
        """A prefill and a decode move KV only over the same backend (``--transfer``): a worker whose backend
        is not that of the others pairs with none of them (every room it takes part in fails, a wasted
        attempt each). Said loudly; it stays in use (which of the two is wrong is not the gateway's to guess:
        refusing the later one locked a whole fleet out behind one stray worker that connected first)."""
        info = client.info
        if info is None or not info.transfer:  # (a combined worker moves no KV; an older worker does not say)
            return
        for other in self.clients:
            if other is not client and other.is_connected and other.info is not None \
                    and other.info.transfer and other.info.transfer != info.transfer:
                log.error("%s worker %s moves KV over %r, %s worker %s over %r: they cannot pair (start every "
                          "worker with the same --transfer)", client.role, client.url, info.transfer, other.role,
                          other.url, other.info.transfer)
                return

    def _worker_up(self, client: WorkerClient) -> None:
        self._check_transfer(client)
        self.router.worker_added(client.state)
        self._check_stop_tokenizer(client)
        frontend, info = self.frontend, client.info
        if frontend is None or info is None:
            return
        if info.max_context < frontend.max_context:  # (longer requests are routed to the others: ``_fitting``)
            log.info("worker %s has a context of %d tokens, less than the fleet's %d: it is given the requests "
                     "that fit it", client.url, info.max_context, frontend.max_context)
        self._follow_max_context()  # (also shorter: the longest worker restarted with less)

    def _worker_down(self, client: WorkerClient) -> None:
        """Its connection closed. The prefix index's entry for its URL goes too, unless that URL is now
        another client's (removed by the admin API and added again before this one's drain ended: the
        new connection's snapshot is the index's now)."""
        current = self.find(client.url)  # (by address: another spelling of it is another key in the index)
        self.router.worker_removed(client.state, drop_index=current is None or current is client
                                   or current.url != client.url)

    def _max_context(self) -> int | None:
        """The longest context the fleet serves: the most tokens (prompt + output) a request may have for some
        pair to take it (the longest context of a combined fleet; of a disaggregated one, the shorter of the
        longest prefill's and the longest decode's); the dispatcher gives each request only to workers whose
        context holds it (``_fitting``). Every worker the gateway was given counts, connected or not: while
        the only one long enough is away (restarting), a request only it could take is a 503 to retry, not a
        400; its handshake, when it comes back, says its context again. (None before any has connected.)"""
        longest: dict[str, int] = {}
        for client in self.clients:
            if client.info is not None:
                role = client.role
                longest[role] = max(longest.get(role, 0), client.info.max_context)
        if not longest:
            return None
        if "prefill" in longest and "decode" in longest:
            return min(longest["prefill"], longest["decode"])
        return max(longest.values())  # (one side only, so far: nothing is served until the other connects)

    def _follow_max_context(self) -> None:
        max_context = self._max_context()
        if self.frontend is not None and max_context is not None and max_context != self.frontend.max_context:
            log.info("the fleet now serves a context of %d tokens", max_context)
            self.frontend.max_context = max_context

    def _tokenizer_source(self) -> WorkerClient | None:
        """The worker whose handshake says which tokenizer to use (and sends it, when this machine has no
        copy): a connected one, a healthy one first, the one whose fetch failed last only after the others."""
        connected = [c for c in self.clients if c.is_connected]
        connected.sort(key=lambda c: (c.url == self._fetch_failed_from, not c.healthy))
        return connected[0] if connected else None

    def _check_stop_tokenizer(self, client: WorkerClient) -> None:
        digest = self.dispatcher.tokenizer_digest
        if client.stops_at_strings and not client.stops_at_strings_as(digest):
            log.warning("worker %s watches stop strings with another tokenizer than this gateway's (tokenizer.json "
                        "digest %s, here %s): the gateway stops its requests at them itself", client.url,
                        client.info.tokenizer_digest if client.info is not None else "?", digest)

    def launch(self) -> asyncio.Task[None]:
        """Connect to the workers and return at once (the server opens its port now: liveness answers and
        SIGTERM is heard while workers are down); the task returned waits for the first of them in the
        background (``_first_workers``). Readiness says 503 until a pair is selectable."""
        self._started = True
        if self.fleet is not None and self.config.tokenizer:
            # SGLang workers tokenize for themselves: a tokenizer here only lets the policies see prompts.
            self.fleet.tokenizer = load_tokenizer(self.config.tokenizer)
        for client in self.clients:
            client.start()
        if self.fleet is not None:
            self.fleet.start()
        self._refresher = asyncio.create_task(self._refresh_load_states(), name="load-freshness")
        task = asyncio.create_task(self._first_workers(), name="first-workers")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(_log_failure)
        return task

    async def start(self) -> None:
        """``launch``, then wait for the first workers (as a server's start-up would if it had to)."""
        await self.launch()

    async def _first_workers(self) -> None:
        """Until every worker is ready, or a pair is, at most ``startup_timeout_s`` (the others join when
        they connect), then the front end from one of them: its tokenizer, fetched when this machine has
        no copy (a request before that makes it itself, ``require_frontend``)."""
        timeout_s = self.config.startup_timeout_s
        pending = {asyncio.ensure_future(c.wait_ready(timeout_s)) for c in self.clients}
        if self.fleet is not None:
            pending.add(asyncio.ensure_future(self.fleet.wait_ready(timeout_s)))
        try:
            while pending and not self.is_ready():
                _, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiting in pending:
                waiting.cancel()
        if not self.clients or self.frontend is not None:  # (made meanwhile for a request: ``require_frontend``)
            return
        source = self._tokenizer_source()
        if source is None:
            if not self.is_ready():  # (else SGLang workers serve meanwhile)
                log.warning("no worker answered within %.0fs; serving 503 until one does", timeout_s)
            return
        # One fetch at a time (``_tokenizer_fetch``): a request's under way is waited for, one started here is
        # what a request meanwhile waits for.
        fetch = self._tokenizer_fetch
        if fetch is None or fetch.done():
            self._tokenizer_fetch = fetch = asyncio.create_task(self._fetch_tokenizer_quietly(source),
                                                                name="tokenizer-fetch")
        await asyncio.wait({fetch})
        if self.frontend is None:
            with contextlib.suppress(NoWorkers):  # (a tokenizer that does not load: logged; requests get a 503)
                self._init_frontend(source)

    async def _fetch_tokenizer(self, client: WorkerClient) -> None:
        """A worker's tokenizer directory that is not on this machine comes from the worker itself."""
        info = client.info
        if info is None or self.config.tokenizer or self._tokenizer_dir or not needs_fetch(info.tokenizer, info):
            return
        try:
            self._tokenizer_dir = await fetch_tokenizer(client.host, client.port, TOKENIZER_FETCH_TIMEOUT_S,
                                                        client.key)
        except RemoteTokenizerError:
            self._fetch_failed_from = client.url  # (the next try asks another worker first, if there is one)
            self._fetch_again_at = asyncio.get_running_loop().time() + FETCH_RETRY_S  # (not at every request)
            raise
        log.info("tokenizer %s fetched from worker %s into %s", info.tokenizer, client.url, self._tokenizer_dir)

    async def _fetch_tokenizer_quietly(self, client: WorkerClient) -> None:
        try:
            await self._fetch_tokenizer(client)
        except RemoteTokenizerError as exc:
            log.warning("%s; serving 503 until a worker sends it", exc)

    def _init_frontend(self, client: WorkerClient) -> None:
        info = client.info
        assert info is not None
        if not self.config.tokenizer and self._tokenizer_dir is None and needs_fetch(info.tokenizer, info):
            loop = asyncio.get_running_loop()
            if (self._tokenizer_fetch is None or self._tokenizer_fetch.done()) and loop.time() >= self._fetch_again_at:
                self._tokenizer_fetch = loop.create_task(self._fetch_tokenizer_quietly(client), name="tokenizer-fetch")
            raise NoWorkers(f"fetching the tokenizer from worker {client.url}", retry_after_s=1.0)
        spec = self.config.tokenizer or self._tokenizer_dir or info.tokenizer
        try:
            tokenizer = load_tokenizer(spec)
        except (OSError, ValueError) as exc:  # (a missing or malformed tokenizer.json: ``TokenizerLoadError``)
            why = f"cannot load the tokenizer {spec} (named by worker {client.url}): {exc}"
            if why != self._load_error:  # (once, not for every request)
                self._load_error = why
                log.error("%s; serving 503 until it loads", why)
            raise NoWorkers(why, retry_after_s=5.0) from None
        self._load_error = None
        self.dispatcher.tokenizer_digest = tokenizer_digest(spec)
        for connected in self.clients:
            if connected.info is not None:
                self._check_stop_tokenizer(connected)
        max_context = self._max_context()
        assert max_context is not None  # (``client`` has connected)
        self.frontend = Frontend(self.dispatcher, tokenizer, self.config.model_name or info.model, max_context,
                                 self.config.default_max_tokens)

    @property
    def max_body_bytes(self) -> int:
        return self.config.max_body_bytes

    @property
    def body_timeout_s(self) -> float:
        return self.config.body_timeout_s

    def require_frontend(self) -> Frontend:
        if self.frontend is None:
            source = self._tokenizer_source()
            if source is None:
                raise NoWorkers("no worker is connected yet", retry_after_s=2.0)
            self._init_frontend(source)
        assert self.frontend is not None
        return self.frontend

    # -- membership (admin API) -----------------------------------------------------------------
    def find(self, url: str) -> WorkerClient | None:
        """The worker at ``url``, however it is spelled (``parse_worker_url``)."""
        try:
            address = parse_worker_url(url)
        except ValueError:
            return None
        return next((c for c in self.clients if (c.host, c.port) == address), None)

    def add_worker(self, url: str, role: str) -> WorkerClient:
        """Start routing to a new worker (it becomes selectable once connected and healthy)."""
        parse_worker_url(url)
        if not self.serves_native:
            raise ValueError("this gateway was started with SGLang (http://) workers only and relays its routes "
                             "to them; start it with a native worker too to serve both kinds")
        if role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
        if (role == "both") != self.is_combined:
            mode = "combined (--worker)" if self.is_combined else "disaggregated (--prefill/--decode)"
            raise ValueError(f"this gateway runs {mode} workers; a {role} worker does not fit")
        existing = self.find(url)
        if existing is not None:
            if existing.is_draining:
                raise ValueError(f"worker {url} is being removed; add it again once it is gone")
            raise ValueError(f"worker {url} is already configured (as {existing.role})")
        client = self._new_client(url, role)
        if self._started:
            client.start()
        log.info("added %s worker %s", role, url)
        return client

    def remove_worker(self, url: str) -> WorkerClient:
        """Drain a worker: no new requests; once its open ones end, close and forget it."""
        client = self.find(url)
        if client is None:
            raise KeyError(url)
        if not client.is_draining:
            client.is_draining = True
            log.info("removing %s worker %s (%d requests open)", client.role, url, client.num_active)
            task = asyncio.create_task(self._drain_worker(client), name=f"drain-worker {url}")
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        return client

    async def _drain_worker(self, client: WorkerClient) -> None:
        deadline = asyncio.get_running_loop().time() + self.config.drain_timeout_s
        while client.num_active and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
        for pool in (self.prefills, self.decodes):
            if client in pool:
                pool.remove(client)
        selectability_changed()
        WorkerState.shape_epoch += 1  # (the dispatcher's pool floors are looked at again without it)
        with contextlib.suppress(Exception):  # (closing announces on_worker_removed if it was up)
            # Requests still open past the drain timeout: dropped by the worker as its connection closes,
            # and continued on other workers here (migrated, retried), as after a lost connection.
            await client.aclose("removed by the admin API (its drain timeout passed)")
        current = self.find(client.url)  # (added again meanwhile, under the same URL: its place stays its own)
        if current is None or current.url != client.url:
            self.router.worker_forgotten(client.url)
            self.metrics.worker_failures.forget("worker", client.url)  # (URLs may never come back: pod IPs)
        self._follow_max_context()  # (the longest worker gone: shorter requests only from now on)
        log.info("removed %s worker %s", client.role, client.url)

    # -- shutdown ---------------------------------------------------------------------------------
    def begin_drain(self) -> None:
        """SIGTERM: refuse new requests (503, Connection: close); open ones carry on."""
        if not self.is_draining:
            self.is_draining = True
            log.warning("draining: %d requests in flight", self.admission.num_active)

    async def _refresh_load_states(self) -> None:
        """Workers report on change; a silent one must still turn stale (then own counts are used)."""
        while True:
            await asyncio.sleep(REFRESH_INTERVAL_S)
            for client in self.clients:
                client.state.refresh()
            for worker in self.fleet.workers if self.fleet is not None else ():
                worker.state.refresh()

    @property
    def has_native_workers(self) -> bool:
        return bool(self.clients) or self.fleet is None

    def is_ready(self) -> bool:
        """A healthy pair (or combined worker) is selectable, of either kind."""
        return (self.fleet is not None and self.fleet.is_ready()) or (
            self.has_native_workers and self.dispatcher.is_ready())

    def serves(self) -> bool:
        """``is_ready``, and a request would be answered now (readiness): native workers also need the front
        end, which is made here when it can be at once (its tokenizer loaded; not while it is being fetched)."""
        if self.fleet is not None and self.fleet.is_ready():
            return True
        if not (self.has_native_workers and self.dispatcher.is_ready()):
            return False
        if self.frontend is None:
            with contextlib.suppress(NoWorkers):
                self.require_frontend()
        return self.frontend is not None

    async def aclose(self) -> None:
        if self.fleet is not None:
            await self.fleet.aclose()
        tasks = [t for t in (self._refresher, self._tokenizer_fetch, *self._tasks) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.gather(*(c.aclose() for c in self.clients), return_exceptions=True)


def _log_failure(task: asyncio.Task[None]) -> None:
    """``_first_workers``' unexpected end, in the log at once (not at garbage collection, or never)."""
    if not task.cancelled() and task.exception() is not None:
        log.error("waiting for the first workers failed; the front end is made at the first request instead",
                  exc_info=task.exception())
