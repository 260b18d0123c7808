"""``/health`` and ``/readiness`` need no key (load balancers and orchestrators probe them), but on a gateway with
keys a request without a valid one gets the status alone: the workers' addresses, roles, load and last errors are
what the admin API's ``GET /workers`` guards (they were listed to anyone). With a client or admin key: all of it."""

from __future__ import annotations

from collections.abc import Callable

import httpx
from pdtest import SimCluster


def test_the_open_probes_list_the_workers_only_to_a_key(sim_cluster: Callable[..., SimCluster]) -> None:
    cluster = sim_cluster(gateway_args=("--api-key", "client-key", "--admin-api-key", "admin-key"))
    for path in ("/health", "/readiness"):
        for headers in ({}, {"authorization": "Bearer wrong"}):
            reply = httpx.get(cluster.base_url + path, headers=headers, timeout=10)
            assert reply.status_code == 200, reply.text
            assert reply.json() == {"status": "ok", "role": "gateway", "ready": True}
            assert str(cluster.decodes[0].port) not in reply.text
        for key in ("client-key", "admin-key"):
            reply = httpx.get(cluster.base_url + path, headers={"authorization": f"Bearer {key}"}, timeout=10)
            assert reply.status_code == 200 and reply.json()["ready"] is True
            assert {w["url"] for w in reply.json()["workers"]} == {w.url for w in cluster.workers()}


def test_a_gateway_without_keys_lists_the_workers_to_anyone(sim_cluster: Callable[..., SimCluster]) -> None:
    cluster = sim_cluster()
    reply = httpx.get(cluster.base_url + "/health", timeout=10)
    assert reply.status_code == 200 and len(reply.json()["workers"]) == 2
