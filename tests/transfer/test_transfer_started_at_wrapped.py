"""Review of 44fca1e: ``transfer_s`` times a write from ``backend.started_at``; every worker wraps its network
backend in ``ShmBackend`` (workers/worker.py: "always wrapped"), which inherits ``PeerThreadBackend.started_at``
but keeps network writes in ``_net_writes``, not ``_writes``: ``started_at`` is None for every cross-host write,
so no such write ever times out (a frozen data path with a batch in hand included)."""

from __future__ import annotations

import time

import msgspec

from tests.transfer.test_transfer_queue_timeout import _Gated
from transfer.base import UNFENCED
from transfer.sender import KVSender, PostedWrite
from transfer.shm import ShmBackend, _Endpoint


def test_a_network_write_through_the_shm_wrapper_is_timed_once_its_backend_took_it() -> None:
    network = _Gated()
    backend = ShmBackend(network, same_host=False)
    try:
        peer = backend.connect(msgspec.msgpack.encode(_Endpoint(network.name, b"", None)))
        posted = time.monotonic()
        handle = backend.write(peer, [(0, 0, 1)], UNFENCED)  # (the network backend's thread takes it: in hand)
        inner = backend._net_writes[handle]
        deadline = time.monotonic() + 10
        while network.started_at(inner, 0.0) is None:
            assert time.monotonic() < deadline, "the network backend's thread never took the batch"
            time.sleep(0.01)
        room = type("Room", (), {})()
        room._writes = [PostedWrite(1, handle, posted, None)]
        later = time.monotonic() + 600  # (in hand, not moving, for 10 minutes)
        overdue = KVSender.settle(room, backend.poll, later, 5.0,  # type: ignore[arg-type]
                                  getattr(backend, "started_at", None))[2]
        assert overdue, "a batch in the network backend's hands for 600 s is never overdue behind the shm wrapper"
    finally:
        network.gate.set()
        backend.close()


def test_a_frozen_data_path_behind_the_workers_shm_wrapper_still_times_the_room_out() -> None:
    """The worker's wiring (workers/worker.py wraps tcp/mooncake/nixl in ``create_shm_backend``): a batch the
    network backend holds and never finishes (a decode whose data path froze, its control channel alive) fails
    its room after ``transfer_s`` (0.3 s here), as before 44fca1e; on HEAD the room stays Transferring."""
    from kvunit import make_args, open_room, wait_for

    from transfer import KVManager, KVPoll, KVTimeouts, TransferErrorKind

    timeouts = KVTimeouts(bootstrap_s=5.0, waiting_s=30.0, transfer_s=0.3, heartbeat_interval_s=0.1,
                          heartbeat_timeout_s=3.0)
    network = _Gated()
    prefill = KVManager("prefill", make_args(), ShmBackend(network, same_host=False), timeouts=timeouts)
    decode = KVManager("decode", make_args(), ShmBackend(_Gated(), same_host=False), timeouts=timeouts)
    try:
        sender, _ = open_room(prefill, decode, 6, [1, 2], 0)
        sender.send([3, 4], last=True)
        assert wait_for(lambda: sender.poll() == KVPoll.Failed, 5), "the room never timed out"
        assert sender.failure().kind == TransferErrorKind.TIMEOUT
    finally:
        network.gate.set()
        prefill.close()
        decode.close()
