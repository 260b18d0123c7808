"""A mixed fleet (native ``pd://`` and SGLang ``http://`` workers under one gateway) and the admin API on
it: a request's answer must not depend on which kind serves it (a model it does not serve: 404 either way),
and the admin API must not take in a worker it would use twice or the gateway itself. (Not yet true: a
streamed /generate that the gateway refuses is a 400 natively and 200 + an error event relayed; a kind
whose only decode died is retried within that kind until its probes say so.)

The SGLang-protocol workers here are our own sim workers' HTTP side (``workers/sglang_api.py``), so both
kinds run the same engine and every difference is the gateway's.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import httpx
import pytest
from pdtest import Procs, Worker, free_port, start_gateway, start_worker

SIM = ("--engine", "sim", "--num-pages", "256", "--page-size", "4")


@dataclass
class Mixed:
    gateway: str
    native_decode: Worker
    http_decode: Worker
    http_prefill_url: str
    http_decode_url: str


def start_mixed(procs: Procs, *gateway_args: str) -> Mixed:
    prefill = start_worker(procs, "prefill", *SIM, "--bootstrap-embedded", str(free_port()))
    decode = start_worker(procs, "decode", *SIM)
    bootstrap_port = free_port()
    http_prefill = start_worker(procs, "prefill", *SIM, "--bootstrap-embedded", str(bootstrap_port))
    http_decode = start_worker(procs, "decode", *SIM)
    hp, hd = f"http://127.0.0.1:{http_prefill.http_port}", f"http://127.0.0.1:{http_decode.http_port}"
    port = start_gateway(procs, "--prefill", prefill.url, hp, str(bootstrap_port), "--decode", decode.url, hd,
                         *(gateway_args or ("--health-interval-s", "0.2")))
    gateway = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 20  # both kinds selectable (readiness needs only one)
    while not all(w["healthy"] for w in httpx.get(f"{gateway}/workers", timeout=10).json()["workers"]):
        assert time.monotonic() < deadline
        time.sleep(0.1)
    return Mixed(gateway, decode, http_decode, hp, hd)


@pytest.mark.parametrize(("path", "body", "status"), [
    # The gateway answers only to its own model name (docs/interop.md); the relay passes any name on.
    ("/v1/chat/completions", {"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}],
                              "max_tokens": 4}, 404),
    ("/v1/completions", {"model": "no-such-model", "prompt": "hi", "max_tokens": 4, "stream": True}, 404),
])
def test_a_mixed_fleet_answers_a_bad_request_the_same_whichever_kind_serves_it(
        procs: Procs, path: str, body: dict, status: int) -> None:  # type: ignore[type-arg]
    fleet = start_mixed(procs)
    statuses = [httpx.post(f"{fleet.gateway}{path}", json=body, timeout=30).status_code for _ in range(16)]
    assert statuses == [status] * 16, statuses


def test_a_worker_of_another_role_is_not_taken_as_this_one(procs: Procs) -> None:
    """A prefill's URL given as a decode (our workers name their role in their /health): never selected."""
    fleet = start_mixed(procs)
    added = httpx.post(f"{fleet.gateway}/workers", json={"url": fleet.http_prefill_url.replace("127.0.0.1",
                                                                                                 "localhost"),
                                                         "role": "decode"}, timeout=10)
    assert added.status_code == 201, added.text
    time.sleep(1.5)
    listed = {w["url"]: w for w in httpx.get(f"{fleet.gateway}/workers", timeout=10).json()["workers"]}
    (twin,) = [w for url, w in listed.items() if "localhost" in url]
    assert not twin["healthy"] and "a prefill worker, not a decode" in (twin["error"] or ""), twin


def test_the_admin_api_does_not_add_the_gateway_itself(procs: Procs) -> None:
    """The gateway's own URL as an SGLang decode passes its probes (``/health`` is 200): every request sent
    there is relayed to the gateway again (a second request, counted again; the first prefill's KV waits for
    a decode that never comes). It must be refused, or at least never selected."""
    fleet = start_mixed(procs)
    added = httpx.post(f"{fleet.gateway}/workers", json={"url": fleet.gateway, "role": "decode"}, timeout=10)
    if added.status_code == 201:
        time.sleep(1.5)
        listed = {w["url"]: w for w in httpx.get(f"{fleet.gateway}/workers", timeout=10).json()["workers"]}
        assert not listed[fleet.gateway]["healthy"], "the gateway is a selectable worker of itself"
    else:
        assert added.status_code in (400, 409), added.text


def test_an_sglang_worker_is_not_added_twice_under_another_spelling(procs: Procs) -> None:
    """``http://localhost:P`` next to ``http://127.0.0.1:P``: one worker with two shares of the requests (and
    of the fleet's pages in the policies' view). Native workers are caught by their worker id (the second
    URL connects but is not used); SGLang ones are not."""
    fleet = start_mixed(procs)
    twin = fleet.http_decode_url.replace("127.0.0.1", "localhost")
    added = httpx.post(f"{fleet.gateway}/workers", json={"url": twin, "role": "decode"}, timeout=10)
    if added.status_code == 201:
        time.sleep(1.5)
        listed = {w["url"]: w for w in httpx.get(f"{fleet.gateway}/workers", timeout=10).json()["workers"]}
        assert not listed[twin]["healthy"], "the same SGLang worker is selectable under two URLs"
    else:
        assert added.status_code == 409, added.text
