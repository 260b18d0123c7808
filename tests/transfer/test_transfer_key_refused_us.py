"""The refused side of a workers' key mismatch on the KV plane (``transfer.auth``'s ``RefusalLog.refused_us``), as a
worker shows it, and whom a failed key handshake is held against: real managers and backends over loopback.

- ``KVManager.num_refused_by_peers`` (the side's control channel and the backend's tcp data connections, through
  the shm wrapper too) is exported as ``pd_worker_kv_peers_refused_us_total``: before, counted but not exported,
  so a prefill refused by every decode's data port (or a decode whose registrations were refused) showed
  nothing on its own /metrics.
- A keyed decode whose prefill closes its control connection on ``AuthHello`` without an answer (a prefill killed
  or stopping at that moment; an earlier release's, which cannot decode it, does the same): the rooms fail with
  the prefill held at fault (``failure_fault`` -> ``Fault.PEER``: the gateway's breaker of the prefill, the retry
  avoiding it). Before, they failed PROTOCOL, the decode's own fault: a prefill that died at the handshake (or
  one of an earlier release in a keyed fleet) had the healthy decodes paired with it blamed and avoided, one
  breaker count per room waiting on that connection, while it went on being picked.
"""

from __future__ import annotations

import socket
import struct
import threading
from types import SimpleNamespace
from typing import Any

import pytest
from kvunit import make_args, wait_for

from transfer import KVManager, KVPoll, KVTimeouts, TransferErrorKind
from transfer.auth import derive
from transfer.shm import ShmBackend
from transfer.tcp import TcpBackend
from workers.pd_queues import failure_fault
from workers.protocol import Fault

pytestmark = pytest.mark.timeout(60)

_FAST = KVTimeouts(bootstrap_s=5.0)


def _scraped(manager: KVManager, role: str, name: str) -> float:
    """``name`` as a worker's ``/metrics`` renders it for ``manager``."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from workers.metrics import SchedulerMetrics, _transfer_metrics

    class _Families:
        def collect(self) -> Any:
            scheduler: Any = SimpleNamespace(metrics=SchedulerMetrics())
            return _transfer_metrics(role, scheduler, manager)

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families())
    text = generate_latest(registry).decode()
    found = [sample.value for family in text_string_to_metric_families(text) for sample in family.samples
             if sample.name == name and sample.labels == {"role": role}]
    assert len(found) == 1, (name, text)
    return found[0]


@pytest.mark.parametrize("wrapped", [False, True], ids=["tcp", "shm-over-tcp"])
def test_a_refused_worker_exports_its_refusals_by_peers(wrapped: bool) -> None:
    def backend() -> Any:
        tcp = TcpBackend("127.0.0.1")
        return ShmBackend(tcp, same_host=False) if wrapped else tcp

    p_args, d_args = make_args(), make_args()
    prefill = KVManager("prefill", p_args, backend(), timeouts=_FAST, auth_key="fleet-key")
    decode = KVManager("decode", d_args, backend(), timeouts=_FAST, auth_key="fleet-key")
    data_port: Any = decode.backend.network if wrapped else decode.backend  # type: ignore[attr-defined]
    data_port.set_kv_keys(derive("other-key"))  # its data port: another key
    try:
        assert _scraped(prefill, "prefill", "pd_worker_kv_peers_refused_us_total") == 0
        for room in (1, 2):
            receiver = decode.create_receiver(room, *prefill.control_address)
            assert wait_for(lambda r=receiver: r.poll() == KVPoll.Failed, 10)  # type: ignore[misc]
            failure = receiver.failure()
            assert failure is not None and failure.kind == TransferErrorKind.PROTOCOL, failure
            receiver.release()
        assert decode.num_peers_refused == 2  # the data port refused the prefill's proof twice
        assert prefill.num_refused_by_peers == 2  # (its tcp data connections: through the shm wrapper too)
        assert _scraped(prefill, "prefill", "pd_worker_kv_peers_refused_us_total") == 2
        assert decode.num_refused_by_peers == 2  # (its registrations, refused with that reason)
        assert _scraped(decode, "decode", "pd_worker_kv_peers_refused_us_total") == 2
        assert _scraped(decode, "decode", "pd_worker_kv_peers_refused_total") == 2  # (as before)
        assert _scraped(prefill, "prefill", "pd_worker_kv_peers_refused_total") == 0
    finally:
        decode.close()
        prefill.close()


def _prefill_dying_at_the_handshake(listener: socket.socket, reset: bool, read: threading.Event) -> None:
    """A prefill's control port that reads the decode's first frame (``AuthHello``) and goes away: its process
    killed (the kernel closes its sockets: a FIN, or a reset) or stopping. (Each connection: a room that came
    after the first connection failed opens another.)"""
    while True:
        try:
            sock, _ = listener.accept()
        except OSError:
            return
        (length,) = struct.unpack(">I", sock.recv(4, socket.MSG_WAITALL))
        sock.recv(length, socket.MSG_WAITALL)
        read.set()
        if reset:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()


@pytest.mark.parametrize("reset", [False, True], ids=["closed", "reset"])
def test_a_prefill_that_goes_away_at_the_key_handshake_is_held_at_fault_not_the_decode(reset: bool) -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    read = threading.Event()
    server = threading.Thread(target=_prefill_dying_at_the_handshake, args=(listener, reset, read), daemon=True)
    server.start()
    decode = KVManager("decode", make_args(), TcpBackend("127.0.0.1"), timeouts=_FAST, auth_key="fleet-key")
    try:
        receivers = [decode.create_receiver(room, *listener.getsockname()[:2]) for room in (1, 2, 3)]
        for receiver in receivers:
            assert wait_for(lambda r=receiver: r.poll() == KVPoll.Failed, 10), receiver.poll()  # type: ignore[misc]
        assert read.is_set()
        for receiver in receivers:
            failure = receiver.failure()
            assert failure is not None and "AuthHello" in failure.message, failure  # (the clear reason stays)
            assert failure.kind in (TransferErrorKind.PEER_GONE, TransferErrorKind.PEER_UNREACHABLE), failure
            # the prefill that went away is the one the gateway's breaker and its retry hold it against
            assert failure_fault(SimpleNamespace(failure=receiver.failure)) == Fault.PEER, failure
            receiver.release()
    finally:
        decode.close()
        listener.shutdown(socket.SHUT_RDWR)
        listener.close()
        server.join(5)
