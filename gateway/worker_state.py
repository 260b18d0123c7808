"""What the gateway knows about one worker's load: the worker's own reports plus its own dispatches.

Lifecycle (one ``WorkerState`` per ``WorkerClient``, touched only on the event loop):
1. ``connected(ack)`` on each handshake: shape of the worker (pages, page size); forgets the old
   report and every unacknowledged dispatch (the connection that carried them is gone).
2. ``dispatched(rid, prefill_tokens, pages)`` when the gateway submits a request; ``ended(rid)``
   when the request's part on this worker ends (finish, "transferred", error, abort, disconnect);
   ``prefill_done(rid)`` when a combined worker's request has its first token (its prompt is done).
3. ``reported(load, now)`` for each ``LoadReport``: its ``last_rid`` says which dispatches the
   figures include; the rest stay counted on top ("unacknowledged"), so a burst routed between two
   reports is never invisible.
4. Policies read the attributes below (synchronously, in ``select``; nothing changes while they
   run, so the object is a consistent snapshot for the duration of the call). When the newest
   report is older than ``stale_after_s`` (checked by ``refresh``, which the gateway runs every
   ``REFRESH_INTERVAL_S``) the figures fall back to the gateway's own counts.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Any

from workers.protocol import HelloAck, LoadReport

DEFAULT_STALE_AFTER_S = 1.0
REFRESH_INTERVAL_S = 0.1
# Dispatches a report has not covered yet, kept at most: the oldest go first (the worker has seen them
# by now), so a worker whose reports stopped costs no growing list.
MAX_UNACKED = 1024


class WorkerState:
    """A worker as policies see it (implements ``gateway.policies.WorkerView``).

    The figures are plain attributes, recomputed on every update, so ``select`` over hundreds of
    workers costs attribute loads only. Freshness is re-evaluated on each update and by
    ``refresh(now)``, which the gateway calls every ``REFRESH_INTERVAL_S`` for every worker.
    """

    # Bumped whenever any worker's shape (its KV pool) may have changed: what is derived from every worker's
    # pool (``gateway.dispatch.Dispatcher``'s capacity floors) is recomputed when it moved.
    shape_epoch = 0

    def __init__(self, url: str, role: str, client: Any = None, *, stale_after_s: float = DEFAULT_STALE_AFTER_S,
                 clock: Callable[[], float] = time.monotonic):
        self._clock = clock  # simulators pass their virtual clock
        self.url = url
        self.role = role  # prefill | decode | both
        self.client = client  # the WorkerClient this state belongs to (the dispatcher's handle)
        self.stale_after_s = stale_after_s
        self.page_size = 0
        self.num_total_pages = 0
        self.max_context = 0  # the model's context on this worker (its handshake's)
        self.report: LoadReport | None = None
        self.report_at = 0.0  # clock() when the report arrived
        # The gateway's own requests open on this worker.
        self.num_active = 0
        self.own_prefill_tokens = 0
        self.own_pages = 0
        self._open: dict[int, tuple[int, int]] = {}  # rid -> (prefill tokens, pages)
        # Dispatches the newest report does not include yet: (rid, prefill tokens, pages), rid order.
        self._unacked: deque[tuple[int, int, int]] = deque()
        self._unacked_tokens = 0
        self._unacked_pages = 0
        # -- the view (see gateway.policies.WorkerView for meanings and units) --
        self.is_load_fresh = False
        self.num_prefill_tokens = 0
        self.prefill_tokens_per_s = 0.0
        self.busy_fraction = 0.0
        self.num_running_seqs = 0
        self.num_waiting_seqs = 0
        self.max_running_seqs = 0
        self.num_reserved_pages = 0
        self.num_free_pages = 0

    # -- updates (event loop) -------------------------------------------------------------------
    def connected(self, ack: HelloAck) -> None:
        self.page_size, self.num_total_pages, self.max_context = ack.page_size, ack.num_pages, ack.max_context
        WorkerState.shape_epoch += 1
        self.report, self.is_load_fresh = None, False
        self._unacked.clear()
        self._unacked_tokens = self._unacked_pages = 0
        self._recompute()

    def dispatched(self, rid: int, prefill_tokens: int, pages: int) -> None:
        self._open[rid] = (prefill_tokens, pages)
        self.num_active += 1
        self.own_prefill_tokens += prefill_tokens
        self.own_pages += pages
        unacked = self._unacked
        unacked.append((rid, prefill_tokens, pages))
        self._unacked_tokens += prefill_tokens
        self._unacked_pages += pages
        if len(unacked) > MAX_UNACKED:
            _, tokens, old_pages = unacked.popleft()
            self._unacked_tokens -= tokens
            self._unacked_pages -= old_pages
        if self.is_load_fresh:  # ``_unacked_figures``, inline (per request)
            report: LoadReport = self.report  # type: ignore[assignment]  # (fresh: there is one)
            self.num_prefill_tokens = report.num_prefill_tokens + self._unacked_tokens
            self.num_waiting_seqs = report.num_waiting + len(unacked)
            self.num_reserved_pages = self._unacked_pages
            free = report.num_free_pages - report.num_queued_pages - self._unacked_pages
            self.num_free_pages = free if free > 0 else 0  # (not ``max(0, free)``: its call costs more)
        else:  # ``_own_figures``, inline (per request)
            self.num_prefill_tokens = self.own_prefill_tokens
            self.num_running_seqs = self.num_active
            self.num_reserved_pages = self.own_pages
            free = self.num_total_pages - self.own_pages
            self.num_free_pages = free if free > 0 else 0

    def ended(self, rid: int) -> None:
        try:  # (fewer opcodes per request than ``pop(rid, None)``; an unknown rid is rare)
            tokens, pages = self._open.pop(rid)
        except KeyError:
            return
        self.num_active -= 1
        self.own_prefill_tokens -= tokens
        self.own_pages -= pages
        if not self.is_load_fresh:  # (a fresh report's figures do not include the gateway's own counts)
            # ``_own_figures``, inline (per request)
            self.num_prefill_tokens = self.own_prefill_tokens
            self.num_running_seqs = self.num_active
            self.num_reserved_pages = self.own_pages
            free = self.num_total_pages - self.own_pages
            self.num_free_pages = free if free > 0 else 0

    def prefill_done(self, rid: int) -> None:
        """``rid``'s prompt has been computed here (a combined worker's first token): its prefill tokens stop
        counting in the gateway's own figures (its pages stay until it ends). A disaggregated prefill's part
        simply ends at its hand-over (``ended``)."""
        cost = self._open.get(rid)
        if cost is None or not cost[0]:
            return
        self._open[rid] = (0, cost[1])
        self.own_prefill_tokens -= cost[0]
        if not self.is_load_fresh:
            self._own_figures()

    def reported(self, load: LoadReport, now: float | None = None) -> None:
        self.report = load
        self.report_at = self._clock() if now is None else now
        self.is_load_fresh = True
        unacked = self._unacked
        while unacked and unacked[0][0] <= load.last_rid:
            _, tokens, pages = unacked.popleft()
            self._unacked_tokens -= tokens
            self._unacked_pages -= pages
        self._recompute()

    def refresh(self, now: float | None = None) -> None:
        """Re-check the report's age (called periodically; reports themselves arrive as events)."""
        now = self._clock() if now is None else now
        fresh = self.report is not None and now - self.report_at <= self.stale_after_s
        if fresh != self.is_load_fresh:
            self.is_load_fresh = fresh
            if not fresh:  # own counts from now on: what the report did not yet cover goes (no unbounded list)
                self._unacked.clear()
                self._unacked_tokens = self._unacked_pages = 0
            self._recompute()

    def _recompute(self) -> None:
        report = self.report
        if report is not None:
            self.prefill_tokens_per_s = report.prefill_tokens_per_s  # a rate stays useful when stale
            self.max_running_seqs = report.max_running
        if report is None or not self.is_load_fresh:
            self.num_waiting_seqs = 0
            self.busy_fraction = 0.0
            self._own_figures()
            return
        self.num_running_seqs = report.num_running + report.num_transfer_seqs
        self.busy_fraction = report.busy_fraction
        self._unacked_figures()

    def _unacked_figures(self) -> None:
        """The view's figures that a fresh report plus the dispatches it does not include yet give (the rest stay as
        ``_recompute`` set them: a dispatch changes only these)."""
        report = self.report
        assert report is not None
        self.num_prefill_tokens = report.num_prefill_tokens + self._unacked_tokens
        self.num_waiting_seqs = report.num_waiting + len(self._unacked)
        self.num_reserved_pages = self._unacked_pages
        self.num_free_pages = max(0, report.num_free_pages - report.num_queued_pages - self._unacked_pages)

    def _own_figures(self) -> None:
        """The view's figures that the gateway's own counts give when no fresh report does (the rest stay
        as ``_recompute`` set them: what a dispatch or an end changes is only these)."""
        self.num_prefill_tokens = self.own_prefill_tokens
        self.num_running_seqs = self.num_active
        self.num_reserved_pages = self.own_pages
        self.num_free_pages = max(0, self.num_total_pages - self.own_pages)

    def __repr__(self) -> str:  # (what a policy's error names: the worker, not an address in memory)
        return f"<{self.role} worker {self.url}>"

    @property
    def capacity_tokens(self) -> int:
        """Tokens of KV the worker's whole pool holds (0 before it connected): a request needing more
        (a decode: prompt + max_new_tokens; a prefill: the prompt) is refused by it."""
        return self.page_size * self.num_total_pages

    @property
    def total_tokens(self) -> int:
        """The most prompt + max_new_tokens the worker takes (0 before it connected): its context, and on a decode
        (or combined) worker what its pool holds too. (A fleet of mixed contexts serves the longest: the dispatcher
        gives each request only to workers whose figure holds it, so one that came back with a shorter context is
        not given a longer request, which it would refuse.)"""
        if self.role == "prefill":
            return self.max_context
        pool = self.page_size * self.num_total_pages
        return min(pool, self.max_context) if self.max_context else pool

    @property
    def report_age_s(self) -> float:
        """Seconds since the newest load report (infinity before the first)."""
        return self._clock() - self.report_at if self.report is not None else float("inf")

    def describe(self) -> dict[str, Any]:
        """A JSON-able view for /health and debugging."""
        self.refresh()
        return {
            "url": self.url, "role": self.role, "active": self.num_active, "load_fresh": self.is_load_fresh,
            "prefill_tokens": self.num_prefill_tokens, "prefill_tokens_per_s": self.prefill_tokens_per_s,
            "running_seqs": self.num_running_seqs, "waiting_seqs": self.num_waiting_seqs,
            "free_pages": self.num_free_pages, "total_pages": self.num_total_pages,
        }
