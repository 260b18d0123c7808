"""The cap on the worker's HTTP connections (``pd-worker --max-http-connections``).

The worker's HTTP port (health probes, ``/load``, ``/metrics``, SGLang's ``/generate``) shares the process's
file descriptors with its KV transfer sockets and the gateways' native connections: however many clients
connect to it, those must keep working. The cap is the gateway's (``gateway/http_connections.py``: at the cap
the longest-idle kept-alive connection is closed for a newcomer, else up to ``PROBATION_SLOTS`` connections may
send a probe, the rest are answered 503 ``too_many_connections``), bound here to the worker's option and its
probes (``PROBE_PATHS``).
"""

from __future__ import annotations

from gateway import http_connections as _shared
from gateway.http_connections import (
    PROBATION_SLOTS,
    CappedHttpProtocol,
    TooManyConnections,
    capped_protocol_class,
    raise_open_file_limit,
)

__all__ = ["PROBATION_SLOTS", "PROBE_PATHS", "CappedHttpProtocol", "ConnectionCap", "TooManyConnections",
           "capped_protocol_class", "fitted_cap", "raise_open_file_limit"]

FLAG = "--max-http-connections"
# (the request target as sent, query string cut): the probes ``workers.http_app.OPEN_PATHS`` answers without a key,
# and the status reads SGLang's routers poll (load, server and model info): a router keeps its view of a worker
# whose port is full rather than taking it for failed
PROBE_PATHS = frozenset((b"/health", b"/liveness", b"/health_generate", b"/metrics", b"/load", b"/get_load",
                         b"/v1/loads", b"/get_server_info", b"/server_info", b"/get_model_info", b"/model_info"))


class ConnectionCap(_shared.ConnectionCap):
    """The worker's HTTP port's ``ConnectionCap``: ``--max-http-connections``, the worker's probes."""

    def __init__(self, cap: int) -> None:
        super().__init__(cap, flag=FLAG, holder="the worker's HTTP port", probe_paths=PROBE_PATHS)


def fitted_cap(cap: int) -> int:
    """``cap``, lowered to a quarter of the process's open-file limit (``ulimit -n``) if that is less: the HTTP
    connections must leave descriptors for the KV transfer and the gateways' native connections."""
    return _shared.fitted_cap(cap, FLAG)
