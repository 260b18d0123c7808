"""A worker that fails its health probes for a moment, its connection up throughout, is unselectable
meanwhile, and keeps what the gateway knows of its prefix cache: the worker sends KV events as changes
on one connection (a full snapshot only on a new one), so what the index dropped would never return."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import struct
from collections.abc import AsyncIterator
from typing import Any

import pytest

from gateway.health import HealthConfig, WorkerHealth
from gateway.runtime import Gateway, GatewayConfig
from workers.page_cache import page_hashes
from workers.protocol import PROTOCOL_VERSION, Hello, HelloAck, KVEvents, Ping, Pong, gateway_codec, worker_codec

PROMPT = list(range(1000, 1000 + 16 * 8 + 1))
HASHES = page_hashes(PROMPT, 16, 8)


async def fake_worker(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, role: str,
                      answer_pings: list[bool], hashes: list[bytes] = HASHES, transfer: str = "tcp") -> None:
    """A worker's native side: the handshake, ``hashes`` as its prefix cache (a prefill), pongs while
    ``answer_pings[0]``."""
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
            port = writer.get_extra_info("sockname")[1]  # (one worker per server: its id names its port)
            send(HelloAck(PROTOCOL_VERSION, f"{role}-{port}", role, "sim", "m", "byte", 16, 4096, 1024,
                          bootstrap_host="127.0.0.1" if role == "prefill" else None, bootstrap_port=1,
                          transfer=transfer))
            if role == "prefill":
                send(KVEvents(stored=hashes, reset=True))
        elif isinstance(msg, Ping) and answer_pings[0]:
            send(Pong(msg.nonce))


@contextlib.asynccontextmanager
async def fleet(answer_pings: list[bool], **config: Any) -> AsyncIterator[tuple[Gateway, int, int]]:
    """A gateway (``Gateway``, started as ``Gateway.start`` does) over one fake prefill and one fake
    decode; yields it with the two ports, and closes all of it."""
    servers = [await asyncio.start_server(lambda r, w, role=role: fake_worker(r, w, role, answer_pings),
                                          "127.0.0.1", 0) for role in ("prefill", "decode")]
    p_port, d_port = (s.sockets[0].getsockname()[1] for s in servers)
    gw = Gateway(GatewayConfig(prefill=(f"pd://127.0.0.1:{p_port}",), decode=(f"pd://127.0.0.1:{d_port}",),
                               startup_timeout_s=5, **config))
    async with started(gw, servers):
        yield gw, p_port, d_port


@contextlib.asynccontextmanager
async def started(gw: Gateway, servers: list[asyncio.Server]) -> AsyncIterator[None]:
    """``gw``'s worker connections started (as ``Gateway.start`` does) and up; then every connection (those of
    workers added meanwhile too) and ``servers`` closed."""
    try:
        for client in gw.clients:
            client.start()
        gw._started = True  # (workers added from now on connect at once)
        assert all(await asyncio.gather(*(c.wait_ready(5) for c in gw.clients)))
        yield
    finally:
        for client in gw.clients:
            await client.aclose()
        for server in servers:
            server.close()


def test_failing_probes_for_a_moment_keep_the_workers_prefix_index() -> None:
    answer_pings = [True]

    async def main() -> None:
        health = HealthConfig(probe_interval_s=0.05, probe_timeout_s=0.05, unhealthy_after=2, healthy_after=2)
        async with fleet(answer_pings, policy="cache_aware", health=health) as (gw, p_port, _):
            prefill, url = gw.prefills[0], f"pd://127.0.0.1:{p_port}"
            for _ in range(100):
                if gw.router.index.num_pages(url):
                    break
                await asyncio.sleep(0.01)
            assert gw.router.index.num_pages(url) == len(HASHES)
            answer_pings[0] = False  # a stall: probes time out, the connection stays
            for _ in range(100):
                await asyncio.sleep(0.02)
                if not prefill.healthy:
                    break
            assert not prefill.healthy and prefill.is_connected
            answer_pings[0] = True
            for _ in range(100):
                await asyncio.sleep(0.02)
                if prefill.healthy:
                    break
            assert prefill.healthy and prefill.is_connected
            assert gw.router.index.num_pages(url) == len(HASHES), "the index forgot the cache it still has"

    asyncio.run(main())


def test_workers_that_come_and_go_at_new_addresses_do_not_grow_the_prefix_index() -> None:
    """Pods replaced at new addresses: each removed (and drained) prefill's place in the index is
    freed for the next one, which does not inherit what the old one held or was assumed to hold."""
    async def main() -> None:
        answer = [True]
        churned = []
        async with fleet(answer, policy="cache_aware", drain_timeout_s=1) as (gw, p_port, _):
            index = gw.router.index
            for i in range(12):
                other = PROMPT[:1] + [7000 + i] * (len(PROMPT) - 1)  # a prefix of its own
                own = page_hashes(other, 16, 8)
                server = await asyncio.start_server(
                    lambda r, w, own=own: fake_worker(r, w, "prefill", answer, own), "127.0.0.1", 0)
                churned.append(server)
                url = f"pd://127.0.0.1:{server.sockets[0].getsockname()[1]}"
                client = gw.add_worker(url, "prefill")
                assert await client.wait_ready(5)
                for _ in range(100):
                    if index.num_pages(url) == len(own):
                        break
                    await asyncio.sleep(0.01)
                assert index.match(own) == {url: len(own)}, "a new worker saw a gone one's pages, or not its own"
                index.assume(url, HASHES[:2])
                gw.remove_worker(url)
                for _ in range(300):
                    if client not in gw.prefills and url not in index._bit_of:
                        break
                    await asyncio.sleep(0.01)
                assert url not in index._bit_of and index.match(own) == {}
                assert index.match(HASHES) == {f"pd://127.0.0.1:{p_port}": len(HASHES)}, "its assumption outlived it"
                server.close()
            assert len(index._urls) <= 2, f"{len(index._urls)} bits for a fleet of 2 prefills at most"
        for server in churned:
            server.close()

    asyncio.run(main())


def test_one_worker_under_two_urls_is_used_once() -> None:
    """``localhost`` and ``127.0.0.1`` are one worker: the second URL does not connect (its share of
    requests and the fleet's free pages would count twice) and says why, until the first is removed."""
    async def main() -> None:
        async with fleet([True], drain_timeout_s=1) as (gw, _, d_port):
            first = gw.decodes[0]
            again = gw.add_worker(f"pd://localhost:{d_port}", "decode")
            started = asyncio.get_running_loop().time()
            assert not await again.wait_ready(30.0)
            assert asyncio.get_running_loop().time() - started < 10, "waiting for it ran to the timeout"
            assert not again.is_connected and again.last_error is not None
            assert "already connected as pd://127.0.0.1" in again.last_error, again.last_error
            assert first.healthy
            gw.remove_worker(first.url)
            assert await again.wait_ready(10), again.last_error  # the one left connects at its next try
            assert gw.decodes == [again]

    asyncio.run(main())


def test_a_worker_on_another_kv_backend_is_reported(caplog: pytest.LogCaptureFixture) -> None:
    """A decode started with another ``--transfer`` than the fleet's pairs with none of its prefills (every
    room it takes part in fails): the gateway says so in its log, naming both."""
    async def main() -> None:
        async with fleet([True], drain_timeout_s=1) as (gw, _, _):
            other = await asyncio.start_server(
                lambda r, w: fake_worker(r, w, "decode", [True], transfer="nixl"), "127.0.0.1", 0)
            try:
                odd = gw.add_worker(f"pd://127.0.0.1:{other.sockets[0].getsockname()[1]}", "decode")
                assert await odd.wait_ready(10.0)
            finally:
                other.close()

    with caplog.at_level(logging.ERROR, logger="gateway.runtime"):
        asyncio.run(main())
    assert any("moves KV over 'nixl'" in r.getMessage() and "'tcp'" in r.getMessage() for r in caplog.records)


def test_probe_failures_count_only_in_a_row() -> None:
    """``unhealthy_after`` counts consecutive failed probes: a probe that passes between two failures (a
    Pong lost now and then) leaves the worker healthy, keeping its requests and its place in selection;
    two failures in a row do not."""
    health = WorkerHealth(HealthConfig(unhealthy_after=2, healthy_after=2))
    assert not health.probe_failed("no Pong in time")
    assert not health.probe_passed(0.0)
    assert not health.probe_failed("no Pong in time")
    assert health.is_probe_healthy and health.is_selectable
    assert health.probe_failed("no Pong in time")  # the second in a row
    assert not health.is_probe_healthy


def test_a_scheduler_stalled_past_the_stall_timeout_fails_its_probes() -> None:
    """A worker that answers pings while its scheduler makes no progress (a wedged engine, the connection's
    thread alive) fails its probes once the stall is longer than ``stall_timeout_s``: ``unhealthy_after``
    such probes make it unhealthy; a stall of up to the timeout (a long prefill) passes."""
    health = WorkerHealth(HealthConfig(unhealthy_after=2, stall_timeout_s=10.0))
    for _ in range(3):
        assert not health.probe_passed(10.0)
    assert health.is_probe_healthy and health.num_probe_failures == 0
    assert not health.probe_passed(10.5)
    assert health.probe_passed(10.5)  # the second in a row: unhealthy
    assert not health.is_probe_healthy and health.num_probe_failures == 2
    assert "no progress" in (health.last_probe_error or "")
