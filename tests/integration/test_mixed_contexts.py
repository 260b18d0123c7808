"""A fleet whose decodes have different contexts serves the longest: a request too long for the short decode
goes to the long one (it was a 400 while the gateway held every prompt to the shortest context), a short one
to either; while the long decode is away, a request only it could take is a 503 to retry, not a 400."""

from __future__ import annotations

import time

import httpx
from pdtest import start_bootstrap, start_gateway, start_worker, wait_pools_full
from sim_reference import expected_tokens, text_of

COMMON = ("--engine", "sim", "--transfer", "tcp", "--num-pages", "256", "--page-size", "4")
LONG_PROMPT = [32 + (i * 7) % 90 for i in range(200)]  # too long for the short decode's context (128)
SHORT_PROMPT = [32 + (i * 5) % 90 for i in range(20)]


def test_a_request_too_long_for_one_decode_goes_to_the_one_it_fits(procs) -> None:  # type: ignore[no-untyped-def]
    boot = start_bootstrap(procs)
    prefill = start_worker(procs, "prefill", *COMMON, bootstrap=boot)
    short = start_worker(procs, "decode", *COMMON, "--engine-option", "max_context=128", bootstrap=boot)
    long = start_worker(procs, "decode", *COMMON, bootstrap=boot)  # (context 8192; its pool holds 1024 tokens)
    port = start_gateway(procs, "--prefill", prefill.url, "--decode", short.url, long.url,
                         "--health-interval-s", "0.2", "--unhealthy-after", "1")
    base = f"http://127.0.0.1:{port}"
    with httpx.Client(base_url=base, timeout=60) as http:
        model = http.get("/v1/models").json()["data"][0]
        assert model["max_model_len"] == 1024  # (the long decode's pool; the short decode's context is 128)
        for _ in range(4):  # (whichever decode the policy would have picked: only the long one takes it)
            reply = http.post("/v1/completions", json={"prompt": LONG_PROMPT, "max_tokens": 6})
            assert reply.status_code == 200, reply.text
            assert reply.json()["choices"][0]["text"] == text_of(expected_tokens(LONG_PROMPT, 6))
        for _ in range(4):
            reply = http.post("/v1/completions", json={"prompt": SHORT_PROMPT, "max_tokens": 6})
            assert reply.status_code == 200, reply.text
        wait_pools_full([prefill, short, long])

        long.proc.kill()
        long.proc.wait()
        deadline = time.monotonic() + 20
        while not any(w["url"] == long.url and not w["healthy"] for w in http.get("/workers").json()["workers"]):
            assert time.monotonic() < deadline, "the gateway never saw the long decode go"
            time.sleep(0.1)
        reply = http.post("/v1/completions", json={"prompt": LONG_PROMPT, "max_tokens": 6})
        assert reply.status_code == 503, reply.text
        assert "Retry-After" in reply.headers and reply.json()["error"]["type"]
        reply = http.post("/v1/completions", json={"prompt": SHORT_PROMPT, "max_tokens": 6})
        assert reply.status_code == 200, reply.text
        wait_pools_full([prefill, short])
