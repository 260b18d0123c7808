"""The worker's /metrics: the plain histogram, the collector over an in-process scheduler (role both), and
every worker's figures through real processes (bootstrap, prefill and decode sim workers, gateway)."""

from __future__ import annotations

import time
import urllib.request
from types import SimpleNamespace

import openai
from pdtest import SimCluster, Worker
from prometheus_client.parser import text_string_to_metric_families
from starlette.testclient import TestClient

from workers.engines.sim import SimEngine
from workers.http_app import create_http_app
from workers.kv_pool import KVPool
from workers.metrics import STEP_SECONDS_BUCKETS, PlainHistogram
from workers.protocol import Error, Outputs, SamplingParams, Submit
from workers.scheduler import Scheduler, SchedulerConfig

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def parse(text: str) -> Samples:
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, frozenset(labels.items()))]


def make(num_pages: int = 64, max_running: int = 8) -> tuple[Scheduler, list[object]]:
    engine = SimEngine()
    info = engine.info
    pool = KVPool(num_layers=info.num_layers, num_pages=num_pages, page_size=4, num_kv_heads=info.num_kv_heads,
                  head_dim=info.head_dim)
    engine.bind(pool)
    sink: list[object] = []
    sched = Scheduler(SchedulerConfig("both", chunk_size=8, max_running=max_running), engine, pool,
                      lambda msgs: sink.extend(m for _, m in msgs))
    return sched, sink


def run_until_idle(sched: Scheduler, limit: int = 500) -> None:
    for _ in range(limit):
        sched.step()
        if not sched.reqs:
            sched.step()
            return
    raise AssertionError("scheduler did not drain")


def app_for(sched: Scheduler) -> TestClient:
    worker = SimpleNamespace(worker_id="both-test", scheduler=sched, kv=None, sglang=None, http_connections=None,
                             config=SimpleNamespace(role="both", engine="sim", transfer="tcp", api_key=None,
                                                    watchdog_timeout_s=300.0))
    return TestClient(create_http_app(worker))  # type: ignore[arg-type]


def test_plain_histogram_buckets_are_cumulative_with_le_semantics() -> None:
    h = PlainHistogram((1, 2, 4))
    for v in (0.5, 1, 1.5, 2, 3, 100):
        h.observe(v)
    buckets, total = h.buckets()
    assert buckets == [("1.0", 2.0), ("2.0", 4.0), ("4.0", 5.0), ("+Inf", 6.0)]
    assert total == 108.0


def test_metrics_match_what_the_scheduler_did() -> None:
    sched, sink = make()
    # no shared prefixes among these (the one cache hit below is request 100's)
    prompts = [list(range(10 + 40 * i, 10 + 40 * i + n)) for i, n in enumerate((3, 17, 9, 30))]
    for rid, p in enumerate(prompts):
        sched.submit(0, Submit(rid, p, SamplingParams(max_new_tokens=5)))
    sched.submit(0, Submit(99, [], SamplingParams()))  # rejected: bad_request
    run_until_idle(sched)
    sched.submit(0, Submit(100, prompts[3], SamplingParams(max_new_tokens=3)))  # same prompt: prefix cache hit
    run_until_idle(sched)
    sched.submit(0, Submit(101, [1, 2, 3], SamplingParams(max_new_tokens=100)))
    sched.step()
    sched.abort(0, 101, "client went away")
    run_until_idle(sched)

    resp = app_for(sched).get("/metrics")
    assert resp.status_code == 200
    assert resp.headers["content-type"].startswith("text/plain; version=0.0.4")
    m = parse(resp.text)
    role = {"role": "both"}

    cached = 4 * ((30 - 1) // 4)  # the full pages of prompt 3 before its last token
    assert value(m, "pd_worker_prompt_tokens_total", **role) == sum(map(len, prompts)) + 30 + 3
    assert 0 < value(m, "pd_worker_cached_prompt_tokens_total", **role) <= cached
    assert value(m, "pd_worker_cached_prompt_tokens_total", **role) == sched.num_cached_prompt_tokens
    assert value(m, "pd_worker_prefix_cache_hit_tokens_total", **role) >= sched.num_cached_prompt_tokens
    assert value(m, "pd_worker_requests_finished_total", reason="length", **role) == 5
    assert value(m, "pd_worker_prefix_waits_total", **role) == sched.num_prefix_waits == 0  # (nothing shared)
    assert value(m, "pd_worker_requests_failed_total", code="bad_request", **role) == 1
    assert value(m, "pd_worker_requests_failed_total", code="aborted", **role) == 1
    errors = [x for x in sink if isinstance(x, Error)]
    finals = [i for x in sink if isinstance(x, Outputs) for i in x.items if i.finish_reason]
    assert len(errors) == 2 and len(finals) == 5

    steps = value(m, "pd_worker_steps_total", **role)
    assert steps == sched.num_steps > 0
    assert value(m, "pd_worker_step_batch_size_count", **role) == steps
    assert value(m, "pd_worker_step_duration_seconds_count", **role) == steps
    assert value(m, "pd_worker_step_duration_seconds_bucket", le="+Inf", **role) == steps
    le = repr(float(STEP_SECONDS_BUCKETS[-1]))
    assert value(m, "pd_worker_step_duration_seconds_bucket", le=le, **role) <= steps
    assert value(m, "pd_worker_step_batch_size_bucket", le="1.0", **role) < steps  # some steps batched several
    assert value(m, "pd_worker_step_batch_size_sum", **role) >= steps

    for queue in ("waiting", "prefilling", "running"):
        assert value(m, "pd_worker_queue_requests", queue=queue, **role) == 0
    assert value(m, "pd_worker_running_batch_size", **role) == 0
    assert value(m, "pd_worker_kv_free_pages", **role) == value(m, "pd_worker_kv_capacity_pages", **role) == 64
    assert value(m, "pd_worker_kv_cached_pages", **role) == sched.cache.num_cached > 0
    assert value(m, "pd_worker_prefill_tokens_per_second", **role) > 0
    assert value(m, "pd_worker_scheduler_alive", **role) == 0  # stepped by hand: no thread
    assert value(m, "pd_worker_info", worker_id="both-test", engine="sim", transfer="", **role) == 1
    assert not any(name.startswith("pd_worker_kv_transfer") for name, _ in m), "no transfer on role both"


def test_queue_gauges_count_live_requests_and_preemptions_show() -> None:
    sched, _ = make(num_pages=12, max_running=4)
    for rid in range(4):
        sched.submit(0, Submit(rid, list(range(20 + rid, 28 + rid)), SamplingParams(max_new_tokens=30)))
    for _ in range(6):
        sched.step()
    m = parse(app_for(sched).get("/metrics").text)
    live = sum(value(m, "pd_worker_queue_requests", role="both", queue=q) for q in ("waiting", "prefilling", "running"))
    assert live == len(sched.reqs) == 4
    assert value(m, "pd_worker_running_batch_size", role="both") == len(sched._running) + len(sched._prefilling)
    assert value(m, "pd_worker_kv_free_pages", role="both") < 12
    run_until_idle(sched)
    m = parse(app_for(sched).get("/metrics").text)
    assert value(m, "pd_worker_preemptions_total", role="both") == sched.num_preemptions > 0
    assert value(m, "pd_worker_requests_finished_total", role="both", reason="length") == 4
    assert value(m, "pd_worker_kv_free_pages", role="both") == 12


# -- real processes ----------------------------------------------------------------------------------
BASE = [ord(c) for c in "Metrics count what the workers really did, token by token. "]


def scrape(worker: Worker) -> tuple[str, Samples]:
    with urllib.request.urlopen(f"http://127.0.0.1:{worker.http_port}/metrics", timeout=5) as resp:
        content_type = resp.headers["content-type"]
        text = resp.read().decode()
    samples = {(s.name, frozenset(s.labels.items())): s.value
               for family in text_string_to_metric_families(text) for s in family.samples}
    return content_type, samples


def settled(worker: Worker, timeout_s: float = 20.0) -> Samples:
    """Scrape until every queue is empty and every page is free (the prefill releases after the reply)."""
    deadline = time.monotonic() + timeout_s
    while True:
        _, m = scrape(worker)
        queues = [v for (name, _), v in m.items() if name == "pd_worker_queue_requests"]
        role = {"role": worker.role}
        if (not any(queues) and value(m, "pd_worker_running_batch_size", **role) == 0
                and value(m, "pd_worker_kv_free_pages", **role) == value(m, "pd_worker_kv_capacity_pages", **role)):
            return m
        if time.monotonic() > deadline:
            raise AssertionError(f"{worker.role} did not settle: {sorted(m.items())}")
        time.sleep(0.05)


def test_worker_metrics_match_the_requests(sim_cluster) -> None:  # type: ignore[no-untyped-def]
    cluster: SimCluster = sim_cluster()
    prefill, decode = cluster.prefills[0], cluster.decodes[0]
    client = openai.OpenAI(base_url=f"{cluster.base_url}/v1", api_key="none", max_retries=0, timeout=60)
    prompts = [BASE + [ord("a") + i] * (3 + 7 * i) for i in range(4)] + [BASE * 6]  # several chunks
    prompts.append(prompts[-1])  # the same prompt again: prefix-cache hits
    max_tokens = 6
    cached_reported = 0
    for prompt in prompts:
        out = client.completions.create(model="sim", prompt=prompt, max_tokens=max_tokens)
        assert out.usage is not None and out.usage.completion_tokens == max_tokens
        details = out.usage.prompt_tokens_details
        cached_reported += (details.cached_tokens or 0) if details is not None else 0
    n = len(prompts)

    content_type, _ = scrape(prefill)
    assert content_type.startswith("text/plain; version=0.0.4")
    p, d = settled(prefill), settled(decode)
    P, D = {"role": "prefill"}, {"role": "decode"}

    # prefill: prompts, prefix cache, outcome, transfer
    assert value(p, "pd_worker_prompt_tokens_total", **P) == sum(map(len, prompts))
    assert value(p, "pd_worker_cached_prompt_tokens_total", **P) == cached_reported > 0
    assert value(p, "pd_worker_prefix_cache_hit_tokens_total", **P) >= cached_reported
    assert value(p, "pd_worker_requests_finished_total", reason="transferred", **P) == n
    assert not [k for k in p if k[0] == "pd_worker_requests_failed_total"]
    assert value(p, "pd_worker_kv_transfer_rooms_total", outcome="completed", **P) == n
    assert value(p, "pd_worker_kv_transfer_rooms_total", outcome="failed", **P) == 0
    assert value(p, "pd_worker_kv_transfer_duration_seconds_count", **P) == n
    assert value(p, "pd_worker_kv_transfer_duration_seconds_sum", **P) > 0
    assert value(p, "pd_worker_kv_cached_pages", **P) > 0
    assert value(p, "pd_worker_prefill_tokens_per_second", **P) > 0
    steps = value(p, "pd_worker_steps_total", **P)
    assert steps >= n and value(p, "pd_worker_step_duration_seconds_count", **P) == steps
    assert value(p, "pd_worker_step_batch_size_count", **P) == steps
    assert value(p, "pd_worker_scheduler_alive", **P) == 1
    assert value(p, "pd_worker_info", worker_id=prefill.get("/info")["worker_id"],  # type: ignore[index]
                 engine="sim", transfer="tcp", **P) == 1

    # decode: nothing prefilled here; every room landed; every request ran to its length
    assert value(d, "pd_worker_prompt_tokens_total", **D) == 0
    assert value(d, "pd_worker_requests_finished_total", reason="length", **D) == n
    assert not [k for k in d if k[0] == "pd_worker_requests_failed_total"]
    assert value(d, "pd_worker_kv_transfer_rooms_total", outcome="completed", **D) == n
    assert value(d, "pd_worker_kv_transfer_rooms_total", outcome="failed", **D) == 0
    d_steps = value(d, "pd_worker_steps_total", **D)
    assert d_steps >= max_tokens - 1 and value(d, "pd_worker_step_batch_size_count", **D) == d_steps
    # the first token comes from the prefill; the decode generates the rest, one per sequence and step
    assert value(d, "pd_worker_step_batch_size_sum", **D) == n * (max_tokens - 1)

    # bytes: the prefill's posted KV + aux equals what the decode counts as landed
    sent = value(p, "pd_worker_kv_transfer_bytes_total", direction="sent", **P)
    received = value(d, "pd_worker_kv_transfer_bytes_total", direction="received", **D)
    assert sent > 0 and sent == received
    info = decode.get("/info")
    assert isinstance(info, dict)
    page_size = info["page_size"]
    pages = sum(-(-len(prompt) // page_size) for prompt in prompts)
    assert sent > pages * 2 * page_size  # at least one byte per position of every K and V buffer

    # idle again: queues empty, every page free (checked by settled())
    for queue in ("bootstrap", "waiting", "prefilling", "inflight"):
        assert value(p, "pd_worker_queue_requests", queue=queue, **P) == 0
    for queue in ("prealloc", "transfer", "running", "quarantine"):
        assert value(d, "pd_worker_queue_requests", queue=queue, **D) == 0
    assert value(p, "pd_worker_kv_free_pages", **P) == value(p, "pd_worker_kv_capacity_pages", **P) == 256
    assert value(d, "pd_worker_kv_free_pages", **D) == value(d, "pd_worker_kv_capacity_pages", **D) == 256
