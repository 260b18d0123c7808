"""What a refused workers' key looks like on the KV plane (``transfer.auth``), on both sides: real managers and
backends over loopback sockets.

- A tcp data port whose key differs from the connecting prefill's answers its proof with a refusal: the prefill's
  ``connect`` fails PROTOCOL saying the key was refused (a configuration error, not a lost peer), the decode's
  registration is refused with that reason, both sides log it once, the data port counts it. Before, the data
  port only closed the connection: the registration went through and the first write failed PEER_GONE.
- A keyed decode reaching a prefill of an earlier release (it cannot decode ``AuthHello`` and closes): the rooms
  fail saying the prefill does not support the workers' KV keys (PEER_GONE still: held against the prefill, which
  may as well have gone away at that moment: test_transfer_key_refused_us.py). Before: "peer closed".
- A mismatched key on the control channel: the refusing side logs and counts it, the other side logs one line
  too (before, a prefill whose proof the decode refused, and a decode whose registration was refused, said
  nothing); no key is ever in a log line.
"""

from __future__ import annotations

import ctypes
import logging
import socket
import struct
import threading
from typing import Any

import msgspec
import pytest
from kvunit import make_args, wait_for

from transfer import KVManager, KVPoll, KVTimeouts, TransferError, TransferErrorKind
from transfer.auth import derive
from transfer.messages import Abort, Ping, Pong, Quiesced, Register, RegisterAck, RoomRequest, RoomStatus
from transfer.tcp import TcpBackend

pytestmark = pytest.mark.timeout(60)

_FAST = KVTimeouts(bootstrap_s=5.0)
_KEYS = ("fleet-key", "other-key")


def _settled(receiver: Any) -> bool:
    return receiver.poll() in (KVPoll.Failed, KVPoll.WaitingForInput, KVPoll.Success)


def _lines(caplog: pytest.LogCaptureFixture, logger: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == logger and r.levelno >= logging.WARNING]


def _no_key_logged(caplog: pytest.LogCaptureFixture) -> None:
    for record in caplog.records:
        assert not any(key in record.getMessage() for key in _KEYS), record.getMessage()


def test_a_data_port_with_another_key_refuses_the_registration_with_the_reason(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="transfer")
    p_args, d_args = make_args(), make_args()
    prefill = KVManager("prefill", p_args, TcpBackend("127.0.0.1"), timeouts=_FAST, auth_key="fleet-key")
    decode = KVManager("decode", d_args, TcpBackend("127.0.0.1"), timeouts=_FAST, auth_key="fleet-key")
    decode.backend.set_kv_keys(derive("other-key"))  # type: ignore[attr-defined]  # its data port: another key
    item = d_args.kv_item_lens[0]
    ctypes.memset(d_args.kv_ptrs[0] + 9 * item, 0, item)
    try:
        for room in (1, 2):  # (the second refusal is counted, not logged again)
            sender = prefill.create_sender(room)
            receiver = decode.create_receiver(room, *prefill.control_address)
            assert wait_for(lambda r=receiver: _settled(r), 10)  # type: ignore[misc]
            failure = receiver.failure()
            assert receiver.poll() == KVPoll.Failed, "registered over a data port that refused the key"
            assert failure is not None and failure.kind == TransferErrorKind.PROTOCOL, failure
            assert "refused the connecting worker's proof of the workers' key" in failure.message, failure.message
            assert sender.request is None  # no page list reached the prefill
            sender.release()
            receiver.release()
        assert ctypes.string_at(d_args.kv_ptrs[0] + 9 * item, item) == bytes(item)  # nothing landed
        assert not prefill.backend._peers  # type: ignore[attr-defined]  # no data path kept
        assert wait_for(lambda: decode.num_peers_refused == 2, 5), decode.num_peers_refused  # the refusing side
        assert prefill.num_peers_refused == 0
        assert prefill.backend.num_refused_by_peers == 2  # type: ignore[attr-defined]
        refused_us = _lines(caplog, "transfer.tcp")
        said = [line for line in refused_us if "refused this worker" in line and "workers' key" in line]
        assert len(said) == 1, refused_us  # the prefill's one line
        assert len([line for line in refused_us if "refused 127.0.0.1" in line]) == 1, refused_us  # the data port's
        _no_key_logged(caplog)
    finally:
        decode.close()
        prefill.close()


def test_a_tcp_connect_refused_for_its_key_is_a_protocol_error_not_a_lost_peer() -> None:
    target, writer = TcpBackend("127.0.0.1"), TcpBackend("127.0.0.1")
    target.set_kv_keys(derive("fleet-key"))
    writer.set_kv_keys(derive("other-key"))
    try:
        with pytest.raises(TransferError) as raised:
            writer.connect(target.endpoint())
        assert raised.value.kind == TransferErrorKind.PROTOCOL, raised.value
        assert "refused the connecting worker's proof of the workers' key" in raised.value.message
        assert target.num_peers_refused == 1 and writer.num_refused_by_peers == 1
        writer.set_kv_keys(derive("fleet-key"))  # the same key: connected, as before
        writer.disconnect(writer.connect(target.endpoint()))
        assert target.num_peers_refused == 1 and writer.num_refused_by_peers == 1
    finally:
        writer.close()
        target.close()


# The control messages of the release before the workers' key: no AuthHello/AuthChallenge/AuthProof.
_EARLIER_RELEASE = msgspec.msgpack.Decoder(Register | RegisterAck | RoomRequest | RoomStatus | Abort | Quiesced
                                           | Ping | Pong)


def _earlier_release_prefill(listener: socket.socket, undecodable: list[bytes]) -> None:
    """A prefill's control port of that release: it reads a frame, cannot decode it and closes."""
    sock, _ = listener.accept()
    with sock:
        (length,) = struct.unpack(">I", sock.recv(4, socket.MSG_WAITALL))
        body = sock.recv(length, socket.MSG_WAITALL)
        try:
            _EARLIER_RELEASE.decode(body)
        except msgspec.DecodeError:
            undecodable.append(body)


def test_a_keyed_decode_reaching_a_prefill_of_an_earlier_release_says_it_does_not_support_keys(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="transfer")
    listener = socket.create_server(("127.0.0.1", 0))
    undecodable: list[bytes] = []
    server = threading.Thread(target=_earlier_release_prefill, args=(listener, undecodable), daemon=True)
    server.start()
    decode = KVManager("decode", make_args(), TcpBackend("127.0.0.1"), timeouts=_FAST, auth_key="fleet-key")
    try:
        receiver = decode.create_receiver(1, *listener.getsockname()[:2])
        assert wait_for(lambda: receiver.poll() == KVPoll.Failed, 10), receiver.poll()
        server.join(5)
        assert undecodable, "the earlier release's decoder took our first frame"  # (the emulation is faithful)
        failure = receiver.failure()
        # (not PROTOCOL, which the decode's own fault would be: the prefill is the one that cannot serve)
        assert failure is not None and failure.kind == TransferErrorKind.PEER_GONE, failure
        assert "does not support the workers' KV keys" in failure.message, failure.message
        assert "earlier release" in failure.message
        lines = _lines(caplog, "transfer.decode")
        assert len(lines) == 1 and "does not support the workers' KV keys" in lines[0], lines
        assert decode.num_peers_refused == 0  # (it refused nothing: the prefill could not take part)
        receiver.release()
    finally:
        decode.close()
        listener.close()


@pytest.mark.parametrize(("prefill_key", "decode_key", "refusing", "other_says"), [
    ("fleet-key", "other-key", "decode", "refused our proof of the worker key"),
    ("fleet-key", None, "prefill", "refused our registration: rejected: this prefill requires the worker key"),
    (None, "fleet-key", "prefill", "refused our registration: rejected: the decode has a worker key"),
], ids=["wrong-key", "decode-without", "prefill-without"])
def test_a_control_channel_refusal_is_logged_once_on_each_side_and_counted_by_the_refusing_one(
        prefill_key: str | None, decode_key: str | None, refusing: str, other_says: str,
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="transfer")
    prefill = KVManager("prefill", make_args(), TcpBackend("127.0.0.1"), timeouts=_FAST, auth_key=prefill_key)
    decode = KVManager("decode", make_args(), TcpBackend("127.0.0.1"), timeouts=_FAST, auth_key=decode_key)
    sides = {"prefill": prefill, "decode": decode}
    other = "decode" if refusing == "prefill" else "prefill"
    try:
        for room in (1, 2, 3):
            receiver = decode.create_receiver(room, *prefill.control_address)
            assert wait_for(lambda r=receiver: r.poll() == KVPoll.Failed, 10)  # type: ignore[misc]
            receiver.release()
        assert wait_for(lambda: sides[refusing].num_peers_refused == 3, 5), sides[refusing].num_peers_refused
        wait_for(lambda: bool(_lines(caplog, f"transfer.{other}")), 5)  # (its reader thread may see the close last)
        refusing_lines = _lines(caplog, f"transfer.{refusing}")
        other_lines = _lines(caplog, f"transfer.{other}")
        assert len(refusing_lines) == 1 and ": refused " in refusing_lines[0], refusing_lines
        assert len(other_lines) == 1 and "refused this worker" in other_lines[0], other_lines
        assert other_says in other_lines[0], other_lines
        _no_key_logged(caplog)
        assert sides[other].num_peers_refused == 0  # (only the refusing side counts a refusal)
        refused_us = sides[other]._prefill or sides[other]._decode
        assert refused_us is not None
        assert wait_for(lambda: refused_us.refusals.num_refused_by_peers == 3, 5)
    finally:
        decode.close()
        prefill.close()
