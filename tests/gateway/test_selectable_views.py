"""The dispatcher keeps its views of the selectable workers between requests (``Dispatcher._views``) and recomputes
them when ``Selectability.epoch`` moves. Whatever happens to the workers (connections lost and made again, stops,
probe verdicts, breakers opening, turning half-open and closing, workers added and removed through the runtime's
admin calls), what a policy is given is what the plain expression gives at that moment: the views of the workers
of each pool that are ``healthy``, in pool order. A change that did not move the epoch would show here as a
recovered worker left out, or a lost one offered."""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import AsyncIterator, Sequence
from typing import Any

import pytest
from test_probe_flap import fake_worker, started

from gateway.errors import NoWorkers
from gateway.health import BreakerState, HealthConfig
from gateway.policies import Pair, RequestInfo
from gateway.router import Router
from gateway.runtime import Gateway, GatewayConfig
from gateway.worker_client import WorkerClient


class _Recorder:
    """A policy that remembers what it was given and picks from it at random, or each side's first with ``first``
    (the views given may hold one whose connection began closing a moment ago: the dispatcher re-checks the pair
    it gets)."""

    name = "recorder"

    def __init__(self, *, first: bool = False) -> None:
        self.calls: list[tuple[list[Any], list[Any]]] = []
        self.rng = random.Random(7)
        self.first = first  # each side's first worker, not a random one

    def select(self, prefills: Sequence[Any], decodes: Sequence[Any], request: RequestInfo) -> Pair:
        self.calls.append((list(prefills), list(decodes)))
        if self.first:
            return Pair(prefills[0] if prefills else None, decodes[0])
        return Pair(self.rng.choice(prefills) if prefills else None, self.rng.choice(decodes))


@contextlib.asynccontextmanager
async def _fleet(num_prefills: int, num_decodes: int) -> AsyncIterator[tuple[Gateway, dict[str, list[Any]], Any]]:
    """A started gateway over fake workers (real sockets); yields it, each URL's open server-side writers (to drop
    a connection from the worker's end) and a function that starts one more server of a role."""
    writers: dict[str, list[Any]] = {}
    servers: list[asyncio.Server] = []

    async def serve(role: str) -> str:
        def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> Any:
            writers.setdefault(url, []).append(writer)
            return fake_worker(reader, writer, role, [True])

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        servers.append(server)
        url = f"pd://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        return url

    prefills = [await serve("prefill") for _ in range(num_prefills)]
    decodes = [await serve("decode") for _ in range(num_decodes)]
    health = HealthConfig(probe_interval_s=30, probe_timeout_s=30, unhealthy_after=2, healthy_after=2,
                          breaker_failures=2, breaker_successes=1, breaker_cooldown_s=30)
    gw = Gateway(GatewayConfig(prefill=tuple(prefills), decode=tuple(decodes), startup_timeout_s=5, health=health,
                               drain_timeout_s=0.05))
    async with started(gw, servers):
        yield gw, writers, serve


def _plain(pool: list[WorkerClient]) -> list[Any]:
    return [w.state for w in pool if w.healthy]


async def _settled(gw: Gateway) -> None:
    """No connection between its transport beginning to close and its loss being announced (the one window no event
    covers, which the dispatcher's re-check of the pair covers instead), and a moment for reconnects."""
    await asyncio.sleep(0.01)
    for _ in range(500):
        if not any(c._transport is not None and c._transport.is_closing() for c in gw.clients):
            return
        await asyncio.sleep(0.01)
    raise AssertionError("a connection stayed closing")


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_views_a_policy_is_given_follow_every_change_of_the_workers(seed: int) -> None:
    async def main() -> None:
        rng = random.Random(seed)
        async with _fleet(2, 3) as (gw, writers, serve):
            policy = _Recorder()
            dispatcher = gw.dispatcher
            dispatcher.router = Router(policy, policy)
            now = [0.0]
            for client in gw.clients:
                client.health.breaker._clock = lambda: now[0]
            rid = iter(range(1, 10**9))
            ops: dict[str, int] = {}

            def pool_client() -> WorkerClient:
                return rng.choice(gw.clients)

            for step in range(160):
                client = pool_client()
                breaker = client.health.breaker
                op = rng.choice(["stop", "probe_fail", "probe_pass", "breaker_fail", "cooldown",
                                 "trial", "drop", "request", "request", "add", "remove"])
                ops[op] = ops.get(op, 0) + 1
                if op == "stop":  # (a worker's "stopping" error; its next connection clears it)
                    client.is_stopping = not client.is_stopping
                elif op == "probe_fail":
                    client.health.probe_failed("no answer")
                elif op == "probe_pass":
                    client.health.probe_passed(0.0)
                elif op == "breaker_fail":
                    breaker.record_failure()
                elif op == "cooldown":
                    now[0] += 31.0  # (open breakers turn half-open when next read)
                elif op == "trial":
                    if breaker.state is BreakerState.HALF_OPEN:
                        breaker.trial_started(r := next(rid))
                        breaker.trials.discard(r)
                        breaker.record_success(r)
                elif op == "drop":  # the worker's end closes the connection; the client connects again
                    for writer in writers.pop(client.url, []):
                        writer.close()
                elif op == "add" and len(gw.clients) < 8:
                    role = rng.choice(["prefill", "decode"])
                    added = gw.add_worker(await serve(role), role)
                    added.health.breaker._clock = lambda: now[0]
                    assert await added.wait_ready(5)
                elif op == "remove" and len(gw.decodes) > 1 and len(gw.prefills) > 1:
                    gw.remove_worker(client.url)  # (draining at once: not selectable)
                    assert not client.healthy
                    policy.calls.clear()
                    with contextlib.suppress(NoWorkers):
                        dispatcher._select(dispatcher.router.request([1, 2, 3], 4), frozenset())
                        assert client.state not in (*policy.calls[0][0], *policy.calls[0][1])
                    for _ in range(200):  # (out of its pool once drained)
                        if client not in gw.clients:
                            break
                        await asyncio.sleep(0.01)
                await _settled(gw)
                for _ in range(2):  # (the second from the kept views when nothing changed)
                    policy.calls.clear()
                    want = _plain(gw.prefills), _plain(gw.decodes)
                    try:
                        pair, prefill, decode = dispatcher._select(dispatcher.router.request([1, 2, 3], 4),
                                                                    frozenset())
                    except NoWorkers:
                        assert not want[0] or not want[1], f"step {step} ({op}): no pair, yet {want}"
                        assert not policy.calls
                        continue
                    assert len(policy.calls) == 1, f"step {step} ({op}): the policy was asked twice"
                    assert policy.calls[0] == (want[0], want[1]), f"step {step} ({op}): {policy.calls[0]} != {want}"
                    assert decode.healthy and prefill is not None and prefill.healthy
                    assert (pair.prefill, pair.decode) == (prefill.state, decode.state)
            # (every kind of change happened, and the kept views were used: most steps changed nothing the
            # epoch counts, e.g. a breaker failure below the threshold)
            assert set(ops) >= {"stop", "probe_fail", "probe_pass", "breaker_fail", "cooldown", "trial",
                                "drop", "request", "add", "remove"}, ops

    asyncio.run(main())


def test_a_connection_closing_before_its_loss_is_announced_is_not_picked() -> None:
    """Its transport closing, the worker still in the kept views: a pick of it is re-done over fresh views."""
    async def main() -> None:
        async with _fleet(1, 2) as (gw, _, _):
            policy = _Recorder(first=True)  # (the closing one is the first decode: picked whenever it is given)
            dispatcher = gw.dispatcher
            dispatcher.router = Router(policy, policy)
            request = dispatcher.router.request([1, 2, 3], 4)
            dispatcher._select(request, frozenset())
            kept = dispatcher._views
            closing = gw.decodes[0]
            assert closing._transport is not None
            closing._transport.close()  # (its loss is announced at the loop's next turn, not now)
            assert dispatcher._views is kept and not closing.healthy
            for i in range(3):
                policy.calls.clear()
                _, _, decode = dispatcher._select(request, frozenset())
                assert decode is gw.decodes[1]
                # the first time from the kept views (it picks the closing one), then again over fresh ones, which
                # are kept from then on
                assert [decodes for _, decodes in policy.calls] == \
                    ([[closing.state, gw.decodes[1].state]] if i == 0 else []) + [[gw.decodes[1].state]]
            await asyncio.sleep(0.05)
            assert not closing._is_up or closing.healthy

    asyncio.run(main())
