"""Operating the gateway on real processes: probes, breakers, retries, admission, drain, keys,
request ids, metrics and the admin API. Every cluster ends with every live worker's KV pool full."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import signal
import socket
import time
from collections.abc import Callable

import httpx
import openai
import pytest
from pdtest import free_port, start_worker, wait_http_ok

PROMPT = [ord(c) for c in "Operators need to trust the gateway under failure."]
SLOW_DECODE = ("--engine-option", "decode_step_s=0.05")


def client(cluster, key: str = "none", **kw) -> openai.OpenAI:  # type: ignore[no-untyped-def]
    return openai.OpenAI(base_url=f"{cluster.base_url}/v1", api_key=key, max_retries=0, timeout=60, **kw)


def workers(cluster, key: str | None = None) -> dict[str, dict]:  # type: ignore[no-untyped-def]
    headers = {"authorization": f"Bearer {key}"} if key else {}
    r = httpx.get(f"{cluster.base_url}/workers", headers=headers, timeout=10)
    assert r.status_code == 200, r.text
    return {w["url"]: w for w in r.json()["workers"]}


def metric(cluster, name: str, **labels: str) -> float:  # type: ignore[no-untyped-def]
    """Sum of a metric's samples whose labels include ``labels``."""
    total = 0.0
    for line in httpx.get(f"{cluster.base_url}/metrics", timeout=10).text.splitlines():
        if not line.startswith(name) or line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        if head.split("{")[0] == name and all(f'{k}="{v}"' in head for k, v in labels.items()):
            total += float(value)
    return total


def wait_until(check: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for: {what}")
        time.sleep(0.1)


FAST_PROBES = ("--health-interval-s", "0.3", "--health-timeout-s", "0.6", "--unhealthy-after", "2",
               "--healthy-after", "2")


def test_frozen_decode_is_detected_failed_over_and_comes_back(sim_cluster) -> None:  # type: ignore[no-untyped-def]
    cluster = sim_cluster(num_decode=2, gateway_args=FAST_PROBES)
    frozen = cluster.decodes[0]
    os.kill(frozen.proc.pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        outs = [client(cluster).completions.create(model="sim", prompt=[*PROMPT, i], max_tokens=4)
                for i in range(4)]  # round robin sends the first to the frozen one: it fails over
        assert all(o.choices[0].finish_reason == "length" for o in outs)
        assert time.monotonic() - started < 20
        wait_until(lambda: workers(cluster)[frozen.url]["healthy"] is False, 10, "frozen decode unhealthy")
        state = workers(cluster)[frozen.url]
        assert state["probe_healthy"] is False and "probe" in (state["probe_error"] or "")
        assert metric(cluster, "pd_gateway_retries_total") >= 1
    finally:
        os.kill(frozen.proc.pid, signal.SIGCONT)
    wait_until(lambda: workers(cluster)[frozen.url]["healthy"] is True, 10, "thawed decode healthy again")
    rooms_before = len(frozen.get("/debug/rooms"))  # type: ignore[arg-type]
    for i in range(4):
        client(cluster).completions.create(model="sim", prompt=[*PROMPT, 50 + i], max_tokens=2)
    assert len(frozen.get("/debug/rooms")) > rooms_before, "the thawed decode serves again"  # type: ignore[arg-type]
    cluster.wait_pools_full()


def test_prefill_killed_before_the_first_token_is_retried_on_another_pair(sim_cluster) -> None:  # type: ignore[no-untyped-def]
    cluster = sim_cluster(num_prefill=2, prefill_args=("--engine-option", "prefill_token_s=0.02"))
    victim = cluster.prefills[0]  # round robin: the first request goes to prefill 0

    async def run() -> openai.types.Completion:
        ac = openai.AsyncOpenAI(base_url=f"{cluster.base_url}/v1", api_key="none", max_retries=0, timeout=60)
        task = asyncio.create_task(ac.completions.create(model="sim", prompt=PROMPT, max_tokens=3))
        await asyncio.sleep(0.4)  # ~1 s of prefill: the request is mid-prefill now
        os.kill(victim.proc.pid, signal.SIGKILL)
        try:
            return await task
        finally:
            await ac.close()

    out = asyncio.run(run())
    assert out.choices[0].finish_reason == "length" and out.usage is not None
    assert metric(cluster, "pd_gateway_retries_total") == 1
    assert len(cluster.prefills[1].get("/debug/rooms")) == 1  # type: ignore[arg-type]
    cluster.wait_pools_full(alive_only=True)


def test_decode_killed_after_the_first_token_is_not_retried(sim_cluster) -> None:  # type: ignore[no-untyped-def]
    """Migration off: the stream ends with an error (tests/integration/test_migration.py has it on)."""
    cluster = sim_cluster(num_decode=2, decode_args=SLOW_DECODE, gateway_args=("--max-migrations", "0"))
    stream = client(cluster).completions.create(model="sim", prompt=PROMPT, max_tokens=200, stream=True)
    assert next(iter(stream)).choices[0].text
    os.kill(cluster.decodes[0].proc.pid, signal.SIGKILL)
    started = time.monotonic()
    with pytest.raises(openai.APIError):
        for _ in stream:
            pass
    assert time.monotonic() - started < 30
    assert metric(cluster, "pd_gateway_retries_total") == 0, "bytes reached the client: no retry"
    out = client(cluster).completions.create(model="sim", prompt=PROMPT, max_tokens=2)  # the other decode
    assert out.choices[0].finish_reason == "length"
    cluster.wait_pools_full(alive_only=True)


def test_breaker_opens_on_a_failing_decode_and_closes_when_it_recovers(sim_cluster, procs) -> None:  # type: ignore[no-untyped-def]
    cluster = sim_cluster(num_decode=1, gateway_args=("--breaker-failures", "2", "--breaker-cooldown-s", "1.5",
                                                       "--breaker-successes", "1", "--retry-backoff-s", "0"))
    # A second decode whose KV pages are another size than the prefill's: every room it takes fails.
    port, http_port = free_port(), free_port()
    common = ("--role", "decode", "--engine", "sim", "--num-pages", "256", "--port", str(port),
              "--http-port", str(http_port), "--log-level", "warning", "--bootstrap", cluster.bootstrap_url)
    bad = procs.start("bad-decode", "-m", "workers.cli", *common, "--page-size", "8")
    wait_http_ok(f"http://127.0.0.1:{http_port}/health", 60, bad)
    url = f"pd://127.0.0.1:{port}"
    admin = httpx.post(f"{cluster.base_url}/workers", json={"url": url, "role": "decode"}, timeout=10)
    assert admin.status_code == 201, admin.text
    wait_until(lambda: workers(cluster)[url]["healthy"], 10, "new decode connected")
    for i in range(6):  # every request still succeeds: a failed decode is retried on the good one
        out = client(cluster).completions.create(model="sim", prompt=[*PROMPT, i], max_tokens=2)
        assert out.choices[0].finish_reason == "length"
    assert workers(cluster)[url]["breaker"] == "open"
    assert metric(cluster, "pd_gateway_worker_breaker_state", worker=url, state="open") == 1
    assert metric(cluster, "pd_gateway_worker_failures_total", worker=url, code="transfer_failed") >= 2
    opened = [line for line in procs.log(f"gateway-{cluster.gateway_port}").splitlines()
              if f"decode worker {url}: breaker opened" in line]
    assert opened and "2 failures in a row" in opened[0] and "transfer_failed" in opened[0], opened  # and why

    # Replace it with a good decode on the same port: after the cool-down a trial succeeds -> closed.
    bad.kill()
    bad.wait()
    start_worker(procs, "decode", "--engine", "sim", "--num-pages", "256", "--page-size", "4", "--port", str(port),
                 bootstrap=cluster.bootstrap_url, name="good-decode")  # (the later --port wins)
    time.sleep(1.6)
    assert workers(cluster)[url]["breaker"] == "half_open"

    def closed() -> bool:
        client(cluster).completions.create(model="sim", prompt=PROMPT, max_tokens=2)
        return bool(workers(cluster)[url]["breaker"] == "closed")

    wait_until(closed, 20, "breaker closed after a successful trial")
    cluster.wait_pools_full(alive_only=True)
    # Removed through the admin API, the worker takes its failure series with it (URLs may never return).
    assert httpx.delete(f"{cluster.base_url}/workers", params={"url": url}, timeout=10).status_code == 202
    wait_until(lambda: url not in workers(cluster), 10, "removed worker gone from the list")
    assert metric(cluster, "pd_gateway_worker_failures_total", worker=url) == 0
    assert metric(cluster, "pd_gateway_worker_probe_failures_total") == 0  # (a counter now; none failed)
    text = httpx.get(f"{cluster.base_url}/metrics", timeout=10).text
    assert "# TYPE pd_gateway_worker_probe_failures_total counter" in text, text
    assert url not in text, [line for line in text.splitlines() if url in line]


def test_admission_limits_queue_and_429_with_retry_after(sim_cluster) -> None:  # type: ignore[no-untyped-def]
    cluster = sim_cluster(decode_args=SLOW_DECODE, gateway_args=(
        "--max-concurrent-requests", "2", "--max-queued-requests", "1", "--queue-timeout-s", "0.5"))

    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=cluster.base_url, timeout=60) as http:
            body = {"prompt": PROMPT, "max_tokens": 20}  # ~1 s each on the slow decode
            return list(await asyncio.gather(*(http.post("/v1/completions", json=body) for _ in range(6))))

    codes = sorted(r.status_code for r in asyncio.run(run()))
    assert codes.count(200) == 2 and codes.count(429) == 4, codes
    rejected = [r for r in asyncio.run(run()) if r.status_code == 429]
    assert all(r.headers["retry-after"] == "1" and r.json()["error"]["type"] == "rate_limit_error" for r in rejected)
    assert metric(cluster, "pd_gateway_rejected_requests_total", reason="queue_full") >= 3
    assert metric(cluster, "pd_gateway_rejected_requests_total", reason="queue_timeout") >= 1
    cluster.wait_pools_full()


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_client_leaving_the_queue_gives_up_its_place(sim_cluster, stream: bool) -> None:  # type: ignore[no-untyped-def]
    """One slot, one queue place: a queued client that closes its connection leaves the queue then (a
    499), so the next client queues instead of getting a 429 while the place is held by nobody."""
    cluster = sim_cluster(decode_args=SLOW_DECODE, gateway_args=(
        "--max-concurrent-requests", "1", "--max-queued-requests", "1", "--queue-timeout-s", "30"))
    host, port = cluster.base_url.removeprefix("http://").split(":")
    left_before = metric(cluster, "pd_gateway_requests_total", route="completions", status="499")

    async def run() -> tuple[int, int]:
        async with httpx.AsyncClient(base_url=cluster.base_url, timeout=60) as http:
            body = {"prompt": PROMPT, "max_tokens": 20}  # ~1 s on the slow decode: holds the slot
            first = asyncio.create_task(http.post("/v1/completions", json=body))
            await asyncio.sleep(0.3)
            payload = json.dumps({"prompt": PROMPT, "max_tokens": 2, "stream": stream}).encode()
            _, writer = await asyncio.open_connection(host, int(port))
            writer.write(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                         b"content-length: %d\r\n\r\n%b" % (len(payload), payload))
            await writer.drain()
            await asyncio.sleep(0.2)  # queued behind the first
            writer.close()
            await asyncio.sleep(0.2)
            third = await http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
            return (await first).status_code, third.status_code

    assert asyncio.run(run()) == (200, 200)
    assert metric(cluster, "pd_gateway_requests_total", route="completions", status="499") == left_before + 1
    assert metric(cluster, "pd_gateway_rejected_requests_total", reason="queue_timeout") == 0
    cluster.wait_pools_full()


def _scrape(sock: socket.socket) -> tuple[bytes, bytes]:
    """GET /metrics on a kept-alive raw connection: (head, body)."""
    sock.sendall(b"GET /metrics HTTP/1.1\r\nhost: x\r\n\r\n")
    data = b""

    def more() -> bytes:
        piece = sock.recv(65536)
        if not piece:
            raise ConnectionError("the gateway closed the connection")
        return piece

    while b"\r\n\r\n" not in data:
        data += more()
    head, body = data.split(b"\r\n\r\n", 1)
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length")))
    while len(body) < length:
        body += more()
    return head.lower(), body


def test_drain_on_sigterm_finishes_open_streams_and_refuses_new_ones(sim_cluster) -> None:  # type: ignore[no-untyped-def]
    # (a keep-alive wait longer than the test: an idle connection closes by the drain's end, not by its own timer)
    cluster = sim_cluster(decode_args=SLOW_DECODE, gateway_args=("--drain-timeout-s", "20",
                                                                 "--keep-alive-timeout-s", "120"))
    gateway = next(p for p in cluster.procs.procs if getattr(p, "name", "").startswith("gateway-"))
    http = httpx.Client(base_url=cluster.base_url, timeout=30)
    # Two clients with a kept-alive connection each, idle when the drain begins: a load balancer's, a scraper's.
    client = httpx.Client(base_url=cluster.base_url, timeout=30)
    host, port = cluster.base_url.split("//", 1)[1].split(":")
    scraper = socket.create_connection((host, int(port)), timeout=30)
    assert client.get("/health").status_code == 200 and _scrape(scraper)[0].startswith(b"http/1.1 200")
    with http.stream("POST", "/v1/completions", json={"prompt": PROMPT, "max_tokens": 30, "stream": True}) as r:
        chunks = r.iter_lines()
        assert next(chunks).startswith("data: ")
        gateway.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        with pytest.raises(httpx.ConnectError):  # the listener is closed
            httpx.get(f"{cluster.base_url}/health", timeout=5)
        # Idle kept-alive connections stay open while a response is going out: a request on one is answered
        # (a generation route: 503, and the connection closes; metrics: served, its open request still
        # counted, and the connection kept, so that the scraper reads on until the drain ends).
        refused = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
        assert refused.status_code == 503 and refused.headers.get("connection") == "close", refused.text
        assert refused.json()["error"]["type"] == "service_unavailable"
        for _ in range(3):
            head, body = _scrape(scraper)
            assert head.startswith(b"http/1.1 200") and b"connection: close" not in head, head
            assert b"pd_gateway_active_requests 1.0" in body
        rest = list(chunks)
    assert "data: [DONE]" in rest
    assert any('"finish_reason":"length"' in line for line in rest), "the open stream ran to its end"
    scraper.settimeout(10)  # (well before the drain's own end, at 20 s, which would close it anyway)
    assert scraper.recv(1) == b"", "the scraper's connection was not closed with the drain's last response"
    scraper.close()
    assert gateway.wait(30) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal once drained
    cluster.wait_pools_full()


def test_a_drain_whose_last_client_leaves_closes_the_idle_connections_at_once(sim_cluster) -> None:  # type: ignore[no-untyped-def]
    """Idle kept-alive connections stay open during a drain while a response is going out; when the last one
    ends with its client leaving (not with its last byte), they close then, and the gateway exits, rather than
    at the end of their keep-alive wait (set above a load balancer's idle timeout: here 120 s)."""
    cluster = sim_cluster(decode_args=SLOW_DECODE, gateway_args=("--drain-timeout-s", "120",
                                                                 "--keep-alive-timeout-s", "120"))
    gateway = next(p for p in cluster.procs.procs if getattr(p, "name", "").startswith("gateway-"))
    idle = httpx.Client(base_url=cluster.base_url, timeout=30)
    assert idle.get("/health").status_code == 200
    with httpx.Client(base_url=cluster.base_url, timeout=30) as http, \
            http.stream("POST", "/v1/completions", json={"prompt": PROMPT, "max_tokens": 400, "stream": True}) as r:
        chunks = r.iter_lines()
        assert next(chunks).startswith("data: ")
        gateway.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        assert gateway.poll() is None, "the drain did not wait for the open stream"
    # (its client left with some 20 s of decoding to go)
    assert gateway.wait(30) in (0, -signal.SIGTERM), "the gateway waited for its idle connections' keep-alive"
    with pytest.raises(httpx.TransportError):
        idle.get("/health")
    cluster.wait_pools_full()


def test_drain_timeout_aborts_what_is_left_on_both_workers(sim_cluster) -> None:  # type: ignore[no-untyped-def]
    cluster = sim_cluster(decode_args=SLOW_DECODE, gateway_args=("--drain-timeout-s", "1"))
    gateway = next(p for p in cluster.procs.procs if getattr(p, "name", "").startswith("gateway-"))
    long = {"prompt": PROMPT, "max_tokens": 400}  # ~20 s of decoding (two of them fit the decode's pool)
    started = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        whole = pool.submit(httpx.post, f"{cluster.base_url}/v1/completions", json=long, timeout=30)
        with httpx.stream("POST", f"{cluster.base_url}/v1/completions", timeout=30,
                          json={**long, "stream": True}) as r:
            lines = r.iter_lines()
            assert r.status_code == 200 and next(lines).startswith("data: {")
            deadline = time.monotonic() + 10
            while metric(cluster, "pd_gateway_active_requests") < 2 and time.monotonic() < deadline:
                time.sleep(0.05)  # (the whole one is being served too)
            gateway.send_signal(signal.SIGTERM)
            received = list(lines)  # (cut off mid-body, this raises)
        cut = whole.result()
    assert time.monotonic() - started < 15
    # The client is told why: an error event and the stream's end, a 503 for an answer not begun.
    assert not any('"finish_reason":"length"' in x for x in received)
    events = [line[6:] for line in received if line.startswith("data: ")]
    assert events[-1] == "[DONE]", events[-3:]
    error = json.loads(events[-2])["error"]
    assert error["type"] == "service_unavailable" and error["code"] == "shutting_down", error
    assert cut.status_code == 503 and cut.json()["error"]["code"] == "shutting_down", cut.text
    assert gateway.wait(30) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal once drained
    cluster.wait_pools_full()


def test_api_keys_admin_key_request_ids_and_json_logs(sim_cluster) -> None:  # type: ignore[no-untyped-def]
    cluster = sim_cluster(gateway_args=("--api-key", "k1", "--api-key", "k2", "--admin-api-key", "adm",
                                        "--log-format", "json", "--log-level", "info"))
    with pytest.raises(openai.AuthenticationError) as info:
        client(cluster, "wrong").completions.create(model="sim", prompt=PROMPT, max_tokens=2)
    assert info.value.status_code == 401 and info.value.code == "invalid_api_key"
    out = client(cluster, "k2").completions.create(model="sim", prompt=PROMPT, max_tokens=2)
    assert out.choices[0].finish_reason == "length"
    assert httpx.get(f"{cluster.base_url}/workers", headers={"authorization": "Bearer k1"}).status_code == 401
    assert len(workers(cluster, "adm")) == 2
    assert httpx.get(f"{cluster.base_url}/health").status_code == 200
    assert httpx.get(f"{cluster.base_url}/metrics").status_code == 200

    r = httpx.post(f"{cluster.base_url}/v1/completions", json={"prompt": PROMPT, "max_tokens": "many"},
                   headers={"authorization": "Bearer k1", "x-request-id": "req-42"})
    assert r.status_code == 400 and r.headers["x-request-id"] == "req-42"
    generated = httpx.post(f"{cluster.base_url}/v1/completions", headers={"authorization": "Bearer k1"},
                           json={"prompt": PROMPT, "max_tokens": 1}).headers["x-request-id"]
    assert len(generated) == 32
    gateway_log = next(cluster.procs.log(n) for n in _names(cluster) if n.startswith("gateway-"))
    entries = [json.loads(line) for line in gateway_log.splitlines() if line.startswith("{")]
    assert any(e["request_id"] == "req-42" and "400" in e["message"] for e in entries), entries[-5:]
    assert "k1" not in gateway_log and "adm" not in gateway_log, "keys are never logged"
    cluster.wait_pools_full()


def _names(cluster) -> list[str]:  # type: ignore[no-untyped-def]
    return [getattr(p, "name", "") for p in cluster.procs.procs]


def test_admin_api_adds_and_drains_workers_with_sglang_aliases(sim_cluster, procs) -> None:  # type: ignore[no-untyped-def]
    cluster = sim_cluster(decode_args=SLOW_DECODE)
    extra = start_worker(procs, "decode", "--engine", "sim", "--num-pages", "256", "--page-size", "4",
                         *SLOW_DECODE, bootstrap=cluster.bootstrap_url, name="extra-decode")
    r = httpx.post(f"{cluster.base_url}/add_worker", params={"url": extra.url, "worker_type": "decode"})  # (SGLang's)
    assert r.status_code == 201 and r.json()["role"] == "decode", r.text
    assert httpx.post(f"{cluster.base_url}/workers", json={"url": extra.url, "role": "decode"}).status_code == 409
    address = extra.url.removeprefix("pd://")
    for alias in (f"pd://{address}/", address, f"tcp://{address}"):  # the same worker, spelled otherwise
        again = httpx.post(f"{cluster.base_url}/workers", json={"url": alias, "role": "decode"})
        assert again.status_code == 409, (alias, again.text)
    for bad_url in (f"pd://{address}/v1", f"pd://{address}?x=1", "pd://127.0.0.1:99999", "pd://127.0.0.1:0",
                    "pd:// 127.0.0.1:1", "pd://h%00:1"):
        refused = httpx.post(f"{cluster.base_url}/workers", json={"url": bad_url, "role": "decode"})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "url", (bad_url, refused.text)
    bad = httpx.post(f"{cluster.base_url}/workers", json={"url": "http://nope", "role": "decode"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "url"
    assert httpx.post(f"{cluster.base_url}/workers", json={"url": extra.url}).status_code == 400
    bad_role = httpx.post(f"{cluster.base_url}/workers", json={"url": extra.url, "role": "decoder"})
    assert bad_role.status_code == 400 and bad_role.json()["error"]["param"] == "role", bad_role.text
    wait_until(lambda: workers(cluster)[extra.url]["healthy"], 10, "added decode healthy")
    listed = httpx.get(f"{cluster.base_url}/list_workers").json()["workers"]
    assert {w["url"] for w in listed} == {*(w.url for w in cluster.workers()), extra.url}

    # Remove the original decode while a stream runs on it: the stream finishes, new requests avoid it.
    old = cluster.decodes[0]
    with httpx.stream("POST", f"{cluster.base_url}/v1/completions", timeout=30,
                      json={"prompt": PROMPT, "max_tokens": 30, "stream": True}) as stream:
        lines = stream.iter_lines()
        next(lines)
        busy = next(w for w in (old, extra) if w.get("/load")["num_running"])  # type: ignore[index]
        removed = httpx.delete(f"{cluster.base_url}/workers", params={"url": busy.url})
        assert removed.status_code == 202 and removed.json()["draining"] is True
        again = httpx.post(f"{cluster.base_url}/workers", json={"url": busy.url, "role": "decode"})
        assert again.status_code == 409 and "being removed" in again.json()["error"]["message"], again.text
        out = client(cluster).completions.create(model="sim", prompt=PROMPT, max_tokens=2)
        assert out.choices[0].finish_reason == "length"
        assert any('"finish_reason":"length"' in line for line in lines), "the drained worker finished its stream"
    wait_until(lambda: busy.url not in workers(cluster), 10, "removed worker gone from the list")
    assert httpx.post(f"{cluster.base_url}/remove_worker", params={"url": busy.url}).status_code == 404
    cluster.wait_pools_full()


def test_openai_client_suite_and_request_metrics(sim_cluster) -> None:  # type: ignore[no-untyped-def]
    cluster = sim_cluster()
    c = client(cluster)
    chunks = list(c.chat.completions.create(model="sim", messages=[{"role": "user", "content": "hi"}], max_tokens=8,
                                            stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 8
    n2 = c.completions.create(model="sim", prompt=PROMPT, max_tokens=5, n=2, logprobs=1)
    assert len(n2.choices) == 2 and all(len(ch.logprobs.token_logprobs) == 5 for ch in n2.choices)  # type: ignore[union-attr]
    full = c.completions.create(model="sim", prompt=PROMPT, max_tokens=12).choices[0].text
    stopped = c.completions.create(model="sim", prompt=PROMPT, max_tokens=12, stop=[full[3:5]])
    assert stopped.choices[0].finish_reason == "stop" and stopped.choices[0].text == full[:full.index(full[3:5])]
    with pytest.raises(openai.BadRequestError) as bad:
        c.completions.create(model="sim", prompt=PROMPT, max_tokens=-1)
    assert bad.value.status_code == 400
    with pytest.raises(openai.NotFoundError) as missing:
        c.completions.create(model="no-such-model", prompt=PROMPT, max_tokens=2)
    assert missing.value.code == "model_not_found"
    assert metric(cluster, "pd_gateway_time_to_first_token_seconds_count") >= 5
    assert metric(cluster, "pd_gateway_inter_token_latency_seconds_count") >= 7
    assert metric(cluster, "pd_gateway_e2e_request_latency_seconds_count") >= 5
    assert metric(cluster, "pd_gateway_generation_tokens_total") >= 8 + 10 + 12
    assert metric(cluster, "pd_gateway_requests_total", route="completions", status="400") == 1
    # Prompt tokens are counted once per prompt whatever n (as the response's usage), generated ones per choice.
    before = {name: metric(cluster, name) for name in ("pd_gateway_prompt_tokens_total",
                                                       "pd_gateway_generation_tokens_total")}
    batch = c.completions.create(model="sim", prompt=["abc", "defgh"], max_tokens=4, n=3)
    assert batch.usage is not None and batch.usage.prompt_tokens == 3 + 5
    assert metric(cluster, "pd_gateway_prompt_tokens_total") - before["pd_gateway_prompt_tokens_total"] == 8
    assert metric(cluster, "pd_gateway_generation_tokens_total") - before["pd_gateway_generation_tokens_total"] == \
        batch.usage.completion_tokens == 2 * 3 * 4
    # /generate's max_new_tokens 0 (the prompt alone, SGLang's scoring) runs for one token it does not answer
    # with: no generated token is counted, whole, batched or streamed; its prompt is
    before = {name: metric(cluster, name) for name in ("pd_gateway_prompt_tokens_total",
                                                       "pd_gateway_generation_tokens_total")}
    for body in ({"text": "abcd"}, {"text": ["ab", "cde"]}, {"text": "abcd", "stream": True}):
        reply = httpx.post(f"{cluster.base_url}/generate", timeout=30,
                           json={**body, "sampling_params": {"max_new_tokens": 0}})
        assert reply.status_code == 200, reply.text
    assert metric(cluster, "pd_gateway_generation_tokens_total") == before["pd_gateway_generation_tokens_total"]
    assert metric(cluster, "pd_gateway_prompt_tokens_total") > before["pd_gateway_prompt_tokens_total"]
    cluster.wait_pools_full()


def test_readiness_follows_the_workers(sim_cluster) -> None:  # type: ignore[no-untyped-def]
    cluster = sim_cluster(gateway_args=FAST_PROBES)
    assert httpx.get(f"{cluster.base_url}/readiness").status_code == 200
    cluster.decodes[0].proc.kill()
    cluster.decodes[0].proc.wait()
    wait_until(lambda: httpx.get(f"{cluster.base_url}/readiness").status_code == 503, 10, "not ready")
    health = httpx.get(f"{cluster.base_url}/health")
    assert health.status_code == 200 and health.json()["ready"] is False, "liveness: the gateway itself is fine"


def test_a_worker_down_at_start_up_does_not_hold_the_gateway_back(sim_cluster, procs) -> None:  # type: ignore[no-untyped-def]
    """A gateway whose list names a worker that is down serves once a pair is ready, not after its start-up
    timeout (60 s here, 30 s for this test's wait): its port was closed, /health included, until then."""
    cluster = sim_cluster()
    dead = f"pd://127.0.0.1:{free_port()}"  # nothing listens there
    port = free_port()
    proc = procs.start(f"gateway-{port}", "-m", "gateway.cli", "--port", str(port), "--log-level", "warning",
                       "--prefill", cluster.prefills[0].url, dead, "--decode", cluster.decodes[0].url,
                       "--startup-timeout-s", "60")
    wait_http_ok(f"http://127.0.0.1:{port}/readiness", 30, proc)
    out = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0).completions.create(
        model="sim", prompt=PROMPT, max_tokens=4)
    assert out.choices[0].finish_reason == "length"
    listed = httpx.get(f"http://127.0.0.1:{port}/health").json()["workers"]
    assert {w["url"]: w["healthy"] for w in listed}[dead] is False


def test_decode_killed_before_the_first_token_is_retried(sim_cluster) -> None:  # type: ignore[no-untyped-def]
    cluster = sim_cluster(num_decode=2, prefill_args=("--engine-option", "prefill_token_s=0.02"))
    victim = cluster.decodes[0]  # round robin: the first request's decode

    async def run() -> openai.types.Completion:
        ac = openai.AsyncOpenAI(base_url=f"{cluster.base_url}/v1", api_key="none", max_retries=0, timeout=60)
        task = asyncio.create_task(ac.completions.create(model="sim", prompt=PROMPT, max_tokens=3))
        await asyncio.sleep(0.4)  # the prefill is still computing: no token yet
        os.kill(victim.proc.pid, signal.SIGKILL)
        try:
            return await task
        finally:
            await ac.close()

    assert asyncio.run(run()).choices[0].finish_reason == "length"
    assert metric(cluster, "pd_gateway_retries_total") == 1
    cluster.wait_pools_full(alive_only=True)


def test_prefill_killed_after_the_first_token_does_not_disturb_the_stream(sim_cluster) -> None:  # type: ignore[no-untyped-def]
    cluster = sim_cluster(decode_args=SLOW_DECODE)
    stream = client(cluster).completions.create(model="sim", prompt=PROMPT, max_tokens=20, stream=True)
    chunks = iter(stream)
    assert next(chunks).choices[0].text
    os.kill(cluster.prefills[0].proc.pid, signal.SIGKILL)  # the decode already holds the KV
    rest = list(chunks)
    assert rest[-1].choices[0].finish_reason == "length"
    cluster.wait_pools_full(alive_only=True)


def test_a_slow_worker_ends_in_a_clear_timeout_not_a_hang(sim_cluster) -> None:  # type: ignore[no-untyped-def]
    cluster = sim_cluster(prefill_args=("--engine-option", "prefill_token_s=0.1"),
                          gateway_args=("--first-token-timeout-s", "1.5"))
    started = time.monotonic()
    with pytest.raises(openai.APIStatusError) as info:
        client(cluster).completions.create(model="sim", prompt=PROMPT, max_tokens=2)  # ~5 s of prefill
    assert info.value.status_code == 504 and time.monotonic() - started < 10
    cluster.wait_pools_full()
