"""Opening a tcp data connection, and its key handshake, both sides (``transfer.tcp``; proofs: ``transfer.auth``).

One ``TcpHandshake`` per backend: its ``connect_timeout_s`` (``timeout_s``) and its ``RefusalLog`` (of the backend's
state, the only thing it touches). Every method blocks its caller, ``timeout_s`` at most. Step by step:
1. Connecting side (``TcpBackend.connect``): ``dial(address, deadline)``, a TCP connection, each of the name's
   addresses tried in turn with what is left of the deadline. Without a key (``set_kv_keys``), that is all: the
   batches follow (``transfer.tcp``'s wire format). The deadline, ``connect_timeout_s`` from the start, is one
   for all of the steps below on this side, the retry included; past it, PEER_UNREACHABLE.
2. Receiving side (an accepted connection's receive thread, before its first batch header: the accept loop and
   other connections go on): ``is_proven(sock, keys, peer)`` sends a fresh nonce (``NONCE_BYTES``) and reads the
   proof (``PROOF_BYTES``), both by one deadline, ``timeout_s`` from the start, however the bytes are spaced out.
3. Connecting side: ``prove(sock, keys, address, deadline)`` reads the nonce (none: PEER_UNREACHABLE, "a data
   port without the key?") and sends the asking proof, ``data_proof(verdict=True)``.
4. Receiving side: the asking proof is answered ``_PROOF_ACCEPTED`` (one byte); the plain proof (``data_proof``,
   the earlier release's connecting side: its first batch follows at once, then it reads its ack) is taken with
   no answer. A wrong proof is answered ``_PROOF_REFUSED`` and the sending side shut down; a missing or late one
   gets nothing. Either is ``refused`` (logged once per address a minute, counted in ``num_peers_refused``) and
   False: the caller closes the connection before any of its bytes reach memory. True leaves no socket timeout.
5. Connecting side reads the verdict: accepted, connected; refused, PROTOCOL ("the two workers hold different
   keys": a configuration error, not a lost peer; ``refused_us``, logged once per address a minute, counted in
   ``num_refused_by_peers``); any other byte, PROTOCOL.
6. Closed without a verdict (an earlier release's data port takes the asking proof for a wrong one; or it went
   away): once more, by the same deadline, ``dial`` and the plain proof, reading no verdict, as the earlier
   release did (there a wrong key shows as the first write failing, PEER_GONE, nothing of it landed).
Once per connection: the batches that follow are ``transfer.tcp``'s.
"""

from __future__ import annotations

import socket
import time

from transfer.auth import NONCE_BYTES, PROOF_BYTES, KVKeys, RefusalLog, data_proof, is_valid, new_nonce
from transfer.errors import TransferError, TransferErrorKind
from transfer.netaddr import split_host_port

_PROOF_ACCEPTED, _PROOF_REFUSED = b"\x00", b"\x01"  # the receiving side's verdict on a connection's key proof


def _recv_by(sock: socket.socket, n: int, deadline: float) -> bytes:
    """``n`` bytes, all of them by ``deadline`` (``time.monotonic()``), however the peer spaces them out (a timeout
    per ``recv`` would let one that sends a byte now and then hold us ``n`` timeouts): TimeoutError past it,
    ConnectionResetError if the peer closes first. (Only for a handshake: batches and acks read without one.)"""
    buf = bytearray()
    while len(buf) < n:
        _set_timeout_by(sock, deadline)
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionResetError("peer closed the data connection")
        buf += chunk
    return bytes(buf)


def _set_timeout_by(sock: socket.socket, deadline: float) -> None:
    """The socket's timeout: what is left until ``deadline``; TimeoutError if nothing is."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("timed out")
    sock.settimeout(left)


class TcpHandshake:
    """Both sides of a tcp data connection's setup for one backend: ``timeout_s`` is its ``connect_timeout_s``,
    ``refusals`` the backend's log and counts of refusals (either way)."""

    def __init__(self, timeout_s: float, refusals: RefusalLog) -> None:
        self.timeout_s = timeout_s
        self._refusals = refusals

    # -- connecting side -------------------------------------------------------------------------
    def dial(self, address: str, deadline: float) -> socket.socket:
        """A TCP connection to ``address`` by ``deadline`` (each of a name's addresses tried in turn, with what is
        left of it; a host name's DNS look-up is the system's, not bounded here: endpoints are addresses as a rule)."""
        failure: OSError | ValueError | None = None
        try:
            infos = socket.getaddrinfo(*split_host_port(address), type=socket.SOCK_STREAM)
        except (OSError, ValueError) as exc:  # (ValueError: no port; a host name that does not encode)
            failure, infos = exc, []
        for family, kind, proto, _, sockaddr in infos:
            sock = socket.socket(family, kind, proto)
            try:
                _set_timeout_by(sock, deadline)
                sock.connect(sockaddr)
                return sock
            except OSError as exc:
                sock.close()
                failure = exc
                if isinstance(exc, TimeoutError):
                    break
        why = self._why(failure) if isinstance(failure, OSError) else str(failure or "no address")
        raise TransferError(TransferErrorKind.PEER_UNREACHABLE, f"tcp: cannot connect to {address}: {why}") from failure

    def prove(self, sock: socket.socket, keys: KVKeys, address: str, deadline: float) -> socket.socket:
        """Our proof of ``keys`` on ``sock`` (just dialled), by ``deadline``, and the one retry with the plain
        proof on a new connection if the data port closes on the asking one without a verdict. Returns the
        connection to use (``sock`` or its replacement, its timeout still set); raises TransferError, every
        socket it had closed."""
        try:
            if not self._prove_once(sock, keys, address, deadline):
                # closed on our proof without a verdict: a data port of the earlier release (ours, asking for a
                # verdict, is a wrong one there), or one that went away: once more with the proof it takes
                sock.close()
                sock = self.dial(address, deadline)
                self._prove_once(sock, keys, address, deadline, verdict=False)
        except BaseException:
            sock.close()
            raise
        return sock

    def _prove_once(self, sock: socket.socket, keys: KVKeys, address: str, deadline: float, *,
                    verdict: bool = True) -> bool:
        """Our side of a data connection's key handshake, by ``deadline``: its nonce, our proof, its verdict. False:
        closed on our proof without a verdict. ``verdict`` False: the earlier release's handshake (the plain proof,
        no verdict: a wrong key shows as the first write failing, PEER_GONE, nothing of it landed)."""
        try:
            nonce = _recv_by(sock, NONCE_BYTES, deadline)
            _set_timeout_by(sock, deadline)
            sock.sendall(data_proof(keys, nonce, verdict=verdict))
        except OSError as exc:
            raise TransferError(TransferErrorKind.PEER_UNREACHABLE, f"tcp: {address} did not start the "
                                f"workers' key handshake: {self._why(exc)} (a data port without the key?)") from exc
        if not verdict:
            return True
        try:
            answer = _recv_by(sock, 1, deadline)
        except ConnectionResetError:
            answer = b""  # (closed: the same)
        except OSError as exc:
            raise TransferError(TransferErrorKind.PEER_UNREACHABLE, f"tcp: {address} gave no verdict on the "
                                f"workers' key proof: {self._why(exc)}") from exc
        if answer == _PROOF_ACCEPTED:
            return True
        if answer == _PROOF_REFUSED:
            reason = (f"tcp: data port {address} refused the connecting worker's proof of the workers' key (the two "
                      "workers hold different keys: --api-key / $PD_WORKER_API_KEY)")
            self._refusals.refused_us(address, "it refused our proof of the workers' key (its key differs from "
                                      "ours: --api-key / $PD_WORKER_API_KEY)")
            raise TransferError(TransferErrorKind.PROTOCOL, reason)
        if not answer:  # (closed with no verdict: a data port of the earlier release, or one that went away)
            return False
        raise TransferError(TransferErrorKind.PROTOCOL, f"tcp: {address} answered the workers' key proof with "
                            f"{answer!r}, not a verdict (another release?)")

    def _why(self, exc: OSError) -> str:
        if isinstance(exc, TimeoutError):
            return f"not within connect_timeout_s ({self.timeout_s:g}s)"
        return str(exc) or type(exc).__name__

    # -- receiving side --------------------------------------------------------------------------
    def is_proven(self, sock: socket.socket, keys: KVKeys, peer: str) -> bool:
        """The connection's first bytes prove the key (a nonce sent first: a fresh proof per connection)."""
        nonce = new_nonce()
        # (one deadline for the whole proof: a peer that sends nothing, or a byte now and then, holds this
        # connection's thread ``timeout_s`` at most; other connections have threads of their own)
        deadline = time.monotonic() + self.timeout_s
        try:
            _set_timeout_by(sock, deadline)
            sock.sendall(nonce)
            proof = _recv_by(sock, PROOF_BYTES, deadline)
        except OSError as exc:
            why = f"not within {self.timeout_s:g}s" if isinstance(exc, TimeoutError) else (
                str(exc) or type(exc).__name__)
            self._refusals.refused(peer, f"no proof of the workers' key ({why})")
            return False
        asks = is_valid(data_proof(keys, nonce, verdict=True), proof)  # (this release's connecting side)
        if not asks and not is_valid(data_proof(keys, nonce), proof):  # (nor an earlier release's)
            self._refusals.refused(peer, "a wrong proof of the workers' key (another --api-key, or none)")
            try:  # (told, so that it says why rather than take the close for a lost peer; nothing of it is read)
                sock.sendall(_PROOF_REFUSED)
                sock.shutdown(socket.SHUT_WR)
            except OSError:
                pass
            return False
        if asks:  # (an earlier release's reads no verdict: its first batch follows, then it reads its ack)
            sock.sendall(_PROOF_ACCEPTED)  # (one byte to a fresh connection: sent at once; an OSError: closed)
        sock.settimeout(None)
        return True
