"""Page allocation with prefix caching: chained hashes of full pages, ref counts, LRU reuse.

Lifecycle (owned by the scheduler thread; other threads read only ``num_available``, under ``_moving``: an
eviction or a flush moves pages from the evictable list to the pool's free list, and a reader between the two
steps would see them in neither):
1. ``match(token_ids)`` finds the longest run of full pages whose chained hash is cached, takes a
   reference on each and returns them; the caller computes only the rest of the prompt.
2. ``alloc(n)`` takes fresh pages from the pool, evicting least-recently-used unreferenced cached
   pages when the free list is short (None if even that is not enough; nothing taken).
3. ``insert(token_ids, pages, num_tokens)`` publishes the full pages a request has computed, so
   later requests can share them.
4. ``release(pages)`` drops one reference per page; a page nobody references stays cached (and
   evictable, tail pages of a prefix before its head) if it holds a published prefix, else goes
   back to the pool's free list.

A page's hash covers its own tokens and every token before it (the chain), so equal hashes mean
equal prefixes. With caching disabled, ``match`` finds nothing and ``insert`` does nothing.

Every hash published by ``insert`` and dropped by eviction or ``clear`` is logged; the scheduler
takes the net changes once per step (``take_events``) and broadcasts them as ``KVEvents``, so
gateways can keep an exact index of which worker holds which prefix (``gateway/prefix_index.py``
computes the same hashes with ``page_hashes``).
"""

from __future__ import annotations

import threading
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from hashlib import blake2b

from workers.kv_pool import KVPool


def page_hashes(token_ids: Sequence[int], page_size: int, num_pages: int | None = None, *, start: int = 0,
                prev: bytes = b"") -> list[bytes]:
    """Chained 16-byte hashes of the first ``num_pages`` full pages of ``token_ids``.

    Page i's hash is blake2b-128 over (hash of page i-1) + its tokens as native int64. The gateway
    computes the same function on its side, so this is part of the KV-events contract. ``start``, ``prev``:
    only the hashes of pages ``start`` on, page ``start - 1``'s hash being ``prev`` (known already).
    """
    full = len(token_ids) // page_size if num_pages is None else min(num_pages, len(token_ids) // page_size)
    if full <= start:
        return []
    raw = array("q", token_ids[start * page_size : full * page_size]).tobytes()
    step = page_size * 8
    hashes = []
    for off in range(0, (full - start) * step, step):
        prev = blake2b(prev + raw[off : off + step], digest_size=16).digest()
        hashes.append(prev)
    return hashes


class PageCache:
    def __init__(self, pool: KVPool, *, enabled: bool = True) -> None:
        self.pool = pool
        self.enabled = enabled
        self._refs: dict[int, int] = {}
        self._by_hash: dict[bytes, int] = {}
        self._hash_of: dict[int, bytes] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, unreferenced; oldest first
        self._moving = threading.Lock()  # (see the module doc)
        self.num_hit_tokens = 0
        self.num_evictions = 0
        self._events: dict[bytes, bool] = {}  # hash -> published (True) / dropped (False), since take_events

    @property
    def num_available(self) -> int:
        """Pages an ``alloc`` could hand out now (free + evictable); from any thread."""
        with self._moving:
            return self.pool.num_free_pages + len(self._evictable)

    @property
    def num_cached(self) -> int:
        return len(self._by_hash)

    def holds(self, page_hash: bytes) -> bool:
        """Whether a page with this chained hash is cached now."""
        return page_hash in self._by_hash

    def num_cached_pages(self, hashes: Sequence[bytes], limit: int) -> int:
        """How many of the first ``limit`` of these chained page hashes, from the first, are cached now."""
        n = 0
        by_hash = self._by_hash
        for h in hashes:
            if n >= limit or h not in by_hash:
                break
            n += 1
        return n

    def match(self, token_ids: Sequence[int], hashes: Sequence[bytes] | None = None) -> list[int]:
        """Cached pages for the longest prefix of full pages, leaving at least one token to compute (taken:
        ``release`` them if unused). ``hashes``: ``token_ids``' page hashes (at least those pages), when the
        caller has them. Not counted as hits here: ``count_hit`` once the caller uses them."""
        if not self.enabled:
            return []
        limit = (len(token_ids) - 1) // self.pool.page_size
        pages = []
        for h in page_hashes(token_ids, self.pool.page_size, limit) if hashes is None else hashes[:limit]:
            page = self._by_hash.get(h)
            if page is None:
                break
            pages.append(page)
        for page in pages:
            self._take(page)
        return pages

    def count_hit(self, pages: Sequence[int]) -> None:
        """``pages`` from ``match`` went to a request: their tokens count as prefix-cache hits (a request that
        waits for fresh pages matches again each step, and is counted once, when it gets them)."""
        self.num_hit_tokens += len(pages) * self.pool.page_size

    def alloc(self, num_pages: int) -> list[int] | None:
        pool = self.pool
        if num_pages > pool.num_free_pages + len(self._evictable):
            return None
        if pool.num_free_pages < num_pages:
            with self._moving:
                while pool.num_free_pages < num_pages:
                    page, _ = self._evictable.popitem(last=False)
                    self._drop_hash(self._hash_of.pop(page))
                    pool.free([page])
                    self.num_evictions += 1
        pages = self.pool.alloc(num_pages)
        assert pages is not None
        for page in pages:
            self._refs[page] = 1
        return pages

    def insert(self, token_ids: Sequence[int], pages: Sequence[int], num_tokens: int,
               hashes: Sequence[bytes] | None = None) -> None:
        """Publish the full pages among the first ``num_tokens`` positions of a request (``hashes``: as
        for ``match``)."""
        if not self.enabled:
            return
        full = num_tokens // self.pool.page_size
        if hashes is None:  # (the leading pages already published give the chain's start: hashed once, not per call)
            known, prev, hash_of = 0, b"", self._hash_of
            while known < full and known < len(pages) and pages[known] in hash_of:
                prev = hash_of[pages[known]]
                known += 1
            pages = pages[known:]
            hashes = page_hashes(token_ids, self.pool.page_size, full, start=known, prev=prev)
        for h, page in zip(hashes[:full], pages, strict=False):
            if h in self._by_hash or page in self._hash_of:
                continue  # an equal prefix is already published (or this page already is)
            self._by_hash[h] = page
            self._hash_of[page] = h
            self._events.pop(h, None)
            self._events[h] = True

    def release(self, pages: Sequence[int]) -> None:
        # Last page first: among pages released together the tail becomes the least recently used,
        # so eviction shortens a cached prefix from its end instead of cutting its head (which
        # would leave the rest cached but unreachable).
        for page in reversed(pages):
            refs = self._refs.get(page, 0) - 1
            if refs < 0:
                raise RuntimeError(f"page {page} released more often than taken")
            if refs:
                self._refs[page] = refs
                continue
            del self._refs[page]
            if page in self._hash_of:
                self._evictable[page] = None
            else:
                self.pool.free([page])

    def _take(self, page: int) -> None:
        self._refs[page] = self._refs.get(page, 0) + 1
        self._evictable.pop(page, None)

    def clear(self) -> int:
        """Forget every unreferenced cached page (``/flush_cache``); returns how many were freed."""
        with self._moving:
            freed = list(self._evictable)
            self._evictable.clear()
            for page in freed:
                self._drop_hash(self._hash_of.pop(page))
            self.pool.free(freed)
        return len(freed)

    def _drop_hash(self, h: bytes) -> None:
        del self._by_hash[h]
        self._events.pop(h, None)
        self._events[h] = False

    def take_events(self) -> tuple[list[bytes], list[bytes]]:
        """(published, dropped) hashes since the last call, net per hash; clears the log."""
        if not self._events:
            return [], []
        events, self._events = self._events, {}
        stored = [h for h, published in events.items() if published]
        removed = [h for h, published in events.items() if not published]
        return stored, removed

    def cached_hashes(self) -> list[bytes]:
        """Every hash held now (a snapshot for a new subscriber)."""
        return list(self._by_hash)
