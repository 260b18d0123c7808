from collections import Counter
from dataclasses import dataclass

import pytest

from gateway.policies import RandomPolicy, RequestInfo, RoundRobinPolicy, create_policy
from workers.plugins import PluginError


@dataclass
class W:
    url: str
    role: str = "decode"
    num_active: int = 0


REQ = RequestInfo([1, 2, 3], 4)


def test_round_robin_cycles_both_pools() -> None:
    p, d = [W("p0", "prefill"), W("p1", "prefill")], [W("d0"), W("d1"), W("d2")]
    policy = RoundRobinPolicy()
    pairs = [policy.select(p, d, REQ) for _ in range(6)]
    assert [x.prefill.url for x in pairs] == ["p0", "p1"] * 3  # type: ignore[union-attr]
    assert [x.decode.url for x in pairs] == ["d0", "d1", "d2"] * 2


def test_random_spreads_and_combined_mode_has_no_prefill() -> None:
    d = [W("d0"), W("d1")]
    policy = RandomPolicy(RandomPolicy.Options(seed=3))
    picks = Counter(policy.select([], d, REQ).decode.url for _ in range(200))
    assert set(picks) == {"d0", "d1"} and min(picks.values()) > 60
    assert policy.select([], d, REQ).prefill is None


class MyPolicy:
    name = "mine"

    def select(self, prefills, decodes, request):  # type: ignore[no-untyped-def]
        return RoundRobinPolicy().select(prefills, decodes, request)


class NotAPolicy:
    pass


def test_plugins_by_entry_point_and_module_path() -> None:
    assert isinstance(create_policy("round_robin"), RoundRobinPolicy)
    assert isinstance(create_policy("random"), RandomPolicy)
    assert type(create_policy(f"{__name__}:MyPolicy")).__name__ == "MyPolicy"
    with pytest.raises(PluginError, match="nope"):
        create_policy("nope")
    with pytest.raises(PluginError, match="select"):
        create_policy(f"{__name__}:NotAPolicy")
