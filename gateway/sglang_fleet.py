"""The SGLang workers behind the gateway (``http://`` worker URLs) and the HTTP connections to them.

Lifecycle:
1. ``SGLangFleet(prefills, decodes, router, health, config)``; ``start()`` opens the relay's pool
   (``gateway.worker_http.HttpPool``: keep-alive connections bounded per worker, TCP_NODELAY, connect and request
   timeouts; 3-4x cheaper per POST than aiohttp, ``loadtests/bench_http_client.py``, docs/interop.md), an aiohttp
   session for the checks below (a pool of its own, so that they never wait behind relayed requests)
   and one probe task per worker: ``GET /health`` every ``probe_interval_s``, unhealthy after
   ``unhealthy_after`` failures, healthy after ``healthy_after`` passes; the router hears joins and
   leaves. After each passed probe, ``GET /v1/loads`` (where the worker serves it) becomes the
   worker's load report for the policies. The served model name is the first worker's
   ``/get_model_info`` (``served_model_name`` or ``model_path``). A request sent again because it crossed a
   worker's close of the idle pooled connection it went out on (``crossed_idle_close``) goes on a new connection
   of the same pool, within its limit per worker (``HttpPool.post(fresh=True)``).
2. ``select()`` gives the requests of ``gateway/sglang_relay.py`` a (prefill, decode) pair from the
   router's policies, over ``HttpWorker.state`` views (the gateway's own open requests on top).
3. ``add(url, role, bootstrap_port)`` / ``remove(url, drain_timeout_s)`` (the admin API): a worker added
   gets its probe (selectable once it passes); one removed leaves selection at once, and once its open
   requests end (or the drain timeout passes: they go on, their connections are not cut) its probe
   stops and the router forgets it.
4. ``aclose()``: stop the probes, close the pool and the session.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import logging
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import aiohttp
import msgspec

from gateway.errors import APIError, NoWorkers
from gateway.health import HealthConfig, WorkerHealth
from gateway.sglang_routing import ROUTING_PAGE_TOKENS
from gateway.worker_http import HttpPool
from gateway.worker_state import DEFAULT_STALE_AFTER_S, WorkerState
from workers.protocol import LoadReport

if TYPE_CHECKING:
    from gateway.policies.base import Pair, RequestInfo
    from gateway.router import Router
    from gateway.tokenizer import Tokenizer

log = logging.getLogger(__name__)


def is_http_url(url: str) -> bool:
    return url.startswith(("http://", "https://"))


def check_http_url(url: str) -> None:
    """ValueError for a URL that cannot be an SGLang worker's: its routes are appended to it, so a port that is not
    one (out of range, 0, empty), a query or a fragment could never be probed nor relayed to."""
    bad = ValueError(f"SGLang worker URL must look like http://HOST:PORT, got {url!r}")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:  # (not a number, out of range, a bracket left open)
        raise bad from None
    if not url.isprintable() or parts.scheme not in ("http", "https") or not parts.hostname:  # (urlsplit drops \n)
        raise bad
    if (port is None and parts.netloc.rpartition("]")[2].count(":")) or port == 0 or parts.query or parts.fragment \
            or "?" in url or "#" in url:
        raise bad
    if parts.username is not None or parts.password is not None:  # (they would show in /health, metrics, logs)
        raise ValueError(f"SGLang worker URL must not carry credentials, got one for {parts.hostname}")


class AlreadyThere(ValueError):
    """``SGLangFleet.add``: the worker is configured already, or still being removed."""


# SGLang's ``GET /health`` is its ``health_generate``: a one-token generation, answered 200 a second (or more
# seconds, on a busy worker) later; its router waits 5 s. A shorter probe timeout fails busy, healthy workers.
SGLANG_MIN_HEALTH_TIMEOUT_S = 5.0


def sglang_health_timeout_s(health: HealthConfig) -> float:
    """How long an SGLang worker's ``GET /health`` may take before it counts as a failed probe."""
    return max(health.probe_timeout_s, SGLANG_MIN_HEALTH_TIMEOUT_S)


PROBE_CONNECTIONS_PER_WORKER = 4  # the checks' own pool (health, loads, model): at most this many per worker
# An idle connection to a worker is kept this long, less than uvicorn's keep-alive (5 s: SGLang's server and our
# workers' HTTP side): one kept longer is closed by the worker, and a request sent on it as its close crosses the
# request on the wire fails (``worker_http.Disconnected``). That is not enough alone: a worker may keep connections
# less long (``--http-keep-alive-timeout-s``) or close an idle one at any age (its connection cap), so such a
# request is sent once more on a fresh connection (``crossed_idle_close``; ``HttpPool.post(fresh=True)``).
WORKER_KEEPALIVE_S = 4.0


@dataclass(frozen=True)
class RelayConfig:
    """Timeouts, retries and pool size of the gateway's requests to SGLang workers."""

    first_byte_timeout_s: float = 300.0  # streams: until the decode's response starts
    read_timeout_s: float = 120.0  # streams: between reads of the decode's body
    request_timeout_s: float = 1800.0  # the whole request, its attempts and backoffs included (a non-streamed
    # decode answers at its end)
    connect_timeout_s: float = 10.0
    max_retries: int = 2
    retry_backoff_s: float = 0.05
    max_connections_per_worker: int = 256
    # Sent as ``Authorization: Bearer KEY`` with every request to the workers (SGLang's ``--api-key``);
    # kept out of the dataclass's repr so that it never reaches a log.
    worker_api_key: str | None = field(default=None, repr=False)


class HttpWorker:
    """One SGLang worker: its URL, role, bootstrap port (prefill), health and the router's view."""

    def __init__(self, url: str, role: str, bootstrap_port: int | None, health: HealthConfig,
                 load_stale_s: float = DEFAULT_STALE_AFTER_S) -> None:
        check_http_url(url)
        self.url = url.rstrip("/")
        self.role = role
        self.bootstrap_port = bootstrap_port
        host = urlsplit(url).hostname or ""
        self.bootstrap_host = f"[{host}]" if ":" in host else host
        # Loads are polled after each passed probe (``/health``, up to its own timeout, at least
        # ``SGLANG_MIN_HEALTH_TIMEOUT_S``: a busy worker's one-token generation; then ``/v1/loads``, up to the probe
        # timeout; then the interval): a report is not stale before the next poll is due.
        self.state = WorkerState(self.url, role, self, stale_after_s=max(
            load_stale_s, health.probe_interval_s + sglang_health_timeout_s(health) + health.probe_timeout_s))
        self.state.page_size = ROUTING_PAGE_TOKENS  # (no handshake to say; prefixes and loads count in these)
        self.health = WorkerHealth(health)
        self.is_up = False  # passing /health probes
        self.has_loads: bool | None = None  # serves /v1/loads (None: not known yet, or down since it said)
        self.is_draining = False  # being removed (the admin API): never selected again
        self.last_error: str | None = None
        self.num_resent = 0  # requests sent again, once, on a fresh connection: they crossed its close of an idle one
        self.addresses: frozenset[tuple[str, int, str]] = frozenset()  # where its URL leads (its last passed probe's)
        self._rids = 0
        # Our requests opened here that have not gone out to it yet (waiting for a free connection, a prefill's for
        # its decode's to go out), in rid order: a load report polled now cannot count them.
        self._unsent: dict[int, None] = {}

    @property
    def healthy(self) -> bool:
        return self.is_up and self.health.is_selectable and not self.is_draining

    @property
    def available(self) -> bool:
        """``healthy``, or only waiting for its half-open breaker's trials to end (readiness: not per request, as
        ``WorkerClient.available``)."""
        return self.is_up and self.health.is_available and not self.is_draining

    @property
    def is_connected(self) -> bool:
        return self.is_up

    @property
    def last_rid(self) -> int:
        """The newest of our requests a load report asked for now counts: every one opened up to it has gone out to
        the worker (or ended). Those after it stay counted on top of the report (``WorkerState.reported``)."""
        return next(iter(self._unsent)) - 1 if self._unsent else self._rids

    def opened(self, prefill_tokens: int = 0, pages: int = 0) -> int:
        """A request sent to this worker, costing it ``prefill_tokens`` / ``pages`` until ``closed``."""
        rid = self._rids = self._rids + 1
        self._unsent[rid] = None
        self.state.dispatched(rid, prefill_tokens, pages)
        breaker = self.health.breaker
        if not breaker.closed:  # half-open: a trial (``CircuitBreaker.trials``), until ``closed``
            breaker.trial_started(rid)
        return rid

    def sent(self, rid: int) -> None:
        """Request ``rid``'s head has gone out to the worker: a load report polled from now on may count it."""
        self._unsent.pop(rid, None)

    def sent_callback(self, rid: int) -> Callable[[object], object]:
        """``sent(rid)`` as a future's done callback (``_unsent.pop`` bound in C, the future its unused default: no
        Python frame when it runs)."""
        return functools.partial(self._unsent.pop, rid)

    def closed(self, rid: int) -> None:
        self._unsent.pop(rid, None)
        self.state.ended(rid)
        self.health.breaker.trials.discard(rid)


class SGLangFleet:
    """The SGLang workers behind the gateway and the HTTP connections to them."""

    def __init__(self, prefills: list[tuple[str, int | None]], decodes: list[str], router: Router,
                 health: HealthConfig, config: RelayConfig | None = None,
                 load_stale_s: float = DEFAULT_STALE_AFTER_S) -> None:
        self._health_config, self._load_stale_s = health, load_stale_s
        self.prefills = [HttpWorker(url, "prefill", port, health, load_stale_s) for url, port in prefills]
        self.decodes = [HttpWorker(url, "decode", None, health, load_stale_s) for url in decodes]
        self.router = router
        self.config = config or RelayConfig()
        self.model_name: str | None = None
        self.tokenizer: Tokenizer | None = None  # --tokenizer: prompts tokenized for routing only
        # The relayed requests' keep-alive connections. A request that crossed a worker's close of its idle pooled
        # connection goes again on a new connection (``crossed_idle_close``, ``post(fresh=True)``): none of the idle
        # ones, where more the worker closed may wait (a keep-alive ending closes every connection idle as long; a
        # restart, all of them), but within the pool's limit per worker.
        self.pool: HttpPool | None = None
        # The workers' health, load and model checks: a pool of their own, so that they never wait for a
        # connection behind relayed requests (a worker with its pool full of streams failed its probes).
        self._checks: aiohttp.ClientSession | None = None
        self._probes: dict[HttpWorker, asyncio.Task[None]] = {}
        self._drains: set[asyncio.Task[None]] = set()
        # Called with a removed worker's URL once no worker has it (its per-worker metric series go with it)
        self.on_forgotten: Callable[[str], None] | None = None

    @property
    def workers(self) -> list[HttpWorker]:
        return self.prefills + self.decodes

    def is_ready(self) -> bool:
        """A selectable pair, or one only waiting for a half-open breaker's trials to answer (they do not flap it)."""
        return any(w.available for w in self.prefills) and any(w.available for w in self.decodes)

    def start(self) -> None:
        """The HTTP client pool and the probes (``wait_ready``: until a pair answers)."""
        cfg = self.config
        # (identity: the relay passes the workers' bytes on as they are, so they must not come compressed)
        headers = {"Accept-Encoding": "identity"}
        if cfg.worker_api_key:
            headers["Authorization"] = f"Bearer {cfg.worker_api_key}"
        posts = {**headers, "Content-Type": "application/json"}  # (the relay's requests: the client's JSON body)
        self.pool = HttpPool(limit_per_host=cfg.max_connections_per_worker, timeout_s=cfg.request_timeout_s,
                             connect_timeout_s=cfg.connect_timeout_s, keepalive_s=WORKER_KEEPALIVE_S, headers=posts)
        self._checks = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, limit_per_host=PROBE_CONNECTIONS_PER_WORKER,
                                           keepalive_timeout=WORKER_KEEPALIVE_S),
            skip_auto_headers=("User-Agent",), headers=headers)
        for worker in self.workers:
            self._start_probe(worker)

    def _start_probe(self, worker: HttpWorker) -> None:
        # (a context of its own: not the admin API request's, whose id its log lines would carry for good)
        self._probes[worker] = asyncio.create_task(self._probe_loop(worker), name=f"sglang-probe {worker.url}",
                                                   context=contextvars.Context())

    def find(self, url: str) -> HttpWorker | None:
        url = url.rstrip("/")
        return next((w for w in self.workers if w.url == url), None)

    def add(self, url: str, role: str, bootstrap_port: int | None) -> HttpWorker:
        """Start routing to a new SGLang worker (selectable once it passes a probe). ValueError: a bad URL or
        role (``AlreadyThere``: a worker there already, checked first)."""
        existing = self.find(url)
        if existing is not None:
            why = "is being removed; add it again once it is gone" if existing.is_draining else "is already configured"
            raise AlreadyThere(f"worker {existing.url} {why}")
        if role not in ("prefill", "decode"):
            raise ValueError(f"an SGLang worker's role must be prefill or decode, got {role!r}")
        if role == "decode" and bootstrap_port is not None:
            raise ValueError("bootstrap_port is a prefill's")
        worker = HttpWorker(url, role, bootstrap_port, self._health_config, self._load_stale_s)
        (self.prefills if role == "prefill" else self.decodes).append(worker)
        if self.pool is not None:  # (started: else ``start`` gives it its probe)
            self._start_probe(worker)
        log.info("added SGLang %s worker %s", role, worker.url)
        return worker

    def remove(self, url: str, drain_timeout_s: float) -> HttpWorker:
        """Drain an SGLang worker (see the module doc). KeyError: no such worker."""
        worker = self.find(url)
        if worker is None:
            raise KeyError(url)
        if not worker.is_draining:
            worker.is_draining = True
            log.info("removing SGLang %s worker %s (%d requests open)", worker.role, worker.url,
                     worker.state.num_active)
            task = asyncio.create_task(self._drain(worker, drain_timeout_s), name=f"sglang-drain {worker.url}")
            self._drains.add(task)
            task.add_done_callback(self._drains.discard)
        return worker

    async def _drain(self, worker: HttpWorker, timeout_s: float) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while worker.state.num_active and loop.time() < deadline:
            await asyncio.sleep(0.05)
        probe = self._probes.pop(worker, None)
        if probe is not None:
            probe.cancel()
            await asyncio.gather(probe, return_exceptions=True)
        pool = self.prefills if worker.role == "prefill" else self.decodes
        if worker in pool:
            pool.remove(worker)
        if worker.is_up:
            worker.is_up = False
            self.router.worker_removed(worker.state)
        if self.find(worker.url) is None:  # (not added again meanwhile)
            self.router.worker_forgotten(worker.url)
            if self.on_forgotten is not None:
                self.on_forgotten(worker.url)
        log.info("removed SGLang %s worker %s", worker.role, worker.url)

    async def wait_ready(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while not self.is_ready() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if not self.is_ready():
            log.warning("no SGLang prefill + decode pair answered /health within %.0fs; serving 503 until one does",
                        timeout_s)
        return self.is_ready()

    async def aclose(self) -> None:
        tasks = [*self._probes.values(), *self._drains]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for worker in self.workers:  # (the policies hear of every worker that was up, as of native ones)
            if worker.is_up:
                worker.is_up = False
                self.router.worker_removed(worker.state)
        if self.pool is not None:
            self.pool.close()
        if self._checks is not None:
            await self._checks.close()

    async def _probe_loop(self, worker: HttpWorker) -> None:
        assert self._checks is not None
        config = worker.health.config
        health_timeout = aiohttp.ClientTimeout(total=sglang_health_timeout_s(config))
        while True:
            try:
                async with self._checks.get(f"{worker.url}/health", timeout=health_timeout) as reply:
                    data = await reply.read()
                    ok, reason = reply.status == 200, f"/health answered {reply.status}"
                    if reply.status in (401, 403):
                        reason += (" (wrong --worker-api-key)" if self.config.worker_api_key else
                                   " (the worker wants a key: --worker-api-key)")
                if ok:
                    ok, reason = _is_what_it_was_added_as(worker, data)
                if ok:
                    ok, reason = await self._is_not_a_twin(worker)
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
            # Up on a passed probe, down when the probe thresholds say so (a worker starts probe-healthy).
            healthy = worker.health.is_probe_healthy and (worker.is_up or ok)
            if healthy != worker.is_up:
                worker.is_up = healthy
                if not healthy:  # (what comes back, restarted or upgraded, may serve /v1/loads: asked again)
                    worker.has_loads = None
                log.log(logging.INFO if healthy else logging.WARNING, "SGLang %s worker %s is %s", worker.role,
                        worker.url, "up" if healthy else f"unhealthy: {reason}")
                (self.router.worker_added if healthy else self.router.worker_removed)(worker.state)
            await asyncio.sleep(config.probe_interval_s)

    async def _is_not_a_twin(self, worker: HttpWorker) -> tuple[bool, str]:
        """A worker whose URL reaches the same server as one of its role listed before it (``http://localhost:P``
        next to ``http://127.0.0.1:P``) would be selected twice as often as it should: it is never up."""
        worker.addresses = await _addresses(worker.url)  # (each time: a worker moves, its old address is reused)
        for other in self.prefills if worker.role == "prefill" else self.decodes:
            if other is worker:
                return True, ""
            if not other.is_draining and other.addresses and worker.addresses & other.addresses:
                other.addresses = await _addresses(other.url)  # (confirmed where it leads now: it may have moved)
            if not other.is_draining and other.addresses and worker.addresses & other.addresses:
                address, port, path = min(worker.addresses & other.addresses)
                return False, f"the same worker as {other.url} (both lead to {address}:{port}{path})"
        return True, ""

    async def _poll_load(self, worker: HttpWorker) -> None:
        """``GET /v1/loads`` into the worker's routing view, where the worker has it (a 404 stops asking)."""
        assert self._checks is not None
        last_rid = worker.last_rid  # our requests that went out before this poll are counted in its answer
        try:
            async with self._checks.get(f"{worker.url}/v1/loads?include=core",
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
            state.num_total_pages = report.num_total_pages
            state.reported(report)

    async def _learn_model(self, worker: HttpWorker) -> None:
        """The name clients use: ``served_model_name`` (our workers' ``/get_model_info``), else the first model of
        ``/v1/models`` (SGLang's ``/get_model_info`` has no ``served_model_name``: its ``model_path`` is the
        directory, not the ``--served-model-name`` its clients send), else ``model_path``."""
        info = await self._get_json(worker, "/get_model_info")
        info = info if isinstance(info, dict) else {}
        name = info.get("served_model_name")
        if not (isinstance(name, str) and name):
            models = await self._get_json(worker, "/v1/models")
            data = models.get("data") if isinstance(models, dict) else None
            first = data[0] if isinstance(data, list) and data and isinstance(data[0], dict) else {}
            name = first.get("id") or info.get("model_path")
        if isinstance(name, str) and name:
            self.model_name = name

    async def _get_json(self, worker: HttpWorker, path: str) -> Any:
        assert self._checks is not None
        try:
            async with self._checks.get(f"{worker.url}{path}", timeout=aiohttp.ClientTimeout(total=5)) as reply:
                return msgspec.json.decode(await reply.read()) if reply.status == 200 else None
        except (aiohttp.ClientError, TimeoutError, OSError, msgspec.DecodeError):
            return None

    def select(self, request: RequestInfo, avoid: set[HttpWorker]) -> tuple[Pair, HttpWorker, HttpWorker]:
        """A healthy pair for one attempt (avoiding the workers that failed it before, while others are up): the
        policy's ``Pair`` (what its ``on_finish`` hears of again), its prefill and its decode; the prompt counts as
        cached on the chosen prefill for a moment (``Router.dispatched``)."""
        if avoid:
            prefills, decodes = _pick(self.prefills, avoid), _pick(self.decodes, avoid)
        else:  # (a request's first attempt: nothing to avoid)
            prefills = [w.state for w in self.prefills if w.healthy]
            decodes = [w.state for w in self.decodes if w.healthy]
        if not prefills or not decodes:
            raise NoWorkers(f"no healthy SGLang {'decode' if prefills else 'prefill'} worker", retry_after_s=1.0)
        router = self.router
        pair = router.pick(prefills, decodes, request)  # (the native path's checks: ``Dispatcher._select``)
        if pair.prefill is None:
            raise APIError(f"routing policy {router.name} chose no prefill worker for a disaggregated fleet")
        prefill = router.client_of(pair.prefill, prefills, HttpWorker)
        decode = router.client_of(pair.decode, decodes, HttpWorker)
        router.dispatched(pair, request)
        return pair, prefill, decode


def _pick(pool: list[HttpWorker], avoid: set[HttpWorker]) -> list[WorkerState]:
    """``pool``'s healthy workers (their views) but those in ``avoid``; all the healthy ones when that leaves none."""
    healthy = [w for w in pool if w.healthy]
    return [w.state for w in healthy if w not in avoid] or [w.state for w in healthy]


def _is_what_it_was_added_as(worker: HttpWorker, health: bytes) -> tuple[bool, str]:
    """Our own workers and gateways name their role in their ``/health`` body (SGLang's workers do not): a
    gateway, or a worker of the other role, given as this worker is not one (the gateway's own URL as a decode
    relayed every request it got back into itself)."""
    try:
        role = msgspec.json.decode(health).get("role") if health.startswith(b"{") else None
    except (msgspec.DecodeError, AttributeError):
        role = None
    if not isinstance(role, str) or role == worker.role:
        return True, ""
    what = "a pd-gateway, not a worker" if role == "gateway" else f"a {role} worker, not a {worker.role}"
    return False, f"{worker.url} is {what}"


async def _addresses(url: str) -> frozenset[tuple[str, int, str]]:
    """Where ``url`` leads: (address, port, path) for each address its host resolves to now (none when it does
    not; the path tells apart the workers behind one proxy)."""
    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(parts.hostname, port, type=socket.SOCK_STREAM)
    except OSError:
        return frozenset()
    path = parts.path.rstrip("/")
    return frozenset((str(info[4][0]), port, path) for info in infos)


def load_report_of(loads: Any, last_rid: int) -> LoadReport | None:
    """``/v1/loads``' ranks summed into one ``LoadReport`` (KV tokens counted in pages of
    ``ROUTING_PAGE_TOKENS``)."""
    if not isinstance(loads, list) or not loads or not all(isinstance(r, dict) for r in loads):
        return None

    def total(key: str) -> int:
        return sum(int(r.get(key) or 0) for r in loads)

    try:
        capacity, used = total("max_total_num_tokens"), total("num_used_tokens")
        return LoadReport(num_running=total("num_running_reqs"), num_waiting=total("num_waiting_reqs"),
                          num_free_pages=max(0, capacity - used) // ROUTING_PAGE_TOKENS,
                          num_total_pages=capacity // ROUTING_PAGE_TOKENS,
                          num_prefill_tokens=max(0, total("num_total_tokens") - used), last_rid=last_rid,
                          max_running=total("max_running_requests"))
    except (TypeError, ValueError):
        return None
