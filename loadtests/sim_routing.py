"""Routing-quality simulator: the real gateway policies over simulated prefill/decode workers.

Pure Python, no servers, virtual time: a discrete-event simulation (one heap, deterministic for a given
``--seed``) that drives the gateway's own routing code path:

- policies are built with ``create_policy`` and wrapped in the real ``Router`` (one joint instance, so
  ``on_*`` hooks run and ``Router.dispatched`` writes the prefix index's "assumed cached" entries);
- the gateway's view of each worker is a real ``WorkerState`` fed with simulated ``LoadReport``s (and the
  gateway's own ``dispatched`` / ``ended`` calls, as ``dispatch.py`` makes them);
- the prefix index is the real ``PrefixIndex`` fed with simulated ``KVEvents`` (chained page hashes of
  ``workers.page_cache.page_hashes``, page size 16).
Both get the simulator's virtual clock. Requests are ``RequestInfo`` objects whose page hashes are
precomputed once per conversation (the same list ``page_hashes`` returns; ``SimRequest``).

Workload (generated from the seed): tenants with a long system prompt (unique random tokens from a
256-id vocabulary, so hashes of different tenants never collide) and Zipf-skewed popularity; multi-turn
conversations (Poisson arrivals): turn k+1's prompt = system prompt + every earlier user message and
answer + a new user message, so it extends turn k's prompt; it arrives when turn k has completed plus an
exponential think time. Every answer is exactly ``max_tokens`` long.

Worker models:
- prefill: FIFO, one request at a time, ``overhead + uncached tokens / speed`` seconds; a KV pool of C
  pages that doubles as an LRU prefix cache, modelled on ``PageCache``: at admission the longest run of
  the prompt's (len-1)//16 page hashes present is a hit (pinned), pages for the rest are allocated,
  evicting least-recently-used unpinned pages; at completion the prompt's full pages are published and
  all its pages released last page first, as ``PageCache.release`` does (so a prefix is evicted from
  its end; ``--evict head`` releases them in page order instead, cutting prefixes at their head, to
  show the difference). KV events reach the gateway 5 ms
  later; load reports when a request ended (<= every 2 ms), admitted or moved on (within 10 ms, or with the
  next report), every 100 ms while busy, every 500 ms idle, 1 ms later.
- decode: KV pool of P pages; a request reserves ceil((prompt + max_tokens)/16) pages, FIFO, when its KV
  has arrived (it waits while there are not enough free pages or ``max_running`` sequences run); until
  then its pages count as ``num_queued_pages``. Steps take ``base + per_seq * batch``; each sequence in a
  step gets one token; new sequences join at the next step; pages are freed when the last token is out.
  (Simplified: a real decode reserves the pages before the prefill starts, in its prealloc queue.)
- KV transfer: 1 ms + 1 us per prompt token. Gateway <-> worker messages: 0.5 ms. The gateway re-checks
  report freshness every ``REFRESH_INTERVAL_S`` (``WorkerState.refresh``), as the real one does.

Definitions (per policy run; "window" = first to last request arrival, so ramp-down is left out):
- hit: cached prompt tokens at prefill admission / prompt tokens (all requests).
- oracle: one pooled LRU cache with the sum of all prefill workers' pages, fed the same prompts in that
  run's arrival order, computing instantly (no load limits); the ORACLE line shows its mean over the runs.
- P-busy: mean over prefill workers of their busy time in the window / the window's length.
- P-imb: max/mean over prefill workers of that busy fraction; a slower worker is busier for the same
  tokens, so this is load normalized by capacity (1.0 = every worker equally busy). An idle slow worker
  raises it too, which is why its goal line is printed for scenario (a) only.
- D-imb: max/mean over decode workers of the time-averaged share of their KV pages in use (window).
- TTFT: arrival at the gateway -> first token back (prefill queue + compute + transfer + decode admission
  + first step); E2E: arrival -> last token back. p50/p99 over all requests, in ms.
- share: percentage of requests per worker (prefill workers, then decode workers).
Goal lines: cache_aware >= 90% of the oracle's hit rate (same run's arrival order) with P-imb <= 1.3 in
(a); power_of_two and ratio_aware beat random on TTFT p99 or E2E p99 in every scenario.

Run (all scenarios, the five built-in policies; any policy name or ``module:attr`` in ``--policies``):

    .venv/bin/python loadtests/sim_routing.py [--scenario a|b|c|all] [--requests N] [--seed S]
        [--policies random,cache_aware] [--policy-option cache_weight=3 ...] [--evict head|tail]

Scenarios: (a) 4 prefill + 2 decode, many tenants whose system prompts exceed one prefill cache but fit
in the four; (b) 3 prefill, one 4x slower, few shared prompts; (c) 2 decodes with 4x different KV
capacity under long generations (decode-bound).
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import math
import random
import sys
import time
from array import array
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from gateway.policies.base import Pair, PrefixLookup, RequestInfo, WorkerView  # noqa: E402
from gateway.policies.loader import PolicyError, create_policy, load_policy_class, option_names  # noqa: E402
from gateway.prefix_index import PrefixIndex  # noqa: E402
from gateway.router import Router  # noqa: E402
from gateway.worker_state import REFRESH_INTERVAL_S, WorkerState  # noqa: E402
from workers.page_cache import page_hashes  # noqa: E402
from workers.plugins import PluginError  # noqa: E402
from workers.protocol import PROTOCOL_VERSION, HelloAck, KVEvents, LoadReport  # noqa: E402

PAGE = 16
DEFAULT_POLICIES = ("random", "round_robin", "power_of_two", "cache_aware", "ratio_aware")
MSG_LAG_S = 0.0005  # gateway <-> worker submit / outputs
REPORT_LAG_S = 0.001
KV_EVENT_LAG_S = 0.005
REPORT_MIN_INTERVAL_S = 0.002
MOVED_REPORT_S = 0.01
BUSY_REPORT_S = 0.1
IDLE_REPORT_S = 0.5
BUSY_WINDOW_S = 1.0
PREFILL_OVERHEAD_S = 0.003
TRANSFER_BASE_S = 0.001
TRANSFER_PER_TOKEN_S = 1e-6


# -- configuration ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class WorkloadSpec:
    num_tenants: int
    zipf_s: float  # tenant popularity ~ 1 / rank**zipf_s
    system_tokens: tuple[int, int]  # uniform range, per tenant
    turns: tuple[int, int]  # uniform range, per conversation
    user_tokens: tuple[int, int]  # per user message
    answer_tokens: tuple[int, int]  # max_tokens per turn (answers are exactly this long)
    think_s: float  # mean think time between a turn's completion and the next turn
    conv_rate: float  # new conversations per second (Poisson)
    max_context: int = 12288  # a conversation ends before a prompt + answer would exceed this


@dataclass(frozen=True)
class PrefillSpec:
    speed: float  # prompt tokens per second
    cache_pages: int  # KV pool = prefix cache capacity, in pages


@dataclass(frozen=True)
class DecodeSpec:
    pages: int
    max_running: int = 256
    step_base_s: float = 0.010
    step_per_seq_s: float = 0.0002


@dataclass(frozen=True)
class Scenario:
    key: str
    title: str
    prefills: tuple[PrefillSpec, ...]
    decodes: tuple[DecodeSpec, ...]
    workload: WorkloadSpec
    requests: int
    goals: tuple[str, ...] = ("power_of_two", "ratio_aware")  # policies whose goal lines this scenario prints


SCENARIOS: dict[str, Scenario] = {
    "a": Scenario(
        "a", "4 prefill + 2 decode; 60 tenants, system prompts ~3x one prefill cache, ~0.75x all four",
        prefills=(PrefillSpec(12000, 2500),) * 4,
        decodes=(DecodeSpec(16000),) * 2,
        workload=WorkloadSpec(num_tenants=60, zipf_s=0.9, system_tokens=(1000, 3000), turns=(1, 6),
                              user_tokens=(30, 200), answer_tokens=(50, 250), think_s=4.0, conv_rate=11.0),
        requests=2000, goals=("cache_aware", "power_of_two", "ratio_aware")),
    "b": Scenario(
        "b", "3 prefill, prefill-2 4x slower; 4 tenants sharing long system prompts",
        prefills=(PrefillSpec(12000, 4000), PrefillSpec(12000, 4000), PrefillSpec(3000, 4000)),
        decodes=(DecodeSpec(16000),) * 2,
        workload=WorkloadSpec(num_tenants=4, zipf_s=1.0, system_tokens=(2000, 3000), turns=(1, 3),
                              user_tokens=(200, 1200), answer_tokens=(50, 200), think_s=3.0, conv_rate=5.0),
        requests=1500),
    "c": Scenario(
        "c", "2 prefill + 2 decode, decode KV 3000 vs 12000 pages; long generations (decode-bound)",
        prefills=(PrefillSpec(20000, 4000),) * 2,
        decodes=(DecodeSpec(3000), DecodeSpec(12000)),
        workload=WorkloadSpec(num_tenants=8, zipf_s=1.0, system_tokens=(500, 1000), turns=(1, 2),
                              user_tokens=(100, 500), answer_tokens=(800, 1600), think_s=5.0, conv_rate=1.8),
        requests=600),
}


# -- workload ---------------------------------------------------------------------------------------
@dataclass
class Conversation:
    cid: int
    tenant: int
    start_s: float
    transcript: array  # system prompt, then user message / answer of each turn
    hashes: list[bytes]  # chained page hashes of every full page of the transcript
    prompt_lens: list[int]
    max_tokens: list[int]
    think_s: list[float]  # before each turn (turn 0: unused)


def _tokens(rng: random.Random, n: int) -> array:
    return array("q", list(rng.randbytes(n)))


def make_workload(spec: WorkloadSpec, num_requests: int, seed: int) -> list[Conversation]:
    """Conversations whose turns add up to ``num_requests`` requests (deterministic for ``seed``)."""
    rng = random.Random(seed)
    systems = [_tokens(rng, rng.randint(*spec.system_tokens)) for _ in range(spec.num_tenants)]
    weights = list(itertools.accumulate(1.0 / (k + 1) ** spec.zipf_s for k in range(spec.num_tenants)))
    tenant_order = list(range(spec.num_tenants))
    rng.shuffle(tenant_order)  # popularity rank independent of prompt length
    convs: list[Conversation] = []
    total, t = 0, 0.0
    while total < num_requests:
        t += rng.expovariate(spec.conv_rate)
        tenant = tenant_order[rng.choices(range(spec.num_tenants), cum_weights=weights)[0]]
        transcript = array("q", systems[tenant])
        lens: list[int] = []
        max_tokens: list[int] = []
        thinks: list[float] = []
        for _ in range(min(rng.randint(*spec.turns), num_requests - total)):
            user = _tokens(rng, rng.randint(*spec.user_tokens))
            answer = rng.randint(*spec.answer_tokens)
            if len(transcript) + len(user) + answer > spec.max_context:
                break
            transcript.extend(user)
            lens.append(len(transcript))
            max_tokens.append(answer)
            thinks.append(rng.expovariate(1.0 / spec.think_s))
            transcript.extend(_tokens(rng, answer))
        if not lens:
            continue
        convs.append(Conversation(len(convs), tenant, t, transcript, page_hashes(transcript, PAGE), lens,
                                  max_tokens, thinks))
        total += len(lens)
    return convs


class SimRequest(RequestInfo):
    """``RequestInfo`` with the prompt's page hashes supplied (equal to what ``page_hashes`` computes)."""

    __slots__ = ("_pre",)

    def __init__(self, input_ids: Sequence[int], max_new_tokens: int, lookup: PrefixLookup,
                 hashes: list[bytes]) -> None:
        super().__init__(input_ids, max_new_tokens, lookup)
        self._pre = hashes

    def page_hashes(self, page_size: int) -> list[bytes]:
        if page_size == PAGE and page_size not in self._hashes:
            self._hashes[page_size] = self._pre
        return super().page_hashes(page_size)


class Job:
    """One request (one conversation turn) through gateway, prefill and decode."""

    __slots__ = ("arrival_s", "conv", "d", "done_s", "est_cached", "first_s", "hit_tokens", "info",
                 "max_tokens", "p", "pages", "pair", "predicted", "prompt_len", "rid_d", "rid_p", "run_end_s", "run_s",
                 "turn", "uncached")

    def __init__(self, conv: Conversation, turn: int, arrival_s: float) -> None:
        self.conv, self.turn, self.arrival_s = conv, turn, arrival_s
        self.prompt_len = conv.prompt_lens[turn]
        self.max_tokens = conv.max_tokens[turn]
        self.info: SimRequest | None = None
        self.pair: Pair | None = None
        self.p = self.d = self.rid_p = self.rid_d = self.pages = 0
        self.est_cached = self.hit_tokens = self.uncached = self.predicted = 0
        self.run_s = self.run_end_s = 0.0
        self.first_s = self.done_s = math.nan

    @property
    def lookup_hashes(self) -> list[bytes]:  # what PageCache.match may serve: (len-1)//page pages
        return self.conv.hashes[: (self.prompt_len - 1) // PAGE]

    @property
    def full_hashes(self) -> list[bytes]:  # what PageCache.insert publishes: every full prompt page
        return self.conv.hashes[: self.prompt_len // PAGE]


# -- the event loop ---------------------------------------------------------------------------------
class Loop:
    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[..., None], tuple[Any, ...]]] = []
        self._seq = itertools.count()

    def clock(self) -> float:
        return self.now

    def at(self, t: float, fn: Callable[..., None], *args: Any) -> None:
        heapq.heappush(self._heap, (t, next(self._seq), fn, args))

    def run(self) -> None:
        heap = self._heap
        while heap:
            t, _, fn, args = heapq.heappop(heap)
            self.now = t
            fn(*args)


class Worker:
    """Shared by both roles: rids, busy accounting, load-report cadence."""

    role = ""

    def __init__(self, sim: Sim, idx: int, url: str, num_pages: int) -> None:
        self.sim, self.idx, self.url = sim, idx, url
        self.state = WorkerState(url, self.role, clock=sim.loop.clock)
        self.state.connected(HelloAck(PROTOCOL_VERSION, url, self.role, "sim", "sim", "byte", PAGE, 1 << 20,
                                      num_pages))
        self.num_pages = num_pages
        self.next_rid = itertools.count(1)
        self.last_rid = 0
        self.busy_total = 0.0
        self.busy_since: float | None = None
        self.busy_at_report = 0.0
        self.busy_fraction = 0.0
        self.last_report = -1.0
        self.flush_pending = False
        self.moved_pending = False  # a report is armed for an admission or a stage move
        self.has_moved = False  # one happened since the last report
        self.tick_pending = False
        self.num_requests = 0

    # busy time
    def set_busy(self, busy: bool) -> None:
        now = self.sim.loop.now
        if busy and self.busy_since is None:
            self.busy_since = now
        elif not busy and self.busy_since is not None:
            self.busy_total += now - self.busy_since
            self.busy_since = None

    def busy_until_now(self) -> float:
        extra = self.sim.loop.now - self.busy_since if self.busy_since is not None else 0.0
        return self.busy_total + extra

    # load reports
    def has_work(self) -> bool:
        raise NotImplementedError

    def load_report(self) -> LoadReport:
        raise NotImplementedError

    def changed(self) -> None:
        loop = self.sim.loop
        if loop.now - self.last_report >= REPORT_MIN_INTERVAL_S:
            self.report()
        elif not self.flush_pending:
            self.flush_pending = True
            loop.at(self.last_report + REPORT_MIN_INTERVAL_S, self._flush)

    def _flush(self) -> None:
        self.flush_pending = False
        self.report()

    def moved(self) -> None:
        """An admission or a stage move (the worker's ``_load_moved``): reported with the next report, or
        ``MOVED_REPORT_S`` after the last one at the latest."""
        self.has_moved = True
        loop = self.sim.loop
        if loop.now - self.last_report >= MOVED_REPORT_S - 1e-12:
            self.report()
        elif not self.moved_pending:
            self.moved_pending = True
            loop.at(self.last_report + MOVED_REPORT_S, self._moved_due)

    def _moved_due(self) -> None:
        self.moved_pending = False
        if self.has_moved:  # (else a report went since)
            self.moved()

    def report(self) -> None:
        loop = self.sim.loop
        since = loop.now - self.last_report if self.last_report >= 0 else BUSY_WINDOW_S
        busy = self.busy_until_now()
        if since > 0:
            weight = min(1.0, since / BUSY_WINDOW_S)
            self.busy_fraction += weight * (min(1.0, (busy - self.busy_at_report) / since) - self.busy_fraction)
        self.busy_at_report = busy
        self.last_report = loop.now
        self.has_moved = False
        loop.at(loop.now + REPORT_LAG_S, self.state.reported, self.load_report())
        self._arm_tick()

    def _arm_tick(self) -> None:
        if not self.tick_pending and not self.sim.finished:
            self.tick_pending = True
            period = BUSY_REPORT_S if self.has_work() else IDLE_REPORT_S
            self.sim.loop.at(self.last_report + period, self._tick)

    def _tick(self) -> None:
        self.tick_pending = False
        if self.sim.finished:
            return
        period = BUSY_REPORT_S if self.has_work() else IDLE_REPORT_S
        if self.sim.loop.now - self.last_report >= period - 1e-12:
            self.report()
        else:
            self._arm_tick()


class PrefillWorker(Worker):
    role = "prefill"

    def __init__(self, sim: Sim, idx: int, spec: PrefillSpec) -> None:
        super().__init__(sim, idx, f"prefill-{idx}", spec.cache_pages)
        self.speed = spec.speed
        self.lru: OrderedDict[bytes, None] = OrderedDict()  # evictable cached pages, oldest first
        self.pinned: dict[bytes, None] = {}  # cached pages the running request uses
        self.allocated = 0  # fresh pages of the running request
        self.queue: deque[Job] = deque()
        self.queued_tokens = 0
        self.running: Job | None = None
        self.measured = False
        self.hit_tokens = 0
        self.prompt_tokens = 0

    def has_work(self) -> bool:
        return self.running is not None or bool(self.queue)

    def cached_tokens(self, hashes: Sequence[bytes]) -> int:
        n = 0
        for h in hashes:
            if h not in self.lru and h not in self.pinned:
                break
            n += 1
        return n * PAGE

    def receive(self, job: Job) -> None:
        job.est_cached = self.cached_tokens(job.lookup_hashes)
        self.queue.append(job)
        self.queued_tokens += job.prompt_len - job.est_cached
        self.last_rid = job.rid_p
        if self.running is None:
            self._start()
        self.moved()

    def _start(self) -> None:
        job = self.queue.popleft()
        self.queued_tokens -= job.prompt_len - job.est_cached
        hashes = job.lookup_hashes
        hit = 0
        for h in hashes:
            if h not in self.lru:
                break
            hit += 1
        for h in hashes[:hit]:
            del self.lru[h]
            self.pinned[h] = None
        need = -(-job.prompt_len // PAGE) - hit
        removed: list[bytes] = []
        while self.lru and len(self.lru) + len(self.pinned) + need > self.num_pages:
            removed.append(self.lru.popitem(last=False)[0])
        self.allocated = need
        if removed:
            self.sim.loop.at(self.sim.loop.now + KV_EVENT_LAG_S, self.sim.kv_events, self, KVEvents(removed=removed))
        job.hit_tokens = hit * PAGE
        job.uncached = job.prompt_len - job.hit_tokens
        self.hit_tokens += job.hit_tokens
        self.prompt_tokens += job.prompt_len
        job.run_s = self.sim.loop.now
        job.run_end_s = job.run_s + PREFILL_OVERHEAD_S + job.uncached / self.speed
        self.running = job
        self.set_busy(True)
        self.sim.loop.at(job.run_end_s, self._finish, job)

    def _finish(self, job: Job) -> None:
        loop = self.sim.loop
        full = job.full_hashes
        hit = job.hit_tokens // PAGE
        stored = [h for h in full[hit:] if h not in self.lru]
        order = [*full[:hit], *stored]
        if self.sim.evict_tail_first:
            order.reverse()
        for h in order:
            self.lru[h] = None
        self.pinned.clear()
        self.allocated = 0
        if stored:
            loop.at(loop.now + KV_EVENT_LAG_S, self.sim.kv_events, self, KVEvents(stored=stored))
        self.running = None
        self.measured = True
        self.set_busy(False)
        transfer_s = TRANSFER_BASE_S + TRANSFER_PER_TOKEN_S * job.prompt_len
        loop.at(loop.now + transfer_s, self.sim.decodes[job.d].kv_arrived, job)
        loop.at(loop.now + transfer_s + MSG_LAG_S, self.state.ended, job.rid_p)
        if self.queue:
            self._start()
        self.changed()

    def load_report(self) -> LoadReport:
        now = self.sim.loop.now
        running = 0
        job = self.running
        if job is not None and job.run_end_s > job.run_s:
            running = round(job.uncached * max(0.0, job.run_end_s - now) / (job.run_end_s - job.run_s))
        return LoadReport(
            num_running=int(job is not None), num_waiting=len(self.queue),
            num_free_pages=self.num_pages - len(self.pinned) - self.allocated, num_total_pages=self.num_pages,
            num_prefill_tokens=self.queued_tokens + running, last_rid=self.last_rid,
            prefill_tokens_per_s=self.speed if self.measured else 0.0, max_running=1,
            busy_fraction=round(self.busy_fraction, 4))


class DecodeWorker(Worker):
    role = "decode"

    def __init__(self, sim: Sim, idx: int, spec: DecodeSpec) -> None:
        super().__init__(sim, idx, f"decode-{idx}", spec.pages)
        self.spec = spec
        self.pending: dict[int, Job] = {}  # dispatched, KV not here yet
        self.queue: deque[Job] = deque()  # KV here, waiting for pages or a batch slot
        self.queued_pages = 0  # pages of pending + queue
        self.used = 0
        self.num_running = 0
        self.stepping = False
        self.step = 0  # number of the step running (or the next one when idle)
        self.batch = 0  # sequences in the running step
        self.joins: dict[int, int] = {}  # step -> sequences that join at it
        self.first_at: dict[int, list[Job]] = {}
        self.finish_at: dict[int, list[Job]] = {}
        self.kv_area = 0.0  # integral of used pages over time
        self.kv_since = 0.0

    def has_work(self) -> bool:
        return bool(self.num_running or self.pending or self.queue)

    def _account(self) -> None:
        now = self.sim.loop.now
        self.kv_area += self.used * (now - self.kv_since)
        self.kv_since = now

    def receive(self, job: Job) -> None:
        self.pending[job.rid_d] = job
        self.queued_pages += job.pages
        self.last_rid = job.rid_d
        self.moved()

    def kv_arrived(self, job: Job) -> None:
        del self.pending[job.rid_d]
        self.queue.append(job)
        self._admit()
        self.moved()

    def _admit(self) -> None:
        spec = self.spec
        while self.queue and self.queue[0].pages <= self.num_pages - self.used and self.num_running < spec.max_running:
            job = self.queue.popleft()
            self.queued_pages -= job.pages
            self._account()
            self.used += job.pages
            self.num_running += 1
            join = self.step + 1 if self.stepping else self.step
            self.joins[join] = self.joins.get(join, 0) + 1
            self.first_at.setdefault(join, []).append(job)
            self.finish_at.setdefault(join + job.max_tokens - 1, []).append(job)
        if not self.stepping and self.joins.get(self.step):
            self._start_step()

    def _start_step(self) -> None:
        self.stepping = True
        self.set_busy(True)
        self.batch += self.joins.pop(self.step, 0)
        spec = self.spec
        self.sim.loop.at(self.sim.loop.now + spec.step_base_s + spec.step_per_seq_s * self.batch, self._end_step)

    def _end_step(self) -> None:
        now = self.sim.loop.now
        k = self.step
        for job in self.first_at.pop(k, ()):
            job.first_s = now + MSG_LAG_S
        done = self.finish_at.pop(k, [])
        if done:
            self._account()
            for job in done:
                self.used -= job.pages
                self.num_running -= 1
                self.sim.loop.at(now + MSG_LAG_S, self.sim.finished_job, job)
            self.batch -= len(done)
        self.step += 1
        self.stepping = False
        if done:
            self._admit()
            self.changed()
        if not self.stepping:
            if self.batch or self.joins.get(self.step):
                self._start_step()
            else:
                self.set_busy(False)

    def load_report(self) -> LoadReport:
        return LoadReport(
            num_running=self.num_running, num_waiting=len(self.pending) + len(self.queue),
            num_free_pages=self.num_pages - self.used, num_total_pages=self.num_pages, last_rid=self.last_rid,
            max_running=self.spec.max_running, num_queued_pages=self.queued_pages,
            busy_fraction=round(self.busy_fraction, 4))


# -- one run --------------------------------------------------------------------------------------
@dataclass
class RunResult:
    policy: str
    num_requests: int
    hit_rate: float
    oracle_hit_rate: float
    prefill_busy: list[float]
    decode_kv: list[float]
    ttft_ms: list[float]
    e2e_ms: list[float]
    prefill_share: list[float]
    decode_share: list[float]
    duration_s: float
    wall_s: float
    stats: dict[str, float] = field(default_factory=dict)

    @property
    def prefill_imbalance(self) -> float:
        return _imbalance(self.prefill_busy)

    @property
    def decode_imbalance(self) -> float:
        return _imbalance(self.decode_kv)

    def ttft(self, q: float) -> float:
        return _percentile(self.ttft_ms, q)

    def e2e(self, q: float) -> float:
        return _percentile(self.e2e_ms, q)


def _imbalance(values: list[float]) -> float:
    mean = sum(values) / len(values) if values else 0.0
    return max(values) / mean if mean > 0 else 1.0


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


def oracle_hit_rate(jobs: Sequence[Job], capacity: int, tail_first: bool = False) -> float:
    """A pooled LRU of ``capacity`` pages fed ``jobs`` in order, computing each prompt instantly."""
    lru: OrderedDict[bytes, None] = OrderedDict()
    hit_tokens = prompt_tokens = 0
    for job in jobs:
        hit = 0
        for h in job.lookup_hashes:
            if h not in lru:
                break
            hit += 1
        hit_tokens += hit * PAGE
        prompt_tokens += job.prompt_len
        full = job.full_hashes
        order = [*full[:hit], *(h for h in full[hit:] if h not in lru)]
        if tail_first:
            order.reverse()
        for h in order:
            lru.pop(h, None)
            lru[h] = None
        while len(lru) > capacity:
            lru.popitem(last=False)
    return hit_tokens / prompt_tokens if prompt_tokens else 0.0


class Sim:
    def __init__(self, scenario: Scenario, convs: list[Conversation], policy_name: str,
                 options: dict[str, str] | None = None, *, seed: int = 0, evict_tail_first: bool = True) -> None:
        self.scenario = scenario
        self.convs = convs
        self.loop = Loop()
        self.finished = False
        self.evict_tail_first = evict_tail_first
        self.index = PrefixIndex(clock=self.loop.clock)
        policy = create_policy(policy_name, policy_options(policy_name, options or {}, seed))
        self.router = Router(policy, policy, self.index)
        self.prefills = [PrefillWorker(self, i, s) for i, s in enumerate(scenario.prefills)]
        self.decodes = [DecodeWorker(self, i, s) for i, s in enumerate(scenario.decodes)]
        self._prefill_views: list[WorkerView] = [w.state for w in self.prefills]
        self._decode_views: list[WorkerView] = [w.state for w in self.decodes]
        self._by_url: dict[str, Worker] = {w.url: w for w in (*self.prefills, *self.decodes)}
        self.jobs: list[Job] = []
        self.remaining = sum(len(c.prompt_lens) for c in convs)
        self.end_s = 0.0
        # Utilization is measured over the arrival window (first to last arrival): snapshots at each arrival.
        self.window: tuple[float, float] | None = None
        self.window_busy: list[float] = []
        self.window_kv: list[float] = []

    def run(self) -> RunResult:
        wall = time.perf_counter()
        loop = self.loop
        for w in (*self.prefills, *self.decodes):
            self.router.worker_added(w.state)
            self.router.kv_events(w.state, KVEvents(reset=True))
            w.report()
        for conv in self.convs:
            loop.at(conv.start_s, self.arrive, conv, 0)
        loop.at(REFRESH_INTERVAL_S, self._refresh)
        loop.run()
        return self._result(time.perf_counter() - wall)

    # gateway side
    def arrive(self, conv: Conversation, turn: int) -> None:
        loop = self.loop
        job = Job(conv, turn, loop.now)
        self.jobs.append(job)
        self._snapshot()
        info = SimRequest(conv.transcript[: job.prompt_len], job.max_tokens, self.index, job.lookup_hashes)
        pair = self.router.select(self._prefill_views, self._decode_views, info)
        if pair.prefill is None:
            raise RuntimeError(f"policy {self.router.name} chose no prefill worker")
        prefill, decode = self._by_url[pair.prefill.url], self._by_url[pair.decode.url]
        if not isinstance(prefill, PrefillWorker) or not isinstance(decode, DecodeWorker):
            raise RuntimeError(f"policy {self.router.name} returned {pair!r}")
        job.info, job.pair, job.p, job.d = info, pair, prefill.idx, decode.idx
        prompt_tokens = job.prompt_len
        if info.has_page_hashes:  # as dispatch.py: count only the uncached part
            job.predicted = info.num_cached_tokens(prefill.state)
            prompt_tokens -= job.predicted
        job.pages = info.num_pages_needed(decode.state.page_size)
        job.rid_d = next(decode.next_rid)
        decode.state.dispatched(job.rid_d, 0, job.pages)
        job.rid_p = next(prefill.next_rid)
        prefill.state.dispatched(job.rid_p, prompt_tokens, 0)
        self.router.dispatched(pair, info)
        prefill.num_requests += 1
        decode.num_requests += 1
        loop.at(loop.now + MSG_LAG_S, decode.receive, job)
        loop.at(loop.now + MSG_LAG_S, prefill.receive, job)

    def _refresh(self) -> None:  # as the gateway's load-freshness task
        if self.finished:
            return
        for w in (*self.prefills, *self.decodes):
            w.state.refresh()
        self.loop.at(self.loop.now + REFRESH_INTERVAL_S, self._refresh)

    def _snapshot(self) -> None:
        now = self.loop.now
        self.window = (self.window[0] if self.window else now, now)
        self.window_busy = [w.busy_until_now() for w in self.prefills]
        for w in self.decodes:
            w._account()
        self.window_kv = [w.kv_area for w in self.decodes]

    def kv_events(self, worker: PrefillWorker, events: KVEvents) -> None:
        self.router.kv_events(worker.state, events)

    def finished_job(self, job: Job) -> None:
        now = self.loop.now
        job.done_s = now
        self.decodes[job.d].state.ended(job.rid_d)
        assert job.pair is not None and job.info is not None
        self.router.finished(job.pair, job.info, "finished")
        job.info = None  # its prompt copy is no longer needed
        self.remaining -= 1
        self.end_s = max(self.end_s, now)
        conv = job.conv
        if job.turn + 1 < len(conv.prompt_lens):
            self.loop.at(now + conv.think_s[job.turn + 1], self.arrive, conv, job.turn + 1)
        if self.remaining == 0:
            self.finished = True

    def _result(self, wall_s: float) -> RunResult:
        jobs = self.jobs
        n = len(jobs)
        start, end = self.window or (0.0, 0.0)
        span = end - start or 1.0
        capacity = sum(s.cache_pages for s in self.scenario.prefills)
        prompt = sum(w.prompt_tokens for w in self.prefills)
        return RunResult(
            policy=self.router.name, num_requests=n,
            hit_rate=sum(w.hit_tokens for w in self.prefills) / prompt if prompt else 0.0,
            oracle_hit_rate=oracle_hit_rate(jobs, capacity, self.evict_tail_first),
            prefill_busy=[b / span for b in self.window_busy],
            decode_kv=[a / (w.num_pages * span) for a, w in zip(self.window_kv, self.decodes, strict=True)],
            ttft_ms=[(j.first_s - j.arrival_s) * 1e3 for j in jobs],
            e2e_ms=[(j.done_s - j.arrival_s) * 1e3 for j in jobs],
            prefill_share=[w.num_requests / n for w in self.prefills],
            decode_share=[w.num_requests / n for w in self.decodes],
            duration_s=self.end_s, wall_s=wall_s, stats=self.router.stats())


def policy_options(name: str, options: dict[str, str], seed: int) -> dict[str, str]:
    """The options ``name`` declares (a ``seed`` option defaults to the run's seed)."""
    accepted = option_names(load_policy_class(name))
    mine = {k: v for k, v in options.items() if k in accepted}
    if "seed" in accepted and "seed" not in mine:
        mine["seed"] = str(seed)
    return mine


# -- scenarios ----------------------------------------------------------------------------------------
@dataclass
class ScenarioResult:
    scenario: Scenario
    runs: dict[str, RunResult]

    @property
    def oracle_hit_rate(self) -> float:
        rates = [r.oracle_hit_rate for r in self.runs.values()]
        return sum(rates) / len(rates) if rates else 0.0


def run_scenario(key: str, policies: Sequence[str] = DEFAULT_POLICIES, *, requests: int | None = None,
                 seed: int = 0, options: dict[str, str] | None = None, evict_tail_first: bool = True,
                 ) -> ScenarioResult:
    scenario = SCENARIOS[key]
    options = options or {}
    unknown = [k for k in options if not any(k in option_names(load_policy_class(p)) for p in policies)]
    if unknown:
        raise PolicyError(f"unknown policy option(s) {', '.join(unknown)} for policies {', '.join(policies)}")
    convs = make_workload(scenario.workload, requests or scenario.requests, seed)
    runs = {}
    for name in policies:
        sim = Sim(scenario, convs, name, options, seed=seed, evict_tail_first=evict_tail_first)
        runs[name] = sim.run()
    return ScenarioResult(scenario, runs)


def _pct(xs: Sequence[float]) -> str:
    return "/".join(f"{100 * x:.0f}" for x in xs)


def format_result(res: ScenarioResult) -> str:
    sc = res.scenario
    speeds = "/".join(f"{s.speed / 1000:g}k" for s in sc.prefills)
    caches = "/".join(str(s.cache_pages) for s in sc.prefills)
    kv = "/".join(str(s.pages) for s in sc.decodes)
    n = next(iter(res.runs.values())).num_requests if res.runs else 0
    lines = [f"== ({sc.key}) {sc.title}",
             f"   {n} requests; prefill tok/s {speeds}, cache pages {caches}; decode KV pages {kv}"]
    wid = max(14, *(len(name) + 2 for name in res.runs))
    head = (f"{'policy':<{wid}}{'hit%':>6}{'P-busy':>7}{'P-imb':>6}{'D-imb':>6}{'TTFT50':>8}{'TTFT99':>8}"
            f"{'E2E50':>8}{'E2E99':>8}  {'prefill%':<13}{'decode%':<8}")
    lines += [head, "-" * len(head)]
    for name, r in res.runs.items():
        busy = sum(r.prefill_busy) / len(r.prefill_busy)
        lines.append(f"{name:<{wid}}{100 * r.hit_rate:>6.1f}{100 * busy:>6.0f}%{r.prefill_imbalance:>6.2f}"
                     f"{r.decode_imbalance:>6.2f}{r.ttft(50):>8.0f}{r.ttft(99):>8.0f}{r.e2e(50):>8.0f}"
                     f"{r.e2e(99):>8.0f}  {_pct(r.prefill_share):<13}{_pct(r.decode_share):<8}")
    if res.runs:
        rates = [r.oracle_hit_rate for r in res.runs.values()]
        lines.append(f"{'ORACLE':<{wid}}{100 * res.oracle_hit_rate:>6.1f}  <- one pooled LRU of "
                     f"{sum(s.cache_pages for s in sc.prefills)} pages (sum of prefill caches), no load limits "
                     f"(range over runs {100 * min(rates):.1f}-{100 * max(rates):.1f})")
    lines += _goals(res)
    return "\n".join(lines)


def _goals(res: ScenarioResult) -> list[str]:
    out = []
    ca = res.runs.get("cache_aware")
    if ca is not None and "cache_aware" in res.scenario.goals:
        share = ca.hit_rate / ca.oracle_hit_rate if ca.oracle_hit_rate else 0.0
        ok = share >= 0.9 and ca.prefill_imbalance <= 1.3
        out.append(f"goal cache_aware hit >= 90% of oracle and P-imb <= 1.3: {100 * share:.0f}% of oracle, "
                   f"P-imb {ca.prefill_imbalance:.2f} -> {'PASS' if ok else 'FAIL'}")
    rnd = res.runs.get("random")
    for name in ("power_of_two", "ratio_aware"):
        r = res.runs.get(name)
        if r is None or rnd is None or name not in res.scenario.goals:
            continue
        ok = r.ttft(99) < rnd.ttft(99) or r.e2e(99) < rnd.e2e(99)
        out.append(f"goal {name} beats random on TTFT p99 or E2E p99: TTFT99 {r.ttft(99):.0f} vs {rnd.ttft(99):.0f}"
                   f", E2E99 {r.e2e(99):.0f} vs {rnd.e2e(99):.0f} -> {'PASS' if ok else 'FAIL'}")
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0] if __doc__ else None)
    ap.add_argument("--scenario", choices=[*SCENARIOS, "all"], default="all")
    ap.add_argument("--requests", type=int, default=None, help="requests per scenario (default: per scenario)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--policies", default=",".join(DEFAULT_POLICIES), help="comma-separated names or module:attr")
    ap.add_argument("--policy-option", action="append", default=[], metavar="K=V",
                    help="passed to every policy that declares K (repeatable)")
    ap.add_argument("--evict", choices=["head", "tail"], default="tail",
                    help="prefix cache release order: tail = last page first, as PageCache; head = page order")
    args = ap.parse_args(argv)
    options: dict[str, str] = {}
    for item in args.policy_option:
        key, sep, value = item.partition("=")
        if not sep or not key:
            ap.error(f"--policy-option: expected K=V, got {item!r}")
        options[key] = value
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    keys = list(SCENARIOS) if args.scenario == "all" else [args.scenario]
    wall = time.perf_counter()
    for key in keys:
        try:
            res = run_scenario(key, policies, requests=args.requests, seed=args.seed, options=options,
                               evict_tail_first=args.evict == "tail")
        except PluginError as exc:  # an unknown policy, or a bad option
            ap.error(str(exc))
        print(format_result(res), "\n", flush=True)
    print(f"simulated in {time.perf_counter() - wall:.1f}s wall")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
