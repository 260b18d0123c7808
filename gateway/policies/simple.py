"""``random`` and ``round_robin``: load-blind baselines."""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

import msgspec

from gateway.policies.base import Pair, RequestInfo, WorkerView

_lcm = math.lcm  # (a global: read per request)


class RandomPolicy:
    """Each side uniformly at random (``seed`` makes it repeatable)."""

    name = "random"

    class Options(msgspec.Struct, forbid_unknown_fields=True):
        seed: int | None = None

    def __init__(self, options: Options | None = None) -> None:
        self._rng = random.Random((options or self.Options()).seed)

    def select(self, prefills: Sequence[WorkerView], decodes: Sequence[WorkerView], request: RequestInfo) -> Pair:
        prefill = self._rng.choice(prefills) if prefills else None
        return Pair(prefill, self._rng.choice(decodes))


class RoundRobinPolicy:
    """Each side in turn, over whichever workers are healthy at the time. The decodes' turn moves one place
    further each time both turns are back where they started together, so that every prefill meets every
    decode (turns in step paired prefill i with decode i for good when the two counts share a divisor: a
    decode then never learned the other prefills' addresses, and failed every room of a surviving prefill
    while the registry was down)."""

    name = "round_robin"

    def __init__(self) -> None:
        self._next_prefill = 0
        self._next_decode = 0

    def select(self, prefills: Sequence[WorkerView], decodes: Sequence[WorkerView], request: RequestInfo) -> Pair:
        turn = self._next_decode
        if prefills:
            num_prefills = len(prefills)
            prefill = prefills[self._next_prefill % num_prefills]
            self._next_prefill += 1
            num_decodes = len(decodes)
            decode = decodes[(turn + turn // _lcm(num_prefills, num_decodes)) % num_decodes]
            self._next_decode = turn + 1
            return Pair(prefill, decode)
        decode = decodes[turn % len(decodes)]
        self._next_decode = turn + 1
        return Pair(None, decode)
