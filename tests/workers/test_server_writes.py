"""The native server's way out: the scheduler thread sends a connection's frames straight to its socket while
nothing of that connection waits in the event loop, and queues them behind what waits otherwise. Whatever path a
frame takes, a gateway reads every frame whole, once, in the order the scheduler delivered it, with the event
loop's own answers (``Pong``) among them, and the direct path comes back once the backlog is written.

Real sockets and a real ``NativeServer`` on a real event loop; the scheduler is a stand-in (only the server's
writes are under test here: the whole worker's are in the integration tests)."""

from __future__ import annotations

import asyncio
import socket
import struct
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from workers.protocol import (
    PROTOCOL_VERSION,
    Hello,
    HelloAck,
    Outputs,
    Ping,
    Pong,
    StepOutput,
    gateway_codec,
)
from workers.scheduler import BROADCAST
from workers.server import NativeServer, _Link

_LEN = struct.Struct(">I")


class _Scheduler:
    """What ``NativeServer`` asks of a scheduler, and nothing else."""

    is_alive = True
    num_steps = 0
    stalled_s = 0.0

    def __init__(self) -> None:
        self.connected: list[int] = []

    def connect(self, conn_id: int) -> None:
        self.connected.append(conn_id)

    def drop_connection(self, conn_id: int) -> None:
        pass

    def submit(self, conn_id: int, msg: Any) -> None:
        pass

    def abort(self, conn_id: int, rid: int, reason: str) -> None:
        pass

    def reports_to_repeat(self, now: float) -> list[Any]:
        return []


def _ack() -> HelloAck:
    return HelloAck(PROTOCOL_VERSION, "w", "decode", "sim", "m", "byte", 16, 4096, 64)


class _Served:
    def __init__(self, server: NativeServer, scheduler: _Scheduler, loop: asyncio.AbstractEventLoop) -> None:
        self.server, self.scheduler, self.loop = server, scheduler, loop

    def connect(self) -> tuple[socket.socket, int]:
        """A gateway's connection after its handshake, and the id the server gave it."""
        known = len(self.scheduler.connected)
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)  # (set before the handshake to hold)
        sock.settimeout(30)
        sock.connect(("127.0.0.1", self.server.port))
        codec = gateway_codec()
        sock.sendall(codec.encode(Hello(PROTOCOL_VERSION)))
        assert isinstance(codec.decode(_read_frame(sock)), HelloAck)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and len(self.scheduler.connected) == known:
            time.sleep(0.01)
        return sock, self.scheduler.connected[-1]


@pytest.fixture(params=["asyncio", "uvloop"])
def served(request: pytest.FixtureRequest) -> Iterator[_Served]:
    if request.param == "uvloop":
        uvloop = pytest.importorskip("uvloop")
        loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
    else:
        loop = asyncio.new_event_loop()
    scheduler = _Scheduler()
    server = NativeServer(scheduler, _ack, "127.0.0.1", 0, max_unread_bytes=1 << 30)  # type: ignore[arg-type]
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    asyncio.run_coroutine_threadsafe(server.start(), loop).result(10)
    try:
        yield _Served(server, scheduler, loop)
    finally:
        asyncio.run_coroutine_threadsafe(server.aclose(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


def _read_exactly(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise EOFError(f"connection closed after {len(buf)} of {n} bytes")
        buf += chunk
    return bytes(buf)


def _read_frame(sock: socket.socket) -> bytes:
    (length,) = _LEN.unpack(_read_exactly(sock, _LEN.size))
    return _read_exactly(sock, length)


def _outputs(rid: int, size: int) -> Outputs:
    return Outputs([StepOutput(rid, list(range(rid, rid + size)))])


def _count_calls(monkeypatch: pytest.MonkeyPatch, cls: type, name: str) -> list[Any]:
    """Every return value of ``cls.name`` from now on."""
    seen: list[Any] = []
    original = getattr(cls, name)

    def counted(self: Any, *args: Any) -> Any:
        result = original(self, *args)
        seen.append(result)
        return result

    monkeypatch.setattr(cls, name, counted)
    return seen


def test_frames_arrive_whole_and_in_order_whichever_way_they_left(served: _Served,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    puts = _count_calls(monkeypatch, _Link, "put")  # True: queued for the event loop
    sock, conn_id = served.connect()
    codec = gateway_codec()
    n, size = 400, 20_000  # ~80 KB a frame, ~32 MB in all: far past what the sockets buffer
    pings = iter(range(1, 1_000))

    def scheduler_thread() -> None:
        for rid in range(n):
            served.server.deliver([(conn_id, _outputs(rid, size))])
            if rid % 50 == 0:  # the event loop's own answers, written among the scheduler's frames
                sock.sendall(codec.encode(Ping(next(pings))))
            if rid % 10 == 5:  # the event loop busy for a while: what waits for it waits longer
                served.loop.call_soon_threadsafe(time.sleep, 0.01)

    rids: list[int] = []
    nonces: list[int] = []

    def gateway_reader() -> None:  # slower than the deliveries: the socket fills, empties a little, fills again
        while len(rids) < n or len(nonces) < 8:
            msg = codec.decode(_read_frame(sock))
            if isinstance(msg, Pong):
                nonces.append(msg.nonce)
                continue
            assert isinstance(msg, Outputs)
            (item,) = msg.items
            assert item.token_ids == list(range(item.rid, item.rid + size))
            rids.append(item.rid)
            if len(rids) % 4 == 0:
                time.sleep(0.002)

    reading = threading.Thread(target=gateway_reader)
    reading.start()
    scheduler_thread()  # (``deliver`` never waits for the reader)
    reading.join(60)
    assert not reading.is_alive()
    assert False in puts and True in puts, "both ways out should have been taken"
    assert rids == list(range(n))
    assert nonces == list(range(1, 9))

    # Everything read: once a write of the event loop's leaves nothing behind (at the latest the next delivery's),
    # the scheduler thread sends for itself again
    for rid in (n, n + 1):
        puts.clear()
        served.server.deliver([(conn_id, _outputs(rid, 4))])
        msg = codec.decode(_read_frame(sock))
        assert isinstance(msg, Outputs) and msg.items[0].rid == rid
    assert puts == [False]
    sock.close()


def test_a_broadcast_reaches_every_connection_with_its_own_frames(served: _Served) -> None:
    (a, a_id), (b, b_id) = served.connect(), served.connect()
    codec = gateway_codec()
    served.server.deliver([(a_id, _outputs(1, 3)), (BROADCAST, _outputs(0, 1)), (b_id, _outputs(2, 3)),
                           (a_id, _outputs(3, 3))])
    got_a = [codec.decode(_read_frame(a)) for _ in range(3)]
    got_b = [codec.decode(_read_frame(b)) for _ in range(2)]
    rids_a = [m.items[0].rid for m in got_a]  # type: ignore[attr-defined]
    rids_b = [m.items[0].rid for m in got_b]  # type: ignore[attr-defined]
    assert [r for r in rids_a if r] == [1, 3] and rids_a.count(0) == 1  # (its own frames in their order)
    assert [r for r in rids_b if r] == [2] and rids_b.count(0) == 1
    a.close()
    b.close()


def test_a_connection_that_closed_takes_no_more_frames_and_the_rest_go_on(served: _Served) -> None:
    (a, a_id), (b, b_id) = served.connect(), served.connect()
    a.close()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and served.server.num_connections > 1:
        time.sleep(0.01)
    assert served.server.num_connections == 1
    served.server.deliver([(a_id, _outputs(1, 3)), (b_id, _outputs(2, 3))])
    msg = gateway_codec().decode(_read_frame(b))
    assert isinstance(msg, Outputs) and msg.items[0].rid == 2
    b.close()


def test_without_a_descriptor_of_its_own_a_connection_is_written_by_the_event_loop(
        served: _Served, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_descriptors(*args: Any) -> socket.socket:
        raise OSError(24, "Too many open files")

    monkeypatch.setattr(socket, "fromfd", no_descriptors)
    puts = _count_calls(monkeypatch, _Link, "put")
    sock, conn_id = served.connect()
    for rid in range(5):
        served.server.deliver([(conn_id, _outputs(rid, 3))])
    codec = gateway_codec()
    assert [codec.decode(_read_frame(sock)).items[0].rid for _ in range(5)] == list(range(5))  # type: ignore[attr-defined]
    assert puts == [True] * 5  # (each queued for the event loop)
    sock.close()
