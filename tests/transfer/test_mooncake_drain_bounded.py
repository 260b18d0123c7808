"""A failed Mooncake batch's drain (``MooncakeBackend._drain``) re-sends the batch's first entries until a re-send
completes. An engine that never completes one (a decode frozen for good) held the peer's sender thread, its budget
and the decode's control connection for good; now the drain gives up after ``drain_timeout_s``: the write fails
TIMEOUT, saying so, and the peer is dropped. The engine is a stand-in that fails every call (the real engine's
answer to a target that never runs again), so the test needs neither Mooncake nor a network namespace."""

from __future__ import annotations

import threading

import pytest

from transfer.errors import TransferError, TransferErrorKind
from transfer.mooncake import MooncakeBackend, _McPeer
from transfer.options import TransferOptionError, parse_options


class _NeverMoves:
    def __init__(self) -> None:
        self.calls = 0

    def batch_transfer_sync_write(self, target: int, src: list[int], dst: list[int], lens: list[int]) -> int:
        self.calls += 1
        return -1


def _backend(drain_timeout_s: float) -> tuple[MooncakeBackend, _NeverMoves]:
    backend = MooncakeBackend.__new__(MooncakeBackend)  # (no engine: only the drain's own state)
    engine = _NeverMoves()
    backend._engine = engine
    backend._drain_timeout_s = drain_timeout_s
    backend._inflight = {}
    backend._budget = threading.Condition()
    backend._max_inflight = 2048
    backend.fail_queued = lambda peer, error: None  # type: ignore[method-assign]
    return backend, engine


def _peer() -> _McPeer:
    return _McPeer.__new__(_McPeer)


def test_a_drain_the_engine_never_completes_gives_up_at_drain_timeout_s() -> None:
    backend, engine = _backend(drain_timeout_s=0.5)
    peer = _peer()
    peer.label, peer.dead, peer.peer_id = "decode:1", None, 1
    done = threading.Event()
    result: list[TransferError] = []

    def drain() -> None:
        import time
        first = TransferError(TransferErrorKind.TIMEOUT, "mooncake: batch timed out")
        result.append(backend._drain(peer, [(1, 2, 3)] * 10, first, time.monotonic()))
        done.set()

    threading.Thread(target=drain, daemon=True).start()
    assert done.wait(60.0), "the drain of a batch the engine never moves never ended"
    error = result[0]
    assert error.kind == TransferErrorKind.TIMEOUT and "drain_timeout_s" in error.message, error
    assert peer.dead is error  # (dropped: its thread fails the rest, the manager closes the decode's connection)
    assert engine.calls >= 1 and backend._inflight == {}


def test_drain_timeout_s_is_an_option_of_the_backend() -> None:
    assert parse_options("mooncake", {"drain_timeout_s": "12.5"}, MooncakeBackend.OPTIONS) == {"drain_timeout_s": 12.5}
    with pytest.raises(TransferOptionError, match="drain_timeout_s"):
        parse_options("mooncake", {"drain_timeout_s": "0"}, MooncakeBackend.OPTIONS)
