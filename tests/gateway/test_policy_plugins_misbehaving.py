"""Review findings: third-party routing policies that misbehave (see /tmp/rev_pol.patch's report).

Each test fails on the reviewed tree and states the behaviour the docs (docs/policies.md, "Writing a policy")
promise."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

import pytest
from relay_harness import Exchange, call, jbody, relay
from test_policy_faults import Picks, TaggedPair, _dispatcher

from gateway.errors import APIError
from gateway.policies.base import Pair, RequestInfo, WorkerView
from gateway.router import Router


def test_a_policy_that_puts_a_draining_worker_back_on_its_list_is_refused() -> None:
    """``select`` may mutate the lists it is given (nothing stops it: they are plain lists), and
    ``Router.client_of`` checks the pick against those same list objects: a policy that appends a worker it
    remembers (draining now: the admin API's DELETE) and returns it passes the check and the request goes to
    the draining worker (in a real cluster, to a removed one: a 502 "not connected" blamed on the worker,
    with retries), instead of the documented 500 naming the policy, sent to no worker."""

    async def main() -> None:
        remembered: list[Any] = []

        def pick(prefills: list[Any], decodes: list[Any]) -> Any:
            decodes.append(remembered[0])  # (a list the policy keeps its favourites on, say)
            return Pair(prefills[0], remembered[0])

        dispatcher, _prefills, decodes = _dispatcher(Picks(pick))
        remembered.append(decodes[0].state)
        decodes[0].is_draining = True
        request = dispatcher.router.request([1, 2, 3], 2)
        with pytest.raises(APIError) as err:
            _pair, _, decode = dispatcher._select(request, set())
            raise AssertionError(f"dispatched to {decode.url} (draining: {decode.is_draining})")
        assert err.value.status == 500 and "routing policy picks" in err.value.message, err.value.message

    asyncio.run(main())


def test_a_select_that_raises_on_every_request_is_not_logged_with_a_traceback_per_request(
        caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """Hooks and ``stats()`` that raise are logged at most every 10 s with a count; a ``select`` that raises
    is logged by ``Router.pick`` with a full traceback on every request (``log.exception``), forever: a
    broken plugin under load floods the log (30 requests: 30 tracebacks in a real gateway's log)."""
    import gateway.router as router_module

    monkeypatch.setattr(router_module.time, "monotonic", lambda: 1000.0)  # (every call in one instant)

    def boom(prefills: Any, decodes: Any) -> Any:
        raise RuntimeError("bug in select")

    policy = Picks(boom)
    router = Router(policy, policy)  # type: ignore[arg-type]
    worker: Any = type("View", (), {"url": "pd://127.0.0.1:1", "page_size": 4})()
    with caplog.at_level(logging.ERROR, logger="gateway.router"):
        for _ in range(20):
            with pytest.raises(APIError):
                router.pick([worker], [worker], router.request([1, 2], 4))
    records = [r for r in caplog.records if r.name == "gateway.router"]
    assert len(records) <= 1, f"{len(records)} log records for 20 failing selects (one per request)"


class Ticketed:
    """Hands out a ``TaggedPair`` per attempt (a ``Pair`` subclass: documented as fine) and expects the same
    object back in ``on_finish``, as the native path gives it."""

    name = "ticketed"

    def __init__(self) -> None:
        self.open: dict[int, TaggedPair] = {}
        self.strangers: list[Pair] = []
        self.finished = 0

    def select(self, prefills: Sequence[WorkerView], decodes: Sequence[WorkerView], request: RequestInfo) -> Pair:
        return TaggedPair(prefills[0] if prefills else None, decodes[0], f"ticket-{len(self.open)}")

    def on_dispatch(self, pair: Pair, request: RequestInfo) -> None:
        self.open[id(pair)] = pair  # type: ignore[assignment]

    def on_finish(self, pair: Pair, request: RequestInfo, outcome: str) -> None:
        self.finished += 1
        if self.open.pop(id(pair), None) is None:
            self.strangers.append(pair)


def test_on_finish_over_sglang_workers_gets_the_pair_on_dispatch_got() -> None:
    """The SGLang relay calls ``on_finish`` with ``Pair(prefill.state, decode.state)`` made anew
    (``gateway/sglang_relay.py``), not the pair the policy returned and ``on_dispatch`` was given: a policy's
    ``Pair`` subclass loses its fields there, and a policy that keeps per-attempt state by the pair object
    never sees its attempts end (its view of load drifts up for good), unlike on native workers."""

    async def prefill(request: Any) -> Any:
        from aiohttp import web
        await request.read()
        return web.json_response({"text": "", "meta_info": {}})

    async def decode(request: Any) -> Any:
        from aiohttp import web
        await request.read()
        return web.json_response({"text": "ok", "meta_info": {}})

    async def main() -> None:
        policy = Ticketed()
        async with relay(prefill, decode) as (responder, fleet):
            fleet.router = Router(policy, policy)  # type: ignore[arg-type]
            for _ in range(3):
                exchange = Exchange(jbody({"text": "hi", "sampling_params": {"max_new_tokens": 2}}))
                await call(responder, exchange)
                assert exchange.status == 200, exchange.content
        assert policy.finished == 3
        assert not policy.strangers and not policy.open, (
            f"on_finish got {policy.strangers[:1]} (a {type(policy.strangers[0]).__name__ if policy.strangers else ''}"
            f"), not the pair on_dispatch got; {len(policy.open)} attempts never ended for the policy")

    asyncio.run(main())


class Quadratic:
    """Reads each view once (the contract's read count stays linear), then ranks by comparing every pair of
    workers: O(workers^2) work per ``select`` on the event loop (~17 ms at 512+512 workers here, ~220 ms at
    2048: every other request and /health waits that long)."""

    name = "quadratic"

    def select(self, prefills: Sequence[WorkerView], decodes: Sequence[WorkerView], request: RequestInfo) -> Pair:
        loads = [w.num_prefill_tokens for w in prefills]
        free = [w.num_free_pages for w in decodes]
        p = min(range(len(loads)), key=lambda i: sum(1 for x in loads if x < loads[i])) if loads else None
        d = min(range(len(free)), key=lambda i: sum(1 for x in free if x > free[i]))
        return Pair(prefills[p] if p is not None else None, decodes[d])


def test_the_contract_flags_a_select_whose_cost_grows_faster_than_linearly() -> None:
    """docs/policies.md: the contract checks "bounded ``select()`` cost"; it counts attribute reads on the views
    only, so a policy that copies the figures out once and then does quadratic work passes all 8 checks."""
    from gateway.policies.contract import run_contract

    failures = run_contract(Quadratic)
    assert any(f.startswith("bounded_cost") for f in failures), failures


def test_a_prefill_returned_as_the_decode_is_a_500_that_names_the_worker_and_the_role() -> None:
    """The 500 for a pick that is not one of the given workers reads "returned <gateway.worker_state.WorkerState
    object at 0x7f...>, which is not one of the workers it was given": the plugin author learns neither which
    worker nor that it was a prefill given as the decode (``WorkerState`` has no ``__repr__``)."""

    async def main() -> None:
        dispatcher, prefills, _ = _dispatcher(Picks(lambda p, d: Pair(p[0], p[1])))
        with pytest.raises(APIError) as err:
            dispatcher._select(dispatcher.router.request([1, 2, 3], 2), set())
        message = err.value.message
        assert err.value.status == 500 and prefills[1].url in message and "prefill" in message, message

    asyncio.run(main())


def test_policy_errors_are_counted_on_metrics() -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    from gateway.metrics import WorkerCollector

    registry = CollectorRegistry()
    registry.register(WorkerCollector(lambda: [], dict, lambda: 3))
    assert b"pd_gateway_policy_errors_total 3.0" in generate_latest(registry)
