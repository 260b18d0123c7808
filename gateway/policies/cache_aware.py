"""``cache_aware``: send a prompt where its prefix is cached, unless that worker is a hot spot.

Prefill cost per candidate, in seconds of prefill work (``gateway.policies.load``)::

    cost = queued_tokens / rate  +  cache_weight * (prompt_tokens - cached_tokens) / rate

``cached_tokens`` comes from the gateway's prefix index: the workers' own KV events (exact) plus a
short-lived "assumed cached" entry for prompts the gateway just routed, so a burst of same-prefix
requests lands together before the events arrive. ``cache_weight`` > 1 because recomputing a
prefix costs more than this request's wait: it takes capacity from everyone and evicts other
prefixes. Guard: a worker whose queued time exceeds the pool mean by ``balance_factor`` (and
``balance_min_tokens`` of work) is skipped, so affinity never builds a hot spot. Ties (an idle pool,
a new prefix) go to the prefix's rendezvous-hash home, so new tenants spread evenly and stick.

Decode: the least pressured worker (KV pages and batch slots with this request placed). With
combined workers (``--worker``, no prefills) the prefill rule above picks among them.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping, Sequence

import msgspec

from gateway.policies.base import Pair, RequestInfo, WorkerView
from gateway.policies.load import fallback_rate, least_pressured


class CacheAwarePolicy:
    name = "cache_aware"

    class Options(msgspec.Struct, forbid_unknown_fields=True):
        cache_weight: float = 2.0
        balance_factor: float = 1.5
        balance_min_tokens: int = 3072

        def __post_init__(self) -> None:
            if not self.cache_weight >= 0:
                raise ValueError("cache_weight must be >= 0")
            if not self.balance_factor >= 1:
                raise ValueError("balance_factor must be >= 1")
            if self.balance_min_tokens < 0:
                raise ValueError("balance_min_tokens must be >= 0")

    def __init__(self, options: Options | None = None) -> None:
        self.options = options or self.Options()
        self.num_selected = 0
        self.num_predicted_hits = 0  # selections where the chosen prefill held part of the prompt
        self.num_skipped_hot = 0  # selections where the best-cached worker was skipped as a hot spot

    def select(self, prefills: Sequence[WorkerView], decodes: Sequence[WorkerView], request: RequestInfo) -> Pair:
        if prefills:
            return Pair(self._select_prefill(prefills, request), least_pressured(decodes, request))
        if decodes[0].role == "both":  # combined workers prefill too: they hold the prefix caches
            return Pair(None, self._select_prefill(decodes, request))
        return Pair(None, least_pressured(decodes, request))  # the decode side of a split policy

    def _select_prefill(self, prefills: Sequence[WorkerView], request: RequestInfo) -> WorkerView:
        opts = self.options
        fallback = fallback_rate(prefills)
        waits = [w.num_prefill_tokens / (w.prefill_tokens_per_s or fallback) for w in prefills]
        limit = max(opts.balance_factor * sum(waits) / len(waits), opts.balance_min_tokens / fallback)
        prompt, weight = request.num_prompt_tokens, opts.cache_weight
        page_size = prefills[0].page_size
        held = request.cached_pages(page_size) if page_size > 0 else {}
        best, best_cost, ties = 0, float("inf"), 1
        for i, w in enumerate(prefills):
            if waits[i] > limit:
                continue
            # (a pool mixing page sizes looks each other size up separately)
            cached = held.get(w.url, 0) * page_size if w.page_size == page_size else request.num_cached_tokens(w)
            cost = waits[i] + weight * (prompt - cached) / (w.prefill_tokens_per_s or fallback)
            if cost < best_cost:
                best, best_cost, ties = i, cost, 1
            elif cost == best_cost:
                ties += 1
        if ties > 1:
            best = self._home(prefills, waits, limit, best_cost, weight, fallback, request)
        self.num_selected += 1
        chosen = request.num_cached_tokens(prefills[best])
        self.num_predicted_hits += chosen > 0
        self.num_skipped_hot += any(waits[i] > limit and request.num_cached_tokens(w) > chosen
                                    for i, w in enumerate(prefills)) if held else 0
        return prefills[best]

    @staticmethod
    def _home(prefills: Sequence[WorkerView], waits: list[float], limit: float, best_cost: float, weight: float,
              fallback: float, request: RequestInfo) -> int:
        """Among equally good workers, the prompt's rendezvous-hash home (stable for a tenant)."""
        seed = zlib.crc32(repr(list(request.input_ids[:64])).encode())
        prompt = request.num_prompt_tokens
        best, best_score = 0, -1
        for i, w in enumerate(prefills):
            if waits[i] > limit:
                continue
            cost = waits[i] + weight * (prompt - request.num_cached_tokens(w)) / (w.prefill_tokens_per_s or fallback)
            if cost == best_cost and (score := zlib.crc32(w.url.encode(), seed)) > best_score:
                best, best_score = i, score
        return best

    def stats(self) -> Mapping[str, float]:
        n = max(1, self.num_selected)
        return {"predicted_hit_share": self.num_predicted_hits / n, "hot_spot_skips": float(self.num_skipped_hot)}
