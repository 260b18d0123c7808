from gateway.prefix_index import PrefixIndex
from workers.page_cache import page_hashes
from workers.protocol import KVEvents

H = page_hashes(list(range(64)), 16)  # 4 chained page hashes


def test_match_is_the_longest_consecutive_run_per_worker() -> None:
    index = PrefixIndex()
    index.apply("a", KVEvents(stored=H[:3]))
    index.apply("b", KVEvents(stored=[H[0], H[2], H[3]]))  # a hole at page 1: only page 0 counts
    index.apply("c", KVEvents(stored=H[1:]))  # no first page: nothing
    assert index.match(H) == {"a": 3, "b": 1}
    assert index.match([]) == {}
    assert index.match(page_hashes([9] * 32, 16)) == {}


def test_removed_reset_and_drop_worker() -> None:
    index = PrefixIndex()
    index.apply("a", KVEvents(stored=H))
    index.apply("b", KVEvents(stored=H[:2]))
    index.apply("a", KVEvents(removed=[H[2]]))
    assert index.match(H) == {"a": 2, "b": 2}
    index.apply("a", KVEvents(stored=[H[0]], reset=True))
    assert index.match(H) == {"a": 1, "b": 2}
    index.drop_worker("b")
    assert index.match(H) == {"a": 1}
    assert index.num_pages("a") == 1 and index.num_pages("b") == 0 and index.num_pages("zz") == 0
    index.apply("a", KVEvents(removed=[H[3]]))  # removing what it never had is harmless
    assert index.match(H) == {"a": 1}


def test_assumed_entries_count_until_they_expire() -> None:
    now = [100.0]
    index = PrefixIndex(assume_ttl_s=2.0, clock=lambda: now[0])
    index.assume("a", H)
    index.assume("a", H[:2])
    assert index.match(H) == {"a": 4}
    now[0] += 1.0
    index.apply("b", KVEvents(stored=H[:1]))
    assert index.match(H) == {"a": 4, "b": 1}
    now[0] += 1.5  # both assumptions expired; nothing real for "a"
    assert index.match(H) == {"b": 1}


def test_an_expired_assumption_is_not_revived_by_another_workers() -> None:
    """Re-assuming a hash extends every worker assumed on it, but only while its entry is live: a worker
    whose assumption had expired (no request routed to it for the TTL) must not come back as holding the
    prefix because another worker was routed it, or requests would follow a cache it may long have evicted."""
    index = PrefixIndex()  # (the default TTL: 2 s)
    index.assume("a", H[:1], now=0.0)
    index.assume("b", H[:1], now=3.0)  # "a"'s entry expired at 2.0
    assert index.match(H, now=3.0) == {"b": 1}
    index.assume("a", H[:1], now=4.0)  # while "b"'s is live, both are assumed on it
    assert index.match(H, now=4.0) == {"a": 1, "b": 1}


def test_a_lost_worker_loses_its_assumed_pages_too() -> None:
    """A restarted worker comes back empty: what it was assumed to hold must not outlive its connection."""
    index = PrefixIndex(assume_ttl_s=60.0)
    index.assume("a", H)
    index.assume("b", H[:2])
    index.drop_worker("a")
    assert index.match(H) == {"b": 2}


def test_many_workers_as_bits() -> None:
    index = PrefixIndex()
    for i in range(300):
        index.apply(f"w{i}", KVEvents(stored=H[: 1 + i % 4]))
    got = index.match(H)
    assert len(got) == 300 and all(got[f"w{i}"] == 1 + i % 4 for i in range(300))


def test_assumed_entries_are_bounded_the_least_recently_assumed_going_first(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A long ``--assume-ttl-s`` at a high rate of new prompts kept every assumed page (found by review: ~150
    bytes each, without bound): past the cap those assumed longest ago go, a prefix assumed again stays."""
    import gateway.prefix_index as module

    monkeypatch.setattr(module, "MAX_ASSUMED", 100)
    monkeypatch.setattr(module, "SWEEP_MIN", 50)
    index = PrefixIndex(assume_ttl_s=300.0, clock=lambda: 0.0)
    hot = [bytes([255, i]) for i in range(4)]
    index.assume("a", hot)
    for i in range(1000):
        index.assume("b", [i.to_bytes(4, "big")])
        if i % 10 == 0:
            index.assume("a", hot)  # kept busy
        assert len(index._assumed) <= 2 * 100
    assert index.match(hot) == {"a": 4}
    assert index.match([(999).to_bytes(4, "big")]) == {"b": 1}
    assert index.match([(0).to_bytes(4, "big")]) == {}  # the oldest went


def test_a_worker_never_assumed_costs_no_pass_over_the_assumptions() -> None:
    """A decode (never assumed) losing its connection must not rebuild every assumed entry on the event loop."""
    index = PrefixIndex(assume_ttl_s=60.0, clock=lambda: 0.0)
    index.assume("prefill", H)
    index.apply("decode", KVEvents(stored=H[:1]))
    before = index._assumed
    index.drop_worker("decode")
    assert index._assumed is before  # (not rebuilt)
    index.drop_worker("prefill")
    assert index._assumed is not before and index.match(H) == {}
    index.assume("prefill", H[:2])  # back: assumed again
    assert index.match(H) == {"prefill": 2}
