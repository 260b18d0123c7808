"""``sticky_prefix``: every prompt prefix has a home prefill; overflow goes to the next in line.

Consistent hashing with bounded loads: the first ``prefix_tokens`` tokens of a prompt (a tenant's
system prompt, a conversation's opening) rank the prefill workers by rendezvous hash; the request
goes to the first-ranked worker whose in-flight prefill tokens stay under ``max_load_factor`` times
the pool's mean. Same prefix -> same worker -> its prefix cache hits, with no index and no shared
state, so any number of gateways agree on the homes. The decode is the one with the most free KV
pages. It keeps its own ledger of in-flight tokens through the hooks.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping, Sequence

import msgspec

from gateway.policies import Pair, RequestInfo, WorkerView

__all__ = ["StickyPrefixPolicy"]


class StickyPrefixPolicy:
    name = "sticky_prefix"

    class Options(msgspec.Struct, forbid_unknown_fields=True):
        prefix_tokens: int = 256
        max_load_factor: float = 1.25

        def __post_init__(self) -> None:
            if self.prefix_tokens < 1:
                raise ValueError("prefix_tokens must be >= 1")
            if self.max_load_factor < 1:
                raise ValueError("max_load_factor must be >= 1")

    def __init__(self, options: Options | None = None) -> None:
        self.options = options or self.Options()
        self._inflight: dict[str, int] = {}  # prefill url -> prompt tokens this policy has in flight
        self.num_routed = 0
        self.num_at_home = 0

    def select(self, prefills: Sequence[WorkerView], decodes: Sequence[WorkerView], request: RequestInfo) -> Pair:
        decode = max(decodes, key=lambda w: (w.num_free_pages, -w.num_active))
        if not prefills:
            return Pair(None, decode)
        key = zlib.crc32(repr(list(request.input_ids[: self.options.prefix_tokens])).encode())
        ranked = sorted(prefills, key=lambda w: zlib.crc32(w.url.encode(), key), reverse=True)
        loads = [self._inflight.get(w.url, 0) for w in prefills]
        bound = self.options.max_load_factor * (sum(loads) + request.num_prompt_tokens) / len(prefills)
        chosen = next((w for w in ranked if self._inflight.get(w.url, 0) + request.num_prompt_tokens <= bound),
                      ranked[0])
        self.num_routed += 1
        self.num_at_home += chosen is ranked[0]
        return Pair(chosen, decode)

    # -- hooks: the gateway calls them as requests and workers come and go ------------------------
    def on_dispatch(self, pair: Pair, request: RequestInfo) -> None:
        if pair.prefill is not None:
            self._inflight[pair.prefill.url] = self._inflight.get(pair.prefill.url, 0) + request.num_prompt_tokens

    def on_finish(self, pair: Pair, request: RequestInfo, outcome: str) -> None:
        if pair.prefill is not None and pair.prefill.url in self._inflight:
            self._inflight[pair.prefill.url] = max(0, self._inflight[pair.prefill.url] - request.num_prompt_tokens)

    def on_worker_added(self, worker: WorkerView) -> None:
        if worker.role == "prefill":
            self._inflight.setdefault(worker.url, 0)

    def on_worker_removed(self, worker: WorkerView) -> None:
        self._inflight.pop(worker.url, None)

    def stats(self) -> Mapping[str, float]:
        return {"home_share": self.num_at_home / max(1, self.num_routed)}
