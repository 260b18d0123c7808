"""``ratio_aware``: the pair chosen decode first, each pool loaded in proportion to its capacity.

1. Decode: among the decodes whose free KV pages fit this request (prompt + max_tokens, which the
   decode reserves up front), the one with the lowest pressure, i.e. the smallest share of its own
   pool and batch slots in use once the request is placed; so a decode with twice the pages takes
   about twice the sequences. If none fits now, the one with the shortest wait.
2. Prefill: the one that finishes this prompt soonest, (queued + prompt tokens) / measured
   throughput, so a prefill three times faster takes about three times the tokens.

``stats()`` reports each pool's utilization and their ratio (``pd_load_ratio``): prefill busy
share over decode KV/slot share. Well above 1 means the prefills are the bottleneck (add prefill
workers or move one over); well below 1 means the decodes are. (The decode side of a split policy
sees no prefills: it reports the decodes only.)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from gateway.policies.base import Pair, RequestInfo, WorkerView
from gateway.policies.load import (
    decode_need,
    decode_pressure,
    decode_utilization,
    fallback_rate,
    fits_pages,
    rate_of,
)


class RatioAwarePolicy:
    name = "ratio_aware"

    def __init__(self) -> None:
        self._prefills: Sequence[WorkerView] = ()
        self._decodes: Sequence[WorkerView] = ()
        self._turn = 0  # ties go round the pool (an idle pool must not herd onto its first worker)

    def select(self, prefills: Sequence[WorkerView], decodes: Sequence[WorkerView], request: RequestInfo) -> Pair:
        self._turn += 1
        self._decodes = decodes
        decode, best_key = decodes[0], (True, float("inf"))
        for w in _rotated(decodes, self._turn):
            need = decode_need(request, w)
            key = (not fits_pages(w, need), decode_pressure(w, need))
            if key < best_key:
                decode, best_key = w, key
        prefill = None
        if prefills:
            self._prefills = prefills
            fallback = fallback_rate(prefills)
            prompt = request.num_prompt_tokens
            best = float("inf")
            for w in _rotated(prefills, self._turn):
                finish_s = (w.num_prefill_tokens + prompt) / rate_of(w, fallback)
                if finish_s < best:
                    prefill, best = w, finish_s
        return Pair(prefill, decode)

    def on_worker_removed(self, worker: WorkerView) -> None:
        """A lost worker's last figures leave the means now, not at the next request (or never, idle)."""
        self._prefills = [w for w in self._prefills if w is not worker]
        self._decodes = [w for w in self._decodes if w is not worker]

    def stats(self) -> Mapping[str, float]:
        decode_util = _mean([decode_utilization(w) for w in self._decodes])
        out = {"decode_utilization": decode_util}
        # Prefills: the busy share of those with a fresh report (0.0 is also "unknown": a stale report's, one not
        # come yet, an SGLang worker's); none such, no figures rather than an idle pool. (The decode side of a
        # split sees no prefills: no figures for them either.)
        busy = [w.busy_fraction for w in self._prefills if w.is_load_fresh]
        if busy:
            prefill_util = _mean(busy)
            out["prefill_utilization"] = prefill_util
            if decode_util > 0:
                out["pd_load_ratio"] = prefill_util / decode_util
        return out


def _rotated(workers: Sequence[WorkerView], turn: int) -> Sequence[WorkerView]:
    k = turn % len(workers)
    return [*workers[k:], *workers[:k]] if k else workers


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0
