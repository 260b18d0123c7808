"""Stdlib TCP data plane: always available, loopback by default.

Lifecycle:
1. ``TcpBackend(host="127.0.0.1", advertise_host=None, options=None)`` listens on an ephemeral port of
   ``host`` (``0.0.0.0`` for every interface); an accept thread serves every incoming connection with
   its own receive thread. ``options`` (``--transfer-option``, ``OPTIONS``): socket buffer sizes, the
   connect timeout and ``turn_bytes`` (rooms to one peer take turns: ``transfer.peer_threads``).
2. ``register(regions)``: incoming batches may only write inside these regions.
3. ``endpoint()`` is ``b"advertise_host:port"`` (``advertise_host`` defaults to ``host``; a wildcard
   ``host`` needs one); ``connect(endpoint)`` opens one persistent connection per peer
   and starts a sender thread for it.
4. ``write`` queues a batch on the peer's sender thread and returns at once. Wire format per batch:
   header ``(seq u64, room u64, generation u64, n u32)``, ``n`` entries ``(dst u64, len u64)``, then
   the payload bytes, sent zero-copy from the source memory (unless ``fence.live()`` is False by then:
   the write fails without a byte sent). The receiver range-checks every entry against its regions and,
   once fencing is on (``set_fence_listener``), checks that the batch's ``(room, generation)`` fence is
   open (a prefill's KV manager turns fencing on and opens none: it takes no writes at all); then it
   ``recv_into`` the destination memory directly, checking the fence again between blocks (or drains and
   rejects the batch: the connection stays usable) and answers ``(seq u64, status u8)``.
5. Fences (``FencesWrites``): ``close_fence`` refuses the room's later batches at once; a batch of it
   being received finishes into scratch, or, with ``cut``, has its connection shut down (a frozen
   writer would otherwise complete it whenever it resumes); the listener hears when it is out.
6. Workers with a key (``set_kv_keys``, ``transfer.auth``): every data connection proves the key once, before
   its first batch (``transfer.tcp_handshake``, both sides, step by step): the data port sends a fresh nonce and
   must get a proof (``data_proof``) by ``connect_timeout_s`` (on the connection's own thread: the accept loop and
   other connections go on), answers the proof that asks for it with a verdict byte, and closes a connection with
   a wrong or missing proof before any of its bytes reach memory (logged once per address a minute, counted in
   ``num_peers_refused``); ``connect`` raises PROTOCOL when its proof is refused (the two hold different keys: a
   configuration error, not a lost peer; counted in ``num_refused_by_peers``) and retries once with the earlier
   release's plain proof when closed without a verdict. All of ``connect`` (the TCP connect, each step, the
   retry) is one deadline, ``connect_timeout_s``: past it, PEER_UNREACHABLE.
7. ``disconnect``/``close`` shut the sockets down (unblocking a sender stuck on a frozen peer) and join.
Peers, sender threads, write records and their failure on disconnect/close are the shared skeleton of
``transfer.peer_threads``; this module adds the wire format (``_send``) and the receiving side; opening a data
connection and its key handshake are ``transfer.tcp_handshake``'s.
"""

from __future__ import annotations

import ctypes
import logging
import socket
import struct
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from transfer.auth import KVKeys, RefusalLog
from transfer.base import Block, Fence, PeerId, Region, fenced
from transfer.blocks import RegionSet
from transfer.errors import TransferError, TransferErrorKind
from transfer.memkind import device_regions
from transfer.netaddr import accept_retrying, is_wildcard, join_host_port, listener
from transfer.options import Option, parse_options, positive_float, positive_int
from transfer.peer_threads import PeerThreadBackend, SenderPeer
from transfer.tcp_handshake import TcpHandshake

log = logging.getLogger(__name__)

_HEADER = struct.Struct(">QQQI")  # seq, room, generation, number of entries
_ENTRY = struct.Struct(">QQ")
_ACK = struct.Struct(">QB")
_ACK_OK, _ACK_REJECTED, _ACK_FENCED = 0, 1, 2
_MAX_BLOCKS = 1 << 22
_MAX_BATCH_BYTES = 1 << 40
_DRAIN_CHUNK = 1 << 20
_MAX_IOV = 512  # views per sendmsg (the kernel takes up to IOV_MAX = 1024)


def _memory(addr: int, length: int) -> memoryview:
    return memoryview((ctypes.c_ubyte * length).from_address(addr)).cast("B")


def _send_all(sock: socket.socket, views: list[memoryview]) -> None:
    """``sendall`` of every view in order, gathered: one ``sendmsg`` per up to ``_MAX_IOV`` views (a
    small batch is one system call and one wake-up of the receiver, not one per block)."""
    start = 0
    while start < len(views):
        part = views[start : start + _MAX_IOV]
        sent = sock.sendmsg(part)
        while part and sent >= part[0].nbytes:  # drop what went out whole
            sent -= part[0].nbytes
            part = part[1:]
            start += 1
        if part and sent:
            views[start] = part[0][sent:]  # the rest of a view that went out in part


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        r = sock.recv_into(view[got:])
        if r == 0:
            raise ConnectionResetError("peer closed the data connection")
        got += r
    return bytes(buf)


def _recv_into(sock: socket.socket, view: memoryview) -> None:
    while view:
        r = sock.recv_into(view)
        if r == 0:
            raise ConnectionResetError("peer closed the data connection mid-batch")
        view = view[r:]


@dataclass(eq=False)
class _TcpPeer(SenderPeer):
    sock: socket.socket | None = None
    seq: int = 0  # of the last batch sent (its ack must echo it)


def _drain(sock: socket.socket, total: int) -> None:
    scratch = memoryview(bytearray(min(total, _DRAIN_CHUNK) or 1))
    while total:
        step = min(total, len(scratch))
        _recv_into(sock, scratch[:step])
        total -= step


class TcpBackend(PeerThreadBackend):
    name = "tcp"
    thread_name = "kv-tcp-send"
    OPTIONS = (
        Option("sndbuf_bytes", positive_int, "SO_SNDBUF of outgoing data connections (default: the kernel's)"),
        Option("rcvbuf_bytes", positive_int, "SO_RCVBUF of incoming data connections (default: the kernel's)"),
        Option("connect_timeout_s", positive_float,
               "connecting to a peer's data port, key handshake included; also the data port's wait for a "
               "connection's key proof (default 5)"),
        Option("turn_bytes", positive_int,
               "the most of one room's batch sent before another room's turn to the same peer (default 4 MiB)"),
    )

    def __init__(self, host: str = "127.0.0.1", connect_timeout_s: float = 5.0, *,
                 advertise_host: str | None = None, options: dict[str, object] | None = None) -> None:
        opts = parse_options(self.name, options, self.OPTIONS)
        if advertise_host is None and is_wildcard(host):
            raise ValueError(f"tcp: bound to {host!r}, so it needs an advertise_host peers can reach")
        self._host = host
        self._advertise = advertise_host or host
        self._connect_timeout_s = float(opts.get("connect_timeout_s", connect_timeout_s))
        self._sndbuf: int | None = opts.get("sndbuf_bytes")
        self._rcvbuf: int | None = opts.get("rcvbuf_bytes")
        super().__init__()  # peers, sender threads, write records (transfer.peer_threads)
        self.turn_bytes = opts.get("turn_bytes", self.turn_bytes)
        self._regions = RegionSet([])
        self._inbound: list[tuple[socket.socket, threading.Thread]] = []
        # fencing (receiving side), under ``_lock``: on once a listener is set
        self._fence_listener: Callable[[int, int], None] | None = None
        self._open_fences: set[tuple[int, int]] = set()
        self._receiving: dict[socket.socket, tuple[int, int]] = {}  # connection -> fence of the batch it is in
        self._awaited: set[tuple[int, int]] = set()  # closed while being received: tell the listener when out
        self._keys: KVKeys | None = None  # (``set_kv_keys``) the proof every data connection owes
        self._refusals = RefusalLog(log, "tcp backend data port")
        self._handshake = TcpHandshake(self._connect_timeout_s, self._refusals)  # (the key's, both sides)
        self._listener = listener(host, 0)
        if self._rcvbuf is not None:  # inherited by accepted sockets (must be set before the handshake)
            self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, self._rcvbuf)
        self._port = self._listener.getsockname()[1]
        self._accept_thread = threading.Thread(target=self._accept_loop, name="kv-tcp-accept", daemon=True)
        self._accept_thread.start()

    # -- target side -----------------------------------------------------------------------------
    def register(self, regions: Sequence[Region]) -> None:
        on_device = device_regions(regions)
        if on_device:  # recv_into and sendall need host memory
            raise TransferError(
                TransferErrorKind.PROTOCOL,
                f"tcp: moves host memory only, and the KV pool is in GPU memory (cuda:{on_device[0][2]}): "
                "use --transfer nixl or mooncake (its CUDA build) with --device cuda",
            )
        self._regions = RegionSet(regions)

    def set_kv_keys(self, keys: KVKeys | None) -> None:
        """(``ProvesKey``) connections accepted from now on, and those ``connect`` opens, prove ``keys``; one
        accepted before (the listener accepts from the constructor on) proved none of them: it is shut down."""
        with self._lock:
            if keys == self._keys:
                return
            self._keys = keys
            unproven = [sock for sock, _ in self._inbound]
        for sock in unproven:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    @property
    def num_peers_refused(self) -> int:
        return self._refusals.num_refused

    @property
    def num_refused_by_peers(self) -> int:
        """Our data connections whose proof of the key the peer's data port refused (``connect`` raised)."""
        return self._refusals.num_refused_by_peers

    def endpoint(self) -> bytes:
        return join_host_port(self._advertise, self._port).encode()

    def _is_closing(self) -> bool:
        with self._lock:
            return self._closed

    def _accept_loop(self) -> None:
        while True:
            accepted = accept_retrying(self._listener, self._is_closing, "tcp backend")
            if accepted is None:
                return
            sock, addr = accepted
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:  # (the key read and the connection listed at once: ``set_kv_keys`` sees either)
                if self._closed:
                    sock.close()
                    return
                thread = threading.Thread(target=self._serve, args=(sock, self._keys, f"{addr[0]}:{addr[1]}"),
                                          name="kv-tcp-recv", daemon=True)
                self._inbound.append((sock, thread))
            thread.start()

    def set_fence_listener(self, listener: Callable[[int, int], None] | None) -> None:
        with self._lock:
            self._fence_listener = listener

    def open_fence(self, room: int, generation: int) -> None:
        with self._lock:
            self._open_fences.add((room, generation))

    def close_fence(self, room: int, generation: int, *, cut: bool) -> bool:
        fence = (room, generation)
        with self._lock:
            self._open_fences.discard(fence)
            busy = [sock for sock, f in self._receiving.items() if f == fence]
            if not busy:
                return True
            self._awaited.add(fence)
        if cut:
            for sock in busy:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
        return False

    def _serve(self, sock: socket.socket, keys: KVKeys | None = None, peer: str = "") -> None:
        try:
            if keys is not None and not self._handshake.is_proven(sock, keys, peer):
                return
            while True:
                try:
                    head = sock.recv(_HEADER.size, socket.MSG_WAITALL)
                except OSError:
                    return
                if not head:
                    return
                if len(head) < _HEADER.size:
                    head += _recv_exact(sock, _HEADER.size - len(head))
                seq, room, generation, count = _HEADER.unpack(head)
                if count > _MAX_BLOCKS:
                    log.warning("tcp backend: batch of %d blocks refused, closing the connection", count)
                    return
                raw = _recv_exact(sock, count * _ENTRY.size)
                entries = [_ENTRY.unpack_from(raw, i * _ENTRY.size) for i in range(count)]
                total = sum(length for _, length in entries)
                if total > _MAX_BATCH_BYTES:
                    log.warning("tcp backend: batch of %d bytes refused, closing the connection", total)
                    return
                fence = (room, generation)
                with self._lock:
                    status = _ACK_OK
                    if not self._regions.all_contain(entries):
                        status = _ACK_REJECTED
                    elif self._fence_listener is not None and fence not in self._open_fences:
                        status = _ACK_FENCED
                    else:
                        self._receiving[sock] = fence
                if status == _ACK_OK:
                    status = self._receive(sock, entries, fence)
                else:
                    _drain(sock, total)
                sock.sendall(_ACK.pack(seq, status))
        except OSError:
            return
        finally:
            sock.close()
            with self._lock:
                self._inbound = [(s, t) for s, t in self._inbound if s is not sock]

    def _receive(self, sock: socket.socket, entries: list[tuple[int, int]], fence: tuple[int, int]) -> int:
        """One admitted batch straight into our memory; the rest into scratch if its fence closes."""
        status = _ACK_OK
        try:
            for i, (dst, length) in enumerate(entries):
                if self._fence_listener is not None and fence not in self._open_fences:
                    _drain(sock, sum(n for _, n in entries[i:]))
                    status = _ACK_FENCED
                    break
                if length:
                    _recv_into(sock, _memory(dst, length))
        finally:
            with self._lock:
                del self._receiving[sock]
                quiet = fence in self._awaited and fence not in self._receiving.values()
                if quiet:
                    self._awaited.discard(fence)
                listener = self._fence_listener
            if quiet and listener is not None:
                listener(*fence)
        return status

    # -- initiator side --------------------------------------------------------------------------
    def connect(self, endpoint: bytes) -> PeerId:
        """One deadline, ``connect_timeout_s``, for all of it: the TCP connect, the key's handshake and its one
        retry (a peer that stalls between the steps, or sends a byte now and then, fails it PEER_UNREACHABLE then,
        not after a timeout per step). Blocks the caller meanwhile (a prefill: that decode's control reader)."""
        address = endpoint.decode(errors="replace")
        deadline = time.monotonic() + self._connect_timeout_s
        sock = self._handshake.dial(address, deadline)
        with self._lock:
            keys = self._keys
        if keys is not None:  # (still by the deadline: a peer that sends no nonce fails the connect)
            sock = self._handshake.prove(sock, keys, address, deadline)
        sock.settimeout(None)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self._sndbuf is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self._sndbuf)
        return self._add_peer(_TcpPeer(label=address, sock=sock))

    def _send(self, peer: SenderPeer, blocks: list[Block], fence: Fence) -> TransferError | None:
        assert isinstance(peer, _TcpPeer) and peer.sock is not None
        peer.seq += 1
        sock, seq = peer.sock, peer.seq
        try:
            entries = b"".join(_ENTRY.pack(dst, length) for _, dst, length in blocks)
            head = _HEADER.pack(seq, fence.room, fence.generation, len(blocks)) + entries
            _send_all(sock, [memoryview(head), *(_memory(src, length) for src, _, length in blocks if length)])
            acked, status = _ACK.unpack(_recv_exact(sock, _ACK.size))
            if acked != seq:
                raise ConnectionError(f"ack for batch {acked}, expected {seq}")
        except OSError as exc:
            peer.dead = peer.dead or TransferError(
                TransferErrorKind.PEER_GONE, f"tcp: connection to {peer.label} broke: {exc}"
            )
            return peer.dead
        if status == _ACK_OK:
            return None
        if status == _ACK_FENCED:
            return fenced("tcp", fence)
        return TransferError(TransferErrorKind.RANGE_REJECTED,
                             f"tcp: {peer.label} rejected a batch writing outside its registered memory")

    def _interrupt(self, peer: SenderPeer) -> None:
        """Unblock a sender stuck on a frozen peer."""
        if isinstance(peer, _TcpPeer) and peer.sock is not None:
            try:
                peer.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def _peer_ended(self, peer: SenderPeer) -> None:
        if isinstance(peer, _TcpPeer) and peer.sock is not None:
            try:
                peer.sock.close()
            except OSError:
                pass

    def _close_resources(self, threads_ended: bool) -> None:
        with self._lock:
            inbound = list(self._inbound)
            self._inbound.clear()
        # shutdown() wakes a thread blocked in accept(); close() alone may not on Linux
        try:
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()
        self._accept_thread.join(timeout=5.0)
        for sock, thread in inbound:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            thread.join(timeout=5.0)
