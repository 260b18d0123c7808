"""A request one side of a PD pair turns away as overloaded (it holds ``--max-requests`` already), driven as
SGLang's router drives our workers: the same body POSTed to both with the bootstrap fields. The full side answers
429 (streamed or not: no stream has begun); the other side answered 502 (``transfer_failed``: a KV failure on a
healthy worker, retried by the router and held against that worker's circuit breaker) and now answers the
overload's 429 too. Nothing is held after."""

from __future__ import annotations

import random
import threading
import time

import httpx
import pytest
from pdtest import Procs, Worker, free_port, post_to_pair, start_worker, wait_pools_full

SIM = ("--engine", "sim", "--page-size", "4", "--num-pages", "64", "--max-requests", "1",
       "--bootstrap-timeout-s", "4")


def overload(reply: httpx.Response) -> str:
    """The error message of an overload as our SGLang API answers it: a 429 before any stream began (else an
    assertion error)."""
    assert reply.status_code == 429, (reply.status_code, reply.text)
    error = reply.json()["error"]
    assert error["code"] == "overloaded", error
    return str(error["message"])


def holding(worker: Worker) -> int:
    load = worker.get("/load")
    assert isinstance(load, dict)
    return int(load["num_running"] + load["num_waiting"] + load.get("num_inflight_transfers", 0))


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_the_other_side_of_an_overloaded_request_answers_the_overload(procs: Procs, stream: bool) -> None:
    registry = free_port()
    prefill = start_worker(procs, "prefill", *SIM, "--bootstrap-embedded", str(registry))
    decode = start_worker(procs, "decode", *SIM)
    body = {"text": "hello there", "sampling_params": {"max_new_tokens": 4}, "stream": stream,
            "bootstrap_host": "127.0.0.1", "bootstrap_port": registry}
    for full, worker in (("prefill", prefill), ("decode", decode)):
        # One request held on the full side alone (its pair never comes: it ends at the bootstrap timeout).
        held = threading.Thread(target=httpx.post, args=(f"http://127.0.0.1:{worker.http_port}/generate",),
                                kwargs={"json": {**body, "bootstrap_room": random.randrange(2**63)}, "timeout": 30})
        held.start()
        try:
            deadline = time.monotonic() + 10
            while not holding(worker):
                assert time.monotonic() < deadline, "the held request never arrived"
                time.sleep(0.05)
            replies = post_to_pair(prefill.http_port, decode.http_port, "generate",
                                   {**body, "bootstrap_room": random.randrange(2**63)}, 30)
            other = "decode" if full == "prefill" else "prefill"
            assert "--max-requests" in overload(replies[full])
            assert "--max-requests" in overload(replies[other]), f"the {other} answered the {full}'s so"
        finally:
            held.join()
    wait_pools_full([prefill, decode], 10)
