"""Routing policies compared end to end: real sim workers, real gateway, the same seeded workload.

For each scenario and each policy a fresh cluster is started on 127.0.0.1 (bootstrap registry, sim
prefill and decode workers, gateway ``--policy NAME``), so every policy starts from empty caches.
The same seeded open-loop workload (Poisson arrivals at a fixed rate, at most ``--concurrency``
requests in flight) goes through the gateway's ``/v1/completions`` with token-id prompts, streamed
(``stream_options.include_usage``) so TTFT is the first token's arrival. Latencies count from each
request's scheduled arrival, so time spent waiting for a free client slot counts as queueing. The
``sim`` engine sleeps for its modelled compute time (``prefill_token_s`` per prompt token,
``decode_step_s + n * decode_seq_s`` per decode step), so a 2-core machine can host the cluster.
``random`` always runs first: it is the baseline the other columns are read against.

Scenarios:
- ``a`` prefix affinity: 4 prefills + 2 decodes, 24 tenants with 1000-2000-token system prompts
  (about 2250 KV pages in all; one prefill's pool holds about a third of them, the four together
  hold them all), Zipf-skewed tenant popularity, each request = tenant prefix + a short unique
  suffix. ``cache_aware`` should keep each tenant on one prefill: the hit rate (workers' own
  ``/stats`` counters and ``usage.prompt_tokens_details.cached_tokens``) goes up, TTFT goes down.
- ``b`` heterogeneous prefill speed: 2 prefills, one 5x slower per token, unique prompts at a rate
  the fast one could mostly absorb alone. Load-aware policies (``power_of_two``, ``ratio_aware``,
  ``cache_aware``) should send the slow one a small share and cut TTFT p99.
- ``c`` heterogeneous decode capacity: 1 prefill + 2 decodes whose KV pools are 4x apart, long
  generations (max_tokens 192-320; sim tokens never hit EOS, so every request runs to max_tokens),
  so decode KV is the constraint. ``ratio_aware`` / ``power_of_two`` should load each decode in
  proportion to its pool, so nobody waits for pages on the small one.

Request shares come from the workers' ``/debug/rooms`` (each served room, counted per worker);
every run ends with a leak check (each worker's KV pool back to all pages free or evictable) and
a scan of the process logs for errors.

    .venv/bin/python loadtests/bench_routing.py [--scenario a|b|c|all] [--requests N] [--seed 0]
        [--policies random,cache_aware] [--rate R] [--concurrency C] [--verbose] [--keep-logs]

All three scenarios take about 2.5 minutes on a 2-core machine (a ~25 s, b ~65 s, c ~60 s).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import re
import shutil
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from pdtest import Procs, Worker, start_bootstrap, start_gateway, start_worker  # noqa: E402
from pdtest import SimCluster as Cluster  # noqa: E402
from stop_signals import stop_like_ctrl_c  # noqa: E402  (this folder: the script's own)

# A small sim model (2 layers x 1 KV head x 8 dims: 32 bytes of KV per token per buffer).
SMALL_MODEL = ("layers=2", "kv_heads=1", "head_dim=8")
PAGE_SIZE = 16
SEEDED_POLICIES = ("random", "power_of_two")  # the policies that take a seed option
T = TypeVar("T")


# -- workload ------------------------------------------------------------------------------------
@dataclass
class Request:
    prompt: list[int]
    max_tokens: int
    arrival_s: float  # offset from the start of the run
    tenant: int | None = None
    prefix_len: int = 0  # tokens of the tenant's shared prefix


@dataclass
class Result:
    ttft_s: float | None = None
    e2e_s: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None


def poisson_arrivals(rng: random.Random, n: int, rate: float) -> list[float]:
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def random_tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(256) for _ in range(n)]


def workload_tenants(rng: random.Random, n: int, rate: float, num_tenants: int = 24) -> list[Request]:
    """Scenario a: per-tenant system prompts + a short unique suffix; every prompt length is unique.

    Unique lengths let the bench map each room a worker reports (it carries ``prompt_tokens``) back
    to its request, hence its tenant.
    """
    prefixes = [random_tokens(rng, rng.randint(1000, 2000)) for _ in range(num_tenants)]
    weights = [1.0 / (k + 1) ** 0.7 for k in range(num_tenants)]  # Zipf-ish popularity
    order = list(range(num_tenants))
    rng.shuffle(order)  # popularity independent of prefix length
    used: set[int] = set()
    reqs = []
    for arrival in poisson_arrivals(rng, n, rate):
        tenant = order[rng.choices(range(num_tenants), weights)[0]]
        suffix_len = rng.randint(8, 40)
        while len(prefixes[tenant]) + suffix_len in used:
            suffix_len += 1
        used.add(len(prefixes[tenant]) + suffix_len)
        reqs.append(Request(prefixes[tenant] + random_tokens(rng, suffix_len), rng.randint(16, 32), arrival, tenant,
                            len(prefixes[tenant])))
    return reqs


def workload_unique(rng: random.Random, n: int, rate: float, prompt: tuple[int, int],
                    max_tokens: tuple[int, int]) -> list[Request]:
    """Scenarios b and c: unique random prompts (no shared prefixes)."""
    return [Request(random_tokens(rng, rng.randint(*prompt)), rng.randint(*max_tokens), arrival)
            for arrival in poisson_arrivals(rng, n, rate)]


# -- scenarios -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class WorkerSpec:
    role: str
    label: str
    args: tuple[str, ...]


def sim_worker(role: str, label: str, num_pages: int, **engine: float) -> WorkerSpec:
    opts = [*SMALL_MODEL, *(f"{k}={v}" for k, v in engine.items())]
    args = ["--engine", "sim", "--page-size", str(PAGE_SIZE), "--num-pages", str(num_pages), "--chunk-size", "512"]
    for opt in opts:
        args += ["--engine-option", opt]
    return WorkerSpec(role, label, tuple(args))


@dataclass(frozen=True)
class Scenario:
    key: str
    title: str
    prefills: tuple[WorkerSpec, ...]
    decodes: tuple[WorkerSpec, ...]
    policies: tuple[str, ...]
    requests: int
    rate: float  # offered load, requests/s
    concurrency: int  # client-side cap on requests in flight
    workload: Callable[[random.Random, int, float], list[Request]]
    note: str


DECODE_FAST = {"decode_step_s": 2e-3, "decode_seq_s": 1e-4}

SCENARIOS: dict[str, Scenario] = {
    "a": Scenario(
        "a", "prefix affinity: 4 prefills (800 pages each) + 2 decodes, 24 tenants x 1000-2000-token prefixes",
        prefills=tuple(sim_worker("prefill", f"P{i}", 800, prefill_token_s=1e-4) for i in range(4)),
        decodes=tuple(sim_worker("decode", f"D{i}", 2048, **DECODE_FAST) for i in range(2)),
        policies=("random", "cache_aware"), requests=240, rate=20.0, concurrency=16,
        workload=workload_tenants,
        note="hit rate = cached / prompt tokens over the run, from the prefills' /stats deltas and from the "
             "responses' usage; stickiness = mean share of a tenant's requests on its most-used prefill",
    ),
    "b": Scenario(
        "b", "slow prefill: 2 prefills, P1 5x slower per token (2.5e-4 s vs 5e-5 s), unique 400-1200-token prompts",
        prefills=(sim_worker("prefill", "P0-fast", 1024, prefill_token_s=5e-5),
                  sim_worker("prefill", "P1-slow", 1024, prefill_token_s=2.5e-4)),
        decodes=tuple(sim_worker("decode", f"D{i}", 2048, **DECODE_FAST) for i in range(2)),
        policies=("random", "power_of_two", "ratio_aware", "cache_aware"), requests=150, rate=12.0, concurrency=16,
        workload=lambda rng, n, rate: workload_unique(rng, n, rate, (400, 1200), (16, 32)),
        note="the fast prefill alone would be ~50% busy at this rate; the slow one alone ~240% busy",
    ),
    "c": Scenario(
        "c", "decode KV: 1 prefill + 2 decodes, D0 160 pages vs D1 640 pages, max_tokens 192-320",
        prefills=(sim_worker("prefill", "P0", 1024, prefill_token_s=2e-5),),
        decodes=(sim_worker("decode", "D0-small", 160, decode_step_s=4e-3, decode_seq_s=2e-4),
                 sim_worker("decode", "D1-big", 640, decode_step_s=4e-3, decode_seq_s=2e-4)),
        policies=("random", "ratio_aware", "power_of_two"), requests=120, rate=8.0, concurrency=24,
        workload=lambda rng, n, rate: workload_unique(rng, n, rate, (100, 300), (192, 320)),
        note="a request reserves ceil((prompt + max_tokens) / 16) ~ 29 pages on its decode for its whole life: "
             "D0 fits ~5 at once, D1 ~22",
    ),
}


# -- cluster -------------------------------------------------------------------------------------
def http_json(port: int, path: str) -> Any:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as resp:
        return json.loads(resp.read())


def http_text(port: int, path: str) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as resp:
        return str(resp.read().decode())


def retry_port_race(start: Callable[[], T], tries: int = 3) -> T:
    """``free_port`` releases the port before the child binds it: a parallel start can lose the race."""
    for attempt in range(tries):
        try:
            return start()
        except (RuntimeError, TimeoutError):
            if attempt == tries - 1:
                raise
    raise AssertionError("unreachable")


def start_cluster(procs: Procs, scenario: Scenario, policy: str, seed: int) -> Cluster:
    boot = retry_port_race(lambda: start_bootstrap(procs))
    specs = [*scenario.prefills, *scenario.decodes]

    def one(s: WorkerSpec) -> Worker:
        return retry_port_race(lambda: start_worker(procs, s.role, *s.args, bootstrap=boot,
                                                    name=f"{scenario.key}-{policy}-{s.label}"))

    with ThreadPoolExecutor(len(specs)) as pool:  # workers start in parallel (each imports numpy etc.)
        futures = [pool.submit(one, s) for s in specs]
        workers = [f.result() for f in futures]
    prefills, decodes = workers[: len(scenario.prefills)], workers[len(scenario.prefills):]
    gw_args = ["--prefill", *(w.url for w in prefills), "--decode", *(w.url for w in decodes), "--policy", policy]
    if policy in SEEDED_POLICIES:
        gw_args += ["--policy-option", f"seed={seed}"]
    return Cluster(procs, boot, prefills, decodes, retry_port_race(lambda: start_gateway(procs, *gw_args)))


@dataclass
class Snapshot:
    stats: list[dict[str, Any]]
    rooms: list[list[dict[str, Any]]]


def snapshot(cluster: Cluster) -> Snapshot:
    workers = cluster.prefills + cluster.decodes
    return Snapshot([w.get("/stats") for w in workers], [w.get("/debug/rooms") for w in workers])  # type: ignore[misc]


def new_rooms(before: list[dict[str, Any]], after: list[dict[str, Any]]) -> list[dict[str, Any]]:
    seen = {r["room"] for r in before}
    return [r for r in after if r["room"] not in seen]


def wait_pools_idle(cluster: Cluster, timeout_s: float = 10.0) -> list[str]:
    """Problems left after the run: workers whose pages are still taken (free + evictable < total)."""
    deadline = time.monotonic() + timeout_s
    while True:
        loads = [(w, w.get("/load")) for w in cluster.prefills + cluster.decodes]
        bad = [f"{w.role}:{w.http_port} free {ld['num_free_pages']}/{ld['num_total_pages']} "  # type: ignore[index]
               f"running {ld['num_running']} waiting {ld['num_waiting']}"  # type: ignore[index]
               for w, ld in loads if ld["num_free_pages"] != ld["num_total_pages"]]  # type: ignore[index]
        if not bad or time.monotonic() > deadline:
            return bad
        time.sleep(0.2)


def index_drift(cluster: Cluster, timeout_s: float = 3.0) -> list[str]:
    """Prefills whose cached page count differs between the gateway's prefix index and the worker itself."""
    deadline = time.monotonic() + timeout_s
    while True:
        indexed = {w["url"]: w["cached_pages"] for w in http_json(cluster.gateway_port, "/health")["workers"]}
        held = {w.url: w.get("/stats")["num_cached_pages"] for w in cluster.prefills}  # type: ignore[index]
        bad = [f"{url}: gateway index {indexed.get(url)} pages, worker {n}" for url, n in held.items()
               if indexed.get(url) != n]
        if not bad or time.monotonic() > deadline:
            return bad
        time.sleep(0.2)


def log_problems(procs: Procs) -> dict[str, str]:
    """{process name: its first warning/error line, timestamp and addresses stripped}."""
    out = {}
    for proc in procs.procs:
        name = proc.name  # type: ignore[attr-defined]
        for line in procs.log(name).splitlines():
            if any(k in line for k in (" ERROR ", " WARNING ", "Traceback", "CRITICAL")):
                line = re.sub(r"^\d{4}-\d\d-\d\d [\d:,]+ ", "", line)
                out[name] = re.sub(r" at 0x[0-9a-f]+", "", line)[:160]
                break
    return out


def summarize_logs(during: dict[str, str], after: dict[str, str]) -> list[str]:
    """One line per distinct first problem: during the run, or only once the processes were stopped."""
    groups: dict[tuple[str, str], list[str]] = {}
    for name, line in after.items():
        groups.setdefault(("during run" if name in during else "at shutdown", line), []).append(name)
    return [f"{when}: {len(names)} process(es) ({', '.join(sorted(names)[:3])}{', ...' if len(names) > 3 else ''}) "
            f"logged: {line}" for (when, line), names in sorted(groups.items())]


# -- driving -------------------------------------------------------------------------------------
async def run_one(http: httpx.AsyncClient, req: Request, scheduled: float) -> Result:
    body = {"prompt": req.prompt, "max_tokens": req.max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    res = Result()
    try:
        async with http.stream("POST", "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                res.error = f"HTTP {resp.status_code}: {(await resp.aread()).decode(errors='replace')[:160]}"
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                if data.startswith('{"error"'):
                    res.error = "stream error: " + str(json.loads(data)["error"].get("message"))[:160]
                    continue
                if res.ttft_s is None and '"text":"' in data and '"text":""' not in data:
                    res.ttft_s = time.perf_counter() - scheduled
                if '"usage":{' in data:
                    usage = json.loads(data)["usage"]
                    res.prompt_tokens = usage["prompt_tokens"]
                    res.completion_tokens = usage["completion_tokens"]
                    res.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    except httpx.HTTPError as exc:
        res.error = f"{type(exc).__name__}: {exc}"[:160]
    if res.error is None:
        res.e2e_s = time.perf_counter() - scheduled
        if res.completion_tokens != req.max_tokens:
            res.error = f"completion_tokens {res.completion_tokens} != max_tokens {req.max_tokens}"
    return res


async def drive(base_url: str, reqs: Sequence[Request], concurrency: int) -> tuple[list[Result], float, str]:
    """Open loop: each request starts at its arrival time, or when a client slot frees up after it.

    Returns the results, the wall time and the gateway's ``/metrics`` scraped mid-run."""
    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=base_url, timeout=httpx.Timeout(120.0), limits=limits) as http:
        t0 = time.perf_counter()

        async def one(req: Request) -> Result:
            scheduled = t0 + req.arrival_s
            await asyncio.sleep(max(0.0, scheduled - time.perf_counter()))
            async with sem:
                return await run_one(http, req, scheduled)

        async def probe() -> str:
            await asyncio.sleep(reqs[len(reqs) // 2].arrival_s)
            async with httpx.AsyncClient(base_url=base_url, timeout=10.0) as side:
                return (await side.get("/metrics")).text

        probe_task = asyncio.create_task(probe())
        results = await asyncio.gather(*(one(r) for r in reqs))
        return list(results), time.perf_counter() - t0, await probe_task


def warmup(base_url: str, rng: random.Random, num_prefills: int) -> None:
    """A few short unique prompts so each prefill has measured its throughput (excluded from figures)."""
    reqs = [Request(random_tokens(rng, 64 + 16 * i), 4, 0.0) for i in range(4 * num_prefills)]
    results, _, _ = asyncio.run(drive(base_url, reqs, 2 * num_prefills))
    errors = [r.error for r in results if r.error]
    if errors:
        raise RuntimeError(f"warm-up failed: {errors[:3]}")


# -- one policy run ------------------------------------------------------------------------------
@dataclass
class RunReport:
    policy: str
    results: list[Result]
    wall_s: float
    prefill_share: list[int]
    decode_share: list[int]
    stats_prompt: int = 0
    stats_cached: int = 0
    evictions: list[int] = field(default_factory=list)  # prefix-cache pages evicted, per prefill
    stickiness: float | None = None
    tenants_split: int = 0
    per_tenant: dict[int, Counter[int]] = field(default_factory=dict)
    kv_unverified: int = 0
    index_drift: list[str] = field(default_factory=list)  # gateway prefix index vs the workers' caches
    leaks: list[str] = field(default_factory=list)
    log_issues: list[str] = field(default_factory=list)
    policy_stats: dict[str, float] = field(default_factory=dict)
    prefill_rates: list[float] = field(default_factory=list)
    gateway_statuses: dict[str, float] = field(default_factory=dict)


def parse_metrics(text: str) -> tuple[dict[str, float], dict[str, float]]:
    stats, statuses = {}, {}
    for line in text.splitlines():
        if line.startswith("pd_gateway_policy_stat{"):
            key = line.split('stat="', 1)[1].split('"', 1)[0]
            stats[key] = float(line.rsplit(" ", 1)[1])
        elif line.startswith("pd_gateway_requests_total{"):
            status = line.split('status="', 1)[1].split('"', 1)[0]
            statuses[status] = statuses.get(status, 0.0) + float(line.rsplit(" ", 1)[1])
    return stats, statuses


def run_policy(scenario: Scenario, policy: str, reqs: list[Request], seed: int, concurrency: int,
               tmp: Path) -> RunReport:
    run_dir = tmp / f"{scenario.key}-{policy}"
    run_dir.mkdir()
    procs = Procs(run_dir)
    try:
        cluster = start_cluster(procs, scenario, policy, seed)
        warmup(cluster.base_url, random.Random(seed + 1), len(cluster.prefills))
        before = snapshot(cluster)
        results, wall, mid_metrics = asyncio.run(drive(cluster.base_url, reqs, concurrency))
        after = snapshot(cluster)
        metrics = http_text(cluster.gateway_port, "/metrics")
        health = http_json(cluster.gateway_port, "/health")
        leaks = wait_pools_idle(cluster)
        drift = index_drift(cluster)
        np_ = len(cluster.prefills)
        served = [new_rooms(b, a) for b, a in zip(before.rooms, after.rooms, strict=True)]
        report = RunReport(policy, results, wall, [len(s) for s in served[:np_]], [len(s) for s in served[np_:]],
                           leaks=leaks, index_drift=drift)
        for b, a in zip(before.stats[:np_], after.stats[:np_], strict=True):
            report.stats_prompt += a["num_prompt_tokens"] - b["num_prompt_tokens"]
            report.stats_cached += a["num_cached_prompt_tokens"] - b["num_cached_prompt_tokens"]
            report.evictions.append(a["num_evictions"] - b["num_evictions"])
        report.kv_unverified = sum(1 for rooms in served[np_:] for r in rooms if r.get("kv_verified") is False)
        if any(r.tenant is not None for r in reqs):
            by_len = {len(r.prompt): r.tenant for r in reqs}
            per_tenant: dict[int, Counter[int]] = {}
            for i, rooms in enumerate(served[:np_]):
                for room in rooms:
                    tenant = by_len.get(room["prompt_tokens"])
                    if tenant is not None:
                        per_tenant.setdefault(tenant, Counter())[i] += 1
            total = sum(sum(c.values()) for c in per_tenant.values())
            report.stickiness = sum(max(c.values()) for c in per_tenant.values()) / max(1, total)
            report.tenants_split = sum(1 for c in per_tenant.values() if len(c) > 1)
            report.per_tenant = per_tenant
        report.policy_stats = parse_metrics(mid_metrics)[0]
        report.gateway_statuses = parse_metrics(metrics)[1]
        report.prefill_rates = [w["prefill_tokens_per_s"] for w in health["workers"] if w["role"] == "prefill"]
        during = log_problems(procs)
        procs.stop_all()
        report.log_issues = summarize_logs(during, log_problems(procs))
        return report
    finally:
        procs.stop_all()


# -- table ---------------------------------------------------------------------------------------
def pct(values: list[float], q: float) -> float:
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


def shares(counts: list[int]) -> str:
    total = sum(counts) or 1
    return "/".join(f"{100 * c / total:.0f}" for c in counts)


def usage_hit_rate(results: list[Result]) -> float:
    return sum(x.cached_tokens for x in results) / max(1, sum(x.prompt_tokens for x in results))


def ideal_hit_rate(reqs: Sequence[Request]) -> float:
    """Hit rate with perfect affinity and unbounded caches: a tenant's first request misses, later ones hit
    every full page of its prefix."""
    seen: set[int] = set()
    cached = 0
    for r in reqs:
        if r.tenant is not None and r.tenant in seen:
            cached += r.prefix_len // PAGE_SIZE * PAGE_SIZE
        if r.tenant is not None:
            seen.add(r.tenant)
    return cached / max(1, sum(len(r.prompt) for r in reqs))


def ms(v: float) -> str:
    return "-" if math.isnan(v) else f"{v * 1e3:.0f}"


def print_table(scenario: Scenario, reports: list[RunReport], reqs: Sequence[Request], rate: float, concurrency: int,
                verbose: bool = False) -> None:
    n = len(reqs)
    print(f"\n== scenario {scenario.key}: {scenario.title}")
    print(f"   {n} requests per policy, Poisson arrivals at {rate:g} req/s, at most {concurrency} in flight; "
          "latencies from scheduled arrival; fresh cluster per policy")
    if scenario.key == "a":
        print(f"   ideal hit rate (each tenant misses once, then always hits): {100 * ideal_hit_rate(reqs):.1f}%")
    rows: list[tuple[str, list[str]]] = []

    def row(name: str, fn: Callable[[RunReport], str]) -> None:
        rows.append((name, [fn(r) for r in reports]))

    def lat(r: RunReport, attr: str, q: float) -> float:
        return pct([getattr(x, attr) for x in r.results if getattr(x, attr) is not None], q)

    if scenario.key == "a":
        row("hit rate, worker /stats", lambda r: f"{100 * r.stats_cached / max(1, r.stats_prompt):.1f}%")
        row("hit rate, usage.cached_tokens", lambda r: f"{100 * usage_hit_rate(r.results):.1f}%")
        row("prefill tokens computed", lambda r: f"{r.stats_prompt - r.stats_cached}")
        row("evicted pages per prefill", lambda r: "/".join(map(str, r.evictions)))
        row("tenant stickiness / split", lambda r: f"{100 * (r.stickiness or 0):.0f}% / {r.tenants_split}")
    row("TTFT p50 / p99 ms", lambda r: f"{ms(lat(r, 'ttft_s', 50))} / {ms(lat(r, 'ttft_s', 99))}")
    row("E2E p50 / p99 ms", lambda r: f"{ms(lat(r, 'e2e_s', 50))} / {ms(lat(r, 'e2e_s', 99))}")
    row("throughput req/s", lambda r: f"{sum(1 for x in r.results if not x.error) / r.wall_s:.1f}")
    row(f"prefill share % ({'/'.join(s.label for s in scenario.prefills)})", lambda r: shares(r.prefill_share))
    row(f"decode share % ({'/'.join(s.label for s in scenario.decodes)})", lambda r: shares(r.decode_share))
    row("prefill tokens/s measured", lambda r: "/".join(f"{v / 1e3:.0f}k" for v in r.prefill_rates))
    row("errors", lambda r: str(sum(1 for x in r.results if x.error)))
    row("KV unverified/leaks/drift", lambda r: f"{r.kv_unverified} / {len(r.leaks)} / {len(r.index_drift)}")
    name_w = max(len(name) for name, _ in rows)
    col_w = max(14, *(len(v) for _, vals in rows for v in vals), *(len(r.policy) for r in reports))
    print(f"   {'':{name_w}}  " + "  ".join(f"{r.policy:>{col_w}}" for r in reports))
    for name, vals in rows:
        print(f"   {name:{name_w}}  " + "  ".join(f"{v:>{col_w}}" for v in vals))
    print(f"   note: {scenario.note}")
    for r in reports:
        extra = [f"{k}={v:.3g}" for k, v in sorted(r.policy_stats.items())]
        if extra:
            print(f"   {r.policy} policy stats (/metrics mid-run): {', '.join(extra)}")
        errors = Counter(x.error for x in r.results if x.error)
        for err, count in errors.most_common(3):
            print(f"   {r.policy} error x{count}: {err}")
        for leak in r.leaks:
            print(f"   {r.policy} LEAK: {leak}")
        for drift in r.index_drift:
            print(f"   {r.policy} prefix-index drift: {drift}")
        for issue in r.log_issues:
            print(f"   {r.policy} log: {issue}")
        if verbose and r.per_tenant:
            popularity = Counter(x.tenant for x in reqs)
            split = [f"t{t}({popularity[t]} reqs): " + " ".join(f"P{i}x{c[i]}" for i in sorted(c))
                     for t, c in sorted(r.per_tenant.items(), key=lambda kv: -popularity[kv[0]]) if len(c) > 1]
            print(f"   {r.policy} tenants on >1 prefill: {'; '.join(split) or 'none'}")
        bad_status = {k: v for k, v in r.gateway_statuses.items() if k != "200"}
        if bad_status:
            print(f"   {r.policy} gateway non-200 statuses: {bad_status}")


# -- main ----------------------------------------------------------------------------------------
def main() -> None:
    stop_like_ctrl_c()  # SIGTERM, SIGHUP: the servers are stopped in ``finally``, as on Ctrl-C
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scenario", choices=["a", "b", "c", "all"], default="all")
    ap.add_argument("--requests", type=int, default=None, help="requests per policy run (default: per scenario)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--policies", default=None,
                    help="comma-separated policies to compare (default: per scenario); random always runs first")
    ap.add_argument("--rate", type=float, default=None, help="offered load in requests/s (default: per scenario)")
    ap.add_argument("--concurrency", type=int, default=None, help="max requests in flight (default: per scenario)")
    ap.add_argument("--keep-logs", action="store_true", help="keep the process logs (their folder is printed)")
    ap.add_argument("--verbose", action="store_true", help="scenario a: list the tenants served by several prefills")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    keys = ["a", "b", "c"] if args.scenario == "all" else [args.scenario]
    tmp = Path(tempfile.mkdtemp(prefix="bench_routing-"))
    started = time.perf_counter()
    try:
        for key in keys:
            scenario = SCENARIOS[key]
            policies = [p for p in (args.policies.split(",") if args.policies else scenario.policies) if p]
            policies = ["random", *(p for p in policies if p != "random")]
            n = args.requests or scenario.requests
            rate = args.rate or scenario.rate
            concurrency = args.concurrency or scenario.concurrency
            reqs = scenario.workload(random.Random(args.seed), n, rate)
            t = time.perf_counter()
            reports = [run_policy(scenario, p, reqs, args.seed, concurrency, tmp) for p in policies]
            print_table(scenario, reports, reqs, rate, concurrency, args.verbose)
            print(f"   scenario {key} took {time.perf_counter() - t:.0f}s", flush=True)
    finally:
        if args.keep_logs:
            print(f"\nlogs: {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    print(f"\ntotal {time.perf_counter() - started:.0f}s")


if __name__ == "__main__":
    main()
