"""Configuration of the bootstrap registry: frozen, validated at construction, one field per CLI flag."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

TokenScope = Literal["all", "writes"]


@dataclass(frozen=True)
class BootstrapConfig:
    """Settings of one registry (``pd-bootstrap`` flags mirror these fields one to one).

    ``ttl_s``: a rank's entry expires this long after its last ``PUT /route`` (its heartbeat);
    ``0`` keeps entries forever (SGLang's own behaviour, for ranks that register once and never
    heartbeat). ``token``: shared bearer token; ``token_scope="all"`` guards every route but
    ``/health``, ``"writes"`` guards only ``PUT``/``DELETE /route`` and ``/register_dp_rank``
    (what SGLang's newest server does, so an unmodified SGLang decode can still read).
    ``room_ttl_s``: lifetime of a ``/register_dp_rank`` entry (SGLang's default cleanup interval is
    120 s). ``max_body_bytes``: larger request bodies get 413. ``body_timeout_s``: a request body must
    arrive within this (else 408 and the connection closes), as the gateway's ``--body-timeout-s``.
    """

    host: str = "127.0.0.1"
    port: int = 8998
    ttl_s: float = 10.0
    token: str | None = field(default=None, repr=False)
    token_scope: TokenScope = "all"
    room_ttl_s: float = 120.0
    max_body_bytes: int = 1 << 20
    body_timeout_s: float = 60.0
    max_rooms: int = 1_000_000
    max_ranks: int = 65_536
    sweep_interval_s: float = 1.0
    log_level: str = "warning"

    def __post_init__(self) -> None:
        if not self.host:
            raise ValueError("host: must not be empty")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port: must be in [0, 65535], got {self.port}")
        _check_duration("ttl_s", self.ttl_s, allow_zero=True)
        _check_duration("room_ttl_s", self.room_ttl_s, allow_zero=False)
        _check_duration("sweep_interval_s", self.sweep_interval_s, allow_zero=False)
        if self.token is not None and not is_sendable_token(self.token):
            raise ValueError("token: must be non-empty printable ASCII without whitespace (an HTTP header value)")
        if self.token_scope not in ("all", "writes"):
            raise ValueError(f"token_scope: must be 'all' or 'writes', got {self.token_scope!r}")
        _check_duration("body_timeout_s", self.body_timeout_s, allow_zero=False)
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes: must be >= 1024, got {self.max_body_bytes}")
        if self.max_rooms < 1:
            raise ValueError(f"max_rooms: must be >= 1, got {self.max_rooms}")
        if self.max_ranks < 1:
            raise ValueError(f"max_ranks: must be >= 1, got {self.max_ranks}")
        if self.log_level not in ("critical", "error", "warning", "info", "debug", "trace"):
            raise ValueError(f"log_level: unknown level {self.log_level!r}")


def is_sendable_token(token: str) -> bool:
    """A bearer token an HTTP client can send: non-empty, visible ASCII only (no whitespace, no control
    character, nothing a client would have to encode: httpx refuses non-ASCII header values, and a
    control character makes the request unparsable)."""
    return bool(token) and all("!" <= c <= "~" for c in token)


def _check_duration(name: str, value: float, *, allow_zero: bool) -> None:
    if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value):
        raise ValueError(f"{name}: must be a finite number of seconds, got {value!r}")
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{name}: must be {bound}, got {value}")
