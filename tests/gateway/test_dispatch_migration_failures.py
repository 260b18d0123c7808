"""A stream that migrates (its decode failed after the first token) over fake native workers on real sockets:

- a decode that falls silent past ``--stream-idle-timeout-s`` mid-stream is a failure of that decode's (its
  breaker hears of it, as of a ``timeout`` it reported itself), not only a reason to move the stream;
- a stream whose decode was lost and that finds no decode left to continue on ends with the failure it
  migrated off (the lost decode, 502), not "no healthy decode worker" (503), as when no decode can hold
  its longer prompt;
- a retry whose backoff would end past the request's own deadline is not waited for: the request ends with
  its failure within its timeout (it ended up to the whole backoff, 2 s at most, after it).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import struct
from collections.abc import AsyncIterator
from typing import Any

from gateway.dispatch import Dispatcher
from gateway.errors import APIError
from gateway.runtime import Gateway, GatewayConfig
from workers.protocol import (
    PROTOCOL_VERSION,
    Error,
    Hello,
    HelloAck,
    Outputs,
    Ping,
    Pong,
    SamplingParams,
    StepOutput,
    Submit,
    gateway_codec,
    worker_codec,
)

PROMPT = list(range(100, 120))


async def fake_worker(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, role: str, mode: str) -> None:
    """A worker's native side. A prefill hands every request over at once. A decode answers a new request
    (the client's own prompt) with one token and then, by ``mode``: ``silent`` (nothing more, pings still
    answered) or ``close`` (drops the connection); a migrated one (a longer prompt) runs to the end. A decode
    in mode ``overloaded`` refuses every request as full."""
    decoder, encoder = worker_codec(), gateway_codec()._encoder

    def send(msg: object) -> None:
        data = encoder.encode(msg)
        writer.write(struct.pack(">I", len(data)) + data)

    while True:
        try:
            size = struct.unpack(">I", await reader.readexactly(4))[0]
            msg = decoder.decode(await reader.readexactly(size))
        except (asyncio.IncompleteReadError, ConnectionError):
            return
        if isinstance(msg, Hello):
            port = writer.get_extra_info("sockname")[1]
            send(HelloAck(PROTOCOL_VERSION, f"{role}-{port}", role, "sim", "m", "byte", 16, 4096, 1024,
                          bootstrap_host="127.0.0.1" if role == "prefill" else None, bootstrap_port=1,
                          transfer="tcp"))
        elif isinstance(msg, Ping):
            send(Pong(msg.nonce))
        elif isinstance(msg, Submit):
            if role == "prefill":
                send(Outputs([StepOutput(msg.rid, [], "transferred")]))
            elif mode == "overloaded":
                send(Error(msg.rid, "overloaded", "the worker holds its --max-requests"))
            elif len(msg.input_ids) == len(PROMPT):
                send(Outputs([StepOutput(msg.rid, [7])]))
                if mode == "close":
                    await writer.drain()
                    await asyncio.sleep(0.05)
                    writer.close()
                    return
            else:
                n = msg.params.max_new_tokens
                send(Outputs([StepOutput(msg.rid, [8] * (n - 1))]))
                send(Outputs([StepOutput(msg.rid, [9], "length")]))


@contextlib.asynccontextmanager
async def fleet(decode_modes: list[str], **config: Any) -> AsyncIterator[Gateway]:
    servers = [await asyncio.start_server(functools.partial(fake_worker, role=role, mode=mode), "127.0.0.1", 0)
               for role, mode in [("prefill", ""), *(("decode", m) for m in decode_modes)]]
    urls = [f"pd://127.0.0.1:{s.sockets[0].getsockname()[1]}" for s in servers]
    gw = Gateway(GatewayConfig(prefill=(urls[0],), decode=tuple(urls[1:]), startup_timeout_s=5, **config))
    try:
        for client in gw.clients:
            client.start()
        gw._started = True
        assert all(await asyncio.gather(*(c.wait_ready(5) for c in gw.clients)))
        yield gw
    finally:
        for client in gw.clients:
            await client.aclose()
        for server in servers:
            server.close()


async def _stream(dispatcher: Dispatcher, max_new_tokens: int = 6) -> tuple[list[int], APIError | None]:
    tokens: list[int] = []
    try:
        async for output in dispatcher.generate(PROMPT, SamplingParams(max_new_tokens=max_new_tokens)):
            tokens.extend(output.token_ids)
    except APIError as exc:
        return tokens, exc
    return tokens, None


def test_a_decode_silent_mid_stream_counts_against_its_breaker() -> None:
    async def main() -> None:
        async with fleet(["silent", "silent"], stream_idle_timeout_s=0.3, retry_backoff_s=0.01) as gw:
            tokens, error = await _stream(gw.dispatcher)
            assert error is None and tokens == [7, 8, 8, 8, 8, 9], (tokens, error)
            assert gw.metrics.migrations._value.value == 1
            failures = [d.health.breaker.failures for d in gw.decodes]
            assert sorted(failures) == [0, 1], f"the silent decode's breaker heard nothing: {failures}"

    asyncio.run(main())


def test_a_stream_that_finds_no_decode_to_migrate_to_ends_with_its_own_failure() -> None:
    async def main() -> None:
        async with fleet(["close"], retry_backoff_s=0.01) as gw:
            tokens, error = await _stream(gw.dispatcher)
            assert tokens == [7]
            assert error is not None
            assert (error.status, error.code) == (502, "worker_gone"), (error.status, error.code, error.message)
            assert "lost connection to decode worker" in error.message

    asyncio.run(main())


def test_a_retry_backoff_past_the_request_deadline_is_not_waited_for() -> None:
    async def main() -> None:
        # The first retry's backoff: 0.5 to 1.5 s; the request has 0.3 s.
        async with fleet(["overloaded"], request_timeout_s=0.3, retry_backoff_s=1.0) as gw:
            tokens, error = await _stream(gw.dispatcher)
            assert tokens == [] and error is not None
            # (waited for, the backoff ran past the deadline: the request ended as timed out, a 504 that hides why)
            assert error.code == "overloaded", (error.status, error.code, error.message)

    asyncio.run(main())
