"""Review: registration fields that pass the registry's validation though they are not what its contract
(docs/bootstrap.md) allows, driven against a real ``pd-bootstrap`` process.

- ``instance_id`` must be 1-128 characters of ``[A-Za-z0-9._:@/-]``; its pattern ended in ``$``, which also
  matches before a final newline, so ``"prefill-0\\n"`` was taken as a second, distinct instance (and is
  looked up as such with ``?instance_id=prefill-0%0A``).
- ``rank_ip`` must be an address a peer can connect to. An IPv6 scope id (``fe80::1%eth0``) was taken as it
  came, so ``::1%<anything>`` passed: spaces, a line break (which the registry then wrote into its log as
  a line of its own: ``moved to ...`` / ``registered rank ... at ...`` use ``%s``), and an unspecified
  address in IPv4-mapped spelling (``::ffff:0.0.0.0``) passed where ``0.0.0.0`` itself is refused. So did
  numbers ``ip_address`` refuses but the decode's resolver reads its own way, taken as host names:
  ``010.0.0.1`` (connected to as 8.0.0.1), ``0`` (0.0.0.0).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import pytest
from conftest import TOPOLOGY_QUERY, RegistryProc, rank_body


def _put(url: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.put(f"{url}/route", json=body, timeout=5)


def _instances(url: str) -> list[str]:
    return [i["instance_id"] for i in httpx.get(f"{url}/instances", timeout=5).json()["instances"]]


@pytest.mark.parametrize("instance_id", ["prefill-0\n", "a\n"])
def test_an_instance_id_with_a_final_newline_is_refused(
    start_registry: Callable[..., RegistryProc], instance_id: str
) -> None:
    reg = start_registry("--ttl-s", "0")
    r = _put(reg.url, rank_body(instance_id=instance_id))
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "invalid_instance_id"
    assert _instances(reg.url) == []
    r = httpx.get(f"{reg.url}/route", params={**TOPOLOGY_QUERY, "instance_id": instance_id}, timeout=5)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_instance_id", r.text


@pytest.mark.parametrize("rank_ip", [
    "fe80::1%eth0\nWARNING bootstrap: forged line",
    "::1%a b",
    "fe80::1%\t",
    "fe80::1%" + "x" * 300,
    "::ffff:0.0.0.0",
    "010.0.0.1",  # (not an address to ``ip_address``; as a "host name", inet_aton's octal: 8.0.0.1)
    "0",  # (0.0.0.0 to the resolver)
    "127.0x1",
])
def test_a_rank_ip_no_peer_can_connect_to_is_refused(start_registry: Callable[..., RegistryProc], rank_ip: str) -> None:
    reg = start_registry("--ttl-s", "0", "--log-level", "info")
    assert _put(reg.url, rank_body(instance_id="p", rank_port=41000)).status_code == 200
    r = _put(reg.url, rank_body(instance_id="p", rank_ip=rank_ip, rank_port=41000))
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "invalid_field" and "rank_ip" in r.json()["error"]["message"]
    lookup: dict[str, str | int] = {"prefill_dp_rank": 0, "prefill_cp_rank": 0, "target_tp_rank": 0,
                                    "target_pp_rank": 0, "instance_id": "p"}
    assert httpx.get(f"{reg.url}/route", params=lookup, timeout=5).json() == {"rank_ip": "127.0.0.1",
                                                                               "rank_port": 41000}
    assert reg.proc is not None and reg.proc.stderr is not None
    reg.proc.terminate()
    reg.proc.wait(10)
    log = reg.proc.stderr.read().decode(errors="replace")
    assert "forged line" not in log, log


@pytest.mark.parametrize("rank_ip", ["fe80::1%eth0", "fe80::1%2", "fe80::1%enp0s31f6", "::1", "10.0.0.5",
                                     "prefill-0.svc.cluster.local"])
def test_connectable_addresses_still_register(start_registry: Callable[..., RegistryProc], rank_ip: str) -> None:
    reg = start_registry("--ttl-s", "0")
    r = _put(reg.url, rank_body(instance_id="ok", rank_ip=rank_ip))
    assert r.status_code == 200, r.text
    lookup: dict[str, str | int] = {"prefill_dp_rank": 0, "prefill_cp_rank": 0, "target_tp_rank": 0,
                                    "target_pp_rank": 0, "instance_id": "ok"}
    assert httpx.get(f"{reg.url}/route", params=lookup, timeout=5).json()["rank_ip"] == rank_ip
