"""The control channel never waits long on, or buffers for, a peer that stopped reading."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from transfer import TransferErrorKind, channel
from transfer.channel import ControlChannel
from transfer.messages import RoomRequest


def test_a_peer_that_stops_reading_closes_the_channel(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(channel, "SEND_TIMEOUT_S", 0.5)
    with socket.create_server(("127.0.0.1", 0)) as listener:
        ours = socket.create_connection(listener.getsockname())
        theirs, _ = listener.accept()  # never read
    closed: list[object] = []
    done = threading.Event()

    def on_close(_: ControlChannel, error: object) -> None:
        closed.append(error)
        done.set()

    chan = ControlChannel(ours, "decode@test", lambda *_: None, on_close)
    chan.start()
    try:
        big = RoomRequest(1, list(range(1, 100_000)), 0)  # ~300 KB a frame
        sent, started = 0, time.monotonic()
        while chan.send(big):
            sent += 1
            assert sent < 1000, "kept accepting frames for a reader that reads nothing"
        assert time.monotonic() - started < 30
        assert chan.is_closed and not chan.send(big)
        assert done.wait(10)
        assert getattr(closed[0], "kind", None) == TransferErrorKind.PEER_GONE, closed
        assert "send failed" in str(closed[0])
    finally:
        chan.close()
        chan.join(5)
        theirs.close()
