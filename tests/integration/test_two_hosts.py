"""Across hosts on one machine: the prefill (and the registry) in one network namespace, the decode (and the
gateway and the client) in another, joined only by a veth pair with their own addresses; each side has
its own private /dev/shm. A P->D chat over tcp, mooncake and nixl (UCX over tcp) must give the exact
output, and the KV bytes must have crossed the veth, not loopback (interface counters of each side).

Needs root (CI runs ``make pytest`` as root inside ``unshare --net``: root there can still make namespaces
and veth pairs); skips with the reason elsewhere. Everything is torn down on failure too (``netns``).
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from netns import TwoHosts, two_hosts_or_skip
from sim_reference import expected_tokens, text_of

from gateway.tokenizer import ByteTokenizer

LAYERS, KV_HEADS, HEAD_DIM = 4, 2, 16  # the sim engine's shape (what sim_reference computes with)
TOKEN_KV_BYTES = 2 * LAYERS * KV_HEADS * HEAD_DIM * 4  # K and V of every layer, float32: 1 KiB
SIM = ("--engine", "sim", "--num-pages", "1024", "--page-size", "16", "--log-level", "warning")
QUESTION = "Across the veth, please: " + " ".join(f"word{i}" for i in range(200))  # ~1.7k tokens: ~1.7 MiB of KV
MAX_TOKENS = 8
OPTIONS = {
    "tcp": ["sndbuf_bytes=4194304"],
    "mooncake": ["protocol=tcp"],
    "nixl": ["ucx_tls=tcp"],  # the network path; the device is the advertised interface (the veth)
}
PORTS = {"registry": 18998, "prefill": 18100, "prefill_http": 18101, "decode": 18200, "decode_http": 18201,
         "gateway": 18000}  # each side has a network stack of its own: fixed ports cannot clash


def _missing(transfer: str) -> str | None:
    if transfer == "mooncake" and importlib.util.find_spec("mooncake") is None:
        return "mooncake-transfer-engine is not installed"
    if transfer == "nixl" and not (importlib.util.find_spec("nixl_cu12") or importlib.util.find_spec("nixl")):
        return "nixl is not installed"
    return None


@pytest.fixture
def hosts(tmp_path: Path) -> Iterator[TwoHosts]:
    yield from two_hosts_or_skip(tmp_path)


def _chat(hosts: TwoHosts, auth: dict[str, str]) -> dict[str, object]:
    """The client, in the decode's namespace: one chat completion and the decode's view of its room (``auth``:
    the headers the decode's HTTP side wants)."""
    code = f"""
import json, urllib.request, openai
c = openai.OpenAI(base_url="http://127.0.0.1:{PORTS['gateway']}/v1", api_key="none", max_retries=0, timeout=120)
out = c.chat.completions.create(model="sim", max_tokens={MAX_TOKENS},
                                messages=[{{"role": "user", "content": {QUESTION!r}}}])
url = "http://{_url_host(hosts.b.addr)}:{PORTS['decode_http']}/debug/rooms"
rooms = json.loads(urllib.request.urlopen(urllib.request.Request(url, headers={auth!r}), timeout=10).read())
print(json.dumps({{"text": out.choices[0].message.content, "prompt_tokens": out.usage.prompt_tokens, "rooms": rooms}}))
"""
    return dict(json.loads(hosts.b.python(code).strip().splitlines()[-1]))


def _url_host(addr: str) -> str:
    return f"[{addr}]" if ":" in addr else addr


@pytest.mark.parametrize(("transfer", "family", "local_registry", "secured"), [
    ("tcp", 4, False, False), ("mooncake", 4, False, False), ("nixl", 4, False, False), ("tcp", 6, False, False),
    # the prefill finds its registry on its own loopback (``--bootstrap http://127.0.0.1:...``), the decode on
    # the other host at the prefill's advertised address (it was sent to its own loopback: every request a 502)
    ("tcp", 4, True, False),
    # a registry token (reads guarded too) and worker keys: the decode sends the token to its own --bootstrap,
    # the registry as it reaches it, which is where the prefill's handshake says its registry is
    ("tcp", 4, False, True), ("tcp", 4, True, True),
])
def test_pd_chat_crosses_the_veth(hosts: TwoHosts, transfer: str, family: int, local_registry: bool,
                                  secured: bool) -> None:
    reason = _missing(transfer)
    if reason:
        pytest.skip(reason)
    a, b = hosts.a, hosts.b
    if family == 6:
        if a.addr6 is None or b.addr6 is None:
            pytest.skip("IPv6 is off in this kernel")
        a.addr, b.addr = a.addr6, b.addr6
    a.python("open('/dev/shm/pd-two-hosts-probe', 'w').close()")  # the sides share no /dev/shm
    assert b.python("import os; print(os.path.exists('/dev/shm/pd-two-hosts-probe'))").strip() == "False"
    # Nothing UCX-wide is inherited: --transfer-option and the advertised address decide.
    clean: dict[str, str | None] = {"NIXL_LOG_LEVEL": "WARN", "MC_LOG_LEVEL": "ERROR", "HF_HUB_OFFLINE": "1",
                                    "UCX_TLS": None, "UCX_NET_DEVICES": None}
    transfer_args = [arg for opt in OPTIONS[transfer] for arg in ("--transfer-option", opt)]
    registry = f"http://{_url_host(a.addr)}:{PORTS['registry']}"
    token = ["--token", "t0ken"] if secured else []
    keyed = ["--api-key", "k3y"] if secured else []
    a.start("registry", "-m", "bootstrap.cli", "--host", "0.0.0.0" if local_registry else a.addr,
            "--port", str(PORTS["registry"]), *token, env=clean)
    a.wait_http_ok(f"{registry}/health")
    # The prefill binds every interface and advertises the address that routes to the registry (a.addr).
    wildcard = "0.0.0.0" if family == 4 else "::"
    where = ["--bootstrap", f"http://127.0.0.1:{PORTS['registry']}", "--advertise-host", a.addr] if local_registry \
        else ["--bootstrap", registry]
    a.start("prefill", "-m", "workers.cli", "--role", "prefill", "--host", wildcard, "--port", str(PORTS["prefill"]),
            "--http-port", str(PORTS["prefill_http"]), *where, "--transfer", transfer, *transfer_args, *SIM,
            *(["--bootstrap-token", "t0ken", *keyed] if secured else []), env=clean)
    b.start("decode", "-m", "workers.cli", "--role", "decode", "--host", b.addr, "--port", str(PORTS["decode"]),
            "--http-port", str(PORTS["decode_http"]), "--transfer", transfer, *transfer_args, *SIM,
            *(["--bootstrap", registry, "--bootstrap-token", "t0ken", *keyed] if secured else []), env=clean)
    try:
        a.wait_http_ok(f"http://{_url_host(a.addr)}:{PORTS['prefill_http']}/health")
        b.wait_http_ok(f"http://{_url_host(b.addr)}:{PORTS['decode_http']}/health")
        b.start("gateway", "-m", "gateway.cli", "--host", "127.0.0.1", "--port", str(PORTS["gateway"]),
                "--log-level", "warning", "--prefill", f"pd://{_url_host(a.addr)}:{PORTS['prefill']}",
                "--decode", f"pd://{_url_host(b.addr)}:{PORTS['decode']}",
                *(["--worker-api-key", "k3y"] if secured else []), env=clean)
        b.wait_http_ok(f"http://127.0.0.1:{PORTS['gateway']}/readiness")
        auth = {"authorization": "Bearer k3y"} if secured else {}
        info = json.loads(a.python(f"import urllib.request; print(urllib.request.urlopen(urllib.request.Request("
                                   f"'http://{_url_host(a.addr)}:{PORTS['prefill_http']}/info', headers={auth!r}))"
                                   ".read().decode())"))
        assert info["instance_id"].endswith(f"{a.addr}:{PORTS['prefill']}"), "the prefill advertises its veth address"

        before = {"a_veth": a.counters(a.ifname), "a_lo": a.counters("lo"),
                  "b_veth": b.counters(b.ifname), "b_lo": b.counters("lo")}
        result = _chat(hosts, auth)
        after = {"a_veth": a.counters(a.ifname), "a_lo": a.counters("lo"),
                 "b_veth": b.counters(b.ifname), "b_lo": b.counters("lo")}
    except Exception:
        for side, name in ((a, "registry"), (a, "prefill"), (b, "decode"), (b, "gateway")):
            print(f"--- {side.name}/{name} ---\n{side.log(name)[-3000:]}")
        raise

    ids = ByteTokenizer().apply_chat_template([{"role": "user", "content": QUESTION}])
    assert result["prompt_tokens"] == len(ids)
    assert result["text"] == text_of(expected_tokens(ids, MAX_TOKENS)), "the decode continued from the exact KV"
    rooms = result["rooms"]
    assert isinstance(rooms, list) and len(rooms) == 1 and rooms[0]["kv_verified"] is True

    kv_bytes = len(ids) * TOKEN_KV_BYTES  # a lower bound: whole pages move
    sent = after["a_veth"]["tx"] - before["a_veth"]["tx"]
    received = after["b_veth"]["rx"] - before["b_veth"]["rx"]
    lo_a = after["a_lo"]["tx"] - before["a_lo"]["tx"]
    lo_b = after["b_lo"]["tx"] - before["b_lo"]["tx"]
    print(f"{transfer} (IPv{family}): KV >= {kv_bytes} B; veth prefill->decode {sent} B sent, {received} B received; "
          f"loopback prefill side {lo_a} B, decode side {lo_b} B")
    assert sent >= kv_bytes and received >= kv_bytes, "the KV crossed the veth"
    assert lo_a < kv_bytes // 4 and lo_b < kv_bytes // 4, "the KV did not go over loopback on either side"
