"""Two gateways in front of one fleet, a worker whose steps take longer than ``--load-stale-s`` (1 s): the load
another gateway put on it must stay in each gateway's view (a worker reports once per step; a gateway takes a
report older than 1 s as gone and falls back to its own requests, so the second gateway saw the busy decode as
idle and sent its requests there, behind the first gateway's queue, while the other decode stood idle)."""

from __future__ import annotations

import threading
import time

import httpx
from pdtest import SimCluster, start_gateway, start_worker


def _post(port: int, max_tokens: int, failures: list[str]) -> None:
    r = httpx.post(f"http://127.0.0.1:{port}/v1/completions",
                   json={"model": "sim", "prompt": "hello", "max_tokens": max_tokens}, timeout=120)
    if r.status_code != 200:
        failures.append(r.text)


def test_a_long_step_keeps_the_other_gateways_load_in_view(sim_cluster) -> None:  # type: ignore[no-untyped-def]
    slow = ("--max-running", "4", "--engine-option", "decode_step_s=1.5")
    cluster: SimCluster = sim_cluster(decode_args=slow)  # the fixture's gateway: A (prefill + the busy decode)
    idle = start_worker(cluster.procs, "decode", "--engine", "sim", "--num-pages", "256", "--page-size", "4", *slow,
                        bootstrap=cluster.bootstrap_url)
    busy = cluster.decodes[0]
    gateway_b = start_gateway(cluster.procs, "--prefill", cluster.prefills[0].url, "--decode", busy.url, idle.url,
                              "--policy", "power_of_two")
    failures: list[str] = []
    load = [threading.Thread(target=_post, args=(cluster.gateway_port, 5, failures)) for _ in range(8)]
    for t in load:
        t.start()
    try:
        deadline = time.monotonic() + 30
        while busy.get("/load")["num_running"] < 4:  # type: ignore[index]
            assert time.monotonic() < deadline, "gateway A's requests never ran"
            time.sleep(0.05)
        views = []
        for _ in range(40):  # 4 s: across several of the busy decode's 1.5 s steps
            health = httpx.get(f"http://127.0.0.1:{gateway_b}/health", timeout=5).json()
            (view,) = [w for w in health["workers"] if w["url"] == busy.url]
            views.append((view["load_fresh"], view["running_seqs"] + view["waiting_seqs"]))
            time.sleep(0.1)
        assert all(fresh and seqs >= 4 for fresh, seqs in views), (
            f"gateway B lost gateway A's load on the busy decode (fresh, sequences): {views}")
        # so B's own requests go to the idle decode, none behind A's queue
        mine = [threading.Thread(target=_post, args=(gateway_b, 2, failures)) for _ in range(4)]
        for t in mine:
            t.start()
            time.sleep(0.3)
        for t in mine:
            t.join()
        assert len(idle.get("/debug/rooms")) == 4  # type: ignore[arg-type]
    finally:
        for t in load:
            t.join()
    assert not failures
