"""A prefill killed (-9) and restarted on its native port (its KV control port is new: a new address to the
registry) serves again as soon as its predecessor's lease stops counting as live: the registry refuses the restart
once (409 ``instance_conflict``, saying when the old lease lapses), the registrar retries right then, and the
gateway, trying at most 0.5 s apart, connects soon after. Used to be 5.2 s or 7.2 s from the kill (two backoffs
doubling to 2 s each); this test counts the refusals and checks the order (kill, restart, served), timing
nothing."""

from __future__ import annotations

import json
import os
import re
import signal
import time
import urllib.error
import urllib.request
from collections.abc import Callable

from pdtest import Procs, SimCluster, free_port, wait_http_ok


def _complete(port: int) -> int:
    body = json.dumps({"model": "default", "prompt": "hello there", "max_tokens": 2}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                     {"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=10) as reply:
            return int(reply.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)


def _refused_puts(registry: str) -> int:
    with urllib.request.urlopen(f"{registry}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    found = re.search(r'bootstrap_http_requests_total\{method="PUT",route="/route",status="409"\} (\S+)', text)
    return int(float(found.group(1))) if found else 0


def test_a_prefill_restarted_on_a_new_control_address_serves_after_one_refusal(
    procs: Procs, sim_cluster: Callable[..., SimCluster],
) -> None:
    cluster = sim_cluster()
    prefill = cluster.prefills[0]
    assert _complete(cluster.gateway_port) == 200
    assert _refused_puts(cluster.bootstrap_url) == 0
    killed_at = time.monotonic()
    os.kill(prefill.proc.pid, signal.SIGKILL)
    prefill.proc.wait(10)
    http_port = free_port()
    restarted = procs.start("prefill-restarted", "-m", "workers.cli", "--role", "prefill", "--engine", "sim",
                            "--transfer", "tcp", "--num-pages", "256", "--page-size", "4", "--port", str(prefill.port),
                            "--http-port", str(http_port), "--bootstrap", cluster.bootstrap_url,
                            "--log-level", "warning")
    wait_http_ok(f"http://127.0.0.1:{http_port}/health", 60, restarted)  # (registered: ready)
    status = 0
    deadline = time.monotonic() + 60  # (a hang guard only)
    while status != 200 and time.monotonic() < deadline:
        status = _complete(cluster.gateway_port)
        if status != 200:
            time.sleep(0.02)
    served_after_s = time.monotonic() - killed_at
    assert status == 200, procs.log("prefill-restarted")
    assert restarted.poll() is None
    # Refused once (its predecessor's lease was still live), registered on the retry that refusal asked for (the
    # backoff took 6 to 8 refusals to get past the 5 s window)
    assert _refused_puts(cluster.bootstrap_url) == 1
    print(f"kill -9 -> first request served by the restarted prefill: {served_after_s:.2f}s")
    cluster.prefills[0] = type(prefill)(restarted, "prefill", prefill.port, http_port)  # (pools checked at teardown)
