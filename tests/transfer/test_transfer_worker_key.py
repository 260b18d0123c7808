"""The KV plane with the workers' key (``KVManager(auth_key=...)``, ``transfer.auth``): real managers over tcp.
Two workers with the same key move KV as before; a decode with another key, or none, is refused on the prefill's
control port with the reason (and a prefill that cannot prove the key gets no Register from a decode); the tcp
data port refuses and closes a connection that does not prove the key before any of its bytes reach memory; no key
on either side works as before. Before, anything that reached these ports was served. (What a refusal looks like
on the refused side: test_transfer_key_refusals.py.)"""

from __future__ import annotations

import ctypes
import logging
import socket
import struct
from typing import Any

import pytest
from kvunit import make_args, open_room, wait_for

from transfer import KVManager, KVPoll, KVTimeouts, TransferError, TransferErrorKind
from transfer.auth import NONCE_BYTES, data_proof, decode_proof, derive, new_nonce
from transfer.messages import (
    PROTOCOL_VERSION,
    AuthChallenge,
    AuthHello,
    AuthProof,
    FrameReader,
    Register,
    RegisterAck,
    encode_frame,
)
from transfer.tcp import TcpBackend

pytestmark = pytest.mark.timeout(60)

_FAST = KVTimeouts(bootstrap_s=5.0)


def _page(args: Any, page: int) -> bytes:
    """Page ``page`` of layer 0's K buffer."""
    item = args.kv_item_lens[0]
    return ctypes.string_at(args.kv_ptrs[0] + page * item, item)


def _fill(args: Any, page: int, byte: int) -> None:
    item = args.kv_item_lens[0]
    ctypes.memset(args.kv_ptrs[0] + page * item, byte, item)


def _pair(prefill_key: str | None, decode_key: str | None) -> tuple[KVManager, KVManager, Any, Any]:
    p_args, d_args = make_args(), make_args()
    prefill = KVManager("prefill", p_args, TcpBackend("127.0.0.1"), timeouts=_FAST, auth_key=prefill_key)
    decode = KVManager("decode", d_args, TcpBackend("127.0.0.1"), timeouts=_FAST, auth_key=decode_key)
    _fill(p_args, 3, 0xAB)
    _fill(d_args, 9, 0)
    return prefill, decode, p_args, d_args


@pytest.mark.parametrize("key", ["fleet-key", None], ids=["same-key", "no-key"])
def test_workers_with_the_same_key_or_none_move_kv(key: str | None) -> None:
    prefill, decode, p_args, d_args = _pair(key, key)
    try:
        sender, receiver = open_room(prefill, decode, 1, [9], 0)
        sender.send([3], last=True)
        assert wait_for(lambda: receiver.poll() == KVPoll.Success, 10), receiver.failure()
        assert sender.poll() == KVPoll.Success
        assert _page(d_args, 9) == _page(p_args, 3)
        assert prefill.num_peers_refused == decode.num_peers_refused == 0
        sender.release()
        receiver.release()
    finally:
        decode.close()
        prefill.close()


@pytest.mark.parametrize(("prefill_key", "decode_key", "said"), [
    ("fleet-key", "other-key", "did not prove the worker key"),
    ("fleet-key", None, "requires the worker key"),
    (None, "fleet-key", "the decode has a worker key and this prefill none"),
], ids=["wrong-key", "decode-without", "prefill-without"])
def test_a_decode_without_the_prefills_key_is_refused_and_gets_no_kv(
        prefill_key: str | None, decode_key: str | None, said: str, caplog: pytest.LogCaptureFixture) -> None:
    prefill, decode, _, d_args = _pair(prefill_key, decode_key)
    caplog.set_level(logging.WARNING, logger="transfer")
    try:
        for room in (1, 2):  # (the second connection's refusal is counted, not logged again)
            sender = prefill.create_sender(room)
            receiver = decode.create_receiver(room, *prefill.control_address)
            assert wait_for(lambda r=receiver: r.poll() == KVPoll.Failed, 10)  # type: ignore[misc]
            failure = receiver.failure()
            assert failure is not None and failure.kind == TransferErrorKind.PROTOCOL, failure
            assert said in failure.message, failure.message
            assert sender.poll() != KVPoll.Success and sender.request is None  # no page list reached it
            sender.release()
            receiver.release()
        assert _page(d_args, 9) == bytes(len(_page(d_args, 9)))  # nothing of the prefill's KV landed
        assert not prefill.backend._peers  # type: ignore[attr-defined]  # its data path never opened
        refusing = decode if "did not prove" in said else prefill
        assert wait_for(lambda: refusing.num_peers_refused == 2, 5), refusing.num_peers_refused
        for side in ("transfer.prefill", "transfer.decode"):  # once on each side (the refused one says so too)
            assert wait_for(lambda s=side: any(r.name == s for r in caplog.records), 5)  # type: ignore[misc]
            logged = [r for r in caplog.records if r.name == side and "refused" in r.getMessage()]
            assert len(logged) == 1, [r.getMessage() for r in logged]
    finally:
        decode.close()
        prefill.close()


def _control(prefill: KVManager) -> tuple[socket.socket, FrameReader]:
    sock = socket.create_connection(prefill.control_address, timeout=10)
    return sock, FrameReader(sock)


def _register_frame(args: Any, version: int = PROTOCOL_VERSION) -> bytes:
    return encode_frame(Register(
        version, "tcp", b"127.0.0.1:1", args.kv_ptrs, args.kv_data_lens, args.kv_item_lens,
        args.aux_ptrs, args.aux_data_lens, args.aux_item_lens, args.page_size, args.kv_dtype))


def _refusal(reader: FrameReader) -> RegisterAck:
    ack = reader.read()
    assert isinstance(ack, RegisterAck) and not ack.ok and ack.kind == "protocol", ack
    assert reader.read() is None  # and the connection closed
    return ack


def test_a_keyed_prefill_refuses_a_wrong_proof_a_bare_register_and_a_room_on_its_control_port() -> None:
    args = make_args()
    prefill = KVManager("prefill", args, TcpBackend("127.0.0.1"), timeouts=_FAST, auth_key="fleet-key")
    try:
        sock, reader = _control(prefill)  # a proof under another key
        with sock:
            nonce = new_nonce()
            sock.sendall(encode_frame(AuthHello(PROTOCOL_VERSION, nonce)))
            challenge = reader.read()
            assert isinstance(challenge, AuthChallenge) and len(challenge.nonce) == NONCE_BYTES
            assert b"fleet-key" not in challenge.proof  # (a MAC, never the key)
            wrong = derive("other-key")
            assert wrong is not None
            sock.sendall(encode_frame(AuthProof(decode_proof(wrong, nonce, challenge.nonce))) + _register_frame(args))
            assert "worker key is not this prefill's" in _refusal(reader).reason
        sock, reader = _control(prefill)  # no handshake at all
        with sock:
            sock.sendall(_register_frame(args))
            assert "requires the worker key" in _refusal(reader).reason
        sock, reader = _control(prefill)  # an old decode: the version's clear error, before the key's
        with sock:
            sock.sendall(_register_frame(args, version=1))
            assert f"protocol version 1, this prefill speaks {PROTOCOL_VERSION}" in _refusal(reader).reason
        assert prefill.num_peers_refused == 3
        assert _scraped_refusals(prefill) == 3  # (what /metrics shows: pd_worker_kv_peers_refused_total)
        assert not prefill.backend._peers  # type: ignore[attr-defined]
    finally:
        prefill.close()


def _scraped_refusals(manager: KVManager) -> float:
    """``pd_worker_kv_peers_refused_total`` as a worker's ``/metrics`` renders it for ``manager``."""
    from types import SimpleNamespace

    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from workers.metrics import SchedulerMetrics, _transfer_metrics

    class _Families:
        def collect(self) -> Any:
            return _transfer_metrics("prefill", SimpleNamespace(metrics=SchedulerMetrics()), manager)

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families())  # type: ignore[arg-type]
    text = generate_latest(registry).decode()
    return sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
               if sample.name == "pd_worker_kv_peers_refused_total" and sample.labels == {"role": "prefill"})


def _batch(dst: int, payload: bytes) -> bytes:
    return struct.pack(">QQQI", 1, 7, 1, 1) + struct.pack(">QQ", dst, len(payload)) + payload


def _answer_until_closed(sock: socket.socket) -> bytes:
    """Every byte the peer sent until it closed (a reset too: it closed with our batch unread)."""
    answer = b""
    try:
        while chunk := sock.recv(64):
            answer += chunk
    except ConnectionResetError:
        pass
    return answer


def test_the_tcp_data_port_closes_a_connection_that_does_not_prove_the_key() -> None:
    keys = derive("fleet-key")
    buf = (ctypes.c_ubyte * 64)()
    dst = ctypes.addressof(buf)
    target = TcpBackend("127.0.0.1")  # (no fence listener: a batch inside its memory lands, once proven)
    target.set_kv_keys(keys)
    target.register([(dst, 64)])
    host, port = target.endpoint().decode().rsplit(":", 1)
    payload = b"POISONED-KV-PAGE"
    try:
        other = derive("other-key")
        assert keys is not None and other is not None
        wrong = (b"", bytes(32), data_proof(other, bytes(NONCE_BYTES)))  # none, garbage, another key's
        for proof in wrong:
            with socket.create_connection((host, int(port)), timeout=10) as sock:
                nonce = sock.recv(NONCE_BYTES, socket.MSG_WAITALL)
                assert len(nonce) == NONCE_BYTES
                sock.sendall(proof + _batch(dst, payload))
                assert _answer_until_closed(sock) == b"\x01"  # refused (its verdict), and no ack: closed
        with socket.create_connection((host, int(port)), timeout=10) as sock:  # another key's, asking a verdict
            sock.sendall(data_proof(other, sock.recv(NONCE_BYTES, socket.MSG_WAITALL), verdict=True))
            assert _answer_until_closed(sock) == b"\x01"
        assert bytes(buf[:len(payload)]) == bytes(len(payload))
        assert target.num_peers_refused == 4
        with socket.create_connection((host, int(port)), timeout=10) as sock:  # the right proof: written
            sock.sendall(data_proof(keys, sock.recv(NONCE_BYTES, socket.MSG_WAITALL)) + _batch(dst, payload))
            assert struct.unpack(">QB", sock.recv(9, socket.MSG_WAITALL)) == (1, 0)  # (no verdict asked, none)
        assert bytes(buf[:len(payload)]) == payload
        ctypes.memset(dst, 0, len(payload))
        with socket.create_connection((host, int(port)), timeout=10) as sock:  # the right one, asking a verdict
            sock.sendall(data_proof(keys, sock.recv(NONCE_BYTES, socket.MSG_WAITALL), verdict=True))
            assert sock.recv(1, socket.MSG_WAITALL) == b"\x00"  # accepted (its verdict)
            sock.sendall(_batch(dst, payload))
            assert struct.unpack(">QB", sock.recv(9, socket.MSG_WAITALL)) == (1, 0)
        assert bytes(buf[:len(payload)]) == payload
    finally:
        target.close()


def test_a_tcp_sender_with_another_key_lands_nothing() -> None:
    buf = (ctypes.c_ubyte * 64)()
    src = (ctypes.c_ubyte * 64)(*([0x5A] * 64))
    target, writer = TcpBackend("127.0.0.1"), TcpBackend("127.0.0.1")
    target.set_kv_keys(derive("fleet-key"))
    writer.set_kv_keys(derive("other-key"))
    target.register([(ctypes.addressof(buf), 64)])
    writer.register([(ctypes.addressof(src), 64)])
    try:
        with pytest.raises(TransferError) as refused:  # (before: connected, its first write failed PEER_GONE)
            writer.connect(target.endpoint())
        assert refused.value.kind == TransferErrorKind.PROTOCOL, refused.value  # the key refused, not a lost peer
        assert "proof of the workers' key" in refused.value.message
        assert bytes(buf) == bytes(64)
        assert target.num_peers_refused == 1
    finally:
        writer.close()
        target.close()
