import pytest

from workers.kv_pool import KVPool
from workers.page_cache import PageCache, page_hashes


def make(num_pages: int = 8, enabled: bool = True) -> PageCache:
    pool = KVPool(num_layers=1, num_pages=num_pages, page_size=4, num_kv_heads=1, head_dim=2)
    return PageCache(pool, enabled=enabled)


def test_hashes_are_chained_and_page_aligned() -> None:
    a = page_hashes(list(range(10)), 4)
    b = page_hashes([99, *range(1, 10)], 4)
    assert len(a) == 2 and a[0] != b[0] and a[1] != b[1], "a change in page 0 changes every later hash"
    assert page_hashes(list(range(12)), 4)[:2] == a


def test_match_shares_pages_and_leaves_one_token_to_compute() -> None:
    cache = make()
    prompt = list(range(12))
    pages = cache.alloc(3)
    assert pages
    cache.insert(prompt, pages, 12)
    assert cache.match(prompt) == pages[:2], "12 tokens: at most 11 may be cached -> 2 full pages"
    assert cache.match([*prompt, 5]) == pages, "13 tokens: all three pages"
    assert cache.match([0, 1, 2, 7, 4]) == [], "differs inside the first page"
    cache.release(pages[:2])
    cache.release(pages)
    cache.release(pages)  # the owner's reference
    assert cache.num_available == 8 and cache.pool.num_free_pages == 5, "published pages stay cached"
    with pytest.raises(RuntimeError):
        cache.release([pages[0]])


def test_eviction_is_lru_and_only_of_unreferenced_pages() -> None:
    cache = make(num_pages=4)
    old, new = cache.alloc(2), cache.alloc(2)
    assert old and new
    cache.insert(list(range(8)), old, 8)
    cache.insert(list(range(100, 108)), new, 8)
    cache.release(old)
    cache.release(new)
    held = cache.match([*range(100, 108), 1])  # touch "new": now referenced
    assert held == new
    got = cache.alloc(2)
    assert got is not None and sorted(got) == sorted(old), "the unreferenced LRU pages were evicted"
    assert cache.alloc(1) is None, "referenced pages are never evicted"
    assert cache.match([*range(8), 1]) == [], "evicted prefixes are forgotten"
    cache.release(got)
    cache.release(held)
    assert cache.clear() == 2 and cache.pool.num_free_pages == 4


def test_disabled_cache_never_matches() -> None:
    cache = make(enabled=False)
    pages = cache.alloc(2)
    assert pages
    cache.insert(list(range(8)), pages, 8)
    assert cache.match(list(range(9))) == []
    cache.release(pages)
    assert cache.pool.num_free_pages == 8


def test_a_growing_sequence_is_hashed_from_where_its_published_pages_end(monkeypatch: pytest.MonkeyPatch) -> None:
    """Publishing a request again as it grows (its answer at its end, a preemption) hashes only the pages not yet
    published: the chain resumes from the last published page's hash (a 32k-token conversation was hashed
    whole, ~2 ms on the scheduler's thread, at each finish). The hashes are the ones computed from the start."""
    import workers.page_cache as page_cache

    cache = make(num_pages=16)
    tokens = list(range(100, 140))  # 10 pages
    pages = cache.alloc(10)
    assert pages
    cache.insert(tokens, pages, 16)  # the prompt's 4 pages, published at its prefill
    calls = []
    real = page_cache.blake2b
    monkeypatch.setattr(page_cache, "blake2b", lambda *a, **k: calls.append(1) or real(*a, **k))
    cache.insert(tokens, pages, 39)  # then its answer: pages 4..8 (39 positions hold KV)
    assert len(calls) == 5, "only the pages not yet published were hashed"
    assert cache.match([*tokens, 7]) == pages[:9]  # (by the hashes computed from the start)
    assert [cache._hash_of[p] for p in pages[:9]] == page_hashes(tokens, 4, 9)
    assert page_hashes(tokens, 4, 9, start=4, prev=page_hashes(tokens, 4, 4)[-1]) == page_hashes(tokens, 4, 9)[4:]
