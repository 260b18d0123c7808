"""``power_of_two``: per role, two distinct random candidates; the less loaded one wins.

Prefill load is queued prefill time (tokens over measured throughput); decode load is KV/batch
pressure with this request placed (``gateway.policies.load``). O(1) per call whatever the pool size,
and it never herds: two gateways with the same stale view still spread their picks.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import msgspec

from gateway.policies.base import Pair, RequestInfo, WorkerView
from gateway.policies.load import decode_need, decode_pressure, rate_of


class PowerOfTwoPolicy:
    name = "power_of_two"

    class Options(msgspec.Struct, forbid_unknown_fields=True):
        seed: int | None = None

    def __init__(self, options: Options | None = None) -> None:
        self._rng = random.Random((options or self.Options()).seed)

    def _two(self, workers: Sequence[WorkerView]) -> tuple[WorkerView, WorkerView]:
        if len(workers) == 1:
            return workers[0], workers[0]
        i, j = self._rng.sample(range(len(workers)), 2)
        return workers[i], workers[j]

    def select(self, prefills: Sequence[WorkerView], decodes: Sequence[WorkerView], request: RequestInfo) -> Pair:
        prefill = None
        if prefills:
            a, b = self._two(prefills)
            # Both rates known: compare queued time; otherwise queued tokens.
            fallback = 1.0 if a.prefill_tokens_per_s > 0 and b.prefill_tokens_per_s > 0 else 0.0
            if fallback:
                prefill = a if a.num_prefill_tokens / rate_of(a, 1.0) <= b.num_prefill_tokens / rate_of(b, 1.0) else b
            else:
                prefill = a if a.num_prefill_tokens <= b.num_prefill_tokens else b
        c, d = self._two(decodes)
        decode = c if decode_pressure(c, decode_need(request, c)) <= decode_pressure(d, decode_need(request, d)) else d
        return Pair(prefill, decode)
