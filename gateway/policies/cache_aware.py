"""``cache_aware``: send a prompt where its prefix is cached, unless that worker is a hot spot.

Prefill cost per candidate, in seconds of prefill work (``gateway.policies.load``)::

    cost = queued_tokens / rate  +  cache_weight * (prompt_tokens - cached_tokens) / rate

``cached_tokens`` comes from the gateway's prefix index: the workers' own KV events (exact) plus a
short-lived "assumed cached" entry for prompts the gateway just routed, so a burst of same-prefix
requests lands together before the events arrive. ``cache_weight`` > 1 because recomputing a
prefix costs more than this request's wait: it takes capacity from everyone and evicts other
prefixes. Guard: a worker whose queued time exceeds the pool mean by ``balance_factor`` (and
``balance_min_tokens`` of work) is skipped, so affinity never builds a hot spot.

A prefix no candidate holds (a new tenant, or one evicted everywhere) picks a home: the worker
with the least recent cache fill (prompt tokens it had to compute, decayed over the last
``fill_window`` dispatches per worker), so tenants spread by how much cache they need rather than
by count and a worker whose cache thrashes stops receiving newcomers; among equals, the prompt's
rendezvous-hash home, so an idle pool places a tenant the same way every time.

Decode: the least pressured worker (KV pages and batch slots with this request placed). With
combined workers (``--worker``, no prefills) the prefill rule above picks among those that have the
pages and a batch slot for the request now (among all of them when none has): a worker holding the
prefix with its pool or batch full would make the request wait while another sits idle.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Mapping, Sequence

import msgspec

from gateway.policies.base import Pair, RequestInfo, WorkerView
from gateway.policies.load import can_take_now, fallback_rate, least_pressured


class CacheAwarePolicy:
    name = "cache_aware"
    decode_options: frozenset[str] = frozenset()  # (its decode side is the least pressured: no option applies)

    class Options(msgspec.Struct, forbid_unknown_fields=True):
        cache_weight: float = 2.0
        balance_factor: float = 1.5
        balance_min_tokens: int = 3072
        fill_window: int = 16

        def __post_init__(self) -> None:
            if not 0 <= self.cache_weight < math.inf:
                raise ValueError("cache_weight must be finite and >= 0")
            if not 1 <= self.balance_factor < math.inf:
                raise ValueError("balance_factor must be finite and >= 1")
            if self.balance_min_tokens < 0:
                raise ValueError("balance_min_tokens must be >= 0")
            if self.fill_window < 1:
                raise ValueError("fill_window must be >= 1")

    def __init__(self, options: Options | None = None) -> None:
        self.options = options or self.Options()
        # Recent cache fill per worker: (decayed tokens, dispatch count when last updated).
        self._fill: dict[str, tuple[float, int]] = {}
        self._num_dispatched = 0
        self._num_decode_picks = 0  # (ties between decodes go round: ``least_pressured``'s turn)
        self._pool_size = 1
        self.num_selected = 0
        self.num_predicted_hits = 0  # selections where the chosen prefill held part of the prompt
        self.num_skipped_hot = 0  # selections where a better-cached worker was skipped as a hot spot

    def select(self, prefills: Sequence[WorkerView], decodes: Sequence[WorkerView], request: RequestInfo) -> Pair:
        if prefills:
            self._num_decode_picks += 1
            return Pair(self._select_prefill(prefills, request),
                        least_pressured(decodes, request, self._num_decode_picks))
        if decodes[0].role == "both":  # combined workers prefill too: they hold the prefix caches
            # (and decode: among those with the pages and a batch slot for it now, while any has)
            return Pair(None, self._select_prefill(can_take_now(decodes, request) or decodes, request))
        self._num_decode_picks += 1
        return Pair(None, least_pressured(decodes, request, self._num_decode_picks))  # a split policy's decode side

    def _select_prefill(self, prefills: Sequence[WorkerView], request: RequestInfo) -> WorkerView:
        opts = self.options
        self._pool_size = len(prefills)
        fallback = fallback_rate(prefills)
        waits = [w.num_prefill_tokens / (w.prefill_tokens_per_s or fallback) for w in prefills]
        # (never below the least-loaded worker's wait: at balance_factor 1 with equal queues, the mean
        # rounded down would skip every worker, and with them the one holding the prefix)
        limit = max(opts.balance_factor * sum(waits) / len(waits), opts.balance_min_tokens / fallback, min(waits))
        prompt, weight = request.num_prompt_tokens, opts.cache_weight
        page_size = prefills[0].page_size
        held = request.cached_pages(page_size) if page_size > 0 else {}
        costs = [float("inf")] * len(prefills)
        best, best_cost, best_cached, hot_cached = 0, float("inf"), 0, 0

        def cached_on(w: WorkerView) -> int:  # (a pool mixing page sizes looks each other size up separately)
            return held.get(w.url, 0) * page_size if w.page_size == page_size else request.num_cached_tokens(w)

        for i, w in enumerate(prefills):
            cached = cached_on(w)
            if waits[i] > limit:
                hot_cached = max(hot_cached, cached)
                continue
            costs[i] = waits[i] + weight * (prompt - cached) / (w.prefill_tokens_per_s or fallback)
            if costs[i] < best_cost:
                best, best_cost, best_cached = i, costs[i], cached
        if 8 * best_cached <= prompt:
            # Nobody worth using holds more than an eighth of this prompt (a new tenant, or one whose prompts
            # share only a short head with others': a chat template's system header, a common preamble, which
            # the first worker to compute it holds; taken as a hold, it drew every later tenant there): choose
            # its home among the workers about as good as the best (within one more computation of it).
            slack = costs[best] + prompt / fallback
            best = self._home(prefills, [i for i, c in enumerate(costs) if c <= slack], request)
            best_cached = cached_on(prefills[best])
        self.num_selected += 1
        self.num_predicted_hits += best_cached > 0
        self.num_skipped_hot += hot_cached > best_cached
        return prefills[best]

    def _home(self, prefills: Sequence[WorkerView], candidates: list[int], request: RequestInfo) -> int:
        """The candidate with the least recent cache fill; ties by the prompt's rendezvous hash."""
        seed = zlib.crc32(repr(list(request.input_ids[:64])).encode())
        return min(candidates, key=lambda i: (round(self._fill_of(prefills[i].url)),
                                              -zlib.crc32(prefills[i].url.encode(), seed)))

    def _decay(self) -> float:
        return 0.5 ** (1.0 / (self.options.fill_window * self._pool_size))

    def _fill_of(self, url: str) -> float:
        value, at = self._fill.get(url, (0.0, 0))
        return value * self._decay() ** (self._num_dispatched - at) if value else 0.0

    # -- hooks ------------------------------------------------------------------------------------
    def on_dispatch(self, pair: Pair, request: RequestInfo) -> None:
        worker = pair.prefill if pair.prefill is not None else pair.decode
        if worker.page_size <= 0:
            return
        self._num_dispatched += 1
        computed = request.num_prompt_tokens - request.num_cached_tokens(worker)
        self._fill[worker.url] = (self._fill_of(worker.url) + computed, self._num_dispatched)

    def on_worker_removed(self, worker: WorkerView) -> None:
        self._fill.pop(worker.url, None)  # it comes back with an empty cache

    def stats(self) -> Mapping[str, float]:
        n = max(1, self.num_selected)
        return {"predicted_hit_share": self.num_predicted_hits / n, "hot_spot_skips": float(self.num_skipped_hot)}
