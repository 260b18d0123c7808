"""The worker's HTTP side under hostile or odd input, on real worker processes:

1. With ``--api-key``, ``/health`` stays open (probes carry no key) but says only the status and role to a request
   without the key: why a prefill's registration lapsed (the registry's answer, its errors) is for key holders, as
   the gateway's open probes show their details to key holders only.
2. An unexpected error in a route (here: a request body nested deeper than the JSON decoder recurses) is answered
   as OpenAI-shaped JSON, as every other error of the worker, not Starlette's plain-text "Internal Server Error"
   that SGLang's router and OpenAI clients cannot parse; the worker keeps serving.
3. ``HEAD /flush_cache`` (a probe, a link checker: HEAD is a safe method) does not flush the prefix cache; only
   ``GET``/``POST`` (SGLang's methods) do.
"""

from __future__ import annotations

import time

import httpx
from pdtest import Procs, start_bootstrap, start_worker

KEY = "s3cr3t-worker-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


def test_health_hides_the_registration_error_from_requests_without_the_key(procs: Procs) -> None:
    bootstrap = start_bootstrap(procs)
    prefill = start_worker(procs, "prefill", "--engine", "sim", "--transfer", "tcp", "--api-key", KEY,
                           "--heartbeat-interval-s", "0.2", bootstrap=bootstrap)
    url = f"http://127.0.0.1:{prefill.http_port}/health"
    procs.procs[0].kill()  # the registry goes away: the prefill's renewals fail, its entry lapses
    procs.procs[0].wait()
    deadline = time.monotonic() + 60
    while True:
        reply = httpx.get(url, headers=AUTH, timeout=5)
        if reply.json()["status"] == "unregistered":
            break
        assert time.monotonic() < deadline, reply.text
        time.sleep(0.2)
    assert reply.status_code == 503 and "renewals failed" in reply.json()["error"]  # (the key holder's view)
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {KEY}"}):
        anonymous = httpx.get(url, headers=headers, timeout=5)
        assert anonymous.status_code == 503
        assert anonymous.json() == {"status": "unregistered", "role": "prefill"}, (headers, anonymous.text)


def test_a_body_nested_past_the_decoder_is_a_json_400(procs: Procs) -> None:
    worker = start_worker(procs, "both", "--engine", "sim")
    base = f"http://127.0.0.1:{worker.http_port}"
    deep = b'{"text": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    reply = httpx.post(f"{base}/generate", content=deep, headers={"content-type": "application/json"}, timeout=30)
    assert reply.status_code == 400, (reply.status_code, reply.text[:200])  # (the client's body, not a 500)
    assert reply.headers["content-type"].startswith("application/json"), (reply.status_code, reply.text[:200])
    assert set(reply.json()["error"]) >= {"message", "type"}
    assert httpx.get(f"{base}/health", timeout=5).status_code == 200
    ok = httpx.post(f"{base}/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2}}, timeout=30)
    assert ok.status_code == 200 and len(ok.json()["output_ids"]) == 2


def test_head_does_not_flush_the_cache(procs: Procs) -> None:
    worker = start_worker(procs, "both", "--engine", "sim", "--api-key", KEY)
    base = f"http://127.0.0.1:{worker.http_port}"
    prompt = {"text": "a prompt long enough to fill some pages " * 8, "sampling_params": {"max_new_tokens": 2}}
    assert httpx.post(f"{base}/generate", json=prompt, headers=AUTH, timeout=30).status_code == 200
    head = httpx.head(f"{base}/flush_cache", headers=AUTH, timeout=10)
    assert head.status_code == 405, head.status_code
    flushed = httpx.post(f"{base}/flush_cache", headers=AUTH, timeout=10)
    assert flushed.status_code == 200 and flushed.json()["num_freed_pages"] > 0, flushed.text  # (still cached)
    assert httpx.get(f"{base}/flush_cache", headers=AUTH, timeout=10).status_code == 200  # (SGLang's GET stays)
    assert httpx.head(f"{base}/flush_cache", timeout=10).status_code == 401  # (no key: refused before the method)
