"""Clients of the bootstrap registry used by our workers.

Prefill side, ``BootstrapRegistrar`` (async, owned by the prefill worker's event loop):
1. ``await start()`` PUTs the rank's registration, retrying with capped exponential backoff and
   jitter on connection errors, 5xx and 409 until it succeeds or ``start_timeout_s`` passes
   (then ``BootstrapError``); 400/401/403/404/405/410/413 fail at once (retrying cannot help), and a 409
   ``instance_conflict`` that lasts ``INSTANCE_CONFLICT_GIVE_UP_S`` (another live process has this instance id).
   A 409 that says when a retry can succeed (``retry_after_s`` in its body, else ``Retry-After``: a restart's
   dead predecessor stops holding the rank then) is retried right then (+ ``CONFLICT_RETRY_MARGIN_S``), not on
   the backoff, which would register up to its 2 s cap late. A ``start()`` that ended without registering
   (cancelled, given up) while a PUT it sent went unanswered leaves ``aclose`` a goodbye to send all the same:
   that PUT may still reach the registry and register the rank, a ghost decodes would look up.
2. A named task (``bootstrap-heartbeat-...``) re-PUTs every ``interval_s``; each PUT renews the
   lease, and after a registry restart the next PUT registers the rank again. Failures are
   logged and retried on the next beat; ``is_registered`` tells whether the last PUT succeeded.
3. ``await drain()`` (optional, a prefill stopping with a drain timeout): PUTs the registration with
   ``"draining": true`` and re-sends it on every beat from then on. The registry keeps answering look-ups of the
   rank (decodes holding rooms for it still find it) and lists it as leaving. A registry that does not confirm the
   state (an older one, SGLang's: ``OK`` instead of ``{"draining": true}``) gets ``aclose``'s goodbye at once
   instead, as before. A rank another process has taken over (409) is not taken back, but the draining PUT is
   re-sent on every beat until ``aclose`` (the drain's end bounds it): should that process go without a goodbye (a
   registry restarted mid-drain, a successor that died), its lease lapses and the next beat makes this prefill
   findable again for the rooms it still holds.
4. ``await aclose()`` stops the heartbeat, sends a best-effort ``DELETE /route`` (so decodes see
   the instance go not-ready at once instead of after the TTL) and closes its HTTP client. A renewal PUT in
   flight is awaited first (up to ``PUT_SETTLE_TIMEOUT_S``), not cancelled: a cancelled one may still reach the
   registry after the goodbye and bring the entry back. Our registry refuses such a late PUT of a ``registrant``
   that said goodbye (410 ``deregistered``, which ``start`` treats as fatal and a heartbeat as the end).

Decode side, ``BootstrapResolver`` (sync, thread-safe, shared by the KV-transfer threads):
1. ``topology(host, port, instance_id)`` and ``resolve(...)`` GET ``/route`` (``http://host:port/route``, as
   SGLang's prefills announce their registry; a registry the resolver was given in full, ``registries``,
   e.g. an ``https://`` one behind a proxy with a path, is asked at its own URL) and cache replies for
   ``cache_ttl_s``; errors are never cached. 503 raises ``BootstrapNotReady``, no reply raises
   ``BootstrapUnreachable``, anything else unexpected ``BootstrapError``. The token goes only to the
   ``registries`` the resolver was given (at their addresses as written and as their host names resolve
   when it is made; a ``bootstrap_host`` spelled otherwise that resolves to one of those addresses is asked
   at that registry's own URL): a request names its ``bootstrap_host`` itself, and anyone who can reach a
   decode's ports could otherwise have it hand the token (the registry's write key) to a host of their
   choosing. A registry elsewhere is asked without it (SGLang's and our embedded ones guard writes only).
   When the registry does not
   answer at all, or answers that the instance is not registered (a registry restarted empty, until
   the prefill's next heartbeat), a reply that expired less than ``stale_if_unreachable_s`` ago
   answers instead (a registry restart must not fail every room of prefills that have not moved; a
   prefill that is really gone refuses the connection, and the caller then ``invalidate``s). Such a
   reply then answers without asking for ``cache_ttl_s`` more (a registry that times out instead of
   refusing cost every look-up ``timeout_s`` before the stale reply).
   ``cached_topology(...)`` / ``cached_address(...)`` answer from the cache alone (None on a miss):
   they never block, so a caller on a hot thread can skip a hand-off to a thread that may.
2. ``invalidate(host, port, instance_id)`` drops the cached replies of one prefill instance (call
   it when a transfer to it fails). ``close()`` closes the one HTTP client.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import random
import socket
import threading
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any
from urllib.parse import urlsplit

import httpx
import msgspec

from bootstrap.config import is_sendable_token
from bootstrap.embedded import EmbeddedRegistry, serve_embedded
from bootstrap.exceptions import BootstrapError, BootstrapNotReady, BootstrapUnreachable
from bootstrap.messages import DEFAULT_BOOTSTRAP_PORT, FOLLOW_BOOTSTRAP_ROOM, RankAddress, Topology
from transfer.netaddr import join_host_port

__all__ = [
    "BootstrapError",
    "BootstrapNotReady",
    "BootstrapRegistrar",
    "BootstrapResolver",
    "BootstrapUnreachable",
    "EmbeddedRegistry",
    "RankRegistration",
    "Topology",
    "check_compatible",
    "check_read_access",
    "serve_embedded",
]

logger = logging.getLogger("bootstrap.client")

_ENCODER = msgspec.json.Encoder()
_TOPOLOGY_DECODER = msgspec.json.Decoder(Topology)
_ADDRESS_DECODER = msgspec.json.Decoder(RankAddress)
_FATAL_PUT_STATUSES = frozenset({400, 401, 403, 404, 405, 410, 413})
WAIT_LOG_INTERVAL_S = 10.0  # a registrar still trying its first registration says so this often
# A starting registrar refused as ``instance_conflict`` this long in a row gives up: the rank's holder still renews,
# i.e. another live process has this instance id (a restart's dead predecessor stops blocking it at most
# ``bootstrap.registry.CONFLICT_WINDOW_S``, 5 s, after its last renewal); waiting for ever would hide the mistake
INSTANCE_CONFLICT_GIVE_UP_S = 15.0
# A 409 that says when a retry can succeed is retried that much later: past the registry's own reckoning (its
# clock reads the next PUT's arrival, at least this much after the hint's end)
CONFLICT_RETRY_MARGIN_S = 0.05
_JSON_HEADERS = {"content-type": "application/json"}
# The PUT that starts a drain waits at most this (as the goodbye does): a stopping worker must not hang on its registry
DRAIN_PUT_TIMEOUT_S = 1.0
# The goodbye (and the drain's first PUT) waits at most this for a renewal in flight to be answered, rather than
# cancelling it (a cancelled PUT may still reach the registry after the goodbye); then it is cancelled
PUT_SETTLE_TIMEOUT_S = 1.0


@dataclass(frozen=True)
class RankRegistration:
    """What one prefill rank PUTs to ``/route``; ``to_json()`` uses SGLang's field names."""

    rank_ip: str
    rank_port: int
    page_size: int
    kv_cache_dtype: str
    instance_id: str | None = None
    attn_tp_size: int = 1
    attn_tp_rank: int = 0
    attn_cp_size: int = 1
    attn_cp_rank: int = 0
    attn_dp_size: int = 1
    attn_dp_rank: int = 0
    pp_size: int = 1
    pp_rank: int = 0
    system_dp_size: int = 1
    system_dp_rank: int = 0
    load_balance_method: str = FOLLOW_BOOTSTRAP_ROOM
    prefill_http_port: int | None = None
    # This process's own mark (an extra field; SGLang's registry ignores it): ours refuses another process's
    # registration of a rank whose holder is still renewing (two prefills given one --instance-id)
    registrant: str | None = None

    def __post_init__(self) -> None:
        for size_name in ("attn_tp_size", "attn_cp_size", "attn_dp_size", "pp_size", "system_dp_size"):
            rank_name = size_name.replace("_size", "_rank")
            size, rank = getattr(self, size_name), getattr(self, rank_name)
            if size < 1 or not 0 <= rank < size:
                raise ValueError(f"{rank_name}={rank} must be in [0, {size_name}={size})")
        if not 1 <= self.rank_port <= 65535:
            raise ValueError(f"rank_port must be in [1, 65535], got {self.rank_port}")
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")
        if not self.rank_ip or not self.kv_cache_dtype:
            raise ValueError("rank_ip and kv_cache_dtype must be non-empty")

    def to_dict(self) -> dict[str, Any]:
        body = asdict(self)
        if self.instance_id is None:
            del body["instance_id"]  # absent = SGLang's single instance
        if self.registrant is None:
            del body["registrant"]
        body["enable_dsa_cache_layer_split"] = False
        return body

    def to_json(self) -> bytes:
        return _ENCODER.encode(self.to_dict())

    @property
    def label(self) -> str:
        dp = self.attn_dp_rank if self.system_dp_size == 1 else self.system_dp_rank
        return f"{self.instance_id or 'default'}/dp{dp}-cp{self.attn_cp_rank}-tp{self.attn_tp_rank}-pp{self.pp_rank}"


def check_compatible(topology: Topology, *, page_size: int, kv_cache_dtype: str) -> None:
    """Raise ``BootstrapError`` naming each mismatch between a prefill's topology and this decode.

    Same rule as SGLang's decode: a field the prefill did not report (None) is not checked.
    """
    problems = []
    if topology.page_size is not None and topology.page_size != page_size:
        problems.append(f"page_size: prefill has {topology.page_size}, decode has {page_size}")
    if topology.kv_cache_dtype is not None and topology.kv_cache_dtype != kv_cache_dtype:
        problems.append(f"kv_cache_dtype: prefill has {topology.kv_cache_dtype!r}, decode has {kv_cache_dtype!r}")
    if problems:
        raise BootstrapError("prefill and decode KV layouts are incompatible: " + "; ".join(problems))


def registry_url(url: str) -> str:
    """``url`` of a registry as ``scheme://host:port[/path]``, so that every reader of one ``--bootstrap``
    (the registrar, the address a prefill advertises, the decode's look-ups) means the same registry: a
    bare ``host[:port]`` is ``http://`` on port 8998 (SGLang's) unless it names one; a URL without a port,
    its scheme's (80, 443). ValueError: not a registry URL."""
    text = url.strip().rstrip("/")
    default_port = DEFAULT_BOOTSTRAP_PORT
    if "://" not in text:
        text = "http://" + text
    else:
        default_port = 443 if text.lower().startswith("https://") else 80
    parts = urlsplit(text)
    try:
        port = parts.port
    except ValueError:
        raise ValueError(f"not a registry URL (bad port): {url!r}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.query or parts.fragment:
        raise ValueError(f"not a registry URL (want http://host:port): {url!r}")
    if port == 0:  # (no registry listens on port 0: it would have been taken as the scheme's default)
        raise ValueError(f"not a registry URL (port 0): {url!r}")
    return f"{parts.scheme}://{join_host_port(parts.hostname, default_port if port is None else port)}{parts.path}"




def _host_port(host: str, port: int | None) -> str:
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{host}:{DEFAULT_BOOTSTRAP_PORT if port is None else port}"


TRUST_RESOLVE_TTL_S = 60.0


def _addresses(host: str, port: int) -> set[str]:
    """``host:port`` as written and with each address ``host`` resolves to now (none if it does not)."""
    found = {_host_port(host, port)}
    with contextlib.suppress(OSError):
        found.update(_host_port(str(info[4][0]), port) for info in socket.getaddrinfo(host, port,
                                                                                     type=socket.SOCK_STREAM))
    return found


def _auth(token: str | None) -> dict[str, str]:
    """The header carrying ``token`` (none without one); ValueError for a token no HTTP client can send."""
    if token and not is_sendable_token(token):
        raise ValueError("bootstrap token must be printable ASCII without whitespace (it goes in an HTTP header)")
    return {"authorization": f"Bearer {token}"} if token else {}


async def check_read_access(url: str, token: str | None, timeout_s: float = 5.0) -> None:
    """A decode's start-up check that the registry at ``url`` takes its token for reads: raises
    ``BootstrapError`` when it answers 401/403 (every room would fail its look-up: better not to start
    than to pass health checks and fail each request). A registry that does not answer only logs a
    warning (it may be starting too), and any other answer passes."""
    if not url.startswith(("http://", "https://")):
        raise BootstrapError(f"bootstrap registry URL {url!r} is not valid: it must start with http:// or https://")
    try:
        headers = _auth(token)
    except ValueError as exc:
        raise BootstrapError(str(exc)) from None
    try:
        async with httpx.AsyncClient(timeout=timeout_s, headers=headers) as client:
            reply = await client.get(url.rstrip("/") + "/instances")
    except httpx.InvalidURL as exc:
        raise BootstrapError(f"bootstrap registry URL {url!r} is not valid: {exc}") from None
    except httpx.HTTPError as exc:
        logger.warning("bootstrap registry %s did not answer a start-up check (%s); carrying on", url, exc)
        return
    if reply.status_code in (401, 403):
        raise BootstrapError(f"bootstrap registry {url} refused this worker's token ({reply.status_code}): "
                             "set --bootstrap-token to the registry's --token", status_code=reply.status_code)


def _may_be_stale(exc: Exception) -> bool:
    """A cached reply may answer for a registry that does not answer, or that has no registration of the
    instance (restarted empty); not for one that says the instance is half registered or lost a rank."""
    return isinstance(exc, BootstrapUnreachable) or getattr(exc, "code", None) == "not_registered"


def _code(response: httpx.Response) -> str | None:
    try:
        return str(msgspec.json.decode(response.content)["error"]["code"])
    except Exception:
        return None


def _retry_after_s(response: httpx.Response) -> float | None:
    """When the refusal says a retry can succeed, in seconds: the body's ``error.retry_after_s`` (ours: exact), else
    a ``Retry-After`` of whole seconds; None when neither says (or says nonsense), bounded by
    ``INSTANCE_CONFLICT_GIVE_UP_S`` (a registry's hint must not park the start-up longer than a conflict lasts)."""
    value: Any = None
    try:
        value = msgspec.json.decode(response.content)["error"].get("retry_after_s")
    except Exception:
        pass
    if value is None:
        header = response.headers.get("retry-after", "").strip()
        value = int(header) if header.isascii() and header.isdigit() and len(header) <= 6 else None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return min(max(float(value), 0.0), INSTANCE_CONFLICT_GIVE_UP_S)


def _reason(response: httpx.Response) -> str:
    try:
        return str(msgspec.json.decode(response.content)["error"]["message"])
    except Exception:
        return response.text[:200] or response.reason_phrase


class BootstrapRegistrar:
    """Keeps one prefill rank registered (see the module docstring for the lifecycle)."""

    def __init__(
        self,
        url: str,
        registration: RankRegistration,
        *,
        interval_s: float = 2.0,
        token: str | None = None,
        start_timeout_s: float = 30.0,
    ) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self.url = registry_url(url)
        self.registration = registration
        self.interval_s = interval_s
        self.start_timeout_s = start_timeout_s
        _auth(token)  # (a token no client can send fails here, not as a refused or unreachable registry)
        self._token = token
        self._body = registration.to_json()  # what each PUT sends (the draining one once ``drain`` began)
        self._goodbye = self._body  # what ``DELETE /route`` sends (registries that know no ``draining`` too)
        self._client: httpx.AsyncClient | None = None
        self._task: asyncio.Task[None] | None = None
        self._beat_idle = asyncio.Event()  # cleared while a heartbeat PUT is in flight
        self._beat_idle.set()
        self._beats_stopping = False  # the heartbeat is being stopped: it starts no new PUT
        # A PUT was sent and never answered (cancelled, or failed once connected): it may still register the rank
        # (sticky: a later answer says nothing of it)
        self._put_unsettled = False
        self.is_registered = False
        self.num_failures = 0  # consecutive failed PUTs
        self.last_error: str | None = None
        self.last_code: str | None = None  # the registry's error code of the last failed PUT, when it sent one
        self.last_retry_after_s: float | None = None  # when the last failed PUT's reply said to retry (seconds)
        self.last_success = 0.0  # time.monotonic() of the newest PUT that succeeded (0: none yet)
        self.is_draining = False  # ``drain`` kept the rank registered as draining
        self._last_reply = b""  # the body of the last PUT answered 200

    async def start(self) -> None:
        if self._client is not None:
            raise RuntimeError("BootstrapRegistrar.start() called twice")
        self._client = self._new_client()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.start_timeout_s
        delay_s = 0.05
        said_at = loop.time()  # (waiting for a registry not up yet is said every WAIT_LOG_INTERVAL_S)
        conflict_since: float | None = None  # refused as ``instance_conflict`` since then, every try
        try:
            while True:
                status = await self._put()
                if status == 200:
                    break
                if status in _FATAL_PUT_STATUSES:
                    raise BootstrapError(
                        f"bootstrap registry {self.url} refused rank {self.registration.label}: {self.last_error}",
                        status_code=status,
                    )
                pause_s: float | None = None  # (None: the backoff's next step)
                if status == 409 and self.last_code == "instance_conflict":
                    pause_s = (None if self.last_retry_after_s is None
                               else self.last_retry_after_s + CONFLICT_RETRY_MARGIN_S)
                    conflict_since = loop.time() if conflict_since is None else conflict_since
                    if loop.time() - conflict_since >= INSTANCE_CONFLICT_GIVE_UP_S:
                        raise BootstrapError(
                            f"bootstrap registry {self.url} refused rank {self.registration.label} for "
                            f"{INSTANCE_CONFLICT_GIVE_UP_S:g}s: another live process holds it (--instance-id "
                            f"{self.registration.instance_id or 'default'} is taken): {self.last_error}",
                            status_code=status,
                        )
                else:
                    conflict_since = None
                remaining = deadline - loop.time()
                if remaining <= 0:
                    raise BootstrapError(
                        f"could not register rank {self.registration.label} with {self.url} within "
                        f"{self.start_timeout_s}s: {self.last_error}",
                        status_code=status or None,
                    )
                if loop.time() - said_at >= WAIT_LOG_INTERVAL_S:
                    said_at = loop.time()
                    logger.warning("rank %s: not registered with %s yet (%s); retrying%s", self.registration.label,
                                   self.url, self.last_error, "" if math.isinf(remaining) else
                                   f" for {remaining:.0f}s more")
                if pause_s is None:
                    pause_s = delay_s * random.uniform(0.75, 1.25)
                    delay_s = min(delay_s * 2, 2.0)
                await asyncio.sleep(min(remaining, pause_s))
        except BaseException:
            # (a PUT still unanswered, ``_put_unsettled``, may yet register the rank: ``aclose`` says goodbye then)
            await self._client.aclose()
            self._client = None
            raise
        self._start_heartbeat()

    def _new_client(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(
            base_url=self.url,
            timeout=httpx.Timeout(max(1.0, min(5.0, self.interval_s * 2))),
            limits=httpx.Limits(max_connections=2, max_keepalive_connections=1),
            headers={**_auth(self._token), **_JSON_HEADERS},
        )

    async def drain(self) -> bool:
        """Keep the rank registered as draining until ``aclose`` (see the module docstring); returns whether it is,
        False when it was deregistered instead (a registry that knows no ``draining`` or refuses the PUT otherwise
        than 409, or a registrar never started). A rank another process holds now (409) is renewed as draining."""
        if self.is_draining:
            return True
        if self._client is None:
            return False
        await self._stop_heartbeat()
        self._body = _ENCODER.encode({**self.registration.to_dict(), "draining": True})
        status = await self._put(timeout_s=DRAIN_PUT_TIMEOUT_S)
        if status == 200 and _confirms_draining(self._last_reply):
            self.is_draining = True
        elif status == 0 or status >= 500:
            # (no answer: the next beats say it again; a registry restarted meanwhile registers it draining)
            logger.warning("rank %s: the registry %s did not answer the drain (%s); renewing it as draining",
                           self.registration.label, self.url, self.last_error)
            self.is_draining = True
        elif status == 409:
            # (another process holds the rank now: not taken back, but renewed in case that one goes without a goodbye)
            logger.warning("rank %s: another process holds it in %s (%s); renewing it as draining until the drain ends",
                           self.registration.label, self.url, self.last_error)
            self.is_draining = True
        else:
            why = ("does not know the draining state" if status == 200 else f"refused it: {self.last_error}")
            logger.warning("rank %s: the registry %s %s; deregistering now (decodes that have not looked this "
                           "prefill up yet will not find it)", self.registration.label, self.url, why)
            await self.aclose()
            return False
        logger.info("rank %s draining in %s: still looked up until it deregisters", self.registration.label, self.url)
        self._start_heartbeat()
        return True

    def _start_heartbeat(self) -> None:
        self._beats_stopping = False
        self._task = asyncio.create_task(self._heartbeat(), name=f"bootstrap-heartbeat-{self.registration.label}")

    async def _stop_heartbeat(self) -> None:
        """Stop the heartbeat once a PUT it has in flight is answered (within ``PUT_SETTLE_TIMEOUT_S``): what comes
        next (the goodbye, the draining PUT) must reach the registry after it, not overtake it."""
        task, self._task = self._task, None
        if task is None:
            return
        self._beats_stopping = True
        try:
            if not self._beat_idle.is_set() and not task.done():
                try:
                    await asyncio.wait_for(self._beat_idle.wait(), PUT_SETTLE_TIMEOUT_S)
                except TimeoutError:
                    logger.info("rank %s: the renewal in flight to %s got no answer within %gs; cancelled",
                                self.registration.label, self.url, PUT_SETTLE_TIMEOUT_S)
        finally:  # (the beat is asleep now, or its PUT overdue: no new PUT starts either way)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def aclose(self) -> None:
        await self._stop_heartbeat()
        client, self._client = self._client, None
        if client is None:
            if not self._put_unsettled:
                return
            # (a ``start`` that failed, or was cancelled, with a PUT unanswered: it may still register the rank)
            client = self._new_client()
        try:
            # (also after a failed renewal: the entry may well live on until its lease ends)
            if self.last_success or self._put_unsettled:
                await self._say_goodbye(client)
        finally:
            self.is_registered = self._put_unsettled = False
            await client.aclose()

    async def _say_goodbye(self, client: httpx.AsyncClient) -> None:
        """The best-effort ``DELETE /route`` (within 1 s)."""
        try:
            await client.request("DELETE", "/route", content=self._goodbye, timeout=1.0)
        except httpx.HTTPError as exc:
            logger.debug("deregistering %s failed: %s", self.registration.label, exc)

    async def _put(self, timeout_s: float | None = None) -> int:
        """One PUT (within ``timeout_s``, else the client's timeout); returns the status (0 = no reply) and records
        success or failure."""
        assert self._client is not None
        error: str | None
        code: str | None = None
        retry_after_s: float | None = None
        unsettled = self._put_unsettled
        self._put_unsettled = True  # (until answered, or known never sent: cancelled here, it stays so)
        try:
            if timeout_s is None:
                response = await self._client.put("/route", content=self._body)
            else:
                response = await self._client.put("/route", content=self._body, timeout=timeout_s)
        except httpx.HTTPError as exc:
            status, error = 0, f"{type(exc).__name__}: {exc}"
            # (no connection, no request; any other failure may have left the request on its way)
            self._put_unsettled = unsettled or not isinstance(
                exc, (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout))
        else:
            self._put_unsettled = unsettled  # (an earlier one may still be on its way)
            status = response.status_code
            error = None if status == 200 else f"HTTP {status}: {_reason(response)}"
            code = None if status == 200 else _code(response)
            self._last_reply = response.content if status == 200 else b""
            if status == 409:
                retry_after_s = _retry_after_s(response)
        self.last_code, self.last_retry_after_s = code, retry_after_s
        if error is None:
            if self.num_failures:
                logger.info("rank %s registered again with %s", self.registration.label, self.url)
            self.is_registered, self.num_failures, self.last_error = True, 0, None
            self.last_success = time.monotonic()
        else:
            self.is_registered = False
            self.num_failures += 1
            self.last_error = error
            if self.num_failures == 1 or self.num_failures % 30 == 0:
                logger.warning(
                    "registering rank %s with %s failed (%d in a row): %s",
                    self.registration.label,
                    self.url,
                    self.num_failures,
                    error,
                )
        return status

    async def _heartbeat(self) -> None:
        refused = False  # (a draining rank taken over says so once, not on every beat)
        while True:
            await asyncio.sleep(self.interval_s)
            if self._beats_stopping:
                return
            self._beat_idle.clear()
            try:
                status = await self._put()
            except Exception:  # a bug in one beat must not end the heartbeat
                logger.exception("heartbeat of rank %s failed", self.registration.label)
                continue
            finally:
                self._beat_idle.set()
            if status == 410:  # (this registrant said goodbye to the rank: it is not ours to register any more)
                logger.warning("rank %s: the registry %s refuses it as deregistered; the heartbeat stops",
                               self.registration.label, self.url)
                return
            if self.is_draining and status == 409 and not refused:
                # (not taken back; renewed until the drain ends, in case the holder goes without a goodbye)
                logger.info("rank %s: another process holds it now; renewing as draining until the drain ends",
                            self.registration.label)
            refused = status == 409


def _confirms_draining(body: bytes) -> bool:
    """The registry's answer to a draining PUT says it took the state (ours: ``{"draining": true}``)."""
    try:
        reply = msgspec.json.decode(body)
    except msgspec.DecodeError:
        return False
    return isinstance(reply, dict) and reply.get("draining") is True


class BootstrapResolver:
    """Looks up prefill topologies and rank addresses (see the module docstring)."""

    def __init__(self, *, token: str | None = None, timeout_s: float = 5.0, cache_ttl_s: float = 5.0,
                 stale_if_unreachable_s: float = 60.0, registries: Iterable[str] = ()) -> None:
        # host:port of each registry given, as written and as its name resolves now -> its whole URL (scheme,
        # path): asked there, with the token; any other registry at http://host:port, without it
        self._trusted: dict[str, str] = {}
        for url in registries:
            base = registry_url(url)
            parts = urlsplit(base)
            assert parts.hostname is not None and parts.port is not None  # (``registry_url`` spells both)
            for address in _addresses(parts.hostname, parts.port):
                self._trusted.setdefault(address, base)
            self._trusted[_host_port(parts.hostname, parts.port)] = base
        self._auth = _auth(token)
        self._resolved: dict[tuple[str, int], tuple[str | None, float]] = {}  # (``_trusted_base``) with expiry
        self.cache_ttl_s = cache_ttl_s
        self.stale_if_unreachable_s = stale_if_unreachable_s
        self._client = httpx.Client(
            timeout=httpx.Timeout(timeout_s),
            limits=httpx.Limits(max_connections=32, max_keepalive_connections=8),
        )
        self._lock = threading.Lock()
        self._cache: dict[tuple[Any, ...], tuple[Any, float]] = {}
        # key -> until when its expired reply answers without asking (set when the registry failed to answer
        # it: a registry that times out instead of refusing would otherwise hold every look-up of that key
        # for ``timeout_s`` before the stale reply, on the decode's few bootstrap threads)
        self._quiet: dict[tuple[Any, ...], float] = {}

    def topology(self, host: str, port: int | None, instance_id: str | None = None) -> Topology:
        key = (host, port, instance_id)
        cached = self._cached(key)
        if cached is not None:
            return cached
        try:
            topology: Topology = self._get(host, port, instance_id, (-1, -1, -1, -1), _TOPOLOGY_DECODER)
        except (BootstrapUnreachable, BootstrapNotReady) as exc:
            stale: Topology | None = self._stale(key) if _may_be_stale(exc) else None
            if stale is None:
                raise
            return stale
        self._store(key, topology)
        return topology

    def resolve(
        self,
        host: str,
        port: int | None,
        instance_id: str | None = None,
        *,
        dp_rank: int = 0,
        cp_rank: int = 0,
        tp_rank: int = 0,
        pp_rank: int = 0,
    ) -> tuple[str, int]:
        ranks = (dp_rank, cp_rank, tp_rank, pp_rank)
        if min(ranks) < 0:
            raise ValueError(f"ranks must be >= 0, got dp={dp_rank} cp={cp_rank} tp={tp_rank} pp={pp_rank}")
        key = (host, port, instance_id, *ranks)
        cached = self._cached(key)
        if cached is not None:
            return cached
        try:
            address: RankAddress = self._get(host, port, instance_id, ranks, _ADDRESS_DECODER)
        except (BootstrapUnreachable, BootstrapNotReady) as exc:
            stale: tuple[str, int] | None = self._stale(key) if _may_be_stale(exc) else None
            if stale is None:
                raise
            return stale
        result = (address.rank_ip, address.rank_port)
        self._store(key, result)
        return result

    def _trusted_base(self, host: str, port: int | None) -> str | None:
        """The URL of the registry given that ``host:port`` reaches (its name resolves to one of its addresses:
        ``localhost`` for ``127.0.0.1``), None if none; resolved at most every ``TRUST_RESOLVE_TTL_S``. The
        look-up then goes to that registry's own URL, not to whatever the name resolves to next."""
        if not self._auth or not self._trusted:
            return None
        key = (host, DEFAULT_BOOTSTRAP_PORT if port is None else port)
        with self._lock:
            known = self._resolved.get(key)
        now = time.monotonic()
        if known is not None and known[1] > now:
            return known[0]
        base = next((self._trusted[a] for a in sorted(_addresses(*key)) if a in self._trusted), None)
        with self._lock:
            if len(self._resolved) >= 1024:  # (hosts named by requests: bounded)
                self._resolved.clear()
            self._resolved[key] = (base, now + TRUST_RESOLVE_TTL_S)
        return base

    def cached_topology(self, host: str, port: int | None, instance_id: str | None = None) -> Topology | None:
        """What ``topology`` would return from its cache now; None if it would ask the registry."""
        topology: Topology | None = self._cached((host, port, instance_id))
        return topology

    def cached_address(self, host: str, port: int | None, instance_id: str | None = None) -> tuple[str, int] | None:
        """What ``resolve`` (rank 0 everywhere) would return from its cache now; None if it would ask."""
        address: tuple[str, int] | None = self._cached((host, port, instance_id, 0, 0, 0, 0))
        return address

    def invalidate(self, host: str, port: int | None, instance_id: str | None = None) -> None:
        prefix = (host, port, instance_id)
        with self._lock:
            for key in [k for k in self._cache if k[:3] == prefix]:
                del self._cache[key]
                self._quiet.pop(key, None)

    def close(self) -> None:
        self._client.close()

    def _cached(self, key: tuple[Any, ...]) -> Any:
        with self._lock:
            hit = self._cache.get(key)
            if hit is None:
                return None
            now = time.monotonic()
            if hit[1] <= now:
                if hit[1] + self.stale_if_unreachable_s <= now:  # too old even to answer for a silent registry
                    del self._cache[key]
                    self._quiet.pop(key, None)
                    return None
                if self._quiet.get(key, 0.0) > now:  # the registry failed it a moment ago: not asked again yet
                    return hit[0]
                return None
            return hit[0]

    def _stale(self, key: tuple[Any, ...]) -> Any:
        """The cached reply, expired or not, unless it expired ``stale_if_unreachable_s`` ago or more."""
        with self._lock:
            hit = self._cache.get(key)
            now = time.monotonic()
            if hit is None or hit[1] + self.stale_if_unreachable_s <= now:
                return None
            self._quiet[key] = now + self.cache_ttl_s  # (asked again after as long as a fresh reply lasts)
            return hit[0]

    def _store(self, key: tuple[Any, ...], value: Any) -> None:
        if self.cache_ttl_s > 0:
            with self._lock:
                self._cache[key] = (value, time.monotonic() + self.cache_ttl_s)
                self._quiet.pop(key, None)

    def _get(
        self,
        host: str,
        port: int | None,
        instance_id: str | None,
        ranks: tuple[int, int, int, int],
        decoder: msgspec.json.Decoder[Any],
    ) -> Any:
        address = _host_port(host, port)
        params: dict[str, str | int] = {
            "prefill_dp_rank": ranks[0],
            "prefill_cp_rank": ranks[1],
            "target_tp_rank": ranks[2],
            "target_pp_rank": ranks[3],
        }
        if instance_id is not None:
            params["instance_id"] = instance_id
        base = self._trusted.get(address) or self._trusted_base(host, port)
        try:
            response = self._client.get(f"{base or 'http://' + address}/route", params=params,
                                        headers=self._auth if base is not None else None)
        except httpx.HTTPError as exc:
            raise BootstrapUnreachable(
                f"bootstrap registry {address} unreachable: {type(exc).__name__}: {exc}"
            ) from exc
        what = "topology" if ranks[0] == -1 else f"rank dp={ranks[0]} cp={ranks[1]} tp={ranks[2]} pp={ranks[3]}"
        if response.status_code == 503:
            raise BootstrapNotReady(f"{address}: {_reason(response)}", status_code=503, code=_code(response))
        if response.status_code != 200:
            hint = ""
            if response.status_code in (401, 403) and self._auth and base is None:
                hint = (" (this worker sends its --bootstrap-token only to its own --bootstrap registry, "
                        f"{' or '.join(sorted(set(self._trusted.values()))) or 'none given'}, which this is not)")
            raise BootstrapError(
                f"{address}: {what} lookup failed with HTTP {response.status_code}: {_reason(response)}{hint}",
                status_code=response.status_code,
            )
        try:
            return decoder.decode(response.content)
        except msgspec.MsgspecError as exc:
            raise BootstrapError(f"{address}: malformed {what} reply: {exc}", status_code=200) from exc
