"""The control channel never waits on, or buffers without bound for, a peer that stopped reading."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator

import pytest

from transfer import TransferError, TransferErrorKind, channel
from transfer.channel import ControlChannel
from transfer.messages import FrameReader, RoomRequest

_BIG_PAGES = list(range(1, 100_000))  # ~300 KB a frame: a few fill any socket buffer


class _Closed:
    def __init__(self) -> None:
        self.errors: list[object] = []
        self.done = threading.Event()

    def __call__(self, _: ControlChannel, error: object) -> None:
        self.errors.append(error)
        self.done.set()


@pytest.fixture
def pair() -> Iterator[tuple[ControlChannel, socket.socket, _Closed]]:
    """Our channel, and the peer's socket (which reads only when a test reads it)."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        ours = socket.create_connection(listener.getsockname())
        theirs, _ = listener.accept()
    closed = _Closed()
    chan = ControlChannel(ours, "decode@test", lambda *_: None, closed)
    chan.start()
    try:
        yield chan, theirs, closed
    finally:
        chan.close()
        chan.join(5)
        theirs.close()


def _send_from_thread(chan: ControlChannel, frames: int, results: list[bool]) -> threading.Thread:
    def send_all() -> None:
        for room in range(frames):
            results.append(chan.send(RoomRequest(room, _BIG_PAGES, 0)))

    thread = threading.Thread(target=send_all, daemon=True)
    thread.start()
    return thread


def test_send_does_not_wait_for_a_peer_that_is_not_reading(pair, monkeypatch: pytest.MonkeyPatch) -> None:
    chan, theirs, _closed = pair
    monkeypatch.setattr(channel, "SEND_TIMEOUT_S", 120.0)  # a waiting send would wait this long
    results: list[bool] = []
    thread = _send_from_thread(chan, 30, results)  # ~9 MB: many times what the sockets hold
    thread.join(60)  # (a liveness bound far below the timeout, not a speed check)
    assert not thread.is_alive(), f"send() waited on the peer after {len(results)} frames"
    assert results == [True] * 30 and not chan.is_closed
    # The peer reads now: every frame arrives, whole and in order (the writer sends what the socket
    # did not take at once).
    theirs.settimeout(30)
    reader = FrameReader(theirs)
    rooms = [reader.read() for _ in range(30)]
    assert [msg.room for msg in rooms] == list(range(30))  # type: ignore[union-attr]
    assert all(msg.page_ids == _BIG_PAGES for msg in rooms)  # type: ignore[union-attr]
    assert chan.settle(10) and not chan.is_closed
    assert chan.send(RoomRequest(99, [1], 0))
    assert reader.read() == RoomRequest(99, [1], 0)


def test_a_peer_that_reads_nothing_for_the_send_timeout_closes_the_channel(pair, monkeypatch) -> None:
    chan, _theirs, closed = pair
    monkeypatch.setattr(channel, "SEND_TIMEOUT_S", 1.0)
    results: list[bool] = []
    _send_from_thread(chan, 20, results).join(60)
    assert results and all(results)  # (queued: the peer's silence is the writer's to judge)
    assert closed.done.wait(30), "the channel waited on a silent peer for good"
    assert chan.is_closed and not chan.send(RoomRequest(1, [1], 0))
    assert getattr(closed.errors[0], "kind", None) == TransferErrorKind.PEER_GONE, closed.errors
    assert "read nothing" in str(closed.errors[0])


def test_what_waits_for_a_peer_is_bounded(pair, monkeypatch: pytest.MonkeyPatch) -> None:
    chan, _theirs, closed = pair
    monkeypatch.setattr(channel, "SEND_TIMEOUT_S", 120.0)
    monkeypatch.setattr(channel, "MAX_BACKLOG_BYTES", 2 * 1024 * 1024)
    big = RoomRequest(1, _BIG_PAGES, 0)
    sent = 0
    while chan.send(big):
        sent += 1
        assert sent < 100, "kept queueing frames for a reader that reads nothing"
    assert chan.is_closed and not chan.send(big)
    assert closed.done.wait(10)
    assert getattr(closed.errors[0], "kind", None) == TransferErrorKind.PEER_GONE, closed.errors
    assert "send failed" in str(closed.errors[0])


def test_a_broken_socket_fails_the_send_and_closes_the_channel(pair) -> None:
    chan, theirs, closed = pair
    theirs.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    theirs.close()  # a reset
    assert closed.done.wait(10)
    assert not chan.send(RoomRequest(1, [1], 0))


def test_settle_ends_when_the_channel_closes(pair, monkeypatch: pytest.MonkeyPatch) -> None:
    """Frames wait for a peer that goes away: ``settle`` returns once the channel has closed (it slept its whole
    timeout: a prefill's KV manager closing spent its one second there)."""
    chan, theirs, closed = pair
    monkeypatch.setattr(channel, "SEND_TIMEOUT_S", 600.0)
    for room in range(20):  # a backlog the peer does not read
        assert chan.send(RoomRequest(room, _BIG_PAGES, 0))
    settled: list[bool] = []
    waiting = threading.Thread(target=lambda: settled.append(chan.settle(600.0)), daemon=True)
    waiting.start()
    theirs.close()  # the peer goes away
    waiting.join(60)  # (a liveness bound far below settle's own, not a speed check)
    assert not waiting.is_alive(), "settle() waited on a closed channel"
    assert settled == [True] and closed.done.wait(10)


def test_close_after_writes_what_was_queued_before_it_closes(pair, monkeypatch: pytest.MonkeyPatch) -> None:
    """A connection closed right after a room's status was sent (a broken data path: the statuses go first)
    must not drop the status if it waited in the backlog: ``close_after`` returns at once, refuses what is sent
    after it, and closes once the peer has taken what came before."""
    chan, theirs, closed = pair
    monkeypatch.setattr(channel, "SEND_TIMEOUT_S", 600.0)
    for room in range(20):  # a backlog the peer does not read yet
        assert chan.send(RoomRequest(room, _BIG_PAGES, 0))
    assert chan.send(RoomRequest(20, [7], 0))  # the last word before the close (queued behind the rest)
    error = TransferError(TransferErrorKind.PEER_GONE, "the data path broke")
    returned = threading.Event()
    threading.Thread(target=lambda: (chan.close_after(error, 600.0), returned.set()), daemon=True).start()
    assert returned.wait(10), "close_after waited for the peer"
    assert not chan.send(RoomRequest(21, [1], 0))  # (after the close was asked for: not taken)
    assert not closed.done.is_set()
    theirs.settimeout(30)
    reader = FrameReader(theirs)
    rooms = [reader.read() for _ in range(21)]
    assert [msg.room for msg in rooms] == list(range(21))  # type: ignore[union-attr]
    assert reader.read() is None  # then the close, and nothing sent after it
    assert closed.done.wait(10) and closed.errors == [error]


def test_close_after_closes_by_its_deadline_when_the_peer_reads_nothing(pair, monkeypatch) -> None:
    chan, _theirs, closed = pair
    monkeypatch.setattr(channel, "SEND_TIMEOUT_S", 600.0)
    for room in range(20):
        assert chan.send(RoomRequest(room, _BIG_PAGES, 0))
    error = TransferError(TransferErrorKind.PEER_GONE, "the data path broke")
    chan.close_after(error, 1.0)
    assert closed.done.wait(30), "close_after waited past its deadline for a peer that reads nothing"
    assert closed.errors == [error] and chan.is_closed


def test_close_after_with_nothing_queued_closes_at_once(pair) -> None:
    chan, theirs, closed = pair
    assert chan.send(RoomRequest(1, [1], 0))
    error = TransferError(TransferErrorKind.PEER_GONE, "the data path broke")
    chan.close_after(error, 600.0)
    assert chan.is_closed and closed.done.wait(10) and closed.errors == [error]
    theirs.settimeout(10)
    reader = FrameReader(theirs)
    assert reader.read() == RoomRequest(1, [1], 0) and reader.read() is None
