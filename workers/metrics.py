"""The worker's Prometheus metrics (``GET /metrics`` on its HTTP side).

Nothing here locks or allocates on the scheduler's hot path. The scheduler thread keeps plain ints,
dicts and bucket lists (its own counters, ``SchedulerMetrics`` below, the page cache's and the KV
manager's counters); ``WorkerCollector`` reads them on the event loop at scrape time, so a scrape
may see figures a step apart (no consistency promised), never a torn value.

Every sample carries the worker's ``role`` label. Histograms observed on the scheduler thread:
batch size and engine time per step (one ``bisect`` and two adds each), and, on a prefill, the KV
transfer latency per room (first chunk posted -> every write done, measured by the KV sender).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from gateway.http_connections import cap_metrics
from workers.request import live

if TYPE_CHECKING:
    from workers.http_connections import ConnectionCap
    from workers.kv_pool import KVPool
    from workers.request import Req
    from workers.scheduler import Scheduler

BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
STEP_SECONDS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
KV_TRANSFER_SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
                               60.0)
CONTENT_TYPE = "text/plain; version=0.0.4"

# Scheduler stages per role: (label, attribute). Live requests are counted (finished ones leave
# their lists at the next step), except quarantine, which only holds ended requests' pages. Every role
# also has "grammar" (``Scheduler.grammar_wait``: its grammar compiling), where the engine compiles grammars.
QUEUES = {
    "prefill": (("bootstrap", "bootstrap_queue"), ("waiting", "_waiting"), ("prefilling", "_prefilling"),
                ("inflight", "inflight_queue")),
    "decode": (("prealloc", "prealloc_queue"), ("transfer", "transfer_queue"), ("imported", "_imported"),
               ("running", "_running"),
               ("quarantine", "quarantine")),
    "both": (("waiting", "_waiting"), ("prefilling", "_prefilling"), ("running", "_running")),
}


class PlainHistogram:
    """Bucket counts for one writer thread, without a lock; ``buckets()`` is read from another thread."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(float(b) for b in bounds)
        self.counts = [0] * (len(self.bounds) + 1)  # the last one is +Inf
        self.sum = 0.0

    def observe(self, value: float, count: int = 1) -> None:
        """``count`` samples of ``value`` (e.g. a gap averaged over the tokens of one output)."""
        self.counts[bisect_left(self.bounds, value)] += count
        self.sum += value * count

    def buckets(self) -> tuple[list[tuple[str, float]], float]:
        """Cumulative ``(le, count)`` pairs ending with +Inf, and the sum (read without a lock)."""
        counts, total = list(self.counts), self.sum
        out, running = [], 0
        for bound, n in zip((*self.bounds, float("inf")), counts, strict=True):
            running += n
            out.append(("+Inf" if bound == float("inf") else repr(bound), float(running)))
        return out, total


class SchedulerMetrics:
    """What the scheduler counts for metrics beyond its own counters (written by its thread only)."""

    def __init__(self) -> None:
        self.step_batch_size = PlainHistogram(BATCH_SIZE_BUCKETS)
        self.step_seconds = PlainHistogram(STEP_SECONDS_BUCKETS)
        self.kv_transfer_seconds = PlainHistogram(KV_TRANSFER_SECONDS_BUCKETS)
        self.finished: dict[str, int] = {}  # finish reason -> requests
        self.failed: dict[str, int] = {}  # error code -> requests (every Error the worker sent)
        self.kv_bytes_received = 0  # decode: KV pages + aux record of every completed room

    def on_step(self, batch_size: int, seconds: float) -> None:
        self.step_batch_size.observe(batch_size)
        self.step_seconds.observe(seconds)

    def on_finish(self, reason: str) -> None:
        self.finished[reason] = self.finished.get(reason, 0) + 1

    def on_error(self, code: str) -> None:
        self.failed[code] = self.failed.get(code, 0) + 1

    def on_room(self, req: Req, pool: KVPool) -> None:
        """A room's KV transfer completed (prefill: the decode has it all; decode: it all landed here)."""
        latency = getattr(req.kv_sender, "latency_s", None)
        if latency is not None:
            self.kv_transfer_seconds.observe(latency)
        if req.kv_receiver is not None:
            # One-sided writes: the decode sees no bytes arrive, so it counts what the prefill wrote,
            # the prompt's pages of every K and V buffer, plus the aux record.
            kv_bytes = pool.pages_for(len(req.input_ids)) * 2 * pool.num_layers * pool.page_bytes
            self.kv_bytes_received += kv_bytes + (getattr(req.kv_receiver, "aux_len", None) or 0)


class WorkerView(Protocol):
    """What the collector reads from a ``workers.worker.Worker``."""

    worker_id: str
    scheduler: Scheduler | None
    kv: Any
    config: Any
    http_connections: ConnectionCap | None


class WorkerCollector(Collector):
    """The worker's state at scrape time: scheduler queues and counters, KV pool, KV transfer."""

    def __init__(self, worker: WorkerView) -> None:
        self._worker = worker

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        w = self._worker
        role = str(w.config.role)
        info = GaugeMetricFamily("pd_worker_info", "The worker's identity (always 1)",
                                 labels=["role", "worker_id", "engine", "transfer"])
        info.add_metric([role, w.worker_id, str(w.config.engine), str(w.config.transfer) if role != "both" else ""],
                        1.0)
        yield info
        sched = w.scheduler
        alive = GaugeMetricFamily("pd_worker_scheduler_alive", "1 while the scheduler thread runs", labels=["role"])
        alive.add_metric([role], float(sched is not None and sched.is_alive))
        yield alive
        if w.http_connections is not None:
            yield from _http_metrics(role, w.http_connections)
        server = getattr(w, "server", None)  # (the native port: gateways' connections)
        if server is not None:
            yield _counter("pd_worker_gateway_peer_timeouts", "Gateway connections the kernel closed because their "
                           "peer stopped answering (--gateway-timeout-s: ETIMEDOUT)", role,
                           float(server.num_peer_timeouts))
        if sched is None:
            return
        yield from _scheduler_metrics(role, sched)
        if sched.grammar_wait is not None:
            yield from _grammar_metrics(role, sched)
        yield from _transfer_metrics(role, sched, w.kv)


def _http_metrics(role: str, cap: ConnectionCap) -> Iterator[Metric]:
    """The HTTP port's connections under ``--max-http-connections`` (``workers/http_connections.py``)."""
    return cap_metrics(cap, "pd_worker_http_connections", "HTTP", {"role": role})


def _gauge(name: str, doc: str, role: str, value: float) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, doc, labels=["role"])
    family.add_metric([role], value)
    return family


def _counter(name: str, doc: str, role: str, value: float) -> CounterMetricFamily:
    family = CounterMetricFamily(name, doc, labels=["role"])
    family.add_metric([role], value)
    return family


def _histogram(name: str, doc: str, role: str, hist: PlainHistogram) -> HistogramMetricFamily:
    family = HistogramMetricFamily(name, doc, labels=["role"])
    buckets, total = hist.buckets()
    family.add_metric([role], buckets, total)
    return family


# The batch lists keep a request that moved on until the next step: counted only in its own stage.
_STAGES = {"prefilling": "prefill", "running": "running"}


def _live(reqs: Iterable[Req], stage: str | None = None) -> int:
    return len(live(reqs, stage))


def _scheduler_metrics(role: str, s: Scheduler) -> Iterator[Metric]:
    queues = GaugeMetricFamily("pd_worker_queue_requests", "Requests in each scheduler stage",
                               labels=["role", "queue"])
    for label, attr in (*QUEUES.get(role, ()), ("grammar", "grammar_wait")):
        reqs = getattr(s, attr)  # a list, a workers.pd_queues queue, or the GrammarWait (None: no grammars)
        if reqs is None:
            continue
        queues.add_metric([role, label], float(len(reqs) if label == "quarantine" else _live(reqs, _STAGES.get(label))))
    yield queues
    yield _gauge("pd_worker_running_batch_size", "Sequences in the batch (decoding + prefilling)", role,
                 s.num_in_batch())
    cache, pool = s.cache, s.pool
    yield _gauge("pd_worker_kv_free_pages", "KV pages an allocation could take now (free + evictable cached)",
                 role, cache.num_available)
    yield _gauge("pd_worker_kv_capacity_pages", "KV pages in the pool", role, pool.num_pages)
    yield _gauge("pd_worker_kv_cached_pages", "KV pages holding a published prefix (prefix cache)", role,
                 cache.num_cached)
    yield _gauge("pd_worker_busy_ratio", "Fraction of recent time the engine was computing (busy_fraction)", role,
                 s.busy_fraction)
    yield _gauge("pd_worker_prefill_tokens_per_second", "Prefill throughput estimate (moving average)", role,
                 s.prefill_tokens_per_s)
    yield _counter("pd_worker_prompt_tokens", "Prompt tokens of requests prefilled here", role, s.num_prompt_tokens)
    yield _counter("pd_worker_cached_prompt_tokens", "Prompt tokens served from the prefix cache", role,
                   s.num_cached_prompt_tokens)
    yield _counter("pd_worker_prefix_cache_hit_tokens", "Tokens matched in the prefix cache (recomputes included)",
                   role, cache.num_hit_tokens)
    yield _counter("pd_worker_prefix_cache_evictions", "Cached KV pages evicted for new allocations", role,
                   cache.num_evictions)
    yield _counter("pd_worker_preemptions", "Sequences preempted for lack of KV pages", role, s.num_preemptions)
    yield _counter("pd_worker_prefix_waits", "Requests that waited for a prefix another request here was computing",
                   role, s.num_prefix_waits)
    yield _counter("pd_worker_steps", "Engine steps (batches) run", role, s.num_steps)
    m = s.metrics
    finished = CounterMetricFamily("pd_worker_requests_finished", "Requests finished, by finish reason",
                                   labels=["role", "reason"])
    for reason, n in sorted(m.finished.copy().items()):
        finished.add_metric([role, reason], n)
    yield finished
    failed = CounterMetricFamily("pd_worker_requests_failed", "Requests that ended in an error, by error code",
                                 labels=["role", "code"])
    for code, n in sorted(m.failed.copy().items()):
        failed.add_metric([role, code], n)
    yield failed
    yield _histogram("pd_worker_step_batch_size", "Sequences per engine step", role, m.step_batch_size)
    yield _histogram("pd_worker_step_duration_seconds", "Engine forward time per step", role, m.step_seconds)


def _grammar_metrics(role: str, s: Scheduler) -> Iterator[Metric]:
    """Constrained decoding (an engine that compiles grammars): ``--grammar-timeout-s`` failures, and the compile
    threads as the engine's ``Constraints`` has them now."""
    wait = s.grammar_wait
    assert wait is not None
    timed_out = CounterMetricFamily("pd_worker_grammar_timeouts", "Requests failed at --grammar-timeout-s, by the "
                                    "code they failed with (bad_request: a slow compile; overloaded: queued "
                                    "behind busy compile threads)", labels=["role", "outcome"])
    for outcome, n in sorted(wait.timed_out.copy().items()):
        timed_out.add_metric([role, outcome], n)
    yield timed_out
    load = getattr(getattr(s.engine, "constraints", None), "compile_load", None)
    if load is not None:
        busy, queued = load()
        yield _gauge("pd_worker_grammar_compile_threads_busy", "Grammar compile threads running a compile", role, busy)
        yield _gauge("pd_worker_grammar_compiles_queued", "Grammar compiles waiting for a free compile thread", role,
                     queued)


def _transfer_metrics(role: str, s: Scheduler, kv: Any) -> Iterator[Metric]:
    if role == "both":
        return
    counters = getattr(kv, "counters", None)
    sent = int(getattr(counters, "num_bytes_sent", 0))
    received = s.metrics.kv_bytes_received
    transfer_bytes = CounterMetricFamily("pd_worker_kv_transfer_bytes", "KV cache bytes moved between workers",
                                         labels=["role", "direction"])
    if role == "prefill":
        transfer_bytes.add_metric([role, "sent"], sent)
    else:
        transfer_bytes.add_metric([role, "received"], received)
    yield transfer_bytes
    rooms = CounterMetricFamily("pd_worker_kv_transfer_rooms", "KV transfer rooms by outcome",
                                labels=["role", "outcome"])
    rooms.add_metric([role, "completed"], int(getattr(counters, "num_rooms_completed", 0)))
    rooms.add_metric([role, "failed"], int(getattr(counters, "num_rooms_failed", 0)))
    rooms.add_metric([role, "aborted"], int(getattr(counters, "num_rooms_aborted", 0)))
    yield rooms
    if role == "decode":
        yield _counter(  # (labelled role, as every worker sample: docs/operations.md)
            "pd_worker_kv_quarantine_expired_rooms", "Failed KV rooms whose pages were given back at "
            "--quarantine-timeout-s without their silent prefill confirming that none of its writes can still land",
            role, int(getattr(counters, "num_rooms_unquiesced_released", 0)))
    refused = getattr(kv, "num_peers_refused", None)
    if refused is not None:  # (transfer.auth: with a worker key, peers that did not prove it)
        peers_refused = CounterMetricFamily(
            "pd_worker_kv_peers_refused", "KV control and tcp data connections refused for not proving the "
            "workers' key (with --api-key)", labels=["role"])
        peers_refused.add_metric([role], int(refused))
        yield peers_refused
    refused_us = getattr(kv, "num_refused_by_peers", None)
    if refused_us is not None:  # (the other way round: a peer with another key, or none, refused this worker)
        refused_by_peers = CounterMetricFamily(
            "pd_worker_kv_peers_refused_us", "KV control and tcp data connections of this worker that the peer "
            "refused (its workers' key differs, or it refused the registration)", labels=["role"])
        refused_by_peers.add_metric([role], int(refused_us))
        yield refused_by_peers
    paths = getattr(getattr(kv, "backend", None), "peer_paths", None)
    if role == "prefill" and paths is not None:  # transfer.shm: decodes written through shared memory or not
        peers = GaugeMetricFamily("pd_worker_kv_peers", "Decodes connected for KV, by data path (shm = same host)",
                                  labels=["role", "path"])
        for path, n in sorted(paths().items()):
            peers.add_metric([role, path], n)
        yield peers
    if role == "prefill":
        yield _histogram("pd_worker_kv_transfer_duration_seconds",
                         "KV transfer of a room, first chunk posted to every write done", role,
                         s.metrics.kv_transfer_seconds)


def create_registry(worker: WorkerView) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(WorkerCollector(worker))
    return registry
