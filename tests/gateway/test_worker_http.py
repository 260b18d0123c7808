"""The relay's HTTP/1.1 client to SGLang workers (``gateway/worker_http.py``) against real servers on 127.0.0.1.

Each test starts an ``asyncio.start_server`` whose connections a test-written handler drives byte by byte (what
it read, what it sends, when it closes), and talks to it through a real ``HttpPool``: the request's bytes, the
answer's framings, keep-alive and its ends, the per-host limit and its waiters, the deadline, the failures and
what they say (``crossed_idle_close``), backpressure, and closing. Every test runs on asyncio's loop and on
uvloop's (the gateway's). No assertion is on elapsed time: the server's events (a connection seen, its EOF) and
the pool's states are awaited, under one hang guard per test; the deadlines' tests check the exception's type.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import socket
import struct
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterator
from typing import Any, NamedTuple

import pytest
import uvloop

from gateway.worker_http import (
    HIGH_WATER,
    BadResponse,
    ConnectFailed,
    Disconnected,
    HttpClientError,
    HttpPool,
    ReadIdle,
    Reply,
    crossed_idle_close,
)

HANG_GUARD_S = 20.0  # a whole test's bound: only a hang reaches it


class Request(NamedTuple):
    line: str
    headers: list[tuple[str, str]]  # as sent, in order
    body: bytes


class Peer:
    """One connection the server accepted: what it read on it, and whether the client closed it."""

    def __init__(self, server: Server, index: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.server, self.index, self.reader, self.writer = server, index, reader, writer
        self.requests: list[Request] = []
        self.eof = asyncio.Event()  # the client closed it (EOF or reset read)
        self.stray = b""  # bytes the client sent after the handler stopped reading requests

    async def read_request(self) -> Request | None:
        """The next request whole, or None once the client has closed the connection."""
        try:
            head = await self.reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, ConnectionError) as exc:
            if isinstance(exc, asyncio.IncompleteReadError):
                self.stray += exc.partial
            self.eof.set()
            return None
        lines = head[:-4].decode("latin-1").split("\r\n")
        headers = [(name, value.strip()) for name, _, value in (line.partition(":") for line in lines[1:])]
        length = int({name.lower(): value for name, value in headers}.get("content-length", "0"))
        request = Request(lines[0], headers, await self.reader.readexactly(length))
        self.requests.append(request)
        self.server.requests.append(request)
        return request

    def send(self, data: bytes) -> None:
        self.writer.write(data)

    async def wait_eof(self) -> None:
        try:
            while data := await self.reader.read(65536):
                self.stray += data
        except ConnectionError:
            pass
        self.eof.set()

    def close(self) -> None:
        """The server closes the connection."""
        self.writer.close()


Handler = Callable[[Peer], Awaitable[None]]


class Server:
    """``handler`` runs once per accepted connection; once it returns, the connection stays open until the client
    closes it (unless the handler closed it)."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.peers: list[Peer] = []
        self.requests: list[Request] = []
        self.num_open = 0
        self.max_open = 0
        self._tasks: set[asyncio.Task[Any]] = set()

    async def __aenter__(self) -> Server:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *_exc: object) -> None:
        self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def url(self, path: str = "/generate") -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        peer = Peer(self, len(self.peers), reader, writer)
        self.peers.append(peer)
        self.num_open += 1
        self.max_open = max(self.max_open, self.num_open)
        try:
            await self.handler(peer)
            if not writer.is_closing():
                await peer.wait_eof()
        except ConnectionError:
            peer.eof.set()
        except asyncio.CancelledError:  # (at the server's end: 3.11's start_server logs a handler task cancelled)
            pass
        finally:
            self.num_open -= 1
            writer.close()
            self._tasks.discard(task)


def ok(body: bytes, extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n%s\r\n%s" % (len(body), extra, body)


async def echo(peer: Peer) -> None:
    """Answers every request with its own body, keeping the connection alive."""
    while (request := await peer.read_request()) is not None:
        peer.send(ok(request.body))


async def until(predicate: Callable[[], bool]) -> None:
    while not predicate():
        await asyncio.sleep(0.005)


def make_pool(**kwargs: Any) -> HttpPool:
    options: dict[str, Any] = {"limit_per_host": 4, "timeout_s": 10.0, "connect_timeout_s": 5.0, "keepalive_s": 30.0}
    options.update(kwargs)
    return HttpPool(**options)


@contextlib.asynccontextmanager
async def pooled(**kwargs: Any) -> AsyncIterator[HttpPool]:
    """``make_pool(**kwargs)``, closed on the way out."""
    pool = make_pool(**kwargs)
    try:
        yield pool
    finally:
        pool.close()


def num_waiting(pool: HttpPool) -> int:
    return sum(len(origin.waiters) for origin in pool._by_key.values())


async def post_read(pool: HttpPool, url: str, data: bytes, asked: asyncio.Future[None] | None = None) -> bytes:
    async with await pool.post(url, data, asked=asked) as reply:
        assert reply.status == 200
        return await reply.read()


@pytest.fixture(params=["asyncio", "uvloop"])
def run(request: pytest.FixtureRequest) -> Iterator[Callable[[Callable[[], Coroutine[Any, Any, None]]], None]]:
    factory = uvloop.new_event_loop if request.param == "uvloop" else asyncio.new_event_loop

    def go(main: Callable[[], Coroutine[Any, Any, None]]) -> None:
        with asyncio.Runner(loop_factory=factory) as runner:
            runner.run(asyncio.wait_for(main(), HANG_GUARD_S))

    yield go


# -- the request ----------------------------------------------------------------------------------------------


def test_post_bytes_as_the_worker_reads_them(run):
    async def main() -> None:
        async with Server(echo) as server, pooled(headers={"Authorization": "Bearer k-1", "X-Gateway": "pd"}) as pool:
            reply = await pool.post(server.url("/generate"), b'{"text": "hi"}', headers={"X-Request-Id": "r-7"})
            assert reply.status == 200
            assert reply.headers == {"content-length": "14"}
            assert await reply.read() == b'{"text": "hi"}'
            reply.release()
            assert await post_read(pool, server.url("/v1/x"), b"") == b""
        first, second = server.requests
        assert first.line == "POST /generate HTTP/1.1"
        assert len(first.headers) == 5, first.headers  # (each once, nothing else)
        assert {name.lower(): value for name, value in first.headers} == {
            "host": f"127.0.0.1:{server.port}", "authorization": "Bearer k-1", "x-gateway": "pd",
            "x-request-id": "r-7", "content-length": "14"}
        assert first.body == b'{"text": "hi"}'
        assert second.line == "POST /v1/x HTTP/1.1"
        assert {name.lower(): value for name, value in second.headers} == {
            "host": f"127.0.0.1:{server.port}", "authorization": "Bearer k-1", "x-gateway": "pd",
            "content-length": "0"}
        assert second.body == b""

    run(main)


@pytest.mark.parametrize("bad", ["\r", "\n", "\0", "\r\nX-Injected: 1"])
def test_header_with_line_break_or_nul_is_refused_before_anything_is_sent(run, bad):
    async def main() -> None:
        async with Server(echo) as server:
            with pytest.raises(ValueError):
                make_pool(headers={"X-Key": f"a{bad}b"})
            pool = make_pool()
            try:
                with pytest.raises(ValueError):
                    await pool.post(server.url(), b"smuggled", headers={"X-Request-Id": f"r{bad}1"})
                if bad != "\0":
                    with pytest.raises(ValueError):
                        await pool.post(server.url(), b"smuggled", headers={f"X-Re{bad}quest-Id": "r1"})
                assert await post_read(pool, server.url(), b"fine") == b"fine"
            finally:
                pool.close()
        assert len(server.peers) == 1  # (no connection opened for the refused ones, nothing written)
        assert [request.body for request in server.requests] == [b"fine"]
        assert all(bad not in value for _, value in server.requests[0].headers)

    run(main)


# -- the answer's framing -------------------------------------------------------------------------------------


def test_chunked_answer_split_across_reads(run):
    pieces = [b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\nx-a: 1\r\n\r\n5\r\nhel", b"lo\r\n6\r\n wo",
              b"rld\r\n1", b"0\r\n" + b"x" * 16 + b"\r\n", b"0\r\n\r\n"]

    async def main() -> None:
        permits: asyncio.Queue[None] = asyncio.Queue()

        async def handler(peer: Peer) -> None:
            await peer.read_request()
            for index, piece in enumerate(pieces):
                peer.send(piece)
                await peer.writer.drain()
                if index < len(pieces) - 1:
                    await permits.get()  # (the client has read what came: the next piece is another read)
            await echo(peer)

        async with Server(handler) as server, pooled() as pool:
            reply = await pool.post(server.url(), b"q")
            assert reply.status == 200
            assert reply.headers["x-a"] == "1"
            permits.put_nowait(None)
            got = []
            while data := await reply.readany():
                got.append(data)
                permits.put_nowait(None)
            assert got[0] == b"hel"
            assert b"".join(got) == b"hello world" + b"x" * 16
            assert reply.ended
            reply.release()
            assert pool.num_idle() == 1
            assert await post_read(pool, server.url(), b"again") == b"again"
        assert len(server.peers) == 1  # (read to its end: kept alive)

    run(main)


def test_chunked_answer_read_whole(run):
    async def handler(peer: Peer) -> None:
        await peer.read_request()
        peer.send(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        for part in (b"a" * 3, b"b" * 300, b"c" * 70000, b"d"):
            peer.send(b"%x;ext=1\r\n%s\r\n" % (len(part), part))
            await peer.writer.drain()
        peer.send(b"0\r\nx-trailer: t\r\n\r\n")

    async def main() -> None:
        async with Server(handler) as server, pooled() as pool:
            assert await post_read(pool, server.url(), b"q") == b"a" * 3 + b"b" * 300 + b"c" * 70000 + b"d"
            assert pool.num_idle() == 1

    run(main)


def test_answer_without_length_ends_with_the_connection_which_is_not_reused(run):
    async def main() -> None:
        permit = asyncio.Event()

        async def handler(peer: Peer) -> None:
            if peer.index:
                return await echo(peer)
            await peer.read_request()
            peer.send(b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\n\r\nfirst ")
            await permit.wait()
            peer.send(b"second")
            await peer.writer.drain()
            peer.close()

        async with Server(handler) as server, pooled() as pool:
            reply = await pool.post(server.url(), b"q")
            assert reply.status == 200
            assert not reply.framed
            assert await reply.readany() == b"first "
            permit.set()
            assert await reply.read() == b"second"
            assert await reply.readany() == b""
            reply.release()
            assert pool.num_idle() == 0
            assert await post_read(pool, server.url(), b"next") == b"next"
        assert len(server.peers) == 2
        assert [len(peer.requests) for peer in server.peers] == [1, 1]

    run(main)


def test_answer_without_length_cut_by_a_reset_is_disconnected_not_a_short_body(run):
    async def handler(peer: Peer) -> None:
        await peer.read_request()
        peer.send(b"HTTP/1.1 200 OK\r\n\r\npart")
        await peer.writer.drain()
        await peer.reader.read(1)  # (held open, quiet, until the test resets it)

    async def main() -> None:
        async with Server(handler) as server, pooled() as pool:
            reply = await pool.post(server.url(), b"q")
            assert await reply.readany() == b"part"
            sock = server.peers[0].writer.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # (close: a reset)
            server.peers[0].writer.transport.abort()
            with pytest.raises(Disconnected) as caught:
                await reply.read()
            assert caught.value.answered
            assert not crossed_idle_close(caught.value)

    run(main)


def test_interim_answers_before_the_real_one(run):
    async def handler(peer: Peer) -> None:
        await peer.read_request()
        peer.send(b"HTTP/1.1 100 Continue\r\nx-interim: yes\r\n\r\n")
        await peer.writer.drain()
        await asyncio.sleep(0.02)  # (most likely another read: either way the same answer)
        peer.send(b"HTTP/1.1 103 Early Hints\r\nlink: </a>\r\n\r\n"
                  b"HTTP/1.1 201 Created\r\nx-final: 1\r\ncontent-length: 4\r\n\r\nbody")
        await echo(peer)

    async def main() -> None:
        async with Server(handler) as server, pooled() as pool:
            reply = await pool.post(server.url(), b"q")
            assert reply.status == 201
            assert reply.headers == {"x-final": "1", "content-length": "4"}
            assert await reply.read() == b"body"
            reply.release()
            assert await post_read(pool, server.url(), b"after") == b"after"
        assert len(server.peers) == 1

    run(main)


# -- keep-alive -------------------------------------------------------------------------------------------------


def test_sequential_requests_reuse_one_connection(run):
    async def main() -> None:
        async with Server(echo) as server, pooled() as pool:
            assert await post_read(pool, server.url(), b"one") == b"one"
            assert pool.num_idle() == 1
            assert await post_read(pool, server.url(), b"two") == b"two"
            assert pool.num_idle() == 1
        assert len(server.peers) == 1
        assert [request.body for request in server.peers[0].requests] == [b"one", b"two"]

    run(main)


def test_release_before_the_answer_ends_closes_the_connection(run):
    async def handler(peer: Peer) -> None:
        if peer.index:
            return await echo(peer)
        await peer.read_request()
        peer.send(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nabc")

    async def main() -> None:
        async with Server(handler) as server, pooled() as pool:
            reply = await pool.post(server.url(), b"q")
            assert await reply.readany() == b"abc"
            reply.release()
            await server.peers[0].eof.wait()
            assert pool.num_idle() == 0
            assert await post_read(pool, server.url(), b"next") == b"next"
        assert len(server.peers) == 2
        assert server.peers[0].stray == b""

    run(main)


def test_connection_close_answer_is_not_reused(run):
    async def handler(peer: Peer) -> None:
        if peer.index:
            return await echo(peer)
        await peer.read_request()
        peer.send(ok(b"ok", b"Connection: close\r\n"))  # (and the server leaves it open: the client closes it)

    async def main() -> None:
        async with Server(handler) as server, pooled() as pool:
            assert await post_read(pool, server.url(), b"q") == b"ok"
            await server.peers[0].eof.wait()
            assert pool.num_idle() == 0
            assert await post_read(pool, server.url(), b"next") == b"next"
        assert len(server.peers) == 2
        assert server.peers[0].stray == b""

    run(main)


def test_idle_connection_past_keepalive_is_closed_by_the_sweep(run):
    async def main() -> None:
        async with Server(echo) as server, pooled(keepalive_s=0.2) as pool:
            assert await post_read(pool, server.url(), b"one") == b"one"
            assert pool.num_idle() == 1
            await server.peers[0].eof.wait()  # (the pool's sweep closed it)
            assert pool.num_idle() == 0
            assert await post_read(pool, server.url(), b"two") == b"two"
        assert len(server.peers) == 2
        assert [len(peer.requests) for peer in server.peers] == [1, 1]

    run(main)


def test_unasked_bytes_on_an_idle_connection_close_it(run):
    async def main() -> None:
        unasked = asyncio.Event()

        async def handler(peer: Peer) -> None:
            if peer.index:
                return await echo(peer)
            await peer.read_request()
            peer.send(ok(b"one"))
            await unasked.wait()
            peer.send(ok(b"nobody asked"))  # (would pass for the next request's answer if the connection were kept)

        async with Server(handler) as server, pooled() as pool:
            assert await post_read(pool, server.url(), b"q") == b"one"
            assert pool.num_idle() == 1
            unasked.set()
            await server.peers[0].eof.wait()
            assert pool.num_idle() == 0
            assert await post_read(pool, server.url(), b"two") == b"two"
        assert len(server.peers) == 2
        assert server.peers[0].stray == b""

    run(main)


def test_unasked_answer_in_the_same_read_as_the_answer_is_not_taken_for_its_body(run):
    async def handler(peer: Peer) -> None:
        if peer.index:
            return await echo(peer)
        await peer.read_request()
        peer.send(ok(b"one") + ok(b"nobody asked"))  # (one write: the client reads both at once)

    async def main() -> None:
        async with Server(handler) as server, pooled() as pool:
            assert await post_read(pool, server.url(), b"q") == b"one"
            await server.peers[0].eof.wait()
            assert pool.num_idle() == 0
            assert await post_read(pool, server.url(), b"two") == b"two"
        assert len(server.peers) == 2

    run(main)


def test_reuse_false_opens_and_closes_a_connection_per_request(run):
    async def main() -> None:
        async with Server(echo) as server, pooled(reuse=False) as pool:
            for index, body in enumerate((b"one", b"two")):
                assert await post_read(pool, server.url(), body) == body
                await server.peers[index].eof.wait()
                assert pool.num_idle() == 0
        assert [[request.body for request in peer.requests] for peer in server.peers] == [[b"one"], [b"two"]]

    run(main)


@pytest.mark.parametrize("limit", [1, 2])
def test_fresh_post_takes_no_idle_connection_and_stays_within_the_limit(run, limit):
    """``post(fresh=True)`` (the relay's resend after a crossed idle close) goes out on a new connection, not the idle
    one; at the limit, the oldest idle connection is closed for it (a pool of its own could open as many again)."""
    async def main() -> None:
        async with Server(echo) as server, pooled(limit_per_host=limit) as pool:
            assert await post_read(pool, server.url(), b"one") == b"one"
            assert pool.num_idle() == 1
            open_at_write = []

            async def count(_transport: Any, reused: bool) -> None:
                assert not reused
                open_at_write.append(sum(origin.num_open for origin in pool._by_key.values()))

            pool.before_write = count
            async with await pool.post(server.url(), b"two", fresh=True) as reply:
                assert await reply.read() == b"two"
            assert [[request.body for request in peer.requests] for peer in server.peers] == [[b"one"], [b"two"]]
            if limit == 1:
                await server.peers[0].eof.wait()  # (closed for the new one)
                assert pool.num_idle() == 1
            else:
                assert not server.peers[0].eof.is_set() and pool.num_idle() == 2
            assert open_at_write == [limit]  # (the new one and, below the limit, the idle one kept)

    run(main)


# -- the per-host limit -----------------------------------------------------------------------------------------


def held_server() -> tuple[Handler, asyncio.Semaphore]:
    """A server that answers each request (with its body) only once the test lets one answer go."""
    answers = asyncio.Semaphore(0)

    async def handler(peer: Peer) -> None:
        while (request := await peer.read_request()) is not None:
            await answers.acquire()
            peer.send(ok(request.body))

    return handler, answers


def test_limit_per_host_third_request_waits_for_a_released_connection(run):
    async def main() -> None:
        handler, answers = held_server()
        async with Server(handler) as server:
            pool = make_pool(limit_per_host=2)
            try:
                loop = asyncio.get_running_loop()
                asked = [loop.create_future() for _ in range(3)]
                tasks = [asyncio.create_task(post_read(pool, server.url(), b"r%d" % i, asked[i])) for i in range(3)]
                await until(lambda: len(server.requests) == 2)
                await asyncio.sleep(0.05)  # (room for a wrong third connection to show)
                assert sum(future.done() for future in asked) == 2
                assert num_waiting(pool) == 1
                assert len(server.peers) == 2
                answers.release()  # (one answer: its connection is released, the waiter's request goes out on it)
                await until(lambda: len(server.requests) == 3)
                assert all(future.done() for future in asked)
                answers.release()
                answers.release()
                assert sorted(await asyncio.gather(*tasks)) == [b"r0", b"r1", b"r2"]
            finally:
                pool.close()
                for task in tasks:
                    task.cancel()
        assert server.max_open == 2
        assert len(server.peers) == 2

    run(main)


def test_waiters_are_served_in_order(run):
    async def main() -> None:
        handler, answers = held_server()
        async with Server(handler) as server:
            pool = make_pool(limit_per_host=1)
            try:
                tasks = [asyncio.create_task(post_read(pool, server.url(), b"first"))]
                await until(lambda: len(server.requests) == 1)
                for body in (b"w1", b"w2", b"w3"):
                    tasks.append(asyncio.create_task(post_read(pool, server.url(), body)))
                    await until(lambda: num_waiting(pool) == len(tasks) - 1)  # (each waits behind the one before)
                for _ in range(4):
                    answers.release()
                assert await asyncio.gather(*tasks) == [b"first", b"w1", b"w2", b"w3"]
            finally:
                pool.close()
                for task in tasks:
                    task.cancel()
        assert [request.body for request in server.requests] == [b"first", b"w1", b"w2", b"w3"]
        assert len(server.peers) == 1

    run(main)


@pytest.mark.parametrize("when", ["waiting", "woken"])
def test_cancelled_waiter_gives_its_turn_on(run, when):
    """``waiting``: cancelled before a connection comes free; ``woken``: cancelled in the very step its turn came
    (the connection put back, the waiter woken, not yet run): either way the next waiter gets the connection."""

    async def main() -> None:
        async with Server(echo) as server, pooled(limit_per_host=1, timeout_s=5.0) as pool:
            holder = await pool.post(server.url(), b"held")
            assert await holder.read() == b"held"  # (read to its end, not released: the one slot stays taken)
            cancelled = asyncio.create_task(post_read(pool, server.url(), b"cancelled"))
            await until(lambda: num_waiting(pool) == 1)
            served = asyncio.create_task(post_read(pool, server.url(), b"served"))
            await until(lambda: num_waiting(pool) == 2)
            if when == "waiting":
                cancelled.cancel()
                await asyncio.wait([cancelled])
                assert num_waiting(pool) == 1
                holder.release()
            else:
                holder.release()
                cancelled.cancel()
            assert await served == b"served"
            assert cancelled.cancelled()
            assert num_waiting(pool) == 0
        assert [request.body for request in server.requests] == [b"held", b"served"]
        assert len(server.peers) == 1

    run(main)


def test_waiting_past_timeout_is_timeout_error(run):
    async def main() -> None:
        async with Server(echo) as server, pooled(limit_per_host=1, timeout_s=0.3) as pool:
            holder = await pool.post(server.url(), b"held")
            assert await holder.read() == b"held"  # (its deadline is over once it ended; the slot stays taken)
            asked = asyncio.get_running_loop().create_future()
            with pytest.raises(TimeoutError, match="no connection"):
                await pool.post(server.url(), b"late", asked=asked)
            assert not asked.done()
            assert num_waiting(pool) == 0
            holder.release()
            assert await post_read(pool, server.url(), b"after") == b"after"
        assert [request.body for request in server.requests] == [b"held", b"after"]

    run(main)


# -- the deadline -------------------------------------------------------------------------------------------------


def test_no_answer_within_timeout_is_timeout_error_and_the_connection_is_closed(run):
    async def silent(peer: Peer) -> None:
        await peer.read_request()

    async def main() -> None:
        async with Server(silent) as server, pooled(limit_per_host=1, timeout_s=0.3) as pool:
            with pytest.raises(TimeoutError):
                await pool.post(server.url(), b"q")
            await server.peers[0].eof.wait()
            assert pool.num_idle() == 0
            with pytest.raises(TimeoutError):  # (the slot was freed: a new connection, silent as well)
                await pool.post(server.url(), b"q2")
        assert len(server.peers) == 2

    run(main)


@pytest.mark.parametrize("how", ["read", "readany"])
def test_body_stopping_midway_is_timeout_error(run, how):
    async def handler(peer: Peer) -> None:
        await peer.read_request()
        peer.send(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\npart")

    async def main() -> None:
        async with Server(handler) as server, pooled(timeout_s=0.3) as pool:
            reply = await pool.post(server.url(), b"q")
            assert reply.status == 200
            if how == "readany":
                assert await reply.readany() == b"part"
                with pytest.raises(TimeoutError):
                    await reply.readany()
            else:
                with pytest.raises(TimeoutError):
                    await reply.read()
            await server.peers[0].eof.wait()
            reply.release()
            assert pool.num_idle() == 0

    run(main)


def test_readany_idle_s_is_read_idle_and_the_answer_goes_on(run):
    """``readany(idle_s)``: a wait longer than ``idle_s`` raises ``ReadIdle`` (a ``TimeoutError``, not the request's
    deadline: the answer and its connection go on, what comes later is read, and the connection is kept)."""
    go_on = asyncio.Event()

    async def handler(peer: Peer) -> None:
        await peer.read_request()
        peer.send(b"HTTP/1.1 200 OK\r\ncontent-length: 8\r\n\r\npart")
        await go_on.wait()
        peer.send(b"more")
        await peer.read_request()  # (the connection is kept: nothing more comes on it)

    async def main() -> None:
        async with Server(handler) as server, pooled(timeout_s=10) as pool:
            reply = await pool.post(server.url(), b"q")
            assert await reply.readany(0.05) == b"part"
            with pytest.raises(ReadIdle):
                await reply.readany(0.05)
            go_on.set()
            assert await reply.readany(5) == b"more"
            assert await reply.readany(5) == b""
            reply.release()
            assert pool.num_idle() == 1

    run(main)


# -- failures -------------------------------------------------------------------------------------------------------


def test_connect_refused_is_connect_failed(run):
    async def main() -> None:
        with socket.socket() as unlistened:  # (bound, never listening: a connect is refused)
            unlistened.bind(("127.0.0.1", 0))
            port = unlistened.getsockname()[1]
            pool = make_pool()
            try:
                with pytest.raises(ConnectFailed) as caught:
                    await pool.post(f"http://127.0.0.1:{port}/generate", b"q")
                assert isinstance(caught.value, HttpClientError)
                assert isinstance(caught.value, OSError)
                assert not crossed_idle_close(caught.value)
            finally:
                pool.close()

    run(main)


def test_close_before_answering_on_a_new_connection(run):
    async def handler(peer: Peer) -> None:
        await peer.read_request()
        peer.close()

    async def main() -> None:
        async with Server(handler) as server, pooled() as pool:
            with pytest.raises(Disconnected) as caught:
                await pool.post(server.url(), b"q")
            assert (caught.value.answered, caught.value.reused) == (False, False)
            assert not crossed_idle_close(caught.value)
        assert len(server.requests) == 1

    run(main)


def test_close_before_answering_on_a_reused_connection_crossed_its_idle_close(run):
    async def handler(peer: Peer) -> None:
        await peer.read_request()
        peer.send(ok(b"one"))
        await peer.read_request()
        peer.close()  # (as a worker whose keep-alive ended as the request came: never answered)

    async def main() -> None:
        async with Server(handler) as server, pooled() as pool:
            assert await post_read(pool, server.url(), b"q1") == b"one"
            with pytest.raises(Disconnected) as caught:
                await pool.post(server.url(), b"q2")
            assert (caught.value.answered, caught.value.reused) == (False, True)
            assert crossed_idle_close(caught.value)
        assert len(server.peers) == 1
        assert [request.body for request in server.requests] == [b"q1", b"q2"]

    run(main)


@pytest.mark.parametrize("reused", [False, True])
def test_half_a_head_then_close_is_answered(run, reused):
    async def handler(peer: Peer) -> None:
        if reused:
            await peer.read_request()
            peer.send(ok(b"one"))
        await peer.read_request()
        peer.send(b"HTTP/1.1 200 OK\r\ncontent-len")
        await peer.writer.drain()
        peer.close()

    async def main() -> None:
        async with Server(handler) as server, pooled() as pool:
            if reused:
                assert await post_read(pool, server.url(), b"q1") == b"one"
            with pytest.raises(Disconnected) as caught:
                await pool.post(server.url(), b"q2")
            assert (caught.value.answered, caught.value.reused) == (True, reused)
            assert not crossed_idle_close(caught.value)

    run(main)


def test_garbage_instead_of_http_is_bad_response(run):
    async def handler(peer: Peer) -> None:
        await peer.read_request()
        peer.send(b"SSH-2.0-OpenSSH_9.6\r\n")

    async def main() -> None:
        async with Server(handler) as server, pooled() as pool:
            with pytest.raises(BadResponse) as caught:
                await pool.post(server.url(), b"q")
            assert not crossed_idle_close(caught.value)
            await server.peers[0].eof.wait()
            assert pool.num_idle() == 0

    run(main)


# -- backpressure ---------------------------------------------------------------------------------------------------

BIG = random.Random(7).randbytes(4 * 1024 * 1024)


async def send_big(peer: Peer) -> None:
    await peer.read_request()
    peer.send(ok(BIG))
    await peer.writer.drain()
    await echo(peer)


async def wait_paused(reply: Reply) -> None:
    """Until the unread body is past ``HIGH_WATER`` and the socket is no longer read."""
    await until(lambda: reply._paused)
    assert reply._size > HIGH_WATER
    transport = reply._conn.transport
    assert transport is not None and not transport.is_reading()


@pytest.mark.parametrize("how", ["readany", "read"])
def test_large_body_read_slowly_arrives_whole_and_in_order(run, how):
    async def main() -> None:
        async with Server(send_big) as server, pooled(timeout_s=60.0) as pool:
            reply = await pool.post(server.url(), b"q")
            await wait_paused(reply)
            if how == "read":
                assert await reply.read() == BIG
            else:
                pieces, num_read, paused_again = [], 0, False
                while data := await reply.readany():
                    pieces.append(data)
                    num_read += len(data)
                    if not paused_again and num_read > len(BIG) // 2:  # (resumed, then past the mark again)
                        await wait_paused(reply)
                        paused_again = True
                    await asyncio.sleep(0)
                assert paused_again
                assert b"".join(pieces) == BIG
            reply.release()
            assert pool.num_idle() == 1  # (read to its end: kept, reading again)
            assert await post_read(pool, server.url(), b"after") == b"after"
        assert len(server.peers) == 1

    run(main)


# -- closing --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("sending", ["streaming", "between_chunks"])
def test_reply_close_while_the_worker_sends_closes_the_connection_and_frees_the_slot(run, sending):
    """``streaming``: chunks keep coming as the reply is closed; ``between_chunks``: the worker is quiet at that
    moment (so nothing it sends after can be what closes the connection)."""

    async def handler(peer: Peer) -> None:
        if peer.index:
            return await echo(peer)
        await peer.read_request()
        peer.send(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")

        async def stream() -> None:
            while True:
                peer.send(b"400\r\n%s\r\n" % (b"t" * 1024))
                if sending == "between_chunks":
                    return
                await peer.writer.drain()
                await asyncio.sleep(0.001)

        streaming = asyncio.create_task(stream())
        try:
            await peer.wait_eof()
        finally:
            streaming.cancel()
            await asyncio.gather(streaming, return_exceptions=True)

    async def main() -> None:
        async with Server(handler) as server, pooled(limit_per_host=1, timeout_s=5.0) as pool:
            reply = await pool.post(server.url(), b"q")
            assert (await reply.readany()).startswith(b"t")
            reply.close()
            await server.peers[0].eof.wait()
            assert pool.num_idle() == 0
            assert await post_read(pool, server.url(), b"next") == b"next"
        assert len(server.peers) == 2

    run(main)


def test_pool_close_fails_waiters_and_closes_idle_connections(run):
    async def holding(peer: Peer) -> None:
        await peer.read_request()
        peer.send(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nabc")

    async def main() -> None:
        async with Server(echo) as idle_server, Server(holding) as busy_server:
            pool = make_pool(limit_per_host=1)
            try:
                assert await post_read(pool, idle_server.url(), b"q") == b"q"
                assert pool.num_idle() == 1
                busy = await pool.post(busy_server.url(), b"busy")
                assert await busy.readany() == b"abc"
                waiter = asyncio.create_task(pool.post(busy_server.url(), b"waiting"))
                await until(lambda: num_waiting(pool) == 1)
            finally:
                pool.close()
            with pytest.raises(ConnectFailed):
                await waiter
            with pytest.raises(Disconnected):
                await busy.read()
            await idle_server.peers[0].eof.wait()
            await busy_server.peers[0].eof.wait()
            assert pool.num_idle() == 0
            with pytest.raises(ConnectFailed):
                await pool.post(idle_server.url(), b"after close")
        assert len(idle_server.peers) == 1
        assert [request.body for request in busy_server.requests] == [b"busy"]

    run(main)
