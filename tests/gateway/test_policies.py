import math
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


# -- load-aware built-ins ----------------------------------------------------------------------------
from gateway.policies import Pair, PolicyError  # noqa: E402
from gateway.policies.contract import FakeLookup, FakeWorker  # noqa: E402
from gateway.prefix_index import PrefixIndex  # noqa: E402
from gateway.router import Router  # noqa: E402


def prefill(name: str, tokens: int = 0, rate: float = 10_000.0) -> FakeWorker:
    return FakeWorker(f"pd://{name}:1", "prefill", num_prefill_tokens=tokens, prefill_tokens_per_s=rate)


def decode(name: str, total: int = 1000, free: int = 1000, running: int = 0) -> FakeWorker:
    return FakeWorker(f"pd://{name}:1", "decode", num_total_pages=total, num_free_pages=free, num_running_seqs=running)


def req(n: int = 320, cached: dict[str, int] | None = None, max_new: int = 16) -> RequestInfo:
    return RequestInfo(list(range(n)), max_new, FakeLookup(cached or {}))


def test_power_of_two_takes_the_less_loaded_by_time_not_tokens() -> None:
    policy = create_policy("power_of_two", {"seed": "1"})
    fast_busy, slow_idle = prefill("fast", tokens=4000, rate=40_000), prefill("slow", tokens=1000, rate=2_000)
    d_full, d_free = decode("full", free=50, running=30), decode("free", free=900)
    for _ in range(20):
        pair = policy.select([fast_busy, slow_idle], [d_full, d_free], req())
        assert pair.prefill is fast_busy, "0.1 s of queue beats 0.5 s"
        assert pair.decode is d_free


def test_cache_aware_follows_the_prefix_and_skips_hot_spots() -> None:
    policy = create_policy("cache_aware")
    a, b, c = prefill("a"), prefill("b"), prefill("c")
    def long() -> RequestInfo:
        return req(n=3200, cached={"pd://b:1": 199})

    assert policy.select([a, b, c], [decode("d")], long()).prefill is b
    b.num_prefill_tokens = 3000  # 0.3 s of queue: still better than recomputing 3200 tokens elsewhere
    assert policy.select([a, b, c], [decode("d")], long()).prefill is b
    assert policy.select([a, b, c], [decode("d")], req(n=320, cached={"pd://b:1": 19})).prefill is not b, (
        "a short prompt is cheaper to recompute than to queue for")
    b.num_prefill_tokens = 60_000  # a hot spot: far above the pool mean -> skipped despite the cache
    assert policy.select([a, b, c], [decode("d")], long()).prefill is not b
    assert policy.stats()["hot_spot_skips"] == 1


@pytest.mark.parametrize("holder", [0, 1, 2])
@pytest.mark.parametrize("cached_pages", [4, 8, 18])
def test_cache_aware_follows_the_prefix_wherever_its_holder_is_listed(holder: int, cached_pages: int) -> None:
    """The holder of a prefix is chosen and counted as a predicted hit whatever its place in the list
    (the first worker's cache was compared with itself and never counted: its prefixes got a new home)."""
    policy = create_policy("cache_aware")
    workers = [prefill(f"p{i}") for i in range(3)]
    policy._fill[workers[holder].url] = (320.0, 0)  # (it computed this prefix recently: not the idlest home)
    request = req(n=320, cached={workers[holder].url: cached_pages})
    assert policy.select(workers, [decode("d")], request).prefill is workers[holder]
    assert policy.stats()["predicted_hit_share"] == 1.0


def test_cache_aware_new_prefixes_spread_evenly_and_stick_to_their_home() -> None:
    policy = create_policy("cache_aware")
    workers = [prefill(f"p{i}") for i in range(4)]
    homes = {}
    for tenant in range(200):
        ids = [tenant * 1000 + i for i in range(100)]
        first = policy.select(workers, [decode("d")], RequestInfo(ids, 8, FakeLookup({}))).prefill
        again = policy.select(workers, [decode("d")], RequestInfo([*ids, 1, 2], 8, FakeLookup({}))).prefill
        assert first is again, "an idle pool sends the same prefix to the same home"
        homes[tenant] = first
    counts = Counter(w.url for w in homes.values())
    assert len(counts) == 4 and min(counts.values()) > 30


def test_ratio_aware_fills_decodes_in_proportion_to_capacity() -> None:
    policy = create_policy("ratio_aware")
    big, small = decode("big", total=4000, free=4000), decode("small", total=1000, free=1000)
    picks = Counter()
    for _ in range(100):  # each request takes 20 pages; place it and account for it
        pair = policy.select([prefill("p")], [big, small], req(n=300, max_new=20))
        pair.decode.num_free_pages -= 20  # type: ignore[attr-defined]
        picks[pair.decode.url] += 1
    assert 75 <= picks["pd://big:1"] <= 85, picks
    small.num_free_pages = 5  # cannot take the next request now
    big.num_free_pages = 30
    assert policy.select([prefill("p")], [big, small], req(n=300, max_new=20)).decode is big
    stats = policy.stats()
    assert set(stats) == {"prefill_utilization", "decode_utilization", "pd_load_ratio"}


def test_ratio_aware_prefill_by_throughput() -> None:
    policy = create_policy("ratio_aware")
    fast, slow = prefill("fast", tokens=0, rate=30_000), prefill("slow", tokens=0, rate=10_000)
    picks = Counter()
    for _ in range(400):
        pair = policy.select([fast, slow], [decode("d")], req(n=100))
        pair.prefill.num_prefill_tokens += 100  # type: ignore[union-attr]
        picks[pair.prefill.url] += 1  # type: ignore[union-attr]
    assert 280 <= picks["pd://fast:1"] <= 320, picks


class Recorder:
    name = "recorder"
    calls: list[tuple[str, object]] = []

    def select(self, prefills, decodes, request):  # type: ignore[no-untyped-def]
        request.num_cached_tokens(prefills[0]) if prefills else None
        return Pair(prefills[0] if prefills else None, decodes[-1])

    def on_dispatch(self, pair, request):  # type: ignore[no-untyped-def]
        self.calls.append(("dispatch", pair))

    def on_finish(self, pair, request, outcome):  # type: ignore[no-untyped-def]
        self.calls.append(("finish", outcome))

    def on_worker_added(self, worker):  # type: ignore[no-untyped-def]
        self.calls.append(("added", worker.url))

    def on_worker_removed(self, worker):  # type: ignore[no-untyped-def]
        self.calls.append(("removed", worker.url))


def test_router_calls_hooks_and_assumes_the_routed_prefix() -> None:
    router = Router.build(f"{__name__}:Recorder", f"{__name__}:Recorder")
    assert router.is_joint
    p, d = prefill("p"), decode("d")
    router.worker_added(p)
    request = router.request(list(range(100)), 4)
    pair = router.select([p], [d], request)
    router.dispatched(pair, request)
    router.finished(pair, request, "finished")
    router.worker_removed(p)
    assert [c[0] for c in Recorder.calls] == ["added", "dispatch", "finish", "removed"]
    assert Recorder.calls[2][1] == "finished"
    # The policy looked at the cache, so the prompt counts as cached on the chosen prefill until events.
    router.worker_added(p)
    router.dispatched(pair, request)
    assert router.request([*range(100), 5], 4).num_cached_tokens(p) == 96


def test_router_sides_and_options() -> None:
    router = Router.build("cache_aware", "ratio_aware", {"": {"cache_weight": "3"}, "prefill": {}, "decode": {}})
    assert not router.is_joint and router.name == "cache_aware+ratio_aware"
    assert router.prefill_policy.options.cache_weight == 3.0  # type: ignore[attr-defined]
    p1, p2, d1, d2 = prefill("p1"), prefill("p2"), decode("d1", free=10), decode("d2", free=900)
    pair = router.select([p1, p2], [d1, d2], router.request(list(range(50)), 4))
    assert pair.decode is d2 and pair.prefill in (p1, p2)
    # ratio_aware on the decode side sees no prefills: decode figures only, not a prefill share of 0
    assert set(router.decode_policy.stats()) == {"decode_utilization"}  # type: ignore[attr-defined]
    with pytest.raises(PolicyError, match=r"unknown policy option.*bogus"):
        Router.build("cache_aware", "cache_aware", {"": {"bogus": "1"}})
    with pytest.raises(PolicyError, match=r"decode\.cache_weight"):
        Router.build("cache_aware", "ratio_aware", {"decode": {"cache_weight": "1"}})
    with pytest.raises(PolicyError, match=r"cache_aware.*balance_factor"):
        Router.build("cache_aware", "cache_aware", {"": {"balance_factor": "0.2"}})
    for option in ("cache_weight", "balance_factor"):  # (inf would make every cost inf: no cache, no guard)
        with pytest.raises(PolicyError, match=rf"cache_aware.*{option}"):
            Router.build("cache_aware", "cache_aware", {"": {option: "inf"}})
    split = Router.build("power_of_two", "power_of_two", {"prefill": {"seed": "1"}, "decode": {"seed": "2"}})
    assert not split.is_joint


def test_cache_aware_with_combined_workers_follows_their_caches() -> None:
    policy = create_policy("cache_aware")
    a, b = FakeWorker("pd://a:1", "both"), FakeWorker("pd://b:1", "both")
    request = RequestInfo(list(range(3200)), 8, FakeLookup({"pd://b:1": 199}))
    assert policy.select([], [a, b], request) == Pair(None, b)


def test_least_pressured_is_the_argmin_of_decode_pressure() -> None:
    import random

    from gateway.policies.contract import random_pool, random_request
    from gateway.policies.load import decode_need, decode_pressure, least_pressured

    rng = random.Random(11)
    for _ in range(300):
        _, decodes = random_pool(rng, 0, rng.randrange(1, 12))
        request = random_request(rng, [])
        best = min(decodes, key=lambda w: (decode_pressure(w, decode_need(request, w)), w.num_active))
        got = least_pressured(decodes, request)
        assert (decode_pressure(got, decode_need(request, got)), got.num_active) == (
            decode_pressure(best, decode_need(request, best)), best.num_active)


def test_a_decode_with_exactly_the_pages_needed_takes_the_request_now() -> None:
    """``num_free_pages == need`` is a fit: every page the request needs is free, it does not wait. Taken for
    a wait, a decode's last free pages would never be used while another has room, and its pressure would
    carry the wait penalty (ranked below any decode that can take the request at once)."""
    from gateway.policies.load import can_take_now, decode_need, decode_pressure, fits_pages

    request = req()  # 320 + 16 tokens: 21 pages of 16
    need = decode_need(request, decode("d"))
    exact = decode("exact", total=100, free=need)
    assert fits_pages(exact, need) and not fits_pages(exact, need + 1)
    assert can_take_now([exact], request) == [exact]
    assert decode_pressure(exact, need) == 1.0, "its pool full once placed, and no wait penalty"
    assert decode_pressure(exact, need + 1) > 2.0  # one page short: it would wait


def test_a_prefix_kept_busy_stays_on_its_prefill_past_the_first_assumption() -> None:
    """With no KV events yet (a busy worker, or an SGLang worker that sends none), each routing of a
    prefix renews its assumption: the same prompt every 1.5 s with a 2 s TTL keeps its prefill."""
    from gateway.policies.cache_aware import CacheAwarePolicy

    now = [0.0]
    policy = CacheAwarePolicy()
    router = Router(policy, policy, PrefixIndex(2.0, clock=lambda: now[0]))
    p0, p1, d = prefill("p0"), prefill("p1"), decode("d")
    chosen = []
    for t in (0.0, 1.5, 3.0, 4.5):
        now[0] = t
        request = router.request(list(range(2000)), 4)
        pair = router.select([p0, p1], [d], request)
        router.dispatched(pair, request)
        chosen.append(pair.prefill)
    assert all(p is chosen[0] for p in chosen), [p.url for p in chosen if p is not None]
    now[0] = 7.0  # not routed for longer than the TTL: no longer assumed
    assert router.request(list(range(2000)), 4).num_cached_tokens(chosen[0]) == 0


def test_cache_aware_at_balance_factor_one_still_takes_the_cached_worker_of_equal_queues() -> None:
    """Three equal queues whose mean rounds below each (3 x 0.7 / 3 = 0.6999...): none is a hot spot, and
    the worker holding most of the prompt is chosen."""
    from gateway.policies.cache_aware import CacheAwarePolicy

    policy = CacheAwarePolicy(CacheAwarePolicy.Options(balance_factor=1.0, balance_min_tokens=0))
    prefills = [prefill(f"p{i}", tokens=7000, rate=10_000.0) for i in range(3)]
    for holder in range(3):
        request = req(1000, {prefills[holder].url: 60})  # 960 of its 1,000 tokens
        assert policy._select_prefill(prefills, request) is prefills[holder]
    assert policy.num_skipped_hot == 0


def test_cache_aware_with_combined_workers_skips_one_that_cannot_take_the_request_now() -> None:
    """A combined worker holding the prefix with its KV pool and batch full would make the request wait for
    pages and a slot while another sits idle: affinity only among those that can take it now."""
    policy = create_policy("cache_aware")
    full = FakeWorker("pd://a:1", "both", num_free_pages=0, num_running_seqs=64, num_waiting_seqs=1,
                      max_running_seqs=64, num_prefill_tokens=500)
    idle = FakeWorker("pd://b:1", "both")
    request = RequestInfo(list(range(520)), 256, FakeLookup({full.url: 32}))  # 512 of its 520 tokens held by A
    assert policy.select([], [full, idle], request) == Pair(None, idle)
    batch_full = FakeWorker("pd://c:1", "both", num_running_seqs=60, num_waiting_seqs=4, max_running_seqs=64)
    assert policy.select([], [batch_full, idle], RequestInfo(list(range(520)), 256, FakeLookup({"pd://c:1": 32}))
                         ) == Pair(None, idle)
    # When none can take it now, the prefix still decides (both would make it wait).
    also_full = FakeWorker("pd://d:1", "both", num_free_pages=0, num_running_seqs=64, max_running_seqs=64)
    assert policy.select([], [also_full, full], request) == Pair(None, full)


@pytest.mark.parametrize(("num_prefills", "num_decodes"), [(2, 2), (2, 4), (3, 6), (4, 6), (2, 3), (1, 3), (3, 1)])
def test_round_robin_pairs_every_prefill_with_every_decode_evenly(num_prefills: int, num_decodes: int) -> None:
    """Both turns in step paired prefill i with decode i for good when the counts share a divisor (2 and 2):
    under a registry outage a decode that had never met a surviving prefill failed all of its rooms."""
    p = [W(f"p{i}", "prefill") for i in range(num_prefills)]
    d = [W(f"d{i}") for i in range(num_decodes)]
    policy = RoundRobinPolicy()
    rounds = num_prefills * num_decodes * math.lcm(num_prefills, num_decodes)
    pairs = [policy.select(p, d, REQ) for _ in range(rounds)]
    met = Counter((x.prefill.url, x.decode.url) for x in pairs)  # type: ignore[union-attr]
    assert len(met) == num_prefills * num_decodes, sorted(met)
    assert len(set(Counter(x.decode.url for x in pairs).values())) == 1  # every decode as often
    assert len(set(Counter(x.prefill.url for x in pairs).values())) == 1  # type: ignore[union-attr]
