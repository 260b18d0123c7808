"""``ratio_aware``'s figures (``decode_utilization``, ``prefill_utilization``, ``pd_load_ratio`` on ``/metrics``)
are the fleet's, not the last request's candidates': a retry that avoids a decode, or a long request only the
larger decodes can hold (``Dispatcher._fitting``), gives ``select`` fewer workers than the fleet has. The stats
were averaged over exactly the last ``select``'s lists, so after a retry off a 90%-full decode the gateway
reported the decodes idle (``decode_utilization`` 0.0, no ``pd_load_ratio`` at all) until the next request: on
an idle or slow gateway, for good. A worker that leaves (``on_worker_removed``) still leaves the figures at once,
and one that stays off the lists (unhealthy) leaves them after a few requests."""

from __future__ import annotations

from gateway.policies.contract import FakeWorker
from gateway.policies.ratio_aware import RatioAwarePolicy
from gateway.router import Router


def _fleet() -> tuple[FakeWorker, FakeWorker, FakeWorker]:
    prefill = FakeWorker("pd://p:1", "prefill", busy_fraction=0.5)
    busy = FakeWorker("pd://d0:1", "decode", num_total_pages=1000, num_free_pages=100)  # 90% of its pool in use
    idle = FakeWorker("pd://d1:1", "decode", num_total_pages=1000, num_free_pages=1000)
    return prefill, busy, idle


def test_a_retry_avoiding_a_decode_leaves_the_figures_the_fleets() -> None:
    prefill, busy, idle = _fleet()
    policy = RatioAwarePolicy()
    router = Router(policy, policy)
    router.pick([prefill], [busy, idle], router.request([1] * 10, 10))
    before = router.stats()
    assert before["ratio_aware.decode_utilization"] > 0.4 and "ratio_aware.pd_load_ratio" in before, before
    # The same request's retry: the decode that failed it is avoided (it only leaves the list).
    router.pick([prefill], [idle], router.request([1] * 10, 10))
    after = router.stats()
    assert after == before, after


def test_a_long_request_for_the_larger_decodes_only_leaves_the_figures_the_fleets() -> None:
    prefill, busy, idle = _fleet()
    policy = RatioAwarePolicy()
    router = Router(policy, policy)
    router.pick([prefill], [busy, idle], router.request([1] * 10, 10))
    before = router.stats()
    router.pick([prefill], [busy], router.request([1] * 10, 10))  # (only the one whose context holds it)
    assert router.stats() == before


def test_a_worker_that_left_leaves_the_figures() -> None:
    prefill, busy, idle = _fleet()
    policy = RatioAwarePolicy()
    router = Router(policy, policy)
    router.pick([prefill], [busy, idle], router.request([1] * 10, 10))
    router.pick([prefill], [idle], router.request([1] * 10, 10))
    router.worker_removed(busy)  # (its connection is lost: gone at once, though not on the last lists)
    assert router.stats()["ratio_aware.decode_utilization"] == 0.0


def test_a_worker_that_stays_off_the_lists_leaves_the_figures_after_a_while() -> None:
    """(Unhealthy, draining: no hook; it is not the fleet's for long.)"""
    prefill, busy, idle = _fleet()
    policy = RatioAwarePolicy()
    router = Router(policy, policy)
    router.pick([prefill], [busy, idle], router.request([1] * 10, 10))
    for _ in range(100):
        router.pick([prefill], [idle], router.request([1] * 10, 10))
    assert router.stats()["ratio_aware.decode_utilization"] == 0.0


def test_the_decode_side_of_a_split_still_reports_decodes_only() -> None:
    prefill, busy, idle = _fleet()
    router = Router.build("random", "ratio_aware")
    router.pick([prefill], [busy, idle], router.request([1] * 10, 10))
    router.pick([prefill], [idle], router.request([1] * 10, 10))
    stats = router.stats()
    assert set(stats) == {"decode.ratio_aware.decode_utilization"}, stats
    assert stats["decode.ratio_aware.decode_utilization"] > 0.4
