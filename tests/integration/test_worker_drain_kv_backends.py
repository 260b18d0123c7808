"""``pd-worker --drain-timeout-s S`` over the production KV backends, Mooncake (TCP transport) and NIXL (UCX over
tcp): a prefill SIGTERMed while a room's KV is still being written finishes the prompt and hands the whole KV to the
decode holding the room; a decode SIGTERMed mid-stream finishes the stream; either way the answer is the exact one
(``sim_reference``), the draining worker refuses a new request, ends its drain with nothing left held, and exits 0,
and its peer's KV pool is full again. (``test_worker_drain_on_sigterm`` covers the tcp backend.)

Real processes, driven as SGLang's routers drive a pair (the same body to both workers' HTTP API), the same-host
shared-memory path off so that the backend's own bytes move. Mooncake binds every interface: its tests run again
inside a network namespace of their own (``unshare --net``, loopback up; root), and skip where that cannot be made.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from pdtest import Procs, Worker, free_port, in_private_netns, start_worker, wait_pools_full
from sim_reference import expected_tokens, text_of

ROOT = Path(__file__).resolve().parents[2]
BACKENDS = ["mooncake", "nixl"]
# (the backend's bytes, not the same-host shared memory; UCX over tcp, the network-like path)
ENV = {"UCX_TLS": "tcp", "NIXL_LOG_LEVEL": "WARN", "MC_LOG_LEVEL": "ERROR"}
INNER = "PD_DRAIN_TEST_IN_NETNS"  # set in the re-run inside the namespace (where it must not re-run again)
SIM = ("--engine", "sim", "--num-pages", "256", "--page-size", "4", "--same-host-kv", "off", "--log-level", "info")
DRAIN_DONE = re.compile(r"drain done: 0 of (\d+) requests still held")


def _transfer_args(transfer: str) -> tuple[str, ...]:
    options = {"mooncake": ("protocol=tcp",), "nixl": ("ucx_tls=tcp",)}[transfer]
    return ("--transfer", transfer, *(arg for opt in options for arg in ("--transfer-option", opt)))


def _env(transfer: str) -> dict[str, str]:
    env = dict(ENV)
    if transfer == "nixl" and not in_private_netns():
        env["UCX_NET_DEVICES"] = "lo"
    return env


def _ran_elsewhere(request: pytest.FixtureRequest, transfer: str) -> bool:
    """Mooncake outside a private network namespace: run this test again inside one of its own (loopback up) and
    answer True (its outcome is this test's); else False (run here). Skips where the backend is not installed or
    the namespace cannot be made."""
    if transfer == "mooncake" and importlib.util.find_spec("mooncake") is None:
        pytest.skip("mooncake-transfer-engine is not installed")
    if transfer == "nixl" and not any(importlib.util.find_spec(m) for m in ("nixl_cu12", "nixl_cu13", "nixl")):
        pytest.skip("nixl is not installed")
    if transfer != "mooncake" or in_private_netns():
        return False
    if os.environ.get(INNER):
        pytest.fail("inside the namespace made for it, the test still is not in a private network namespace")
    if os.geteuid() != 0 or shutil.which("unshare") is None or shutil.which("ip") is None:
        pytest.skip("Mooncake binds 0.0.0.0: its drain tests need a private network namespace (root, unshare, ip)")
    script = 'ip link set lo up && exec "$0" -m pytest -q -p no:cacheprovider --timeout 240 "$1"'
    nodeid = f"{Path(request.node.path).relative_to(ROOT)}::{request.node.name}"
    run = subprocess.run(["unshare", "--net", "--", "sh", "-c", script, sys.executable, nodeid], cwd=ROOT,
                         capture_output=True, text=True, timeout=300, env={**os.environ, INNER: "1"})
    out = run.stdout + run.stderr
    if run.returncode == 0 and re.search(r"\b1 skipped\b", out) and not re.search(r"\b1 passed\b", out):
        pytest.skip(f"skipped inside the namespace: {out[-500:]}")
    assert run.returncode == 0 and re.search(r"\b1 passed\b", out), out[-6000:]
    return True


def _metric(worker: Worker, line_start: str) -> float:
    """The value of the first ``/metrics`` sample whose line starts with ``line_start`` (0 if none)."""
    text = httpx.get(f"http://127.0.0.1:{worker.http_port}/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith(line_start):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _load(worker: Worker) -> dict[str, Any]:
    """The worker's ``/load`` report (fields at their default are left out of it)."""
    report = worker.get("/load")
    assert isinstance(report, dict), report
    return report


def _rooms(worker: Worker) -> list[dict[str, Any]]:
    """The rooms the worker finished (``/debug/rooms``)."""
    rooms = worker.get("/debug/rooms")
    assert isinstance(rooms, list), rooms
    return rooms


def _wait(what: str, check: Callable[[], bool], timeout_s: float = 30.0) -> None:
    """Poll ``check()`` until true (a hang guard, not a speed assertion)."""
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def _body(bootstrap_port: int, room: int, prompt: list[int], max_new_tokens: int, stream: bool) -> dict[str, object]:
    return {"input_ids": prompt, "stream": stream, "bootstrap_host": "127.0.0.1", "bootstrap_port": bootstrap_port,
            "bootstrap_room": room,
            "sampling_params": {"max_new_tokens": max_new_tokens, "ignore_eos": True, "temperature": 0}}


def _post_pair(answers: dict[str, httpx.Response], tag: str, prefill: Worker, decode: Worker,
               body: dict[str, object]) -> list[threading.Thread]:
    def post(name: str, port: int) -> None:
        answers[name] = httpx.post(f"http://127.0.0.1:{port}/generate", json=body, timeout=120)

    threads = [threading.Thread(target=post, args=(f"{role}-{tag}", worker.http_port))
               for role, worker in (("prefill", prefill), ("decode", decode))]
    for thread in threads:
        thread.start()
    return threads


def _streamed_text(response: httpx.Response) -> tuple[str, dict[str, Any]]:
    """A streamed SGLang answer's whole text and its last chunk (no error chunk, ``[DONE]`` last)."""
    assert response.status_code == 200, response.text
    events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
    assert events and events[-1] == "[DONE]", events[-3:]
    chunks = [json.loads(event) for event in events[:-1]]
    assert chunks and not any("error" in chunk for chunk in chunks), chunks[-2:]
    return str(chunks[-1]["text"]), chunks[-1]


def _drained_clean(procs: Procs, worker: Worker, transfer: str) -> None:
    """The draining worker exits 0, its log saying that its drain ended with nothing left held (so no request
    ended ``shutting_down`` and every page it held was given back before its KV manager closed)."""
    assert worker.proc.wait(60) == 0
    log = procs.log(f"{worker.role}-{transfer}")
    assert DRAIN_DONE.search(log), log[-3000:]
    assert "Traceback" not in log, log[-3000:]


def _pair(procs: Procs, transfer: str, prefill_args: tuple[str, ...] = (),
          decode_args: tuple[str, ...] = ()) -> tuple[int, Worker, Worker]:
    bootstrap_port = free_port()
    env = _env(transfer)
    prefill = start_worker(procs, "prefill", *SIM, *_transfer_args(transfer), "--bootstrap-embedded",
                           str(bootstrap_port), *prefill_args, name=f"prefill-{transfer}", env=env)
    decode = start_worker(procs, "decode", *SIM, *_transfer_args(transfer), *decode_args, name=f"decode-{transfer}",
                          env=env)
    return bootstrap_port, prefill, decode


@pytest.mark.slow
@pytest.mark.parametrize("transfer", BACKENDS)
def test_a_prefill_sigtermed_mid_kv_write_hands_over_the_whole_kv(procs: Procs, request: pytest.FixtureRequest,
                                                                    transfer: str) -> None:
    """SIGTERM reaches the prefill once the first chunks of a room's KV went out over the backend and while later
    chunks are still being computed (8-token chunks of a 160-token prompt, 20 ms a token): it finishes the prompt,
    writes the rest of the KV, and the decode answers exactly what an undisturbed pair answers."""
    if _ran_elsewhere(request, transfer):
        return
    bootstrap_port, prefill, decode = _pair(
        procs, transfer, prefill_args=("--chunk-size", "8", "--engine-option", "prefill_token_s=0.02",
                                       "--drain-timeout-s", "120"))
    prompt = [(7 * i) % 200 + 32 for i in range(160)]
    answers: dict[str, httpx.Response] = {}
    threads = _post_pair(answers, "1", prefill, decode, _body(bootstrap_port, 9101, prompt, 8, stream=False))
    sent = 'pd_worker_kv_transfer_bytes_total{direction="sent",role="prefill"}'
    _wait("no KV byte sent while the prompt was computed",
          lambda: _metric(prefill, sent) > 0 and _load(prefill)["num_running"] >= 1)
    assert _metric(prefill, f'pd_worker_kv_peers{{path="{transfer}",role="prefill"}}') == 1.0
    prefill.proc.send_signal(signal.SIGTERM)
    _wait("/health never turned 503 stopping", lambda: prefill.health_status() == 503)
    refused = httpx.post(f"http://127.0.0.1:{prefill.http_port}/generate",
                         json=_body(bootstrap_port, 9102, prompt[:8], 4, stream=False), timeout=60)
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down", refused.text
    for thread in threads:
        thread.join(120)
    assert answers["prefill-1"].status_code == 200, answers["prefill-1"].text
    answer = answers["decode-1"]
    assert answer.status_code == 200, answer.text
    assert answer.json()["text"] == text_of(expected_tokens(prompt, 8)), answer.text
    assert answer.json()["meta_info"]["completion_tokens"] == 8, answer.text
    (room,) = _rooms(decode)
    assert room["room"] == 9101 and room["kv_verified"] is True, room  # (every page of the prompt's KV landed)
    _drained_clean(procs, prefill, transfer)
    wait_pools_full([decode])


@pytest.mark.slow
@pytest.mark.parametrize("transfer", BACKENDS)
def test_a_decode_sigtermed_mid_stream_finishes_it(procs: Procs, request: pytest.FixtureRequest,
                                                   transfer: str) -> None:
    """SIGTERM reaches the decode while it streams one request (60 tokens, 50 ms a step) and another's KV is still
    arriving (a 200-token prompt in 8-token chunks, 10 ms a token): both run to their end with the exact tokens, a
    request sent meanwhile is refused ``shutting_down`` (its prefill told at once: 429), and the decode gives back
    the finished stream's pages while the drain runs on for the other."""
    if _ran_elsewhere(request, transfer):
        return
    bootstrap_port, prefill, decode = _pair(
        procs, transfer, prefill_args=("--chunk-size", "8", "--engine-option", "prefill_token_s=0.01"),
        decode_args=("--engine-option", "decode_step_s=0.05", "--drain-timeout-s", "120"))
    short, long = [(3 * i) % 90 + 33 for i in range(37)], [(5 * i) % 90 + 33 for i in range(200)]
    answers: dict[str, httpx.Response] = {}
    threads = _post_pair(answers, "short", prefill, decode, _body(bootstrap_port, 9201, short, 60, stream=True))
    _wait("the decode never streamed", lambda: _load(decode)["num_running"] >= 1)
    threads += _post_pair(answers, "long", prefill, decode, _body(bootstrap_port, 9202, long, 40, stream=True))
    _wait("the long prompt's KV never began to arrive", lambda: _load(decode).get("num_transfer_seqs", 0) >= 1
          and _load(prefill)["num_running"] >= 1)
    both_free = _load(decode)["num_free_pages"]
    assert _metric(prefill, f'pd_worker_kv_peers{{path="{transfer}",role="prefill"}}') == 1.0
    decode.proc.send_signal(signal.SIGTERM)
    _wait("/health never turned 503 stopping", lambda: decode.health_status() == 503)
    refused = _post_pair(answers, "refused", prefill, decode, _body(bootstrap_port, 9203, short, 4, stream=False))
    for thread in refused:
        thread.join(60)
    assert answers["decode-refused"].status_code == 503, answers["decode-refused"].text
    assert answers["decode-refused"].json()["error"]["code"] == "shutting_down", answers["decode-refused"].text
    assert answers["prefill-refused"].status_code == 429, answers["prefill-refused"].text
    threads[1].join(60)  # (the short stream's decode side)
    text, last = _streamed_text(answers["decode-short"])
    assert text == text_of(expected_tokens(short, 60)), (text, last)
    assert last["meta_info"]["finish_reason"]["type"] == "length", last
    short_pages = -(-(len(short) + 60 - 1) // 4)  # (its reservation: prompt and outputs but the last, 4 a page)
    # (the finished stream's pages back in the pool while the other still runs: the drain frees as it goes)
    _wait("the finished stream's pages never came back", lambda: decode.proc.poll() is not None
          or _load(decode)["num_free_pages"] >= both_free + short_pages)
    assert decode.proc.poll() is None, "the decode ended its drain with a stream still open"
    for thread in threads:
        thread.join(120)
    text, last = _streamed_text(answers["decode-long"])
    assert text == text_of(expected_tokens(long, 40)), (text, last)
    (room,) = [r for r in _rooms(prefill) if r["room"] == 9202]
    assert room["prompt_tokens"] == 200, room
    assert all(answers[f"prefill-{tag}"].status_code == 200 for tag in ("short", "long"))
    _drained_clean(procs, decode, transfer)
    wait_pools_full([prefill])
