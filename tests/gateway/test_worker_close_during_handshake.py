"""``WorkerClient.aclose`` while a connection's handshake completes: it returns and leaves the client down.

Python 3.11's ``asyncio.wait_for`` returns the awaited result when the cancellation arrives after that result
is in but before the waiting task resumed (gh-86296): the cancellation is lost. The connect task waited for
its connection and ``HelloAck`` that way, so ``aclose()`` (the admin API removing a worker, the gateway's
shutdown) landing in that loop pass did not end the task: it went on to serve the new connection and
``aclose`` waited for it for good."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from gateway import worker_client
from gateway.worker_client import WorkerClient
from workers.protocol import PROTOCOL_VERSION, HelloAck, read_frame, worker_codec


@pytest.mark.parametrize("passes", range(6))
def test_aclose_as_the_hello_ack_arrives_ends_the_client(monkeypatch: pytest.MonkeyPatch, passes: int) -> None:
    """``aclose`` is started ``passes`` loop passes after the ``HelloAck`` is read (each lands in another
    step of the connect task's wait): every one returns, and the client is left disconnected."""
    async def main() -> None:
        loop = asyncio.get_running_loop()
        codec = worker_codec()

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await read_frame(reader)
            writer.write(codec.encode(HelloAck(PROTOCOL_VERSION, "w", "decode", "sim", "m", "byte", 16, 4096, 64)))
            await asyncio.sleep(30)  # (the worker stays up: only the gateway ends the connection)

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        client = WorkerClient(f"pd://127.0.0.1:{server.sockets[0].getsockname()[1]}", "decode")
        closing: list[asyncio.Future[Any]] = []
        frames = worker_client._FrameProtocol._frames

        def close_soon(k: int) -> None:
            if k:
                loop.call_soon(close_soon, k - 1)
            else:
                closing.append(asyncio.ensure_future(client.aclose()))

        def spy(proto: Any, buf: Any) -> int:
            used = frames(proto, buf)
            if proto.backlog and not closing and not getattr(spy, "armed", False):
                spy.armed = True  # type: ignore[attr-defined]
                loop.call_soon(close_soon, passes)
            return used

        monkeypatch.setattr(worker_client._FrameProtocol, "_frames", spy)
        client.start()
        try:
            for _ in range(500):
                if closing:
                    break
                await asyncio.sleep(0.01)
            assert closing, "the handshake never came"
            done, _ = await asyncio.wait(closing, timeout=3.0)
            assert done, "aclose() hung: the connect task lost its cancellation and serves the connection"
            assert not client.is_connected
        finally:
            if client._task is not None and not client._task.done():
                client._task.cancel()
                await asyncio.gather(client._task, return_exceptions=True)
            server.close()

    asyncio.run(main())


def test_aclose_cancelled_by_its_caller_is_cancelled() -> None:
    """``aclose`` waits for the connection task it cancelled; a cancellation of ``aclose``'s own caller (a
    shutdown's timeout) landing in that wait was taken for the task's and swallowed: the caller went on as if
    never cancelled. It propagates now, and the client is still left down."""
    async def main() -> None:
        client = WorkerClient("pd://127.0.0.1:1", "decode")

        async def slow_to_end() -> None:  # (a connection task whose clean-up takes a moment)
            try:
                await asyncio.sleep(30)
            finally:
                await asyncio.sleep(0.5)

        client._task = asyncio.create_task(slow_to_end())
        await asyncio.sleep(0)
        closing = asyncio.create_task(client.aclose())
        await asyncio.sleep(0.05)  # (aclose is waiting for the task)
        closing.cancel()
        with pytest.raises(asyncio.CancelledError):
            await closing
        assert not client.is_connected
        await asyncio.gather(client._task, return_exceptions=True)

    asyncio.run(main())
