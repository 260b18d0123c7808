"""Two hosts (``netns``) joined by a slow link: a ``tbf`` rate limit on the prefill's veth end, so that the KV of
a long prompt takes seconds to cross. What must hold however slow the link (as long as it moves bytes):
``--transfer-timeout-s`` judges writes that do not move, not writes queued behind other rooms' writes on a link
that is busy moving them (every request of a burst whose KV the link carries at its rate ends 200).
And rooms take turns on one prefill -> decode path: a small request's KV waits for a turn of each big
transfer ahead of it, not for all of their bytes (it did, one FIFO per peer: 39 s at 20 mbit behind three long
prompts).

Needs root and the ``tbf`` qdisc; skips with the reason elsewhere. Slow (tens of seconds each).
"""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from netns import TwoHosts, two_hosts_or_skip

pytestmark = pytest.mark.slow

LAYERS = 16  # sim engine: 2 x 16 layers x 2 heads x 16 dims x 4 B = 4 KiB of KV per token
TOKEN_KV_BYTES = 2 * LAYERS * 2 * 16 * 4
BIG_WORDS = 1500  # ~7.9k tokens: ~31 MiB of KV per big request
PORTS = {"registry": 18998, "prefill": 18100, "prefill_http": 18101, "decode": 18200, "decode_http": 18201,
         "gateway": 18000}
OPTIONS = {"tcp": [], "mooncake": ["protocol=tcp"], "nixl": ["ucx_tls=tcp"]}
CLEAN: dict[str, str | None] = {"NIXL_LOG_LEVEL": "WARN", "MC_LOG_LEVEL": "ERROR", "HF_HUB_OFFLINE": "1",
                                "UCX_TLS": None, "UCX_NET_DEVICES": None}


@pytest.fixture
def hosts(tmp_path: Path) -> Iterator[TwoHosts]:
    yield from two_hosts_or_skip(tmp_path, subnet="10.215.0")


def _rate_limit(hosts: TwoHosts, rate: str) -> None:
    a = hosts.a
    assert a.holder is not None
    out = subprocess.run(["nsenter", "-t", str(a.holder.pid), "--net", "--", "tc", "qdisc", "replace", "dev",
                          a.ifname, "root", "tbf", "rate", rate, "burst", "64kbit", "latency", "2s"],
                         capture_output=True, text=True, timeout=30)
    if out.returncode != 0:
        pytest.skip(f"no tbf qdisc here: {out.stderr.strip()}")


def _start(hosts: TwoHosts, transfer: str, extra: list[str]) -> None:
    a, b = hosts.a, hosts.b
    targs = [x for o in OPTIONS[transfer] for x in ("--transfer-option", o)]
    registry = f"http://{a.addr}:{PORTS['registry']}"
    a.start("registry", "-m", "bootstrap.cli", "--host", a.addr, "--port", str(PORTS["registry"]), env=CLEAN)
    a.wait_http_ok(f"{registry}/health")
    common = ["--engine", "sim", "--engine-option", f"layers={LAYERS}", "--num-pages", "8192", "--page-size", "16",
              "--log-level", "warning", "--transfer", transfer, *targs, *extra]
    a.start("prefill", "-m", "workers.cli", "--role", "prefill", "--host", a.addr, "--port", str(PORTS["prefill"]),
            "--http-port", str(PORTS["prefill_http"]), "--bootstrap", registry, *common, env=CLEAN)
    b.start("decode", "-m", "workers.cli", "--role", "decode", "--host", b.addr, "--port", str(PORTS["decode"]),
            "--http-port", str(PORTS["decode_http"]), *common, env=CLEAN)
    a.wait_http_ok(f"http://{a.addr}:{PORTS['prefill_http']}/health")
    b.wait_http_ok(f"http://{b.addr}:{PORTS['decode_http']}/health")
    b.start("gateway", "-m", "gateway.cli", "--host", "127.0.0.1", "--port", str(PORTS["gateway"]),
            "--log-level", "warning", "--prefill", f"pd://{a.addr}:{PORTS['prefill']}",
            "--decode", f"pd://{b.addr}:{PORTS['decode']}", env=CLEAN)
    b.wait_http_ok(f"http://127.0.0.1:{PORTS['gateway']}/readiness")


def _client(hosts: TwoHosts, num_big: int, small: bool) -> dict[str, object]:
    """In the decode's namespace: ``num_big`` long prompts at once; with ``small``, once the first MiB of their
    KV crossed, one short prompt, noting the veth's received bytes when it was sent and when it ended."""
    code = f"""
import json, threading, time, httpx
RX = "/sys/class/net/{hosts.b.ifname}/statistics/rx_bytes"
rx = lambda: int(open(RX).read())
URL = "http://127.0.0.1:{PORTS['gateway']}/v1/completions"
def post(prompt):
    r = httpx.post(URL, json={{"model": "sim", "prompt": prompt, "max_tokens": 4, "temperature": 0}}, timeout=600)
    return {{"status": r.status_code, "body": r.json() if r.status_code != 200 else None}}
bigs = [None] * {num_big}
def big(i):
    bigs[i] = post(f"big{{i}} " + " ".join(f"w{{j}}" for j in range({BIG_WORDS})))
start = rx()
threads = [threading.Thread(target=big, args=(i,)) for i in range({num_big})]
for t in threads: t.start()
out = {{"bigs": bigs}}
if {small}:
    while rx() - start < 2**20: time.sleep(0.01)
    sent = rx()
    out["small"] = post("small hi")
    out["small_rx"] = rx() - sent
    out["big_rx_so_far"] = sent - start
for t in threads: t.join()
out["total_rx"] = rx() - start
print(json.dumps(out))
"""
    return dict(json.loads(hosts.b.python(code, timeout_s=900).strip().splitlines()[-1]))


def _load(hosts: TwoHosts) -> dict[str, dict[str, int]]:
    a, b = hosts.a, hosts.b
    get = "import urllib.request; print(urllib.request.urlopen({!r}, timeout=10).read().decode())"
    return {"prefill": json.loads(a.python(get.format(f"http://{a.addr}:{PORTS['prefill_http']}/load"))),
            "decode": json.loads(b.python(get.format(f"http://{b.addr}:{PORTS['decode_http']}/load")))}


def _dump(hosts: TwoHosts) -> None:
    for side, name in ((hosts.a, "prefill"), (hosts.b, "decode"), (hosts.b, "gateway")):
        print(f"--- {side.name}/{name} ---\n{side.log(name)[-3000:]}")


def test_transfer_timeout_does_not_fire_on_writes_queued_behind_a_moving_link(hosts: TwoHosts) -> None:
    # 3 x ~31 MiB at 50 mbit/s: ~15 s of KV in all, every chunk posted at once (the sim prefills in ~1 s).
    # Each write moves at the link's rate once it is on the wire; only waiting in the queue takes longer
    # than the 5 s timeout. The link never stalls: no request may end with "a chunk ... still pending".
    _rate_limit(hosts, "50mbit")
    _start(hosts, "tcp", ["--transfer-timeout-s", "5"])
    try:
        out = _client(hosts, num_big=3, small=False)
    except Exception:
        _dump(hosts)
        raise
    statuses = [b["status"] for b in out["bigs"]]  # type: ignore[union-attr]
    assert statuses == [200, 200, 200], [b["body"] for b in out["bigs"]]  # type: ignore[union-attr]


@pytest.mark.parametrize("transfer", ["tcp", "mooncake", "nixl"])
def test_a_small_request_does_not_wait_for_every_big_transfer_queued_before_it(hosts: TwoHosts, transfer: str) -> None:
    # 3 x ~31 MiB at 50 mbit/s (~15 s), every chunk (2 MiB: 512 tokens) queued at once; once 1 MiB crossed, a
    # short prompt. Measured in bytes, not time: what the decode's veth received while the short one was
    # answered. First in, first out, that was all the big transfers' rest (~90 MiB); in turns, a turn of each
    # (one chunk) plus what sits in the socket buffers and the tbf queue (2 s at the rate: ~12 MB).
    pytest.importorskip({"tcp": "socket", "mooncake": "mooncake.engine", "nixl": "nixl"}[transfer])
    _rate_limit(hosts, "50mbit")
    _start(hosts, transfer, [])
    try:
        out = _client(hosts, num_big=3, small=True)
    except Exception:
        _dump(hosts)
        raise
    statuses = [b["status"] for b in out["bigs"]]  # type: ignore[union-attr]
    assert statuses == [200, 200, 200], [b["body"] for b in out["bigs"]]  # type: ignore[union-attr]
    assert out["small"]["status"] == 200, out["small"]  # type: ignore[index]
    total, before, during = out["total_rx"], out["big_rx_so_far"], out["small_rx"]
    assert isinstance(total, int) and isinstance(before, int) and isinstance(during, int)
    assert total > 3 * 25 * 2**20, total  # (the big prompts' KV did cross)
    left = total - before
    print(f"{transfer}: {during / 2**20:.1f} MiB crossed while the short request was answered, "
          f"of {left / 2**20:.1f} MiB left when it came")
    assert during < left / 3, (f"the short request was answered after {during / 2**20:.1f} MiB of the "
                               f"{left / 2**20:.1f} MiB still to cross when it came")


def _iptables(hosts: TwoHosts, *rule: str) -> None:
    b = hosts.b
    assert b.holder is not None
    out = subprocess.run(["nsenter", "-t", str(b.holder.pid), "--net", "--", "iptables", *rule],
                         capture_output=True, text=True, timeout=30)
    if out.returncode != 0:
        pytest.skip(f"no iptables here: {out.stderr.strip()}")


@pytest.mark.parametrize("transfer", ["tcp", "mooncake"])
def test_a_data_path_that_stops_moving_is_dropped_and_the_next_request_goes_over_a_fresh_one(
        hosts: TwoHosts, transfer: str) -> None:
    # The decode's host drops every large packet from the prefill's (small ones pass: heartbeats, control
    # messages): the data connection stalls while the control connection lives, as behind a black hole for
    # large packets. Each request still ends (the rooms queued behind the stalled write fail with it instead of
    # waiting for the decode's waiting_s, 300 s); once the path is clear again, a request succeeds over a fresh
    # connection (tcp fences: closed at once; mooncake does not: closed once its stuck engine call ended, at
    # MC_TRANSFER_TIMEOUT at the latest), as soon as the gateway's breaker lets the pair back in.
    pytest.importorskip({"tcp": "socket", "mooncake": "mooncake.engine"}[transfer])
    _start(hosts, transfer, ["--transfer-timeout-s", "3"])
    rule = ["INPUT", "-i", hosts.b.ifname, "-p", "tcp", "-m", "length", "--length", "1200:65535", "-j", "DROP"]
    code = f"""
import json, threading, time, httpx
URL = "http://127.0.0.1:{PORTS['gateway']}/v1/completions"
def post(prompt, timeout):
    try:
        body = {{"model": "sim", "prompt": prompt, "max_tokens": 4, "temperature": 0}}
        r = httpx.post(URL, json=body, timeout=timeout)
        return {{"status": r.status_code, "body": r.text[:300]}}
    except httpx.TimeoutException as exc:
        return {{"status": "client timeout", "body": repr(exc)}}
"""
    try:
        warm = json.loads(hosts.b.python(code + "print(json.dumps(post('warm up', 30)))"))
        assert warm["status"] == 200, warm
        _iptables(hosts, "-A", *rule)
        try:
            stalled = json.loads(hosts.b.python(code + """
out = {}
def big(): out["big"] = post("big " + " ".join(f"w{j}" for j in range(400)), 90)
t = threading.Thread(target=big); t.start(); time.sleep(0.5)
out["small"] = post("small hi", 90)
t.join()
print(json.dumps(out))""", timeout_s=200))
        finally:
            _iptables(hosts, "-D", *rule)
        after = json.loads(hosts.b.python(code + """
tries = []
end = time.monotonic() + 60
while time.monotonic() < end:  # (the gateway's breaker may hold the pair out for its cool-down first)
    tries.append(post("after it cleared", 30))
    if tries[-1]["status"] == 200:
        break
    time.sleep(1)
print(json.dumps(tries))""", timeout_s=200))
    except Exception:
        _dump(hosts)
        raise
    # (while the path is black-holed every request ends, with an error: the gateway retried on the only pair)
    for name in ("big", "small"):
        assert stalled[name]["status"] != "client timeout", (name, stalled)
    print("while stalled:", stalled, f"\nafter: {len(after)} tries, the last {after[-1]['status']}")
    assert after[-1]["status"] == 200, after
    log = hosts.a.log("prefill") + hosts.b.log("decode")
    assert "still pending" in log, log[-3000:]
    # (each retry came over a fresh control connection: the decode left the old one when told of the stall)
    assert len(set(re.findall(r"a chunk to (decode@[0-9.]+:[0-9]+) still pending", log))) >= 2 or transfer != "tcp", \
        log[-3000:]
