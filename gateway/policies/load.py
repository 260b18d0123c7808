"""Load figures shared by the load-aware policies (pure functions over ``WorkerView``s).

Prefill load is time: queued prompt tokens divided by the worker's measured throughput, so a worker
three times slower looks three times as loaded for the same queue. Decode load is pressure: the
share of the KV pool or of the batch slots in use once this request is placed, whichever is higher,
plus a penalty when the request would have to wait for pages. A decode whose KV pool is unknown (an
SGLang worker without ``/v1/loads``: no report, no pool size) is judged by its slots alone, its own open
requests over its batch limit or, unknown too, ``NOMINAL_SLOTS``: neither full nor free, so that it
neither starves next to reporting workers nor wins every tie among its peers.
"""

from __future__ import annotations

from collections.abc import Sequence

from gateway.policies.base import RequestInfo, WorkerView

UNKNOWN_RATE = 1.0  # tokens/s stand-in when no worker has measured its prefill throughput yet
NOMINAL_SLOTS = 256  # batch slots assumed for a decode that reports neither its KV pool nor its batch limit


def fallback_rate(prefills: Sequence[WorkerView]) -> float:
    """The rate to assume for workers that have not measured theirs: the mean of those that have."""
    total, n = 0.0, 0
    for w in prefills:
        rate = w.prefill_tokens_per_s
        if rate > 0:
            total += rate
            n += 1
    return total / n if n else UNKNOWN_RATE


def rate_of(worker: WorkerView, fallback: float) -> float:
    rate = worker.prefill_tokens_per_s
    return rate if rate > 0 else fallback


def prefill_wait_s(worker: WorkerView, fallback: float) -> float:
    """Seconds of queued prefill work ahead of a new request on this worker."""
    return worker.num_prefill_tokens / rate_of(worker, fallback)


def fits_pages(worker: WorkerView, need_pages: int) -> bool:
    """The request's pages are free on the worker now (assumed where its pool is unknown)."""
    return worker.num_total_pages <= 0 or need_pages <= worker.num_free_pages


def decode_pressure(worker: WorkerView, need_pages: int) -> float:
    """Utilization (0..1, more when over-committed) of a decode worker once this request is placed."""
    total = worker.num_total_pages
    if total <= 0:  # the pool is unknown: the slots alone, no page term and no wait penalty
        return (worker.num_running_seqs + worker.num_waiting_seqs + 1) / (worker.max_running_seqs or NOMINAL_SLOTS)
    free = worker.num_free_pages
    kv = (total - free + need_pages) / total if total > 0 else 0.0
    limit = worker.max_running_seqs
    seqs = (worker.num_running_seqs + worker.num_waiting_seqs + 1) / limit if limit > 0 else 0.0
    pressure = max(kv, seqs)
    if need_pages > free:  # it would wait for pages: worse than any worker that can take it now
        pressure += 1.0 + worker.num_waiting_seqs
    return pressure


def decode_utilization(worker: WorkerView) -> float:
    """Share of a decode worker's KV pool or batch slots in use now, whichever is higher."""
    total, limit = worker.num_total_pages, worker.max_running_seqs
    if total <= 0:  # (the pool unknown: as ``decode_pressure``)
        limit = limit or NOMINAL_SLOTS
    kv = (total - worker.num_free_pages) / total if total > 0 else 0.0
    seqs = (worker.num_running_seqs + worker.num_waiting_seqs) / limit if limit > 0 else 0.0
    return max(kv, seqs)


def decode_need(request: RequestInfo, worker: WorkerView) -> int:
    return request.num_pages_needed(worker.page_size or 16)


def can_take_now(workers: Sequence[WorkerView], request: RequestInfo) -> list[WorkerView]:
    """The workers with the free pages and a batch slot for this request now (it would wait on the others)."""
    fit = []
    for w in workers:
        limit = w.max_running_seqs
        if fits_pages(w, decode_need(request, w)) and (
                limit <= 0 or w.num_running_seqs + w.num_waiting_seqs < limit):
            fit.append(w)
    return fit


def least_pressured(decodes: Sequence[WorkerView], request: RequestInfo, turn: int = 0) -> WorkerView:
    """The decode with the lowest pressure for this request (ties: fewest of our requests open, then the first
    from ``turn`` on: a caller counting its picks there spreads an idle fleet's requests, one at a time, over
    its decodes rather than sending every one to the first).

    ``decode_pressure`` inlined: this loop runs over every decode worker for every request.
    """
    tokens = request.num_prompt_tokens + request.max_new_tokens
    start = turn % len(decodes)
    if start:
        decodes = [*decodes[start:], *decodes[:start]]
    best, best_pressure, best_active = decodes[0], float("inf"), 0
    for w in decodes:
        total, free, limit = w.num_total_pages, w.num_free_pages, w.max_running_seqs
        if total > 0:
            need = -(-tokens // (w.page_size or 16))
            pressure = (total - free + need) / total
            if limit > 0:
                pressure = max(pressure, (w.num_running_seqs + w.num_waiting_seqs + 1) / limit)
            if need > free:
                pressure += 1.0 + w.num_waiting_seqs
        else:  # the pool unknown: the slots alone (not inlined: the rare case)
            pressure = decode_pressure(w, 0)
        if pressure < best_pressure or (pressure == best_pressure and w.num_active < best_active):
            best, best_pressure, best_active = w, pressure, w.num_active
    return best
