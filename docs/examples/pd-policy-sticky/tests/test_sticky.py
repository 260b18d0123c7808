from pd_policy_sticky import StickyPrefixPolicy

from gateway.policies import RequestInfo
from gateway.policies.contract import FakeWorker, run_contract


def test_passes_the_pd_gateway_policy_contract() -> None:
    assert run_contract(StickyPrefixPolicy) == []


def test_same_prefix_same_home() -> None:
    policy = StickyPrefixPolicy()
    prefills = [FakeWorker(f"pd://p{i}:1", "prefill") for i in range(4)]
    decodes = [FakeWorker("pd://d0:1", "decode")]
    homes = {policy.select(prefills, decodes, RequestInfo([7] * 300 + [i], 8)).prefill.url for i in range(20)}
    assert len(homes) == 1
