"""A cap on the connections an HTTP port serves at once (``gateway --max-client-connections``, ``pd-worker
--max-http-connections``: ``workers/http_connections.py`` binds it to the worker's flag and probes).

A server's HTTP port shares the process's file descriptors with its own connections to its peers (the
gateway's native connections to its workers and HTTP ones to SGLang workers; a worker's KV transfer sockets
and the gateways' native connections): however many clients connect to it, those must keep working. Per
accepted connection, on the event loop only (``CappedHttpProtocol.connection_made``; nothing here runs per
request on an admitted connection):
1. While fewer than ``ConnectionCap.cap`` connections are admitted, it is admitted: served as any other
   (``gateway.http_protocol.GuardedHttpProtocol``: head, body and write timeouts; kept alive between
   requests for the server's keep-alive timeout).
2. At the cap, the admitted connection idle longest between requests (kept alive, nothing in flight) is
   closed to make room and the new one is admitted (as nginx reuses idle keep-alive connections when it runs
   out of them; a look that found none is not repeated for ``IDLE_SCAN_INTERVAL_S``). A client sending a
   request on it just then sees it close, as when its keep-alive ends.
3. Otherwise it is let in on probation, one of at most ``PROBATION_SLOTS`` (when they are all taken, the
   oldest one still waiting for its head is answered the 503 below and closed for it, or one lingering after
   its refusal closed): its request head
   must arrive within ``PROBATION_HEAD_TIMEOUT_S``. A probe (``ConnectionCap.probe_paths``) is served and the
   connection closed after its answer (a request pipelined behind it left unanswered, as ``Connection: close``
   says); any other request is answered 503 ``too_many_connections``
   (OpenAI-shaped, ``Retry-After: 1``, ``Connection: close``), after which what the client still sends is
   dropped for ``LINGER_S`` before the close. So clients that hold every admitted connection (silent, slow or
   just many) cannot make the probes of a healthy server fail, and an orchestrator does not restart it for
   them. (Only such a connection's parser calls ``_probe_headers_complete``: an admitted one pays nothing
   per request for the cap.)
4. When every probation slot is serving a probe, the connection is answered that 503 at once, before its
   request is read, and closed.
The HTTP port thus holds at most ``cap + PROBATION_SLOTS`` connections (plus, for the instant of their
refusal, those of step 4). A drain (``GuardedHttpProtocol.shutdown``) treats every connection alike.
"""

from __future__ import annotations

import contextlib
import logging
import resource
import time
from collections.abc import Iterator
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import msgspec
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from uvicorn.protocols.http.httptools_impl import STATUS_LINE

from gateway.errors import APIError
from gateway.http_protocol import LINGER_S, ClientLimits, GuardedHttpProtocol

if TYPE_CHECKING:
    from gateway.hot_cycle import HotRoutes

log = logging.getLogger(__name__)

PROBATION_SLOTS = 8
PROBATION_HEAD_TIMEOUT_S = 2.0
# At the cap with no idle admitted connection, the next look for one is at least this much later
IDLE_SCAN_INTERVAL_S = 0.05
# At most this share of the process's open-file limit goes to admitted HTTP connections by default: a worker's HTTP
# port is beside its KV transfer and native connections (a quarter); a gateway's client port is its main use of
# descriptors, the rest kept for its connections to the workers (three quarters)
WORKER_FD_SHARE = 0.25
GATEWAY_FD_SHARE = 0.75

_json = msgspec.json.Encoder()


class TooManyConnections(APIError):
    """The HTTP port holds as many connections as its cap allows (503: try again, or another server)."""

    status = 503
    type = "service_unavailable"


def raise_open_file_limit() -> int:
    """Raise this process's soft open-file limit (``ulimit -n``) to its hard limit, as SGLang's servers do: the soft
    one is often 1024 while the hard one is far higher, and a server holding many HTTP, native and KV connections
    needs them. Returns the soft limit now in force."""
    with contextlib.suppress(ValueError, OSError):
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or hard > soft):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def open_file_share(share: float = WORKER_FD_SHARE) -> int | None:
    """The most HTTP connections the open-file limit (``ulimit -n``) leaves room for: ``share`` of it (None: no
    limit), so that the process's connections to its peers always find descriptors."""
    with contextlib.suppress(ValueError, OSError):
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != resource.RLIM_INFINITY:
            return max(1, int(soft * share))
    return None


def fitted_cap(cap: int, flag: str, share: float = WORKER_FD_SHARE) -> int:
    """``cap`` (from the option ``flag``), lowered to ``open_file_share(share)`` with a warning if that is less."""
    most = open_file_share(share)
    if most is not None and cap > most:
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        log.warning("%s %d lowered to %d: the open-file limit (ulimit -n) is %d", flag, cap, most, soft)
        return most
    return cap


class ConnectionCap:
    """The counts behind the cap, shared by the connections of one server (event loop only).

    ``flag`` names the option that sets ``cap`` and ``holder`` the server (both in the 503's message);
    ``probe_paths`` are the request targets (as sent, query string cut) a probation connection may serve."""

    def __init__(self, cap: int, *, flag: str, holder: str, probe_paths: frozenset[bytes]) -> None:
        if cap < 1:
            raise ValueError(f"{flag.lstrip('-').replace('-', '_')}: must be at least 1")
        self.cap = cap
        self.flag = flag
        self.probe_paths = probe_paths
        self.admitted: dict[CappedHttpProtocol, None] = {}  # (in arrival order: the oldest first)
        self.probation: dict[CappedHttpProtocol, None] = {}  # (in arrival order: the oldest first)
        self.num_evicted = 0  # admitted connections closed while idle to make room (step 2)
        self.num_refused = 0  # requests answered 503, connections closed unanswered for a newcomer (steps 3, 4)
        self._no_idle_until = 0.0  # (monotonic) the last look found no idle admitted connection: none until then
        error = TooManyConnections(f"{holder} holds its {flag} ({cap}): try again later",
                                   code="too_many_connections", retry_after_s=1.0)
        self._body = _json.encode(error.body())
        self._headers = b"".join(b"%s: %s\r\n" % pair for pair in error.headers())

    def refusal(self, default_headers: list[tuple[bytes, bytes]]) -> bytes:
        """The 503 answer, whole (``Connection: close``)."""
        head = [STATUS_LINE[503], *(b"%s: %s\r\n" % pair for pair in default_headers), self._headers,
                b"content-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n" % len(self._body)]
        return b"".join(head) + self._body

    def admit(self, conn: CappedHttpProtocol) -> str:
        """Where ``conn``, just accepted, goes: ``admitted``, ``probation`` or ``refused`` (steps 1-4)."""
        if len(self.admitted) >= self.cap:
            self._close_idle_admitted()
        if len(self.admitted) < self.cap:
            self.admitted[conn] = None
            return "admitted"
        if len(self.probation) >= PROBATION_SLOTS:
            self._close_waiting_probation()
        if len(self.probation) < PROBATION_SLOTS:
            self.probation[conn] = None
            return "probation"
        self.num_refused += 1
        return "refused"

    def release(self, conn: CappedHttpProtocol) -> None:
        self.admitted.pop(conn, None)
        self.probation.pop(conn, None)

    def _close_idle_admitted(self) -> None:
        now = time.monotonic()
        if now < self._no_idle_until:  # (a flood must not cost a scan of every admitted connection per accept)
            return
        idle = [c for c in self.admitted if c.is_idle]
        if not idle:
            self._no_idle_until = now + IDLE_SCAN_INTERVAL_S
        else:
            # (one keep-alive for all: the longest idle; on a tie, as the loop's clock counts milliseconds, the oldest)
            oldest = min(idle, key=lambda c: c.idle_deadline)
            del self.admitted[oldest]
            self.num_evicted += 1
            oldest.transport.close()

    def _close_waiting_probation(self) -> None:
        for conn in self.probation:
            if conn.is_waiting_or_refused:
                del self.probation[conn]
                if conn.is_refused:  # (answered already: its linger cut short)
                    conn.transport.close()
                else:  # its head still due: told 503 (retryable) rather than closed unanswered, which a router
                    self.num_refused += 1  # or our relay takes for a failed worker (its breaker then opens)
                    conn._answer_busy(linger=False)
                return


def cap_metrics(cap: ConnectionCap, prefix: str, noun: str, labels: dict[str, str]) -> Iterator[Metric]:
    """``cap``'s counts as Prometheus families named ``prefix``..., read at scrape time (the gateway's client port
    and a worker's HTTP port alike; ``noun`` names the connections, ``labels`` go on every series)."""
    names, values = list(labels), list(labels.values())
    open_ = GaugeMetricFamily(prefix, f"{noun} connections open: admitted (at most {cap.flag}) or on probation "
                              "(probes only)", labels=[*names, "slot"])
    open_.add_metric([*values, "admitted"], float(len(cap.admitted)))
    open_.add_metric([*values, "probation"], float(len(cap.probation)))
    yield open_
    for family, name, doc, value in (
            (GaugeMetricFamily, "limit", f"{cap.flag} as applied", cap.cap),
            (CounterMetricFamily, "refused", "Requests answered 503 too_many_connections, and connections closed "
                                             "unanswered, at the cap", cap.num_refused),
            (CounterMetricFamily, "evicted", f"Idle kept-alive {noun.lower()} connections closed to make room for a "
                                             "new one at the cap", cap.num_evicted)):
        series = family(f"{prefix}_{name}", doc, labels=names)
        series.add_metric(values, float(value))
        yield series


class CappedHttpProtocol(GuardedHttpProtocol):
    """``GuardedHttpProtocol`` under a ``ConnectionCap`` (the module doc); made by ``capped_protocol_class``."""

    cap: ConnectionCap

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._busy = False  # (``_probe_headers_complete``) this request is refused 503
        self._behind_probe = False  # (``_probe_headers_complete``) a request pipelined behind the probe: left unread

    @property
    def is_idle(self) -> bool:
        """Kept alive between requests, nothing in flight (``GuardedHttpProtocol`` waits for the next head)."""
        cycle = self.cycle
        return (self._waiting_for == "idle" and not self.pipeline and (cycle is None or cycle.response_complete)
                and not self.transport.is_closing())

    @property
    def idle_deadline(self) -> float:
        return self._deadline

    @property
    def is_refused(self) -> bool:
        return self._refused

    @property
    def is_waiting_or_refused(self) -> bool:
        """A probation connection that is not serving a probe: its head still to come, or refused."""
        return self._refused or self.cycle is None or self.transport.is_closing()

    def connection_made(self, transport: Any) -> None:
        self.transport = transport  # (a connection closed to make room is closed through it)
        slot = self.cap.admit(self)
        if slot == "probation":
            self.limits = replace(self.limits, head_timeout_s=min(self.limits.head_timeout_s,
                                                                  PROBATION_HEAD_TIMEOUT_S))
            # httptools binds a parser's callbacks when it is made: a parser made now calls the probe check at
            # the end of each head of this connection (an admitted one's parser never does)
            self.on_headers_complete = self._probe_headers_complete  # type: ignore[method-assign]
            self._renew_parser()
        super().connection_made(transport)
        if slot == "refused":
            self._answer_busy(linger=False)

    def connection_lost(self, exc: Exception | None) -> None:
        self.cap.release(self)
        super().connection_lost(exc)

    def handle_websocket_upgrade(self) -> None:
        """uvicorn hands the transport to its WebSocket protocol: this one's ``connection_lost`` is never called,
        so it is run when that protocol's connection ends: the slot is given back (it counts against the cap until
        then), and a request still being answered on the connection (the upgrade was pipelined behind it) sees its
        client gone, as at any other close (its generation is aborted, not run to its end for nobody)."""
        super().handle_websocket_upgrade()
        protocol = self.transport.get_protocol()
        lost = protocol.connection_lost

        def connection_lost(exc: Exception | None) -> None:
            try:
                self.connection_lost(exc)  # (the cap's release, the cycles' disconnect, the timers)
            finally:
                lost(exc)

        protocol.connection_lost = connection_lost  # type: ignore[method-assign]

    def _probe_headers_complete(self) -> None:
        """``on_headers_complete`` on probation: one probe is served; anything else is refused. A request pipelined
        behind the probe is left unanswered: the probe's answer (``Connection: close``) goes out whole, then the
        connection closes (a refusal cannot go in the middle of that answer: it would close it unanswered)."""
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete and not cycle.keep_alive:
            self._behind_probe = True
            raise TooManyConnections("a request behind the probe")  # (the parser stops: send_400_response)
        if cycle is not None or self.url.partition(b"?")[0] not in self.cap.probe_paths:
            self._busy = True
            raise TooManyConnections("too many connections")  # (the parser stops: send_400_response answers)
        super().on_headers_complete()
        if self.cycle is not None:
            self.cycle.keep_alive = False  # (closed after the probe's answer)

    def send_400_response(self, msg: str) -> None:
        if self._behind_probe:  # (what else comes is not read: the probe's answer closes the connection)
            self.flow.pause_reading()
        elif self._busy:
            self.cap.num_refused += 1
            self._answer_busy(linger=True)
        else:
            super().send_400_response(msg)

    def _answer_busy(self, *, linger: bool) -> None:
        """Answer 503 ``too_many_connections`` and close: at once, or after dropping what the client still sends
        for ``LINGER_S`` (so that it reads the answer rather than a reset)."""
        self._refused = True
        self._disarm()
        transport = self.transport
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:  # (a probe's answer going out: not in its middle)
            cycle.disconnected = True
            cycle.message_event.set()
            transport.close()
            return
        if transport.is_closing():
            return
        transport.write(self.cap.refusal(self.server_state.default_headers))
        if not linger:
            transport.close()
            return
        if transport.can_write_eof():
            transport.write_eof()
        self.loop.call_later(LINGER_S, transport.close)


def capped_protocol_class(limits: ClientLimits, cap: ConnectionCap,
                          hot_routes: HotRoutes | None = None) -> type[CappedHttpProtocol]:
    """A ``CappedHttpProtocol`` bound to ``limits``, ``cap`` (and ``hot_routes``), for ``uvicorn.Config(http=...)``."""
    return type("CappedHttpProtocol", (CappedHttpProtocol,), {"limits": limits, "cap": cap, "hot_routes": hot_routes})
