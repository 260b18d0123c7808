"""A retry after a worker said ``overloaded`` goes to another worker when there is one (docs/operations.md: a retry
avoids the worker the failure counts against, or for one nobody is blamed for, the worker that reported it).

Before, an ``overloaded`` failure avoided nobody: a policy that prefers the full worker (``cache_aware``: it holds
the prompt's prefix) sent every try back to it, and the client got a 429 while the other prefill sat idle."""

from __future__ import annotations

import threading
import time

import httpx
from pdtest import Procs, Worker, start_bootstrap, start_gateway, start_worker, wait_pools_full

PROMPT = [65 + i % 26 for i in range(300)]


def _prompt_tokens(worker: Worker) -> float:
    text = httpx.get(f"http://127.0.0.1:{worker.http_port}/metrics", timeout=5).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("pd_worker_prompt_tokens_total"))


def test_an_overloaded_prefill_is_not_tried_again(procs: Procs) -> None:
    registry = start_bootstrap(procs)
    common = ("--engine", "sim", "--max-requests", "1", "--bootstrap-timeout-s", "6", "--page-size", "4")
    prefills = [start_worker(procs, "prefill", *common, bootstrap=registry) for _ in range(2)]
    decode = start_worker(procs, "decode", "--engine", "sim", "--page-size", "4", bootstrap=registry)
    port = start_gateway(procs, "--prefill", *[w.url for w in prefills], "--decode", decode.url,
                         "--policy", "cache_aware", "--retry-backoff-s", "0.01")
    base = f"http://127.0.0.1:{port}"
    body = {"prompt": PROMPT, "max_tokens": 2}
    assert httpx.post(f"{base}/v1/completions", json=body, timeout=30).status_code == 200
    # The prefill that computed the prompt holds its prefix (the policy's choice for it from now on)
    homes = [w for w in prefills if _prompt_tokens(w) > 0]
    assert len(homes) == 1, homes
    home = homes[0]
    time.sleep(0.5)  # (its KV events reach the gateway)
    # That prefill is full: a request of SGLang's HTTP protocol waits there for a decode's page list that never comes
    held = threading.Thread(target=lambda: httpx.post(
        f"http://127.0.0.1:{home.http_port}/generate", timeout=30,
        json={"input_ids": [1, 2, 3, 4], "sampling_params": {"max_new_tokens": 1}, "bootstrap_host": "127.0.0.1",
              "bootstrap_room": 12345}))
    held.start()
    try:
        time.sleep(0.5)
        answer = httpx.post(f"{base}/v1/completions", json=body, timeout=30)
        # the other prefill, idle, serves it
        assert answer.status_code == 200, answer.text
    finally:
        held.join()
    wait_pools_full([*prefills, decode], 10)
