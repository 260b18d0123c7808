"""A worker stopped by SIGTERM while an SGLang router drives it over its HTTP side: the requests it still holds
end as the native protocol's do, ``shutting_down`` (a 503 with Retry-After, or a stream's error event), which a
router retries elsewhere without holding it against the worker; not a 502 ``worker_gone`` ("lost connection ...:
gateway shutting down"), which our gateway's relay counts as the worker's failure (5 of them open its breaker)."""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
from pdtest import Procs, free_port, start_worker, wait_pools_full

SIM = ("--engine", "sim", "--num-pages", "256", "--page-size", "4", "--engine-option", "decode_step_s=0.05")


def test_requests_open_on_a_stopping_decodes_sglang_side_end_shutting_down(procs: Procs) -> None:
    bootstrap_port = free_port()
    prefill = start_worker(procs, "prefill", *SIM, "--bootstrap-embedded", str(bootstrap_port))
    decode = start_worker(procs, "decode", *SIM)
    answers: dict[str, httpx.Response] = {}

    def post(name: str, port: int, body: dict[str, object]) -> None:
        answers[name] = httpx.post(f"http://127.0.0.1:{port}/generate", json=body, timeout=60)

    threads = []
    for stream in (False, True):  # (some 10 s of decoding each: both open when the signal lands)
        body = {"text": "a request in flight", "sampling_params": {"max_new_tokens": 200}, "stream": stream,
                "bootstrap_host": "127.0.0.1", "bootstrap_port": bootstrap_port, "bootstrap_room": 4242 + stream}
        for role, port in (("prefill", prefill.http_port), ("decode", decode.http_port)):
            threads.append(threading.Thread(target=post, args=(f"{role}-{stream}", port, body)))
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 20
    while decode.get("/load")["num_running"] < 2:  # type: ignore[index]
        assert time.monotonic() < deadline, decode.get("/load")
        time.sleep(0.05)
    decode.proc.send_signal(signal.SIGTERM)
    assert decode.proc.wait(30) == 0
    for thread in threads:
        thread.join(30)
    whole = answers["decode-False"]
    assert whole.status_code == 503 and whole.headers.get("retry-after") == "1", whole.text
    assert whole.json()["error"]["code"] == "shutting_down", whole.text
    streamed = answers["decode-True"]
    events = [line[6:] for line in streamed.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]", events[-3:]
    error = json.loads(events[-2])["error"]
    assert error["code"] == "shutting_down" and error["type"] == "service_unavailable", error
    wait_pools_full([prefill])
