"""A decode that is only busy (every KV page in use, requests waiting for pages) is not a failed worker:
the prefill's wait for its page list running out must not count against its breaker (overload is no
worker's failure, docs/operations.md) and take the only decode out of service."""

from __future__ import annotations

import asyncio

import httpx
from test_operations import PROMPT, metric, workers


def test_a_busy_decode_is_not_blamed_for_its_queue(sim_cluster) -> None:  # type: ignore[no-untyped-def]
    # The decode's pool holds one request (prompt ~51 + 10 tokens = 16 pages of 4), each ~0.5 s; the workers'
    # KV waits (2 s) run out before the gateway's first-token deadline (10 s) for most of a burst of 12.
    # Before, each such room was a failure of the decode's: its breaker opened and every request after the
    # burst was a 503 "no healthy decode worker" for the breaker's cooldown.
    cluster = sim_cluster(
        worker_args=("--bootstrap-timeout-s", "2", "--waiting-timeout-s", "2"),
        decode_args=("--num-pages", "16", "--engine-option", "decode_step_s=0.05"),
        gateway_args=("--first-token-timeout-s", "10", "--retry-backoff-s", "0"))
    decode = cluster.decodes[0].url

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=cluster.base_url, timeout=60) as http:
            body = {"prompt": PROMPT, "max_tokens": 10}
            return list(await asyncio.gather(*(http.post("/v1/completions", json=body) for _ in range(12))))

    answers = asyncio.run(burst())
    seen = sorted({(r.status_code, r.json().get("error", {}).get("message", "")[:90]) for r in answers})
    failures = metric(cluster, "pd_gateway_worker_failures_total", worker=decode)
    breaker = workers(cluster)[decode]["breaker"]
    after = httpx.post(f"{cluster.base_url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}, timeout=30)
    # (a request that waited past its first-token deadline may end in a 504; none is a 503 "no healthy decode")
    assert all(r.status_code in (200, 504) for r in answers), seen
    assert failures == 0 and breaker == "closed" and after.status_code == 200, (seen, failures, breaker, after.text)
    cluster.wait_pools_full()


def test_a_busy_prefill_is_not_blamed_for_its_queue(sim_cluster) -> None:  # type: ignore[no-untyped-def]
    # The mirror image: the prefill computes ~0.5 s per prompt (52 tokens at 10 ms each), a burst of 12 queues
    # there; the decode's wait for a room's KV (--waiting-timeout-s 2) runs out for the requests at the back of the
    # prefill's queue. The prefill is only busy, not failed: before, each such room counted against its breaker, which
    # opened, and every request after the burst was a 503 "no healthy prefill worker" for the breaker's cooldown.
    cluster = sim_cluster(
        worker_args=("--bootstrap-timeout-s", "2", "--waiting-timeout-s", "2"),
        prefill_args=("--engine-option", "prefill_token_s=0.01", "--chunk-size", "64"),
        gateway_args=("--first-token-timeout-s", "20", "--retry-backoff-s", "0"))
    prefill = cluster.prefills[0].url

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=cluster.base_url, timeout=60) as http:
            # (prompts that differ from their first token: no prefix cache hit saves a prefill its work)
            bodies = [{"prompt": [65 + i, *PROMPT], "max_tokens": 4} for i in range(12)]
            return list(await asyncio.gather(*(http.post("/v1/completions", json=body) for body in bodies)))

    answers = asyncio.run(burst())
    seen = sorted({(r.status_code, r.json().get("error", {}).get("message", "")[:90]) for r in answers})
    failures = metric(cluster, "pd_gateway_worker_failures_total", worker=prefill)
    breaker = workers(cluster)[prefill]["breaker"]
    after = httpx.post(f"{cluster.base_url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}, timeout=30)
    # (a request whose three tries all waited past the decode's KV wait ends in a 502; none is a 503 "no healthy
    # prefill")
    assert all(r.status_code in (200, 502, 504) for r in answers), seen
    assert failures == 0 and breaker == "closed" and after.status_code == 200, (seen, failures, breaker, after.text)
    cluster.wait_pools_full()
