"""Worker configuration: a frozen dataclass, validated at load; CLI flags mirror its fields."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from workers.grammar import GRAMMAR_TIMEOUT_S
from workers.protocol import MAX_UNREAD_BYTES, PEER_TIMEOUT_S


class ConfigError(ValueError):
    """A bad setting; the message names the field."""


@dataclass(frozen=True)
class WorkerConfig:
    role: str = "both"  # prefill | decode | both
    engine: str = "sim"
    model: str | None = None
    transfer: str = "tcp"
    host: str = "127.0.0.1"  # what every socket binds (0.0.0.0: every interface)
    advertise_host: str | None = None  # what peers are told (default: host, or the route to the registry)
    port: int = 0  # native protocol
    http_port: int = 0
    bootstrap: str | None = None  # registry URL (prefill registers, decode looks up)
    bootstrap_token: str | None = field(default=None, repr=False)
    # Required of every peer of the native port (``Hello.key``) and of the HTTP side's requests but its health
    # probes (``Authorization: Bearer KEY``): the gateway's --worker-api-key
    api_key: str | None = field(default=None, repr=False)
    bootstrap_embedded: int | None = None  # prefill: serve the registry in this process on this port
    instance_id: str | None = None
    page_size: int = 16
    num_pages: int = 2048
    chunk_size: int = 512
    max_running: int = 64
    # Requests the worker holds at once, in any stage (queued, in transfer, running); more are refused
    # ``overloaded`` (a 429 to the client; a gateway retries on another worker)
    max_requests: int = 4096
    device: str = "cpu"
    dtype: str = "float32"
    attention: str = "auto"
    num_threads: int = 1
    bootstrap_timeout_s: float = 300.0
    waiting_timeout_s: float = 300.0
    transfer_timeout_s: float = 60.0
    # A request arriving over SGLang's HTTP API (workers/sglang_api.py) ends by this deadline; a native
    # request carries its gateway's.
    http_request_timeout_s: float = 1800.0
    heartbeat_interval_s: float = 2.0
    # decode over mooncake/nixl: a failed room's pages wait at most this long (time the decode ran) for a silent
    # prefill's word that none of its writes can still land, then go back to the pool (inf: until it answers or dies)
    quarantine_timeout_s: float = 300.0
    # A prefill starting before its registry is up waits this long for it, its native port closed and /health 503
    # "starting" meanwhile (0: for as long as it takes, as under an orchestrator that starts them in any order)
    registry_wait_s: float = 0.0
    # /liveness turns 503 once the scheduler, holding requests, has not finished a step for this long (a hung
    # forward: a stuck GPU kernel or collective), so that the orchestrator (or pd-cluster) restarts the worker
    watchdog_timeout_s: float = 300.0
    # A constrained request whose grammar has not compiled this long after it arrived fails (400 naming its
    # field); its compile, which cannot be stopped, goes on (at most a few at once: workers/grammar.py)
    grammar_timeout_s: float = GRAMMAR_TIMEOUT_S
    max_unread_bytes: int = MAX_UNREAD_BYTES  # per gateway connection: past it the gateway is not reading
    # Connections the HTTP port serves at once (workers/http_connections.py: at the cap an idle one is closed for
    # a new one, else a few more are let in for probes, the rest answered 503); 0 = ``max_requests`` + 256 (an
    # SGLang router holds a connection per request); at most a quarter of ulimit -n
    max_http_connections: int = 0
    # a gateway connection whose host answers nothing this long is closed, its requests ended (``watch_peer``)
    gateway_timeout_s: float = PEER_TIMEOUT_S
    http_keep_alive_timeout_s: float = 5.0  # an HTTP connection idle between requests this long is closed
    # On SIGTERM/SIGINT the requests held already run on for up to this long (new ones are refused shutting_down),
    # then the rest end shutting_down; a second signal ends the drain at once. 0: they end at once (a gateway
    # retries or migrates them; a router that does not, SGLang's, wants the orchestrator's grace period less a margin)
    drain_timeout_s: float = 0.0
    engine_options: dict[str, str] = field(default_factory=dict)
    transfer_options: dict[str, str] = field(default_factory=dict)  # --transfer-option, checked by the backend
    # auto: KV moves through shared memory to a co-located peer that proves it maps the decode's pool
    # (transfer.shm; a decode's pool then lives in /dev/shm); off: always the --transfer backend
    same_host_kv: str = "auto"

    def __post_init__(self) -> None:
        if self.api_key is not None and (not self.api_key or any(c.isspace() or not c.isprintable()
                                                                 for c in self.api_key)):
            raise ConfigError("api_key: must be non-empty, without white space or control characters")
        if self.model == "default":  # the embedded SmolLM2 (torch engine)
            object.__setattr__(self, "model", None)
        if self.role not in ("prefill", "decode", "both"):
            raise ConfigError(f"role: must be prefill, decode or both, got {self.role!r}")
        for name in ("page_size", "num_pages", "chunk_size", "max_running", "max_requests", "num_threads"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name}: must be positive, got {getattr(self, name)}")
        for name in ("port", "http_port"):
            if not 0 <= getattr(self, name) <= 65535:
                raise ConfigError(f"{name}: not a TCP port: {getattr(self, name)}")
        if self.device == "cuda":  # one spelling, so the engine's device and the pool's tensors compare equal
            object.__setattr__(self, "device", "cuda:0")
        if self.engine == "sim" and self.device != "cpu":
            raise ConfigError(f"device: the sim engine runs on the CPU, got {self.device!r}")
        if not (self.device == "cpu" or self.device == "cuda" or self.device.startswith("cuda:")):
            raise ConfigError(f"device: must be cpu, cuda or cuda:N, got {self.device!r}")
        if self.same_host_kv not in ("auto", "off"):
            raise ConfigError(f"same_host_kv: must be auto or off, got {self.same_host_kv!r}")
        if self.max_http_connections < 0:
            raise ConfigError("max_http_connections: must be positive (or 0: automatic), got "
                              f"{self.max_http_connections}")
        if self.max_unread_bytes < 1 << 16:
            raise ConfigError("max_unread_bytes: must be at least 64 KiB")
        for name in ("bootstrap_timeout_s", "waiting_timeout_s", "transfer_timeout_s", "http_request_timeout_s",
                     "heartbeat_interval_s", "watchdog_timeout_s", "grammar_timeout_s", "http_keep_alive_timeout_s",
                     "gateway_timeout_s"):
            if not 0 < getattr(self, name) < math.inf:  # (NaN and inf refused too)
                raise ConfigError(f"{name}: must be positive and finite")
        if not self.quarantine_timeout_s > 0:  # (inf allowed: never given back unconfirmed; NaN refused)
            raise ConfigError("quarantine_timeout_s: must be positive (inf: until the prefill answers or dies)")
        if not 0 <= self.drain_timeout_s < math.inf:
            raise ConfigError("drain_timeout_s: must be >= 0 (0: no drain) and finite")
        if not 0 <= self.registry_wait_s < math.inf:
            raise ConfigError("registry_wait_s: must be >= 0 (0: no limit) and finite")
        if self.bootstrap:
            from bootstrap.client import registry_url

            try:  # (one spelling for every reader: the registrar, the advertised address, the look-ups)
                object.__setattr__(self, "bootstrap", registry_url(self.bootstrap))
            except ValueError as exc:
                raise ConfigError(f"bootstrap: {exc}") from None
        if self.bootstrap_embedded is not None:
            if self.role != "prefill":
                raise ConfigError("bootstrap_embedded: only a prefill worker can embed the registry")
            if self.bootstrap:
                raise ConfigError("bootstrap_embedded: give either --bootstrap URL or --bootstrap-embedded PORT")
            if not 0 <= self.bootstrap_embedded <= 65535:
                raise ConfigError(f"bootstrap_embedded: not a TCP port: {self.bootstrap_embedded}")
        elif self.role == "prefill" and not self.bootstrap:
            # A decode needs none: each request names its prefill's registry (host and port).
            raise ConfigError("bootstrap: a prefill worker needs --bootstrap URL of the registry (or "
                              "--bootstrap-embedded PORT)")
