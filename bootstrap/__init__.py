"""The bootstrap registry: where decode workers find the prefill ranks' KV control endpoints.

Server: ``create_app(config)`` (run by ``pd-bootstrap`` or embedded with ``serve_embedded``),
SGLang-compatible routes plus instances, leases, token, metrics. Clients: ``BootstrapRegistrar``
(prefill ranks register and heartbeat) and ``BootstrapResolver`` (decode-side look-ups).
"""

from bootstrap.app import create_app
from bootstrap.client import (
    BootstrapRegistrar,
    BootstrapResolver,
    RankRegistration,
    check_compatible,
)
from bootstrap.config import BootstrapConfig
from bootstrap.embedded import EmbeddedRegistry, serve_embedded
from bootstrap.exceptions import BootstrapError, BootstrapNotReady, BootstrapUnreachable
from bootstrap.messages import DEFAULT_BOOTSTRAP_PORT, DEFAULT_INSTANCE_ID, RankAddress, Topology

__all__ = [
    "DEFAULT_BOOTSTRAP_PORT",
    "DEFAULT_INSTANCE_ID",
    "BootstrapConfig",
    "BootstrapError",
    "BootstrapNotReady",
    "BootstrapRegistrar",
    "BootstrapResolver",
    "BootstrapUnreachable",
    "EmbeddedRegistry",
    "RankAddress",
    "RankRegistration",
    "Topology",
    "check_compatible",
    "create_app",
    "serve_embedded",
]
