"""The contract calls ``select`` the way the gateway does: with tuples (``Router.pick`` hands a policy tuples, so
that it cannot change what it was given). A policy that sorts or trims its lists in place passed the contract,
which gave it plain lists, and then failed every request in the gateway: a 500 naming the policy for each one
(``'tuple' object has no attribute 'sort'``). "Run the contract before you ship" (docs/policies.md) promised
otherwise."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from gateway.errors import APIError
from gateway.policies.base import Pair, RequestInfo, WorkerView
from gateway.policies.contract import FakeWorker, run_contract
from gateway.router import Router


class SortsInPlace:
    """Least-queued prefill, most free decode: by sorting the lists it was given in place."""

    name = "sorts_in_place"

    def select(self, prefills: Sequence[WorkerView], decodes: Sequence[WorkerView], request: RequestInfo) -> Pair:
        if prefills:
            prefills.sort(key=lambda w: w.num_prefill_tokens)  # type: ignore[attr-defined]
        decodes.sort(key=lambda w: -w.num_free_pages)  # type: ignore[attr-defined]
        return Pair(prefills[0] if prefills else None, decodes[0])


def test_the_gateway_refuses_a_policy_that_sorts_what_it_was_given() -> None:
    """(What the gateway does with it: every request a 500 naming the policy.)"""
    policy = SortsInPlace()
    router = Router(policy, policy)  # type: ignore[arg-type]
    prefills = [FakeWorker("pd://p0:1", "prefill"), FakeWorker("pd://p1:1", "prefill")]
    decodes = [FakeWorker("pd://d0:1", "decode")]
    with pytest.raises(APIError) as err:
        router.pick(prefills, decodes, RequestInfo([1, 2, 3], 4))
    assert err.value.status == 500 and "sorts_in_place" in err.value.message


def test_the_contract_fails_a_policy_the_gateway_would_answer_500_for() -> None:
    failures = run_contract(SortsInPlace)  # type: ignore[arg-type]
    assert failures, "the contract passed a policy whose every request is a 500 in the gateway"
    assert any("sort" in f for f in failures), failures


def test_the_builtin_policies_still_pass() -> None:
    from gateway.policies.loader import create_policy

    for name in ("random", "round_robin", "power_of_two", "cache_aware", "ratio_aware"):
        options = {"seed": "1"} if name in ("random", "power_of_two") else {}
        assert run_contract(lambda name=name, options=options: create_policy(name, options)) == [], name
