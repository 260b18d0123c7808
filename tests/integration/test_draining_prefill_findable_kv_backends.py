"""A prefill draining on SIGTERM stays findable over the production KV backends too (Mooncake's TCP transport, NIXL's
UCX over tcp): a decode that first looks the prefill up, and connects to its KV control port, only after the drain
began still gets the whole KV and answers the exact tokens. (``test_draining_prefill_stays_findable`` covers tcp;
the namespace re-run for Mooncake is ``test_worker_drain_kv_backends``'s.)"""

from __future__ import annotations

import signal
import threading
import time
from typing import Any

import httpx
import pytest
from pdtest import Procs, free_port, start_worker, wait_pools_full
from sim_reference import expected_tokens, text_of
from test_worker_drain_kv_backends import (
    BACKENDS,
    SIM,
    _body,
    _env,
    _load,
    _ran_elsewhere,
    _transfer_args,
)


@pytest.mark.slow
@pytest.mark.parametrize("transfer", BACKENDS)
def test_a_decode_that_looks_a_draining_prefill_up_late_gets_its_kv(procs: Procs, request: pytest.FixtureRequest,
                                                                   transfer: str) -> None:
    if _ran_elsewhere(request, transfer):
        return
    bootstrap_port = free_port()
    env = _env(transfer)
    prefill = start_worker(procs, "prefill", *SIM, *_transfer_args(transfer), "--bootstrap-embedded",
                           str(bootstrap_port), "--drain-timeout-s", "60", name=f"prefill-{transfer}", env=env)
    decode = start_worker(procs, "decode", *SIM, *_transfer_args(transfer), name=f"decode-{transfer}", env=env)
    registry = f"http://127.0.0.1:{bootstrap_port}"
    prompt = [(11 * i) % 200 + 32 for i in range(40)]
    body = _body(bootstrap_port, 9301, prompt, 8, stream=False)
    answers: dict[str, httpx.Response] = {}

    def post(role: str, port: int) -> None:
        answers[role] = httpx.post(f"http://127.0.0.1:{port}/generate", json=body, timeout=120)

    to_prefill = threading.Thread(target=post, args=("prefill", prefill.http_port))
    to_prefill.start()
    deadline = time.monotonic() + 30
    while True:  # the prefill holds the room (waiting for the decode, which has not been asked yet)
        load: Any = _load(prefill)
        if load["num_running"] + load.get("num_waiting", 0) >= 1:
            break
        assert time.monotonic() < deadline, load
        time.sleep(0.02)
    prefill.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 30
    while prefill.health_status() != 503 or not httpx.get(f"{registry}/instances", timeout=5).json()[
            "instances"][0]["draining"]:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    post("decode", decode.http_port)  # (its first look-up of, and connection to, this prefill)
    to_prefill.join(120)
    assert answers["decode"].status_code == 200, answers["decode"].text
    assert answers["decode"].json()["text"] == text_of(expected_tokens(prompt, 8)), answers["decode"].text
    assert answers["prefill"].status_code == 200, answers["prefill"].text
    assert prefill.proc.wait(60) == 0
    wait_pools_full([decode])
