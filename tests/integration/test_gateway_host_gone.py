"""A gateway whose host goes away (the network cut: nothing closes its sockets) must not hold a worker's KV pages
and running places until the requests' own timeouts: the worker's kernel notices the silent peer
(``--gateway-timeout-s``: keep-alive probes while idle, ``TCP_USER_TIMEOUT`` while a stream's sends wait
unacknowledged), the connection closes and its requests end.

The worker in one network namespace, the gateway and its client in another, joined by a veth pair; the cut is the
gateway side's veth taken down. Needs root (skips with the reason elsewhere; ``netns``).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from netns import TwoHosts, two_hosts_or_skip

from transfer.netaddr import watch_peer

PORTS = {"worker": 18300, "worker_http": 18301, "gateway": 18002}
NUM_PAGES = 1024
# A stream that would run for minutes: one token every 20 ms, 6,000 of them
WORKER = ("--engine", "sim", "--num-pages", str(NUM_PAGES), "--page-size", "16", "--log-level", "warning",
          "--engine-option", "decode_step_s=0.02", "--max-running", "4")


@pytest.fixture
def hosts(tmp_path: Path) -> Iterator[TwoHosts]:
    yield from two_hosts_or_skip(tmp_path, subnet="10.214.0")


def _load(hosts: TwoHosts) -> dict[str, int]:
    out = hosts.a.python(
        "import json, urllib.request\n"
        f"url = 'http://{hosts.a.addr}:{PORTS['worker_http']}/load'\n"
        "print(urllib.request.urlopen(url, timeout=5).read().decode())")
    load = json.loads(out)
    return {"running": int(load["num_running"]) + int(load["num_waiting"]), "free_pages": int(load["num_free_pages"])}


def _start(hosts: TwoHosts, timeout_args: tuple[str, ...]) -> None:
    a, b = hosts.a, hosts.b
    a.start("worker", "-m", "workers.cli", "--role", "both", "--host", a.addr, "--port", str(PORTS["worker"]),
            "--http-port", str(PORTS["worker_http"]), *WORKER, *timeout_args, env={"HF_HUB_OFFLINE": "1"})
    a.wait_http_ok(f"http://{a.addr}:{PORTS['worker_http']}/health")
    b.start("gateway", "-m", "gateway.cli", "--host", "127.0.0.1", "--port", str(PORTS["gateway"]),
            "--log-level", "warning", "--worker", f"pd://{a.addr}:{PORTS['worker']}")
    b.wait_http_ok(f"http://127.0.0.1:{PORTS['gateway']}/readiness")
    # two clients on the gateway's side, each a stream that would last minutes
    for i in range(2):
        b.start(f"client{i}", "-c", (
            "import openai\n"
            f"c = openai.OpenAI(base_url='http://127.0.0.1:{PORTS['gateway']}/v1', api_key='none', max_retries=0,"
            " timeout=600)\n"
            "for chunk in c.completions.create(model='sim', prompt='a long one, please', max_tokens=6000,"
            " stream=True):\n"
            "    pass\n"))


def _peer_timeouts(hosts: TwoHosts) -> float:
    """The worker's ``pd_worker_gateway_peer_timeouts_total`` (its /metrics, parsed as Prometheus text)."""
    out = hosts.a.python(
        "import urllib.request\n"
        "from prometheus_client.parser import text_string_to_metric_families\n"
        f"text = urllib.request.urlopen('http://{hosts.a.addr}:{PORTS['worker_http']}/metrics', timeout=5).read()\n"
        "print(sum(s.value for f in text_string_to_metric_families(text.decode()) for s in f.samples"
        " if s.name == 'pd_worker_gateway_peer_timeouts_total'))")
    return float(out)


def _wait_running(hosts: TwoHosts, want: int, timeout_s: float) -> dict[str, int]:
    deadline = time.monotonic() + timeout_s
    while True:
        load = _load(hosts)
        if load["running"] == want or time.monotonic() > deadline:
            return load
        time.sleep(0.2)


@pytest.mark.parametrize("gateway_timeout_s", [2.0])
def test_a_gateway_whose_network_is_cut_frees_the_workers_pages(hosts: TwoHosts, gateway_timeout_s: float) -> None:
    _start(hosts, ("--gateway-timeout-s", str(gateway_timeout_s)))
    try:
        load = _wait_running(hosts, 2, 60.0)
        assert load["running"] == 2, f"the two streams did not start: {load}"
        assert load["free_pages"] < NUM_PAGES
        assert _peer_timeouts(hosts) == 0
        hosts.b.python(f"import subprocess; subprocess.run(['ip', 'link', 'set', {hosts.b.ifname!r}, 'down'],"
                       " check=True)")
        # The kernel gives up on the silent peer after about gateway_timeout_s (with retransmission rounding):
        # well within this bound, where the streams themselves would run for minutes more.
        load = _wait_running(hosts, 0, 60.0)
        assert load["running"] == 0, f"the cut-off gateway's requests still run: {load}"
        assert load["free_pages"] == NUM_PAGES, f"KV pages not back: {load}"
        # the kernel's close shows as ETIMEDOUT: counted once, for the gateway's one connection
        assert _peer_timeouts(hosts) == 1
    except Exception:
        for side, name in ((hosts.a, "worker"), (hosts.b, "gateway"), (hosts.b, "client0"), (hosts.b, "client1")):
            print(f"--- {side.name}/{name} ---\n{side.log(name)[-3000:]}")
        raise


def test_watch_peer_sets_the_kernels_timeouts() -> None:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        watch_peer(sock, 30.0)
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == 10
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL) == 5
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT) == 3
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == 30000
