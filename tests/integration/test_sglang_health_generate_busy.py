"""``/health_generate`` on a combined worker that is saturated (it holds its ``--max-requests``) but makes
progress is healthy, as SGLang's own ``/health_generate`` is ("if the server is running something, this request
will be ignored": any progress counts). It answered 503 ``unhealthy`` because its one-token check was turned away
as overloaded (429): a health checker on that route (a readiness probe, SGLang's router with
``--health-check-endpoint /health_generate``) took a busy, healthy worker out of rotation under load."""

from __future__ import annotations

import threading
import time

import httpx
from pdtest import Procs, start_worker


def test_a_saturated_combined_worker_is_healthy(procs: Procs) -> None:
    worker = start_worker(procs, "both", "--engine", "sim", "--num-pages", "256", "--page-size", "4",
                          "--max-requests", "2", "--engine-option", "decode_step_s=0.02")
    base = f"http://127.0.0.1:{worker.http_port}"
    assert httpx.get(f"{base}/health_generate", timeout=30).status_code == 200

    def generate() -> None:  # ~6 s each at 20 ms a step
        httpx.post(f"{base}/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 300,
                                                                               "ignore_eos": True}}, timeout=60)

    threads = [threading.Thread(target=generate) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        deadline = time.monotonic() + 10
        while worker.get("/load")["num_running"] < 2:  # type: ignore[index]
            assert time.monotonic() < deadline, "the two requests did not start"
            time.sleep(0.05)
        reply = httpx.get(f"{base}/health_generate", timeout=30)
        assert reply.status_code == 200, reply.text
        assert worker.get("/load")["num_running"] == 2, "the check ran while the worker was full"  # type: ignore[index]
    finally:
        for t in threads:
            t.join()
