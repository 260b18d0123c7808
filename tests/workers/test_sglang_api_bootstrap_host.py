"""A ``bootstrap_host`` that is no host (``"127.0.0.1:80"``, a URL, a path) is the request's fault, refused with a
400 naming it on both sides of the pair, as a bad ``bootstrap_port`` or ``bootstrap_room`` is. It went through
to the decode's registry look-up, which failed it as a 502 transfer failure (retried by SGLang's router and our
relay and held against the healthy decode's circuit breaker), while the prefill held the prompt's KV pages for
its whole bootstrap timeout waiting for a decode that could never come."""

from __future__ import annotations

import random

import pytest
from pdtest import Procs, free_port, post_to_pair, start_worker, wait_pools_full

from gateway.api import ClientBootstrap
from gateway.errors import BadRequest
from workers.sglang_api import RelayDispatcher

BAD_HOSTS = ["127.0.0.1:80", "http://10.0.0.2", "10.0.0.2/route", "user@10.0.0.2", "a host", "host?x=1",
             "host#x", "[127.0.0.1:80]", "exa mple.com", "example..com", "-bad"]
GOOD_HOSTS = [("10.0.0.2", "10.0.0.2"), ("prefill-0.svc.cluster.local", "prefill-0.svc.cluster.local"),
              ("[::1]", "::1"), ("::1", "::1"), ("fe80::1%eth0", "fe80::1%eth0"), ("my_host", "my_host"),
              ("example.com.", "example.com."), ("[10.0.0.2]", "10.0.0.2")]


@pytest.mark.parametrize("role", ["prefill", "decode"])
@pytest.mark.parametrize("host", BAD_HOSTS)
def test_a_bootstrap_host_that_is_no_host_is_a_400_naming_it(role: str, host: str) -> None:
    with pytest.raises(BadRequest) as err:
        RelayDispatcher(None, role).target(ClientBootstrap(host, 8998, 7), 0)  # type: ignore[arg-type]
    assert err.value.param == "bootstrap_host", err.value.message


@pytest.mark.parametrize(("host", "expected"), GOOD_HOSTS)
def test_host_names_and_ip_literals_are_taken(host: str, expected: str) -> None:
    target = RelayDispatcher(None, "decode").target(ClientBootstrap(host, 8998, 7), 0)  # type: ignore[arg-type]
    assert target is not None and target.host == expected


def test_both_sides_refuse_a_bootstrap_host_with_a_port_in_it_at_once(procs: Procs) -> None:
    registry = free_port()
    sim = ("--engine", "sim", "--page-size", "4", "--bootstrap-timeout-s", "8")
    prefill = start_worker(procs, "prefill", *sim, "--bootstrap-embedded", str(registry))
    decode = start_worker(procs, "decode", *sim)
    body = {"text": "hello", "sampling_params": {"max_new_tokens": 4}, "bootstrap_host": f"127.0.0.1:{registry}",
            "bootstrap_port": registry, "bootstrap_room": random.randrange(2**63)}
    replies = post_to_pair(prefill.http_port, decode.http_port, "generate", body, 30)
    for role, reply in replies.items():
        assert reply.status_code == 400, (role, reply.status_code, reply.text)
        assert reply.json()["error"]["param"] == "bootstrap_host", (role, reply.text)
    wait_pools_full([prefill, decode], 10)
