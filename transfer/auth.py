"""Proof of the workers' key on the KV plane: our control channel and the tcp data port.

A worker started with a key (``pd-worker --api-key``) hands it to its KV manager; the manager derives
two keys from it (``KVKeys``: one for the control channel, one for the tcp data port; the worker key
itself never leaves the process) and every connection proves them once, before anything else is taken:
1. Control (``transfer.messages``): the decode sends ``AuthHello(version, decode_nonce)``; the prefill
   answers ``AuthChallenge(prefill_nonce, proof)``, its proof over both nonces; the decode checks it
   (a prefill that cannot prove the key is not ours: the decode closes, its memory undisclosed) and
   sends ``AuthProof(proof)``, its own proof (another label: a reflected proof is no proof), then its
   ``Register`` as before. A peer that proves nothing, or wrongly, is refused with ``RegisterAck(ok=False,
   kind="protocol")`` and closed. Without a key neither side sends any of this (the protocol as before);
   a prefill with a key refuses a decode without one, and one without a key refuses a decode with one,
   each with a reason that says so.
2. Data (``transfer.tcp``): the receiving side sends a fresh nonce as a connection's first bytes, the
   connecting side answers ``data_proof(verdict=True)``, the receiving side its verdict (one byte) before the
   first batch (the earlier release's plain ``data_proof`` gets none, as it expects); a wrong or missing proof
   closes the connection before a byte of it reaches memory, and the connecting side's ``connect`` fails
   PROTOCOL saying that its proof was refused (a configuration error, not a lost peer).
A refusal is logged on both sides, once per peer address a minute (``RefusalLog``: ``refused`` on the refusing
side, which counts it in ``num_peers_refused``; ``refused_us`` on the refused one), never with a key or a proof.
Per connection, never per room. Proofs are HMAC-SHA256 and compared with ``hmac.compare_digest``.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import math
import secrets
import threading
import time
from dataclasses import dataclass, field

NONCE_BYTES = 32
PROOF_BYTES = 32  # (SHA-256)
REFUSAL_LOG_S = 60.0  # a refused peer address is logged at most this often
_MAX_LOGGED_PEERS = 4096  # addresses remembered for the rate limit (a scan of many addresses forgets the oldest)
_MAX_LOGGED_REASON = 400  # characters of a peer's own reason that are logged (it is the peer's text)

_DERIVE_LABEL = b"pd-gateway kv-plane key v1"
_PREFILL_LABEL = b"pd-kv control: prefill"
_DECODE_LABEL = b"pd-kv control: decode"
_DATA_LABEL = b"pd-kv tcp data"
# (the proof of a connecting side that reads the data port's verdict: an earlier release's data port takes it for a
# wrong one and closes; an earlier release's connecting side sends the plain one and reads no verdict)
_DATA_VERDICT_LABEL = b"pd-kv tcp data, verdict"


@dataclass(frozen=True)
class KVKeys:
    """The keys derived from the worker key (``derive``); ``repr`` shows none of them."""

    control: bytes = field(repr=False)
    data: bytes = field(repr=False)


def derive(worker_key: str | None) -> KVKeys | None:
    """The KV plane's keys for ``worker_key`` (None: no key, no proofs: the protocol as before)."""
    if worker_key is None:
        return None
    if not worker_key:
        raise ValueError("the worker key for the KV plane must not be empty")
    root = hmac.new(worker_key.encode(), _DERIVE_LABEL, hashlib.sha256).digest()
    return KVKeys(control=hmac.new(root, b"control", hashlib.sha256).digest(),
                  data=hmac.new(root, b"data", hashlib.sha256).digest())


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def _mac(key: bytes, label: bytes, *parts: bytes) -> bytes:
    mac = hmac.new(key, label, hashlib.sha256)
    for part in parts:
        mac.update(len(part).to_bytes(4, "big"))  # (length-prefixed: no two splits of the bytes read alike)
        mac.update(part)
    return mac.digest()


def prefill_proof(keys: KVKeys, decode_nonce: bytes, prefill_nonce: bytes) -> bytes:
    return _mac(keys.control, _PREFILL_LABEL, decode_nonce, prefill_nonce)


def decode_proof(keys: KVKeys, decode_nonce: bytes, prefill_nonce: bytes) -> bytes:
    return _mac(keys.control, _DECODE_LABEL, decode_nonce, prefill_nonce)


def data_proof(keys: KVKeys, nonce: bytes, *, verdict: bool = False) -> bytes:
    """``verdict``: the proof of a connecting side that asks for the data port's verdict (``transfer.tcp``)."""
    return _mac(keys.data, _DATA_VERDICT_LABEL if verdict else _DATA_LABEL, nonce)


def is_valid(expected: bytes, got: bytes) -> bool:
    """Constant-time comparison of a proof."""
    return hmac.compare_digest(expected, got)


class RefusalLog:
    """Warns about a refused peer at most once per ``REFUSAL_LOG_S`` per address (a peer retrying in a loop,
    or a scan, must not flood the log); counts every refusal (``num_refused``). The other way round too: a peer
    that refused us (``refused_us``: our proof of the key, our registration) is warned about as seldom and
    counted apart (``num_refused_by_peers``). No reason logged here carries a key or a proof."""

    def __init__(self, logger: logging.Logger, what: str) -> None:
        self._log = logger
        self._what = what
        self._lock = threading.Lock()
        self._last: dict[tuple[str, bool], float] = {}  # (host, whether it refused us) -> when last logged
        self.num_refused = 0
        self.num_refused_by_peers = 0

    def refused(self, peer: str, reason: str) -> None:
        """We refused ``peer`` (``[name@]host:port``); the rate limit goes by everything before the port (a
        peer that reconnects comes from a new port each time)."""
        if self._count(peer, us=False):
            self._log.warning("%s: refused %s: %s (the next refusals of this address in %gs are not logged)",
                              self._what, peer, reason, REFUSAL_LOG_S)

    def refused_us(self, peer: str, reason: str) -> None:
        """``peer`` refused us (``reason``: what it or its close says); logged as seldom as ``refused``."""
        if self._count(peer, us=True):
            self._log.warning("%s: %s refused this worker: %s (the next refusals by this address in %gs are not "
                              "logged)", self._what, peer, reason[:_MAX_LOGGED_REASON], REFUSAL_LOG_S)

    def _count(self, peer: str, *, us: bool) -> bool:
        """Count a refusal; True if it is to be logged."""
        now = time.monotonic()
        key = (peer.rsplit(":", 1)[0], us)
        with self._lock:
            if us:
                self.num_refused_by_peers += 1
            else:
                self.num_refused += 1
            if now - self._last.get(key, -math.inf) < REFUSAL_LOG_S:
                return False
            if len(self._last) >= _MAX_LOGGED_PEERS:
                self._last.pop(next(iter(self._last)))
            self._last.pop(key, None)  # (re-inserted last: the dict's order is the age)
            self._last[key] = now
        return True
