"""Load-aware policies over decodes whose KV pool is unknown (SGLang workers without ``/v1/loads``: no report,
no pool size), and ``ratio_aware``'s figures over prefills whose busy share is unknown. Found by review: such a
decode read as full (0 free of 0 pages, plus the wait penalty), so next to a reporting decode it got nothing
while the other had room, and among its peers the gateway's own counts did not count (all tied at 1.0)."""

from __future__ import annotations

from collections import Counter

import pytest

from gateway.health import HealthConfig
from gateway.policies.base import RequestInfo
from gateway.policies.loader import create_policy
from gateway.policies.ratio_aware import RatioAwarePolicy
from gateway.router import Router
from gateway.sglang_fleet import SGLangFleet, load_report_of
from gateway.worker_state import WorkerState
from workers.protocol import PROTOCOL_VERSION, HelloAck, LoadReport

POLICIES = ["power_of_two", "ratio_aware", "cache_aware"]


def _fleet(policy: str) -> SGLangFleet:
    p = create_policy(policy, {"seed": "1"} if policy == "power_of_two" else {})
    fleet = SGLangFleet([("http://127.0.0.1:1", 9000)], ["http://127.0.0.1:3", "http://127.0.0.1:4"],
                        Router(p, p), HealthConfig())
    for w in fleet.workers:
        w.is_up = True
    return fleet


@pytest.mark.parametrize("policy", POLICIES)
def test_a_decode_without_loads_shares_the_traffic_with_a_reporting_one(policy: str) -> None:
    fleet = _fleet(policy)
    with_loads, without = fleet.decodes
    without.has_loads = False
    report = load_report_of([{"max_total_num_tokens": 160_000, "num_used_tokens": 112_000, "num_running_reqs": 40,
                              "num_waiting_reqs": 0, "num_total_tokens": 112_000, "max_running_requests": 256}], 0)
    with_loads.state.num_total_pages = report.num_total_pages
    with_loads.state.reported(report)  # 70% of its pool in use
    counts: Counter[str] = Counter()
    picks = []
    for i in range(200):
        request = fleet.router.request(list(range(i, i + 200)), 64)
        _, _, decode = fleet.select(request, set())
        decode.opened(0, request.num_pages_needed(16))  # open, never closed: load builds up where it went
        counts[decode.url] += 1
        picks.append(decode.url)
    # (before: its first request came only once the reporting one's pool was near full, the 176th)
    assert picks.index(without.url) < 10 and counts[with_loads.url] > 0, dict(counts)


@pytest.mark.parametrize("policy", POLICIES)
def test_decodes_without_loads_are_chosen_by_the_gateways_own_counts(policy: str) -> None:
    fleet = _fleet(policy)
    for w in fleet.workers:
        w.has_loads = False
    busy, _idle = fleet.decodes
    for _ in range(50):
        busy.opened(0, 20)  # 50 of our requests open on it, none on the other
    picks = Counter(fleet.select(fleet.router.request(list(range(i, i + 200)), 64), set())[2].url for i in range(20))
    assert picks[busy.url] == 0, dict(picks)


def test_ratio_aware_leaves_out_prefills_whose_busy_share_is_unknown() -> None:
    """A prefill whose report went stale reads busy 0.0 ("unknown"): it was averaged as idle, and a swamped
    prefill that froze turned ``pd_load_ratio`` from >1 (prefills the bottleneck) to 0 (the decodes)."""
    now = [0.0]
    prefill = WorkerState("pd://p:1", "prefill", clock=lambda: now[0])
    decode = WorkerState("pd://d:1", "decode", clock=lambda: now[0])
    for w, role in ((prefill, "prefill"), (decode, "decode")):
        w.connected(HelloAck(PROTOCOL_VERSION, role, role, "sim", "m", "byte", 16, 1000, 4096))
    prefill.reported(LoadReport(8, 40, 900, 1000, num_prefill_tokens=200_000, busy_fraction=1.0,
                                prefill_tokens_per_s=5e3))
    decode.reported(LoadReport(10, 0, 500, 1000, max_running=64))
    policy = RatioAwarePolicy()
    policy.select([prefill], [decode], RequestInfo(list(range(100)), 16))
    assert policy.stats()["pd_load_ratio"] > 1
    now[0] = 1.5  # past the report's freshness: the prefill's figures are the gateway's own, busy unknown
    prefill.refresh()
    decode.reported(LoadReport(10, 0, 500, 1000, max_running=64))
    stats = policy.stats()
    assert "pd_load_ratio" not in stats and "prefill_utilization" not in stats and stats["decode_utilization"] > 0
