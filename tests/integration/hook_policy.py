"""A policy that counts the hooks the gateway calls, exported through ``stats()`` (for tests)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence

from gateway.policies import Pair, RequestInfo, RoundRobinPolicy, WorkerView


class HookCounter(RoundRobinPolicy):
    name = "hook_counter"

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def select(self, prefills: Sequence[WorkerView], decodes: Sequence[WorkerView], request: RequestInfo) -> Pair:
        self.counts["select"] += 1
        return super().select(prefills, decodes, request)

    def on_dispatch(self, pair: Pair, request: RequestInfo) -> None:
        self.counts["dispatch"] += 1

    def on_finish(self, pair: Pair, request: RequestInfo, outcome: str) -> None:
        self.counts[f"finish_{outcome}"] += 1

    def on_worker_added(self, worker: WorkerView) -> None:
        self.counts[f"added_{worker.role}"] += 1

    def on_worker_removed(self, worker: WorkerView) -> None:
        self.counts[f"removed_{worker.role}"] += 1

    def stats(self) -> Mapping[str, float]:
        return {k: float(v) for k, v in self.counts.items()}
