"""The routing simulator (loadtests/sim_routing.py): small seeded runs of the real policies, no servers.

Virtual time only, so nothing here depends on the machine's speed; each run takes well under a second.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "loadtests"))  # loadtests is not a package

import sim_routing

from workers.page_cache import page_hashes


def test_precomputed_hashes_are_what_page_hashes_computes() -> None:
    convs = sim_routing.make_workload(sim_routing.SCENARIOS["a"].workload, 40, seed=5)
    assert sum(len(c.prompt_lens) for c in convs) == 40
    for conv in convs[:6]:
        for n in conv.prompt_lens:
            assert page_hashes(conv.transcript[:n], 16, (n - 1) // 16) == conv.hashes[: (n - 1) // 16]
    for conv in convs:  # each turn extends the previous prompt
        assert conv.prompt_lens == sorted(conv.prompt_lens)


def test_cache_aware_hits_far_more_than_random_with_many_tenants() -> None:
    res = sim_routing.run_scenario("a", ("random", "cache_aware"), requests=400, seed=3)
    rnd, ca = res.runs["random"], res.runs["cache_aware"]
    assert ca.num_requests == rnd.num_requests == 400
    assert ca.hit_rate > rnd.hit_rate + 0.2, (ca.hit_rate, rnd.hit_rate)
    assert ca.hit_rate <= ca.oracle_hit_rate + 0.01  # the pooled cache is an upper bound
    assert ca.hit_rate >= 0.8 * ca.oracle_hit_rate
    assert min(ca.prefill_share) > 0.1  # affinity spread the tenants rather than piling them on one worker


def test_power_of_two_avoids_the_slow_prefill_more_than_random() -> None:
    res = sim_routing.run_scenario("b", ("random", "power_of_two"), requests=400, seed=3)
    slow = 2  # scenario b: the third prefill is 4x slower
    assert sim_routing.SCENARIOS["b"].prefills[slow].speed < sim_routing.SCENARIOS["b"].prefills[0].speed
    rnd, p2 = res.runs["random"], res.runs["power_of_two"]
    assert p2.prefill_share[slow] < rnd.prefill_share[slow] - 0.08, (p2.prefill_share, rnd.prefill_share)
    assert p2.ttft(99) < rnd.ttft(99)


def test_runs_are_deterministic_for_a_seed() -> None:
    first = sim_routing.run_scenario("c", ("random", "ratio_aware"), requests=120, seed=7)
    second = sim_routing.run_scenario("c", ("random", "ratio_aware"), requests=120, seed=7)
    for name in ("random", "ratio_aware"):
        a, b = first.runs[name], second.runs[name]
        assert (a.ttft_ms, a.e2e_ms, a.prefill_share, a.decode_share) == (b.ttft_ms, b.e2e_ms, b.prefill_share,
                                                                          b.decode_share)
    # ratio_aware weighs the decodes by KV capacity (3000 vs 12000 pages); random splits evenly
    assert first.runs["ratio_aware"].decode_share[1] > first.runs["random"].decode_share[1]
