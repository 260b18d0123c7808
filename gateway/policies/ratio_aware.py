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
sees no prefills: it reports the decodes only.) The pools are the workers of the last ``select`` and of
the ``WINDOW`` calls before it: one request's lists can be short of the fleet (a retry avoids the worker
that failed it, a long request goes only to the workers that hold it), and a worker off them for that
long (unhealthy, draining) has left it; one lost (``on_worker_removed``) leaves at once.
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
        self._prefills = _Pool()
        self._decodes = _Pool()
        self._turn = 0  # ties go round the pool (an idle pool must not herd onto its first worker)

    def select(self, prefills: Sequence[WorkerView], decodes: Sequence[WorkerView], request: RequestInfo) -> Pair:
        self._turn += 1
        self._decodes.given(decodes, self._turn)
        decode, best_key = decodes[0], (True, float("inf"))
        for w in _rotated(decodes, self._turn):
            need = decode_need(request, w)
            key = (not fits_pages(w, need), decode_pressure(w, need))
            if key < best_key:
                decode, best_key = w, key
        prefill = None
        if prefills:
            self._prefills.given(prefills, self._turn)
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
        self._prefills.removed(worker)
        self._decodes.removed(worker)

    def stats(self) -> Mapping[str, float]:
        decode_util = _mean([decode_utilization(w) for w in self._decodes.members(self._turn)])
        out = {"decode_utilization": decode_util}
        # Prefills: the busy share of those with a fresh report (0.0 is also "unknown": a stale report's, one not
        # come yet, an SGLang worker's); none such, no figures rather than an idle pool. (The decode side of a
        # split sees no prefills: no figures for them either.)
        busy = [w.busy_fraction for w in self._prefills.members(self._turn) if w.is_load_fresh]
        if busy:
            prefill_util = _mean(busy)
            out["prefill_utilization"] = prefill_util
            if decode_util > 0:
                out["pd_load_ratio"] = prefill_util / decode_util
        return out


WINDOW = 16  # ``select`` calls a worker missing from the lists still counts in ``stats()`` for


class _Pool:
    """One role's workers for ``stats()``: those of the last ``select`` (``current``), and those of an earlier
    one within ``WINDOW`` calls (``_earlier``: id -> (view, the last call it was given to)). Noted only when the
    lists change (the same workers as the call before, the common case, cost one comparison)."""

    __slots__ = ("_earlier", "current")

    def __init__(self) -> None:
        self.current: Sequence[WorkerView] = ()
        self._earlier: dict[int, tuple[WorkerView, int]] = {}

    def given(self, workers: Sequence[WorkerView], turn: int) -> None:
        if workers == self.current:  # (by identity: views define no equality)
            return
        earlier = self._earlier
        for w in self.current:  # (each was on the lists up to the call before this one)
            earlier[id(w)] = (w, turn - 1)
        for key in [key for key, (_, at) in earlier.items() if at < turn - WINDOW]:
            del earlier[key]
        self.current = workers

    def removed(self, worker: WorkerView) -> None:
        self._earlier.pop(id(worker), None)
        if any(w is worker for w in self.current):
            self.current = tuple(w for w in self.current if w is not worker)

    def members(self, turn: int) -> list[WorkerView]:
        out = list(self.current)
        here = {id(w) for w in out}
        out += [w for key, (w, at) in self._earlier.items() if key not in here and at >= turn - WINDOW]
        return out


def _rotated(workers: Sequence[WorkerView], turn: int) -> Sequence[WorkerView]:
    k = turn % len(workers)
    return [*workers[k:], *workers[:k]] if k else workers


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0
