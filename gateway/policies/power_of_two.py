"""``power_of_two``: per role, two distinct random candidates; the less loaded one wins.

Prefill: when this prompt would be done, (queued + prompt tokens) / measured throughput; decode:
KV/batch pressure with this request placed (``gateway.policies.load``). O(1) per call whatever the pool size,
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
            # When this prompt would be done on each: (queued + its own tokens) / rate, so an idle slow
            # worker loses to an idle fast one. Unknown rates count as the other's (or as equal).
            fallback = a.prefill_tokens_per_s or b.prefill_tokens_per_s or 1.0
            prompt = request.num_prompt_tokens
            a_s = (a.num_prefill_tokens + prompt) / rate_of(a, fallback)
            b_s = (b.num_prefill_tokens + prompt) / rate_of(b, fallback)
            prefill = a if a_s <= b_s else b
        c, d = self._two(decodes)
        decode = c if decode_pressure(c, decode_need(request, c)) <= decode_pressure(d, decode_need(request, d)) else d
        return Pair(prefill, decode)
