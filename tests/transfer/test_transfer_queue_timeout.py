"""``transfer_s`` times a batch from when its bytes begin to move, not from when it was queued.

A thread-per-peer backend sends one peer's batches in order: on a busy (slow, but moving) link a room's chunk
can wait in the queue behind other rooms' for longer than ``transfer_s``. Timed from its post, it failed as
TIMEOUT and counted against a healthy decode's breaker (review: KV over a slow link, where a 50 mbit link
with three large prompts opened the only decode's breaker). A batch still queued is bounded by the decode's
``waiting_s`` and the peers' heartbeats instead.
"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from typing import Any

from kvunit import StubPeerBackend

from transfer.base import UNFENCED, WriteState
from transfer.peer_threads import SenderPeer
from transfer.sender import KVSender, PostedWrite


class _Gated(StubPeerBackend):
    """A backend whose sends wait for ``gate``: the first batch stays in hand, the next ones queued."""

    name = "gated"

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()

    def _send(self, peer: SenderPeer, blocks: Any, fence: Any) -> None:
        self.gate.wait(30)
        return None


def _overdue(backend: _Gated, handle: Any, posted: float, now: float, timed_from_start: bool) -> bool:
    room = SimpleNamespace(_writes=[PostedWrite(1, handle, posted, None)])
    started_at = backend.started_at if timed_from_start else None
    return KVSender.settle(room, backend.poll, now, 5.0, started_at)[2]  # type: ignore[arg-type]


def test_a_batch_queued_behind_another_is_not_timed_until_it_is_sent() -> None:
    backend = _Gated()
    try:
        peer = backend.connect(b"")
        posted = time.monotonic()
        first = backend.write(peer, [(0, 0, 1)], UNFENCED)
        queued = backend.write(peer, [(0, 0, 1)], UNFENCED)
        deadline = time.monotonic() + 10
        while backend.started_at(first, 0.0) is None:
            assert time.monotonic() < deadline, "the peer's thread never took the first batch"
            time.sleep(0.01)
        assert backend.started_at(queued, 0.0) is None
        later = time.monotonic() + 60  # (both pending 60 s after their post: the first in hand, the second queued)
        assert _overdue(backend, first, posted, later, timed_from_start=True)
        assert not _overdue(backend, queued, posted, later, timed_from_start=True)
        assert _overdue(backend, queued, posted, later, timed_from_start=False)  # (what it was, from the post)
        backend.gate.set()
        deadline = time.monotonic() + 10
        while backend.poll(queued) == WriteState.PENDING:
            assert time.monotonic() < deadline, "the queued batch was never sent"
            time.sleep(0.01)
        assert backend.started_at(queued, 0.0) is not None
    finally:
        backend.gate.set()
        backend.close()
