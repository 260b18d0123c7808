"""A relayed request taken onto a pooled connection whose close by the worker the relay has already *seen*.

The crossing ``test_sglang_relay_idle_close.py`` covers has the worker's FIN still on the wire when the request
goes out (``ServerDisconnectedError``, or a reset: ``ECONNRESET``/``EPIPE``). Under load at a worker's
``--max-http-connections`` (the cap closing its longest-idle connection for a newcomer) the FIN also lands in the
relay's event loop between the pool handing out the connection and the request's write: aiohttp then fails the
write on the closing transport, ``ClientOSError(None, "Can not write request body ...")``, errno None. The worker
never read that request either, but it went back to the client as a 502 ``worker_failed`` (counted against the
healthy worker's breaker and retried elsewhere): seen as 12 such 502s in 20 s with 24 clients through
``gateway --prefill http://... --decode http://...`` in front of two sim workers capped at 8 connections.

Made certain here: a trace hook holds the request once its head is ready (before aiohttp's write task starts) until
the worker (its keep-alive, or its cap taken by two newcomers) has closed that pooled connection, then yields once
to the loop, which reads the FIN (the transport starts closing) just before the write runs.
"""

from __future__ import annotations

import asyncio
import select
import socket
from typing import Any

import aiohttp
import pytest
from pdtest import Procs, free_port, start_worker
from relay_harness import Exchange, call, jbody

from gateway.admission import Admission
from gateway.health import CircuitBreaker, HealthConfig
from gateway.metrics import GatewayMetrics
from gateway.router import Router
from gateway.sglang_fleet import RelayConfig, RequestTrace, SGLangFleet, crossed_idle_close
from gateway.sglang_relay import SGLangResponder

SIM = ("--engine", "sim", "--num-pages", "64", "--page-size", "4")
HANG_GUARD_S = 30.0


def _peer_port(proto: Any) -> int | None:
    transport = proto.transport
    peer = transport.get_extra_info("peername") if transport is not None else None
    return peer[1] if peer else None


class CloseSeenOnTake:
    """Once armed, the pooled connection the next request to ``port`` goes out on is closed by the worker (``how``:
    its keep-alive ends, or two newcomers take its cap of 2), and the loop reads that close before the write."""

    def __init__(self, port: int, how: str) -> None:
        self.port, self.how = port, how
        self.armed = False
        self.num_closed = 0

    async def __call__(self, session: aiohttp.ClientSession, _ctx: Any, _params: Any) -> None:
        if not self.armed:
            return
        connector = session.connector
        assert connector is not None
        taken = [p for p in connector._acquired if _peer_port(p) == self.port]
        if len(taken) != 1:  # (a request to the other worker; or a fresh connection of the pooled session)
            return
        self.armed = False
        proto = taken[0]
        transport = proto.transport
        assert transport is not None
        sock = transport.get_extra_info("socket")
        newcomers = []
        if self.how == "cap":  # (the relay's and the probes' idle connections are the cap's two: both closed)
            newcomers = [socket.create_connection(("127.0.0.1", self.port), timeout=HANG_GUARD_S) for _ in range(2)]
        readable, _, _ = select.select([sock], [], [], HANG_GUARD_S)
        with socket.fromfd(sock.fileno(), socket.AF_INET, socket.SOCK_STREAM) as peek:  # (a copy of it)
            assert readable and peek.recv(1, socket.MSG_PEEK) == b"", "the worker did not close the idle connection"
        self.num_closed += 1
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


@pytest.mark.parametrize(("side", "how", "stream"), [("decode", "cap", False), ("decode", "keep-alive", True),
                                                      ("prefill", "cap", False)])
def test_a_request_on_a_connection_seen_closed_is_sent_again_not_blamed(procs: Procs, side: str, how: str,
                                                                        stream: bool) -> None:
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
        hook = CloseSeenOnTake(target.http_port, how)
        trace = aiohttp.TraceConfig()
        trace.on_request_headers_sent.append(hook)
        trace.freeze()
        assert fleet.session is not None
        fleet.session._trace_configs.append(trace)
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
                "a request on a connection the worker had closed counted against a healthy worker"
            assert worker.num_resent == 1
        finally:
            await fleet.aclose()

    asyncio.run(main())


def _trace(reused: bool) -> RequestTrace:
    trace = RequestTrace()
    trace.is_reused = reused
    return trace


def _write_failed(cause: BaseException) -> aiohttp.ClientOSError:
    """What aiohttp raises when the request's write fails (``ClientRequest.write_bytes``)."""
    exc = aiohttp.ClientOSError(getattr(cause, "errno", None), "Can not write request body for http://w/generate")
    exc.__cause__ = cause
    return exc


@pytest.mark.parametrize(("reused", "exc", "crossed"), [
    (True, _write_failed(aiohttp.ClientConnectionResetError("Cannot write to closing transport")), True),
    (True, _write_failed(aiohttp.ClientConnectionResetError("Connection lost")), True),
    (False, _write_failed(aiohttp.ClientConnectionResetError("Cannot write to closing transport")), False),
    (True, _write_failed(OSError(None, "something else")), False),
    (True, aiohttp.ClientOSError(None, "no cause"), False),
])
def test_a_write_on_a_closed_pooled_connection_is_a_crossing(reused: bool, exc: BaseException,
                                                             crossed: bool) -> None:
    assert crossed_idle_close(_trace(reused), exc) is crossed
