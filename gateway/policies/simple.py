"""``random`` and ``round_robin``: load-blind baselines."""

from __future__ import annotations

import random
from collections.abc import Sequence

from gateway.policies.base import Pair, RequestInfo, WorkerView


class RandomPolicy:
    name = "random"

    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def select(self, prefills: Sequence[WorkerView], decodes: Sequence[WorkerView], request: RequestInfo) -> Pair:
        prefill = self._rng.choice(prefills) if prefills else None
        return Pair(prefill, self._rng.choice(decodes))


class RoundRobinPolicy:
    name = "round_robin"

    def __init__(self) -> None:
        self._next_prefill = 0
        self._next_decode = 0

    def select(self, prefills: Sequence[WorkerView], decodes: Sequence[WorkerView], request: RequestInfo) -> Pair:
        prefill = None
        if prefills:
            prefill = prefills[self._next_prefill % len(prefills)]
            self._next_prefill += 1
        decode = decodes[self._next_decode % len(decodes)]
        self._next_decode += 1
        return Pair(prefill, decode)
