"""The routing-policy seam shared by built-in policies and third-party plugins.

A policy is a small class found by entry point (group ``pd_gateway.policies``) or ``module:attr``
and selected by name on the gateway's command line (``--policy``, or ``--prefill-policy`` and
``--decode-policy`` for one side each). Lifecycle, all on the gateway's event loop:

1. Construction: ``cls()``, or ``cls(options)`` when the class declares ``Options`` (a
   ``msgspec.Struct``; ``--policy-option K=V`` values are converted to it and validated at start-up).
2. ``on_worker_added(worker)`` when a worker joins the routable set (its connection is up) and
   ``on_worker_removed(worker)`` when it leaves it (connection lost, gateway closing).
3. ``select(prefills, decodes, request)`` per attempt: synchronous, no I/O, reads only the views
   and the request it is given, costs O(workers). The lists hold healthy workers only (kept between requests
   while no worker's selectability changed: ``Dispatcher._views``; a pick of one whose connection began closing
   in between is re-done over fresh lists), whose KV pools
   can hold the request (``gateway.dispatch.Dispatcher._fitting``); ``decodes`` is never empty;
   ``prefills`` is empty when the gateway runs combined workers (return ``prefill=None`` then).
   Return members of the given lists.
4. ``on_dispatch(pair, request)`` once the request was sent to the pair; ``on_finish(pair, request,
   outcome)`` when that attempt ended (``outcome`` is "finished", "failed" or "cancelled").

Hooks are optional: a policy defines the ones it needs (``PolicyHooks`` lists them). A policy that
wants its figures on ``/metrics`` defines ``stats() -> Mapping[str, float]`` (``PolicyStats``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from workers.page_cache import page_hashes

OUTCOMES = ("finished", "failed", "cancelled")


@runtime_checkable
class WorkerView(Protocol):
    """What a policy may read about a worker (read-only; units in the names).

    Figures combine the worker's newest load report with the gateway's own dispatches since (the
    report says which of them it includes); when the report is stale they are the gateway's own
    counts (``is_load_fresh`` False). The gateway's ``WorkerState`` is the implementation.
    """

    url: str
    role: str  # "prefill" | "decode" | "both"
    page_size: int  # tokens per KV page (0 until connected)
    num_total_pages: int  # KV pool size
    num_active: int  # requests this gateway has open on the worker
    is_load_fresh: bool  # the worker's load report is recent
    num_prefill_tokens: int  # prompt tokens queued + running, less cached prefixes
    prefill_tokens_per_s: float  # measured prefill throughput (0.0 = not measured yet)
    busy_fraction: float  # share of recent time spent computing, 0..1 (0.0 = unknown)
    num_running_seqs: int  # sequences holding KV (running, or receiving KV)
    num_waiting_seqs: int  # admitted sequences waiting for pages or a batch slot
    max_running_seqs: int  # the worker's batch limit (0 = unknown)
    num_free_pages: int  # KV pages free after every admitted and reserved request
    num_reserved_pages: int  # pages this gateway reserved that the worker's figures don't show yet


class PrefixLookup(Protocol):
    """Which workers hold a prefix: ``match(page hashes)`` -> {worker url: leading pages held}."""

    def match(self, hashes: Sequence[bytes]) -> Mapping[str, int]: ...


class RequestInfo:
    """One request as policies see it; cache look-ups are computed on first use and memoized."""

    __slots__ = ("_hashes", "_lookup", "_matches", "input_ids", "max_new_tokens")

    def __init__(self, input_ids: Sequence[int], max_new_tokens: int, lookup: PrefixLookup | None = None) -> None:
        self.input_ids = input_ids
        self.max_new_tokens = max_new_tokens
        self._lookup = lookup
        self._hashes: dict[int, list[bytes]] = {}
        self._matches: dict[int, Mapping[str, int]] = {}

    @property
    def has_page_hashes(self) -> bool:
        """Whether a policy has looked at the prefix cache for this request."""
        return bool(self._hashes)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.input_ids)

    def page_hashes(self, page_size: int) -> list[bytes]:
        """The chained hashes a worker with this page size could serve from its prefix cache."""
        hashes = self._hashes.get(page_size)
        if hashes is None:
            hashes = page_hashes(self.input_ids, page_size, (len(self.input_ids) - 1) // page_size)
            self._hashes[page_size] = hashes
        return hashes

    def num_cached_tokens(self, worker: WorkerView) -> int:
        """Prompt tokens ``worker`` holds in its prefix cache (by KV events and recent routing)."""
        page_size = worker.page_size
        if self._lookup is None or page_size <= 0:
            return 0
        return self.cached_pages(page_size).get(worker.url, 0) * page_size

    def cached_pages(self, page_size: int) -> Mapping[str, int]:
        """{worker url: leading pages of this prompt it holds} for workers of this page size."""
        matches = self._matches.get(page_size)
        if matches is None:
            matches = self._lookup.match(self.page_hashes(page_size)) if self._lookup is not None else {}
            self._matches[page_size] = matches
        return matches

    def num_pages_needed(self, page_size: int) -> int:
        """KV pages a decode worker reserves for this request (prompt + max_new_tokens)."""
        return -(-(len(self.input_ids) + self.max_new_tokens) // max(1, page_size))


@dataclass(frozen=True)
class Pair:
    prefill: WorkerView | None
    decode: WorkerView


class Policy(Protocol):
    name: str

    def select(self, prefills: Sequence[WorkerView], decodes: Sequence[WorkerView], request: RequestInfo) -> Pair:
        ...


@runtime_checkable
class PolicyHooks(Protocol):
    """Optional hooks; the gateway calls whichever a policy defines."""

    def on_dispatch(self, pair: Pair, request: RequestInfo) -> None: ...

    def on_finish(self, pair: Pair, request: RequestInfo, outcome: str) -> None: ...

    def on_worker_added(self, worker: WorkerView) -> None: ...

    def on_worker_removed(self, worker: WorkerView) -> None: ...


@runtime_checkable
class PolicyStats(Protocol):
    """Optional: figures the gateway exports on ``/metrics`` as ``pd_gateway_policy_stat``."""

    def stats(self) -> Mapping[str, float]: ...
