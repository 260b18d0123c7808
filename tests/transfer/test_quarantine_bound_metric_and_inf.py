"""The bounded quarantine (``KVTimeouts.quarantine_s``) and Mooncake drain (``drain_timeout_s``): metric and ``inf``.

* ``pd_worker_kv_quarantine_expired_rooms_total`` is labelled ``role`` as every worker sample is
  (docs/operations.md: "every sample labelled role"; a ``{role="decode"}`` selector or ``sum by (role)`` missed it).
* ``drain_timeout_s=inf`` keeps the old, unbounded drain: without it a decode run with ``--quarantine-timeout-s inf``
  ("never reused unconfirmed") was still told ``Quiesced`` by a Mooncake prefill whose drain gave up at 300 s with
  the engine still holding the batch's bytes, and no setting restored the old wait."""

from __future__ import annotations

import math
import threading
import time
from types import SimpleNamespace

from transfer.errors import TransferError, TransferErrorKind
from transfer.mooncake import MooncakeBackend, _McPeer
from transfer.options import parse_options
from workers.metrics import _transfer_metrics


def test_the_quarantine_expired_counter_is_labelled_role() -> None:
    counters = SimpleNamespace(num_rooms_completed=0, num_rooms_failed=1, num_rooms_aborted=0,
                               num_rooms_unquiesced_released=2)
    kv = SimpleNamespace(counters=counters)
    sched = SimpleNamespace(metrics=SimpleNamespace(kv_bytes_received=0))
    families = {f.name: f for f in _transfer_metrics("decode", sched, kv)}  # type: ignore[arg-type]
    family = families["pd_worker_kv_quarantine_expired_rooms"]
    samples = [s for s in family.samples if s.name.endswith("_total")]
    assert [(s.labels, s.value) for s in samples] == [({"role": "decode"}, 2.0)]


def test_drain_timeout_s_inf_keeps_the_unbounded_drain() -> None:
    assert parse_options("mooncake", {"drain_timeout_s": "inf"}, MooncakeBackend.OPTIONS) == {
        "drain_timeout_s": math.inf}
    # and the drain then waits for the engine, ending only when a re-send completes (or the peer is dropped)
    backend = MooncakeBackend.__new__(MooncakeBackend)
    calls: list[int] = []

    class _MovesOnTheFifth:
        def batch_transfer_sync_write(self, target: int, src: list[int], dst: list[int], lens: list[int]) -> int:
            calls.append(1)
            return 0 if len(calls) >= 5 else -1

    backend._engine = _MovesOnTheFifth()
    backend._drain_timeout_s = math.inf
    backend._inflight = {}
    backend._budget = threading.Condition()
    backend._max_inflight = 2048
    backend.fail_queued = lambda peer, error: None  # type: ignore[method-assign]
    peer = _McPeer.__new__(_McPeer)
    peer.label, peer.dead, peer.peer_id = "decode:1", None, 1
    first = TransferError(TransferErrorKind.PEER_GONE, "mooncake: batch failed")
    result: list[TransferError] = []

    def drain() -> None:
        result.append(backend._drain(peer, [(1, 2, 3)], first, time.monotonic()))

    thread = threading.Thread(target=drain, daemon=True)
    thread.start()
    thread.join(30.0)
    assert result == [first] and len(calls) == 5 and peer.dead is None
