"""``cache_aware``'s decode side is the least pressured decode; ties (an idle fleet of equal decodes, requests one
at a time) went to the first decode every time, so the others took no request until the first was busier. Ties
now go round, while a decode that is less pressured is still chosen whatever the turn."""

from __future__ import annotations

from collections import Counter

import pytest

from gateway.policies import RequestInfo, create_policy
from gateway.policies.contract import FakeLookup, FakeWorker


def _request() -> RequestInfo:
    return RequestInfo(list(range(40)), 8, FakeLookup({}))


@pytest.mark.parametrize("split", [False, True], ids=["joint", "decode-side-only"])
def test_an_idle_fleets_requests_go_round_its_decodes(split: bool) -> None:
    policy = create_policy("cache_aware")
    prefills = [] if split else [FakeWorker("pd://p:1", "prefill")]
    decodes = [FakeWorker(f"pd://d{i}:1", "decode") for i in range(3)]
    picks = Counter(policy.select(prefills, decodes, _request()).decode.url for _ in range(30))
    assert picks == {"pd://d0:1": 10, "pd://d1:1": 10, "pd://d2:1": 10}


def test_a_less_pressured_decode_is_chosen_whatever_the_turn() -> None:
    policy = create_policy("cache_aware")
    busy = [FakeWorker(f"pd://d{i}:1", "decode", num_free_pages=512, num_running_seqs=8) for i in range(2)]
    idle = FakeWorker("pd://idle:1", "decode")
    for _ in range(6):
        assert policy.select([FakeWorker("pd://p:1", "prefill")], [*busy, idle], _request()).decode is idle
