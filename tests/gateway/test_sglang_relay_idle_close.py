"""A relayed request that crosses a worker's close of the idle pooled connection it went out on.

Our workers' HTTP side closes an idle kept-alive connection when its keep-alive ends
(``--http-keep-alive-timeout-s``, which may be shorter than the relay's ``WORKER_KEEPALIVE_S``) and, at its
connection cap (``--max-http-connections``), the longest-idle one for a newcomer, at any age. A request the
relay sends on it at that moment breaks before any answer: it used to be retried elsewhere and counted as a
failure against the healthy worker's breaker. The worker never read it (it closes only connections with
nothing in flight): it is now sent once more to the same worker on a fresh connection, no failure, no retry.

The crossing itself is made certain, not left to chance: a hook on the relay's pool (``HttpPool.on_reuse``) holds
the event loop at the moment a pooled connection to the worker is taken for a request, until the worker's close
(its FIN) has arrived on it (the keep-alive timer, or connections opened to the worker that take its cap), so
that the request goes out on a connection the worker has closed, as when the FIN is on the wire. Under load the FIN
also lands in the relay's loop between the pool handing out the connection and the request's write (seen with
aiohttp, the relay's client before, as 12 502s in 20 s with 24 clients in front of two sim workers capped at 8
connections); the ``seen`` cases hold the request once its bytes are ready instead (``HttpPool.before_write``), then
yield once to the loop, which reads the FIN just before the write.
"""

from __future__ import annotations

import asyncio
import select
import socket
from typing import Any

import pytest
from aiohttp import web
from pdtest import Procs, free_port, start_worker
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from relay_harness import Exchange, call, jbody, serve

from gateway.admission import Admission
from gateway.health import CircuitBreaker, HealthConfig
from gateway.metrics import GatewayMetrics, WorkerCollector
from gateway.router import Router
from gateway.sglang_fleet import RelayConfig, SGLangFleet
from gateway.sglang_relay import SGLangResponder
from gateway.worker_http import BadResponse, ConnectFailed, Disconnected, crossed_idle_close

SIM = ("--engine", "sim", "--num-pages", "64", "--page-size", "4")
HANG_GUARD_S = 30.0


def _peer_port(transport: Any) -> int | None:
    peer = transport.get_extra_info("peername")
    return peer[1] if peer else None


class CloseOnTake:
    """The hook: once armed, the next pooled connection taken for a request to ``port`` is closed by the worker
    (``how``: its keep-alive ends, or its cap of 2 is taken by two connections that make it close its idle ones)
    before the request goes out on it; ``seen``: the loop has read that close before the write (the hook then runs
    once the request's bytes are ready, ``before_write``, rather than at the connection's reuse, ``on_reuse``)."""

    def __init__(self, port: int, how: str, seen: bool = False) -> None:
        self.port, self.how, self.seen = port, how, seen
        self.armed = False
        self.num_closed = 0

    async def __call__(self, transport: Any, reused: bool = True) -> None:
        if not self.armed or not reused or _peer_port(transport) != self.port:  # (a request to the other worker)
            return
        self.armed = False
        sock = transport.get_extra_info("socket")
        newcomers = []
        if self.how == "cap":  # (the relay's and the probes' idle connections are the cap's two: both closed)
            newcomers = [socket.create_connection(("127.0.0.1", self.port), timeout=HANG_GUARD_S) for _ in range(2)]
        # The loop is held here (no await): the worker's FIN waits on the socket, unseen by the pool.
        readable, _, _ = select.select([sock], [], [], HANG_GUARD_S)
        with socket.fromfd(sock.fileno(), socket.AF_INET, socket.SOCK_STREAM) as peek:  # (a copy of it)
            assert readable and peek.recv(1, socket.MSG_PEEK) == b"", "the worker did not close the idle connection"
        self.num_closed += 1
        if self.seen:
            await asyncio.sleep(0)  # (the loop reads the FIN, which closes the transport, just before the write)
        for newcomer in newcomers:  # (they leave: the worker serves them and closes them, freeing its cap)
            newcomer.sendall(b"GET /health HTTP/1.1\r\nhost: w\r\nconnection: close\r\n\r\n")
            while newcomer.recv(65536):
                pass
            newcomer.close()


def _count_failures(breaker: CircuitBreaker) -> list[int]:
    failures = [0]
    record = breaker.record_failure

    def counted() -> None:
        failures[0] += 1
        record()

    breaker.record_failure = counted  # type: ignore[method-assign]
    return failures


@pytest.mark.parametrize(("side", "how", "stream", "seen"), [
    ("decode", "keep-alive", False, False), ("decode", "cap", True, False), ("prefill", "cap", False, False),
    ("decode", "cap", False, True), ("decode", "keep-alive", True, True), ("prefill", "cap", False, True),
])
def test_a_request_crossing_an_idle_close_is_sent_again_not_blamed(procs: Procs, side: str, how: str,
                                                                   stream: bool, seen: bool) -> None:
    closing = ("--http-keep-alive-timeout-s", "0.5") if how == "keep-alive" else ("--max-http-connections", "2")
    bootstrap_port = free_port()
    prefill = start_worker(procs, "prefill", *SIM, "--bootstrap-embedded", str(bootstrap_port),
                           *(closing if side == "prefill" else ()))
    decode = start_worker(procs, "decode", *SIM, *(closing if side == "decode" else ()))
    target = decode if side == "decode" else prefill

    async def main() -> None:
        metrics = GatewayMetrics()
        fleet = SGLangFleet([(f"http://127.0.0.1:{prefill.http_port}", bootstrap_port)],
                            [f"http://127.0.0.1:{decode.http_port}"], Router.build("random", "random"),
                            HealthConfig(probe_interval_s=60), RelayConfig(retry_backoff_s=0.01))
        fleet.start()
        hook = CloseOnTake(target.http_port, how, seen)
        assert fleet.pool is not None
        if seen:
            fleet.pool.before_write = hook
        else:
            fleet.pool.on_reuse = hook
        try:
            assert await fleet.wait_ready(HANG_GUARD_S)
            (worker,) = [w for w in fleet.workers if w.role == side]
            failures = {w.role: _count_failures(w.health.breaker) for w in fleet.workers}
            responder = SGLangResponder(fleet, "generate", "generate", Admission(0, 0, 1.0, metrics), metrics,
                                        1 << 24, 10.0)
            body = {"text": "idle", "sampling_params": {"max_new_tokens": 4, "temperature": 0}, "stream": stream}
            first = Exchange(jbody(body))
            await call(responder, first)  # (leaves a pooled connection to each worker, idle)
            assert first.status == 200, first.content
            for _ in range(int(HANG_GUARD_S / 0.01)):  # (the first's prefill reply may trail its answer)
                if not any(w.state.num_active for w in fleet.workers):
                    break
                await asyncio.sleep(0.01)
            hook.armed = True
            second = Exchange(jbody(body))
            await call(responder, second)
            assert hook.num_closed == 1, "the request did not go out on a pooled connection the worker closed"
            assert second.status == 200, second.content
            assert b'"text"' in second.content and (not stream or second.content.endswith(b"data: [DONE]\n\n"))
            retries = sum(value.value for value in metrics.retries._children.values())
            assert (failures["prefill"][0], failures["decode"][0], retries) == (0, 0, 0), \
                "a request crossing an idle close counted against a healthy worker"
            assert worker.num_resent == 1
            # ...and shows in /metrics, per worker (the other worker's series: 0)
            metrics.add_collector(WorkerCollector(lambda: fleet.workers, lambda: {}))
            resent = {(s.labels["worker"], s.labels["role"]): s.value
                      for f in text_string_to_metric_families(generate_latest(metrics.registry).decode())
                      for s in f.samples if s.name == "pd_gateway_worker_resent_requests_total"}
            assert resent == {(w.url, w.role): (1.0 if w is worker else 0.0) for w in fleet.workers}
        finally:
            await fleet.aclose()

    asyncio.run(main())


@pytest.mark.parametrize(("exc", "crossed"), [
    (Disconnected("closed", answered=False, reused=True), True),
    (Disconnected("closed", answered=False, reused=False), False),  # (a new connection: a worker gone)
    (Disconnected("broke off", answered=True, reused=True), False),  # (it had begun to answer: it read the request)
    (ConnectFailed("refused"), False),
    (BadResponse("garbage"), False),
    (TimeoutError("silent"), False),
    (ConnectionResetError(104, "reset"), False),  # (not the client's failure report)
])
def test_only_a_pooled_connection_closed_before_an_answer_is_a_crossing(exc: BaseException, crossed: bool) -> None:
    assert crossed_idle_close(exc) is crossed


def test_a_worker_closing_requests_unanswered_fails_once_per_attempt() -> None:
    """A decode that reads a request and closes its connection unanswered (dying, say), on a pooled connection as
    on a fresh one: the request sent again on a fresh connection fails too, and that is the worker's failure, once
    per attempt, retried as before; never sent a third time."""

    async def main() -> None:
        answered = [0]

        async def decode(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                while True:
                    head = await reader.readuntil(b"\r\n\r\n")
                    if head.startswith(b"GET "):  # (its probes)
                        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}")
                        continue
                    length = next(int(line.partition(b":")[2]) for line in head.split(b"\r\n")
                                  if line.lower().startswith(b"content-length:"))
                    await reader.readexactly(length)
                    answered[0] += 1
                    if answered[0] > 1:
                        return  # read, then closed unanswered
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}")
            except (asyncio.IncompleteReadError, ConnectionError):
                pass
            finally:
                writer.close()

        async def prefill(_: web.Request) -> web.Response:
            return web.json_response({})

        server = await asyncio.start_server(decode, "127.0.0.1", 0)
        d_url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        p_runner, p_url = await serve(prefill)
        metrics = GatewayMetrics()
        fleet = SGLangFleet([(p_url, 8998)], [d_url], Router.build("random", "random"),
                            HealthConfig(probe_interval_s=60, breaker_failures=1000),
                            RelayConfig(retry_backoff_s=0.01, max_retries=1))
        fleet.start()
        try:
            assert await fleet.wait_ready(HANG_GUARD_S)
            worker = fleet.decodes[0]
            failures = _count_failures(worker.health.breaker)
            responder = SGLangResponder(fleet, "generate", "generate", Admission(0, 0, 1.0, metrics), metrics,
                                        1 << 24, 10.0)
            first = Exchange(jbody({"text": "x"}))
            await call(responder, first)
            assert first.status == 200  # (its connection stays pooled)
            second = Exchange(jbody({"text": "x"}))
            await call(responder, second)
            assert second.status == 502, second.content
            retries = sum(value.value for value in metrics.retries._children.values())
            # attempt 1: the pooled connection, then a fresh one (the worker's failure); attempt 2: a new connection
            assert (answered[0], worker.num_resent, failures[0], retries) == (4, 1, 2, 1)
        finally:
            await fleet.aclose()
            await p_runner.cleanup()
            server.close()

    asyncio.run(main())
