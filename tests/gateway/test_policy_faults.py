"""A routing policy's bugs stay the policy's: a hook or ``stats()`` that raises is logged and ignored
(the request the workers served is answered, a worker's connection stays up, ``/metrics`` keeps the other
figures); a pair that is not one of the workers the policy was given, a prefill-less pair for a
disaggregated fleet, a ``select`` that raises or returns something else: a 500 naming the policy, never
a dispatch to a draining worker or a 400 blaming the client."""

from __future__ import annotations

import asyncio
import gc
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pytest
from test_hot_path import _connected_workers

from gateway.dispatch import DispatchConfig, Dispatcher
from gateway.errors import APIError
from gateway.health import HealthConfig
from gateway.policies.base import Pair, RequestInfo, WorkerView
from gateway.policies.contract import run_contract
from gateway.policies.loader import PolicyError, create_policy
from gateway.policies.ratio_aware import RatioAwarePolicy
from gateway.policies.simple import RoundRobinPolicy
from gateway.router import Router
from gateway.sglang_fleet import SGLangFleet
from workers.protocol import SamplingParams


class Faulty:
    """Round robin whose hooks and stats raise."""

    name = "faulty"

    def __init__(self) -> None:
        self.inner = RoundRobinPolicy()
        self.calls: list[str] = []

    def select(self, prefills: Sequence[WorkerView], decodes: Sequence[WorkerView], request: RequestInfo) -> Pair:
        return self.inner.select(prefills, decodes, request)

    def _raise(self, hook: str) -> None:
        self.calls.append(hook)
        raise RuntimeError(f"bug in {hook}")

    def on_dispatch(self, pair: Pair, request: RequestInfo) -> None:
        self._raise("on_dispatch")

    def on_finish(self, pair: Pair, request: RequestInfo, outcome: str) -> None:
        self._raise("on_finish")

    def on_worker_added(self, worker: WorkerView) -> None:
        self._raise("on_worker_added")

    def on_worker_removed(self, worker: WorkerView) -> None:
        self._raise("on_worker_removed")

    def stats(self) -> dict[str, float]:
        raise RuntimeError("bug in stats")


def test_hooks_that_raise_are_ignored_and_counted() -> None:
    policy = Faulty()
    router = Router(policy, policy)  # type: ignore[arg-type]
    worker: Any = type("View", (), {"url": "pd://127.0.0.1:1", "page_size": 4})()
    router.worker_added(worker)
    router.worker_removed(worker)
    router.dispatched(Pair(None, worker), router.request([1, 2], 4))
    router.finished(Pair(None, worker), router.request([1, 2], 4), "finished")
    assert policy.calls == ["on_worker_added", "on_worker_removed", "on_dispatch", "on_finish"]
    assert router.num_hook_errors == 4
    assert router.stats() == {} and router.num_hook_errors == 5


class Figures:
    def __init__(self, name: str, figures: dict[str, Any]) -> None:
        self.name, self.figures = name, figures

    def select(self, prefills: Any, decodes: Any, request: Any) -> Pair:
        raise AssertionError

    def stats(self) -> dict[str, Any]:
        return self.figures


def test_stats_keep_good_figures_and_tell_the_two_sides_apart() -> None:
    joint = Figures("p", {"a": 1, "b": math.nan, "c": math.inf})
    assert Router(joint, joint).stats() == {"p.a": 1.0}  # type: ignore[arg-type]
    split = Router(Figures("same", {"x": 3}), Figures("same", {"x": 0}))  # type: ignore[arg-type]
    assert split.stats() == {"prefill.same.x": 3.0, "decode.same.x": 0.0}
    broken = Router(Figures("good", {"x": 1}), Figures("bad", {"x": "not a number"}))  # type: ignore[arg-type]
    assert broken.stats() == {"prefill.good.x": 1.0} and broken.num_hook_errors == 1


class Picks:
    """Returns what ``pick(prefills, decodes)`` says."""

    name = "picks"

    def __init__(self, pick: Any) -> None:
        self.pick = pick

    def select(self, prefills: Sequence[WorkerView], decodes: Sequence[WorkerView], request: RequestInfo) -> Any:
        return self.pick(prefills, decodes)


def _dispatcher(policy: Any) -> tuple[Dispatcher, list[Any], list[Any]]:
    loop = asyncio.get_running_loop()
    prefills, _ = _connected_workers(loop, "prefill", 2)
    decodes, _ = _connected_workers(loop, "decode", 2)
    return Dispatcher(prefills, decodes, Router(policy, policy), DispatchConfig(max_retries=0)), prefills, decodes


async def _answer(dispatcher: Dispatcher) -> None:
    async for _ in dispatcher.generate([1, 2, 3], SamplingParams(max_new_tokens=2)):
        pass


@pytest.mark.parametrize("case", ["draining", "no_prefill", "raises", "not_a_pair"])
def test_a_bad_pick_is_a_500_naming_the_policy_and_nothing_is_sent(case: str) -> None:
    async def main() -> None:
        remembered: list[Any] = []

        def pick(prefills: Sequence[Any], decodes: Sequence[Any]) -> Any:
            if case == "draining":  # a worker the policy saw before, draining now (the admin API's DELETE)
                return Pair(prefills[0], remembered[0] if remembered else decodes[0])
            if case == "no_prefill":
                return Pair(None, decodes[0])
            if case == "raises":
                raise KeyError("worker-7")
            return (prefills[0], decodes[0])

        dispatcher, prefills, decodes = _dispatcher(Picks(pick))
        remembered.append(decodes[0].state)
        decodes[0].is_draining = True
        with pytest.raises(APIError) as err:
            await _answer(dispatcher)
        assert err.value.status == 500 and "routing policy picks" in err.value.message
        assert not any(w.state.num_active for w in (*prefills, *decodes))  # nothing was dispatched

    asyncio.run(main())


def test_ratio_aware_forgets_a_removed_worker() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        decodes, _ = _connected_workers(loop, "decode", 2)
        full, idle = decodes[0].state, decodes[1].state
        full.num_free_pages = 0  # (the view's figure: a decode with its pool in use)
        policy = RatioAwarePolicy()
        router = Router(policy, policy)
        router.select([], [full, idle], router.request([1], 1))
        assert policy.stats()["decode_utilization"] > 0
        router.worker_removed(full)
        assert policy.stats()["decode_utilization"] == 0.0

    asyncio.run(main())


def test_a_plugin_that_cannot_be_named_is_a_clear_start_up_error(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys
    import types

    class NoName:
        __slots__ = ()

        def select(self, prefills: Any, decodes: Any, request: Any) -> Pair:
            raise AssertionError

    module = types.ModuleType("slotted_policy_plugin")
    module.NoName = NoName  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "slotted_policy_plugin", module)
    with pytest.raises(PolicyError, match="slotted_policy_plugin:NoName"):
        create_policy("slotted_policy_plugin:NoName", {})


@dataclass(frozen=True)
class TaggedPair(Pair):
    """A policy's own ``Pair`` subclass (the contract accepts it: the gateway must too)."""

    reason: str = ""


def test_a_pair_subclass_is_served() -> None:
    async def main() -> None:
        dispatcher, prefills, decodes = _dispatcher(Picks(lambda p, d: TaggedPair(p[1], d[0], "mine")))
        pair, prefill, decode = dispatcher._select(dispatcher.router.request([1, 2, 3], 2), set())
        assert isinstance(pair, TaggedPair) and (prefill, decode) == (prefills[1], decodes[0])
        assert run_contract(lambda: Picks(lambda p, d: TaggedPair(p[0] if p else None, d[0]))) == []

    asyncio.run(main())


def _sglang_fleet(policy: Any) -> SGLangFleet:
    fleet = SGLangFleet([("http://127.0.0.1:1", 9000), ("http://127.0.0.1:2", None)],
                        ["http://127.0.0.1:3", "http://127.0.0.1:4"], Router(policy, policy), HealthConfig())
    for worker in fleet.workers:
        worker.is_up = True
    return fleet


@pytest.mark.parametrize("case", ["unhealthy", "avoided", "no_prefill", "raises", "not_a_pair"])
def test_a_bad_pick_over_sglang_workers_is_a_500_naming_the_policy(case: str) -> None:
    """The SGLang relay's pair goes through the native path's checks: a pick that is not one of the workers
    the policy was given (one it remembers, unhealthy or avoided by the retry now), a pair without a prefill,
    an exception or not a ``Pair`` is the request's 500 naming the policy, sent to no worker."""
    remembered: list[Any] = []

    def pick(prefills: Sequence[Any], decodes: Sequence[Any]) -> Any:
        if case in ("unhealthy", "avoided"):
            if not remembered:
                remembered.append(Pair(prefills[0], decodes[0]))
            return remembered[0]
        if case == "no_prefill":
            return Pair(None, decodes[0])
        if case == "raises":
            raise KeyError("worker-7")
        return (prefills[0], decodes[0])

    fleet = _sglang_fleet(Picks(pick))
    request = fleet.router.request([1, 2, 3], 4)
    avoid: set[Any] = set()
    if case in ("unhealthy", "avoided"):
        assert fleet.select(request, set())[1:] == (fleet.prefills[0], fleet.decodes[0])
        if case == "unhealthy":
            fleet.prefills[0].is_up = False
        else:
            avoid = {fleet.decodes[0]}
    with pytest.raises(APIError) as err:
        fleet.select(request, avoid)
    assert err.value.status == 500 and "routing policy picks" in err.value.message, err.value.message


class AsyncParts(RoundRobinPolicy):
    """Round robin with ``async def`` hooks (and, as ``AsyncSelect``, ``select``): nothing would await them."""

    name = "async_parts"

    def __init__(self) -> None:
        super().__init__()
        self.ran: list[str] = []

    async def on_dispatch(self, pair: Pair, request: RequestInfo) -> None:
        self.ran.append("on_dispatch")

    async def on_finish(self, pair: Pair, request: RequestInfo, outcome: str) -> None:
        self.ran.append("on_finish")


class AsyncSelect(RoundRobinPolicy):
    name = "async_select"

    async def select(self, prefills: Any, decodes: Any, request: Any) -> Pair:  # type: ignore[override]
        return RoundRobinPolicy.select(self, prefills, decodes, request)


def test_async_hooks_and_select_are_refused_not_silently_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys
    import types
    import warnings

    module = types.ModuleType("async_policy_plugin")
    module.AsyncParts, module.AsyncSelect = AsyncParts, AsyncSelect  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "async_policy_plugin", module)
    for name, parts in (("AsyncParts", "on_dispatch, on_finish"), ("AsyncSelect", "select")):
        with pytest.raises(PolicyError, match=f"async_policy_plugin:{name}.*{parts} must be plain functions"):
            create_policy(f"async_policy_plugin:{name}", {})
        (failure,) = run_contract(getattr(module, name))
        assert failure.startswith("synchronous:") and parts in failure, failure
    # Made by hand past the loader: each call is a hook error (counted, logged), its coroutine closed unrun.
    policy = AsyncParts()
    router = Router(policy, policy)
    worker: Any = type("View", (), {"url": "pd://127.0.0.1:1", "page_size": 4})()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # ("coroutine ... was never awaited" would be a RuntimeWarning)
        router.dispatched(Pair(None, worker), router.request([1, 2], 4))
        router.finished(Pair(None, worker), router.request([1, 2], 4), "finished")
        gc.collect()
    assert router.num_hook_errors == 2 and policy.ran == []


class Affinity:
    """A prompt's first pair, kept for the prompt; forgotten only when a worker is removed (the hook)."""

    name = "affinity"

    def __init__(self) -> None:
        self.homes: dict[tuple[int, ...], Pair] = {}

    def select(self, prefills: Sequence[WorkerView], decodes: Sequence[WorkerView], request: RequestInfo) -> Pair:
        key = tuple(request.input_ids[:8])
        if key not in self.homes:
            self.homes[key] = Pair(prefills[len(self.homes) % len(prefills)] if prefills else None,
                                   decodes[len(self.homes) % len(decodes)])
        return self.homes[key]

    def on_worker_removed(self, worker: WorkerView) -> None:
        self.homes = {k: p for k, p in self.homes.items() if worker not in (p.prefill, p.decode)}


def test_the_contract_catches_a_policy_that_picks_an_unhealthy_worker_it_remembers() -> None:
    """Unhealthy, draining and avoided workers leave the lists without a hook call: a policy that forgets
    workers only in ``on_worker_removed`` fails the contract (the gateway would answer its requests 500)."""
    failures = run_contract(Affinity)
    assert [f.split(":")[0] for f in failures] == ["never_unhealthy"], failures
    assert "unhealthy: no hook called" in failures[0]
