"""A prefill draining on SIGTERM (``--drain-timeout-s S``) stays findable in the bootstrap registry for the rooms it
holds: a decode that looks it up only after the drain began still gets its address and the request completes, while
the registry's listing flags the instance ``draining`` (nothing new should be routed there) and the prefill
deregisters once the drain ends. Real processes: a ``pd-bootstrap`` registry, a prefill and a decode (sim engine),
driven over SGLang's HTTP PD API as SGLang's routers do."""

from __future__ import annotations

import signal
import threading
import time
from typing import Any

import httpx
from pdtest import Procs, Worker, start_bootstrap, start_worker, wait_pools_full

SIM = ("--engine", "sim", "--num-pages", "256", "--page-size", "4", "--engine-option", "decode_step_s=0.02")


def _ranks(registry: str) -> list[dict[str, Any]]:
    listing = httpx.get(f"{registry}/instances", timeout=5).json()
    return [rank for instance in listing["instances"] for rank in instance["ranks"]]


def test_a_decode_that_looks_the_prefill_up_after_sigterm_still_gets_its_kv(procs: Procs) -> None:
    """Before: the prefill deregistered at SIGTERM, so this decode's look-up found nothing and it failed the request
    at once, while the prefill held the room until its drain timed out."""
    registry = start_bootstrap(procs)
    port = int(registry.rsplit(":", 1)[1])
    prefill = start_worker(procs, "prefill", *SIM, "--drain-timeout-s", "30", bootstrap=registry)
    decode = start_worker(procs, "decode", *SIM, bootstrap=registry)
    answers: dict[str, httpx.Response] = {}
    body = {"input_ids": list(range(1, 41)), "bootstrap_host": "127.0.0.1", "bootstrap_port": port,
            "bootstrap_room": 7301, "sampling_params": {"max_new_tokens": 8, "ignore_eos": True, "temperature": 0}}

    def post(role: str, worker: Worker) -> None:
        answers[role] = httpx.post(f"http://127.0.0.1:{worker.http_port}/generate", json=body, timeout=60)

    to_prefill = threading.Thread(target=post, args=("prefill", prefill))
    to_prefill.start()
    deadline = time.monotonic() + 20
    while True:  # the prefill holds the room (it waits for the decode's pages, which has not been asked yet)
        load: Any = prefill.get("/load")
        if load["num_running"] + load["num_waiting"] >= 1:
            break
        assert time.monotonic() < deadline, load
        time.sleep(0.02)
    prefill.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 20
    # the drain is on: /health says stopping, and the registry no longer lists the prefill as a plain live one
    while prefill.health_status() != 503 or any(not rank.get("draining") for rank in _ranks(registry)):
        assert time.monotonic() < deadline, _ranks(registry)
        time.sleep(0.02)
    listing = httpx.get(f"{registry}/instances", timeout=5).json()
    # only now does the decode get the room: its first look-up of this prefill happens during the drain
    post("decode", decode)
    to_prefill.join(60)
    assert answers["decode"].status_code == 200, answers["decode"].text
    ranks = [rank for instance in listing["instances"] for rank in instance["ranks"]]
    assert ranks and all(rank["draining"] for rank in ranks), listing  # (still there, for the rooms it holds)
    assert all(instance["draining"] for instance in listing["instances"]), listing
    assert answers["decode"].json()["meta_info"]["completion_tokens"] == 8, answers["decode"].text
    assert answers["prefill"].status_code == 200, answers["prefill"].text
    assert prefill.proc.wait(30) == 0  # (the drain ended with nothing left: not its 30 s)
    assert _ranks(registry) == []  # deregistered at the drain's end
    wait_pools_full([decode])


def test_without_a_drain_the_prefill_still_deregisters_at_once(procs: Procs) -> None:
    registry = start_bootstrap(procs)
    prefill = start_worker(procs, "prefill", *SIM, bootstrap=registry)
    assert len(_ranks(registry)) == 1
    prefill.proc.send_signal(signal.SIGTERM)
    assert prefill.proc.wait(30) == 0
    assert _ranks(registry) == []
