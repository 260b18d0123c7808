"""The chaos runner (``loadtests/chaos.py``) at CI size, and one test for each bug its runs found.

The CI-sized run starts its own cluster (registry, 2 prefill, 2 decode, gateway with migration on,
sim engine), drives streaming and whole requests through every fault of ``CI_FAULTS`` and checks
every invariant (see the runner's docstring); it reaps every child in its own ``finally``.

Bugs the runs found (each test below failed before its fix):
- A restarted prefill listens on a new KV control port, but the decode's registry cache kept the
  dead one for its whole lifetime: every room sent to that prefill failed meanwhile
  (``test_a_restarted_prefill_is_reached_at_its_new_control_port``).
- A transfer failure was held against the worker that reported it, usually the victim: a frozen
  prefill or a registry outage opened the decodes' breakers, and with two of them open the whole
  cluster answered 503 (``test_a_frozen_prefill_is_not_held_against_the_decodes``,
  ``test_a_registry_outage_is_held_against_no_worker``).
- A migrated stream whose new pair failed before its first token ended with an error event,
  migrations and retries left (``test_a_migrated_stream_whose_new_pair_fails_first_is_retried``).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from pdtest import ROOT, Worker, wait_http_ok
from sim_reference import expected_tokens, text_of

sys.path.insert(0, str(ROOT / "loadtests"))  # loadtests is not a package
import chaos

PROMPT = [ord(c) for c in "Chaos finds what a quiet test run never does."]
KV_HEARTBEAT = ("--heartbeat-interval-s", "0.5")  # a silent KV peer is noticed after 1.5 s


def _skip_reason(transfer: str) -> str | None:
    """The backend's own reason it cannot run here (``unavailable_reason()``), or None."""
    from transfer.registry import load_backend

    check = getattr(load_backend(transfer), "unavailable_reason", None)
    return check() if check is not None else None


@pytest.mark.parametrize("transfer", ["tcp", "nixl", "shm", pytest.param("mooncake", marks=pytest.mark.slow)])
def test_ci_sized_chaos_run_keeps_every_invariant(transfer: str, tmp_path: Path) -> None:
    reason = _skip_reason(transfer)
    if reason:
        pytest.skip(reason)
    report = asyncio.run(chaos.run(chaos.ChaosConfig(transfer=transfer, seed=0, log_dir=tmp_path)))
    text = chaos.summary(report)
    print(text)
    assert report.reaped, "every child the run started was reaped"
    assert report.ok, text
    assert [f.name for f in report.faults] == list(chaos.CI_FAULTS) and all(f.recovered for f in report.faults)
    assert sum(report.pages_leaked.values()) == 0


# -- the bugs the chaos runs found ---------------------------------------------------------------
def client(cluster, **kw) -> httpx.Client:  # type: ignore[no-untyped-def]
    return httpx.Client(base_url=cluster.base_url, timeout=60, **kw)


def complete(cluster, prompt: list[int], max_tokens: int) -> httpx.Response:  # type: ignore[no-untyped-def]
    with client(cluster) as http:
        return http.post("/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens})


def workers(cluster) -> dict[str, dict]:  # type: ignore[no-untyped-def,type-arg]
    return {w["url"]: w for w in httpx.get(f"{cluster.base_url}/workers", timeout=10).json()["workers"]}


def blamed(cluster, url: str) -> float:  # type: ignore[no-untyped-def]
    """``pd_gateway_worker_failures_total`` of one worker (every code)."""
    text = httpx.get(f"{cluster.base_url}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("pd_gateway_worker_failures_total{") and f'worker="{url}"' in line)


def wait_until(check: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for: {what}")
        time.sleep(0.05)


def test_a_restarted_prefill_is_reached_at_its_new_control_port(sim_cluster, procs) -> None:  # type: ignore[no-untyped-def]
    cluster = sim_cluster(num_prefill=1, num_decode=1)
    assert complete(cluster, PROMPT, 4).json()["choices"][0]["text"] == text_of(expected_tokens(PROMPT, 4))
    # The decode now has the prefill's control address cached (for 5 s). SIGKILL + restart on the same
    # ports: the new process's control port is another one.
    old = cluster.prefills[0]
    old.proc.kill()
    old.proc.wait()
    proc = procs.start("prefill-restarted", *old.proc.args[1:])  # type: ignore[index]
    wait_http_ok(f"http://127.0.0.1:{old.http_port}/health", 60, proc)
    cluster.prefills[0] = Worker(proc, "prefill", old.port, old.http_port)
    wait_until(lambda: workers(cluster)[old.url]["healthy"], 20, "the gateway uses the restarted prefill")
    # (Before the fix every room went to the dead port until the cache expired; with one prefill every
    # retry did too, and the client got a 502.)
    reply = complete(cluster, [*PROMPT, 1], 4)
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["text"] == text_of(expected_tokens([*PROMPT, 1], 4))
    cluster.wait_pools_full()


def test_a_frozen_prefill_is_not_held_against_the_decodes(sim_cluster) -> None:  # type: ignore[no-untyped-def]
    # Slow probes: the decodes notice the frozen prefill (KV heartbeat, 1.5 s) long before the gateway does.
    cluster = sim_cluster(num_prefill=1, num_decode=2, worker_args=KV_HEARTBEAT,
                          prefill_args=("--engine-option", "prefill_token_s=0.01", "--chunk-size", "8"),
                          gateway_args=("--breaker-failures", "2", "--max-retries", "0", "--health-interval-s", "2",
                                        "--health-timeout-s", "5"))
    prefill = cluster.prefills[0]

    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=cluster.base_url, timeout=60) as http:
            body = {"prompt": PROMPT * 4, "max_tokens": 4}  # ~2 s of prefill, its pages sent chunk by chunk
            pending = [asyncio.create_task(http.post("/v1/completions", json={**body, "prompt": [*PROMPT * 4, i]}))
                       for i in range(4)]
            deadline = time.monotonic() + 10
            while not prefill.get("/load").get("num_running"):  # type: ignore[attr-defined]
                assert time.monotonic() < deadline, "the prefill never started"
                await asyncio.sleep(0.01)
            os.kill(prefill.proc.pid, signal.SIGSTOP)
            try:
                return list(await asyncio.gather(*pending))
            finally:
                os.kill(prefill.proc.pid, signal.SIGCONT)

    replies = asyncio.run(run())
    failed = [r for r in replies if r.status_code != 200]
    assert failed, "the frozen prefill's rooms failed (else this test shows nothing)"
    for reply in failed:
        assert reply.json()["error"]["type"] == "upstream_error", reply.text
    states = workers(cluster)
    for decode in cluster.decodes:
        assert states[decode.url]["breaker"] == "closed", states[decode.url]
        assert blamed(cluster, decode.url) == 0, "the decodes only reported the prefill's silence"
    assert blamed(cluster, prefill.url) >= 1, "the frozen prefill is the one to blame"
    cluster.wait_pools_full()


def test_a_registry_outage_is_held_against_no_worker(sim_cluster, procs) -> None:  # type: ignore[no-untyped-def]
    cluster = sim_cluster(num_prefill=1, num_decode=2, worker_args=KV_HEARTBEAT,
                          gateway_args=("--breaker-failures", "2", "--max-retries", "1"))
    registry = next(p for p in procs.procs if p.name.startswith("bootstrap-"))  # type: ignore[attr-defined]
    registry.kill()
    registry.wait()
    for i in range(4):  # no decode has resolved the prefill yet: every room needs the registry
        reply = complete(cluster, [*PROMPT, i], 4)
        assert reply.status_code == 502 and reply.json()["error"]["type"] == "upstream_error", reply.text
    states = workers(cluster)
    for worker in cluster.workers():
        assert states[worker.url]["breaker"] == "closed", states[worker.url]
        assert blamed(cluster, worker.url) == 0
    # The registry comes back on its port; the prefill registers again with its next heartbeat.
    again = procs.start("bootstrap-again", *registry.args[1:])
    wait_http_ok(f"{cluster.bootstrap_url}/health", 30, again)
    wait_until(lambda: complete(cluster, PROMPT, 4).status_code == 200, 20, "served again")
    cluster.wait_pools_full()


def test_a_migrated_stream_whose_new_pair_fails_first_is_retried(sim_cluster) -> None:  # type: ignore[no-untyped-def]
    """16 streams; one decode is killed while one prefill is frozen: streams that migrate onto the frozen
    prefill must be retried on the other one, not end with an error event."""
    cluster = sim_cluster(num_prefill=2, num_decode=2, worker_args=KV_HEARTBEAT,
                          decode_args=("--engine-option", "decode_step_s=0.03"))
    max_tokens, num_streams = 48, 16
    want = text_of(expected_tokens(PROMPT, max_tokens))
    frozen, killed = cluster.prefills[0], cluster.decodes[0]

    async def stream(http: httpx.AsyncClient, progress: list[int], i: int) -> dict:  # type: ignore[type-arg]
        out: dict = {"text": "", "error": None, "done": False}  # type: ignore[type-arg]
        body = {"prompt": PROMPT, "max_tokens": max_tokens, "stream": True}
        async with http.stream("POST", "/v1/completions", json=body) as reply:
            assert reply.status_code == 200
            async for line in reply.aiter_lines():
                if line == "data: [DONE]":
                    out["done"] = True
                elif line.startswith("data: "):
                    event = json.loads(line[6:])
                    if "error" in event:
                        out["error"] = event["error"]
                    for choice in event.get("choices", ()):
                        out["text"] += choice["text"]
                        progress[i] = len(out["text"])
        return out

    async def run() -> list[dict]:  # type: ignore[type-arg]
        progress = [0] * num_streams
        async with httpx.AsyncClient(base_url=cluster.base_url, timeout=60) as http:
            tasks = [asyncio.create_task(stream(http, progress, i)) for i in range(num_streams)]
            deadline = time.monotonic() + 30
            while min(progress) < 3:
                assert time.monotonic() < deadline, progress
                await asyncio.sleep(0.02)
            os.kill(frozen.proc.pid, signal.SIGSTOP)
            os.kill(killed.proc.pid, signal.SIGKILL)
            try:
                return list(await asyncio.gather(*tasks))
            finally:
                os.kill(frozen.proc.pid, signal.SIGCONT)

    for out in asyncio.run(run()):
        assert out["error"] is None and out["done"], out
        assert out["text"] == want
    cluster.wait_pools_full(alive_only=True)
