"""A prefill at its ``--max-requests`` turns requests away as overloaded, behind our gateway. Its decode, whose
room the prefill ended, reported a ``transfer_failed`` (a KV failure, counted in the gateway's transfer-failure
metric) and, when its report reached the gateway first, the client got a 502 for what was a full worker: most of
the clients of a burst did. Both sides now say ``overloaded``: every client gets its answer or a 429 to retry."""

from __future__ import annotations

import concurrent.futures
from collections import Counter

import httpx
from pdtest import Procs, start_bootstrap, start_gateway, start_worker, wait_pools_full

SLOW_PREFILL = ("--engine", "sim", "--engine-option", "prefill_token_s=0.002")


def test_a_full_prefill_gives_its_clients_429_not_502(procs: Procs) -> None:
    registry = start_bootstrap(procs)
    prefill = start_worker(procs, "prefill", *SLOW_PREFILL, "--max-requests", "1", bootstrap=registry)
    decode = start_worker(procs, "decode", *SLOW_PREFILL, bootstrap=registry)
    port = start_gateway(procs, "--prefill", prefill.url, "--decode", decode.url, "--max-retries", "1",
                         "--retry-backoff-s", "0.01")
    body = {"model": "default", "messages": [{"role": "user", "content": "hello " * 200}], "max_tokens": 4}

    def ask(_: int) -> tuple[int, str | None]:
        reply = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=60)
        return reply.status_code, (reply.json().get("error") or {}).get("code")

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        outcomes = Counter(pool.map(ask, range(24)))
    assert set(outcomes) <= {(200, None), (429, "overloaded")}, outcomes
    assert outcomes[(429, "overloaded")], f"the prefill was never full: {outcomes}"
    metrics = httpx.get(f"http://127.0.0.1:{port}/metrics").text
    assert "pd_gateway_kv_transfer_failures_total{" not in metrics, "a full worker was counted as a KV failure"
    wait_pools_full([prefill, decode], 10)
