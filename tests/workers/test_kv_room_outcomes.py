"""``pd_worker_kv_transfer_rooms_total{outcome}`` tells an aborted room from a failed transfer, on real prefill and
decode sim workers behind a real gateway: a client that leaves while its prompt is prefilled has the gateway abort
the request on both workers, and both count that room ``aborted``, not ``failed`` (operators alert on failed)."""

from __future__ import annotations

import json
import socket
import time
import urllib.request
from collections.abc import Callable

from pdtest import SimCluster, Worker
from prometheus_client.parser import text_string_to_metric_families

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]
# ~0.4 s of modelled prefill per 100 prompt tokens: the client below leaves in the middle of it
SLOW_PREFILL = ("--engine-option", "prefill_token_s=0.004")
PROMPT = "every room counted as what it was " * 20
GENEROUS_S = 30.0  # a hang guard only


def scrape(worker: Worker) -> Samples:
    with urllib.request.urlopen(f"http://127.0.0.1:{worker.http_port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def rooms(worker: Worker) -> dict[str, float]:
    return {dict(labels)["outcome"]: v for (name, labels), v in scrape(worker).items()
            if name == "pd_worker_kv_transfer_rooms_total"}


def busy(worker: Worker) -> bool:
    """The worker holds a request: queued, running, or holding KV pages."""
    m = scrape(worker)
    role = frozenset({("role", worker.role)})
    queued = sum(v for (name, _), v in m.items() if name == "pd_worker_queue_requests")
    return bool(queued or m[("pd_worker_running_batch_size", role)]
                or m[("pd_worker_kv_free_pages", role)] < m[("pd_worker_kv_capacity_pages", role)])


def leave_mid_prefill(cluster: SimCluster, workers: list[Worker]) -> None:
    """Send a completion, wait until both workers hold its room (it is in their queues), and close the connection."""
    host, port = cluster.base_url.removeprefix("http://").split(":")
    body = json.dumps({"prompt": PROMPT, "max_tokens": 4}).encode()
    with socket.create_connection((host, int(port)), timeout=GENEROUS_S) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                     b"content-length: %d\r\n\r\n%b" % (len(body), body))
        deadline = time.monotonic() + GENEROUS_S
        while not all(busy(w) for w in workers):
            assert time.monotonic() < deadline, "the request never reached both workers"
            time.sleep(0.01)


def test_a_room_aborted_by_a_leaving_client_counts_aborted_not_failed(
        sim_cluster: Callable[..., SimCluster]) -> None:
    cluster = sim_cluster(prefill_args=SLOW_PREFILL)
    prefill, decode = cluster.prefills[0], cluster.decodes[0]
    leave_mid_prefill(cluster, [prefill, decode])
    deadline = time.monotonic() + GENEROUS_S
    while not (rooms(prefill).get("aborted") and rooms(decode).get("aborted")):
        assert time.monotonic() < deadline, (rooms(prefill), rooms(decode))
        time.sleep(0.05)
    cluster.wait_pools_full()
    for worker in (prefill, decode):
        outcomes = rooms(worker)
        assert outcomes == {"completed": 0.0, "failed": 0.0, "aborted": 1.0}, (worker.role, outcomes)
