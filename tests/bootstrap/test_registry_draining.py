"""The ``draining`` state of a registry entry: a prefill stopping with a drain timeout stays looked up for the rooms
it holds, flagged as leaving, until it deregisters. The pure state with an explicit clock, the routes and the
registrar against a real registry process, and the registrar's fallback with a registry that knows no such state."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import msgspec
import pytest
from conftest import RegistryProc, rank_body, topology

from bootstrap import BootstrapRegistrar, RankRegistration
from bootstrap.errors import ApiError
from bootstrap.messages import RankPut, Topology
from bootstrap.registry import Registry

ADDRESS_QUERY = {"prefill_dp_rank": 0, "prefill_cp_rank": 0, "target_tp_rank": 0, "target_pp_rank": 0}


def put(**kw: Any) -> RankPut:
    return msgspec.convert(rank_body(**kw), RankPut)


def test_a_draining_rank_is_still_looked_up_and_flagged() -> None:
    reg = Registry(ttl_s=10, max_ranks=10)
    reg.register(put(instance_id="p"), {"registrant": "a"}, now=0.0)
    reg.register(put(instance_id="p", draining=True), {"registrant": "a"}, now=1.0)
    inst = reg.find_instance("p", now=2.0)
    assert inst.is_ready and inst.is_draining
    assert reg.topology(inst).page_size == 16
    assert reg.lookup(inst, (0, 0, 0, 0)).rank_port == 40000
    assert reg.num_drains == 1
    # a renewal sent before the drain began and arriving after it does not undo it; draining ones renew the lease
    reg.register(put(instance_id="p"), {"registrant": "a"}, now=3.0)
    reg.register(put(instance_id="p", draining=True), {"registrant": "a"}, now=9.0)
    inst = reg.find_instance("p", now=18.0)
    assert inst.is_draining and inst.entries[(0, 0, 0, 0)].draining
    assert reg.num_drains == 1
    assert reg.deregister(put(instance_id="p", draining=True), now=18.5, extra={"registrant": "a"})
    assert reg.instances == {}


def test_a_draining_rank_lapses_without_renewals() -> None:
    reg = Registry(ttl_s=10, max_ranks=10)
    reg.register(put(draining=True), {"registrant": "a"}, now=0.0)  # (a registry restarted during the drain)
    assert reg.find_instance(None, now=1.0).is_draining and reg.num_drains == 1
    assert reg.sweep(now=10.0) == 1 and reg.instances == {}


def test_a_successor_takes_a_draining_rank_at_once_and_the_leaver_does_not_take_it_back() -> None:
    """A live holder that still renews keeps its rank from another process for 5 s (``instance_conflict``); a
    draining one does not: a rolling restart's new prefill with the same --instance-id registers at once."""
    reg = Registry(ttl_s=10, max_ranks=10)
    reg.register(put(instance_id="p"), {"registrant": "old"}, now=0.0)
    with pytest.raises(ApiError) as refused:  # (not draining: the holder is live)
        reg.register(put(instance_id="p", rank_port=40001), {"registrant": "new"}, now=0.5)
    assert refused.value.code == "instance_conflict"
    reg.register(put(instance_id="p", draining=True), {"registrant": "old"}, now=1.0)
    reg.register(put(instance_id="p", rank_port=40001), {"registrant": "new"}, now=1.5)
    inst = reg.find_instance("p", now=2.0)
    assert reg.lookup(inst, (0, 0, 0, 0)).rank_port == 40001 and not inst.is_draining
    with pytest.raises(ApiError) as refused:  # the leaver's next renewal
        reg.register(put(instance_id="p", draining=True), {"registrant": "old"}, now=2.5)
    assert refused.value.status == 409 and refused.value.code == "instance_conflict"
    assert reg.lookup(reg.find_instance("p", now=3.0), (0, 0, 0, 0)).rank_port == 40001
    assert not reg.deregister(put(instance_id="p"), now=3.0, extra={"registrant": "old"})  # (its late goodbye)
    assert reg.num_ranks == 1


def test_put_route_confirms_draining_and_the_listing_flags_it(start_registry: Callable[..., RegistryProc]) -> None:
    reg = start_registry()
    plain = httpx.put(f"{reg.url}/route", json=rank_body(registrant="a"), timeout=5)
    assert plain.status_code == 200 and plain.text == "OK"  # (SGLang's answer, unchanged)
    listing = httpx.get(f"{reg.url}/instances", timeout=5).json()
    assert listing["instances"][0]["draining"] is False and listing["instances"][0]["ranks"][0]["draining"] is False
    drained = httpx.put(f"{reg.url}/route", json=rank_body(registrant="a", draining=True), timeout=5)
    assert drained.status_code == 200 and drained.json() == {"draining": True}
    instance = httpx.get(f"{reg.url}/instances", timeout=5).json()["instances"][0]
    assert instance["draining"] is True and instance["ranks"][0]["draining"] is True
    assert "draining" not in instance["ranks"][0]["extra"]
    # look-ups answer as before, in SGLang's shapes (nothing added to the topology)
    assert set(topology(reg.url).json()) == set(Topology.__struct_fields__)
    address = httpx.get(f"{reg.url}/route", params=ADDRESS_QUERY, timeout=5).json()
    assert address == {"rank_ip": "127.0.0.1", "rank_port": 40000}
    metrics = httpx.get(f"{reg.url}/metrics", timeout=5).text
    assert 'bootstrap_instance_draining{instance_id="default"} 1.0' in metrics
    assert "bootstrap_rank_drains_total 1.0" in metrics
    bad = httpx.put(f"{reg.url}/route", json=rank_body(draining="yes"), timeout=5)
    assert bad.status_code == 400


def _registration(**kw: Any) -> RankRegistration:
    base: dict[str, Any] = {"rank_ip": "127.0.0.1", "rank_port": 51000, "page_size": 16, "kv_cache_dtype": "auto",
                            "registrant": "me"}
    base.update(kw)
    return RankRegistration(**base)


def test_a_draining_registrar_stays_registered_and_renews_until_it_closes(
    start_registry: Callable[..., RegistryProc],
) -> None:
    reg = start_registry("--ttl-s", "1")

    async def run() -> None:
        registrar = BootstrapRegistrar(reg.url, _registration(instance_id="d"), interval_s=0.2)
        await registrar.start()
        assert await registrar.drain() is True and registrar.is_draining
        await asyncio.sleep(1.5)  # (past the 1 s lease: only renewals keep it)
        instance = httpx.get(f"{reg.url}/instances", timeout=5).json()["instances"][0]
        assert instance["draining"] is True, instance
        assert instance["ranks"][0]["num_puts"] >= 3, instance  # (the drain's PUT and renewals since)
        assert topology(reg.url, "d").status_code == 200
        await registrar.aclose()

    asyncio.run(run())
    assert topology(reg.url, "d").status_code == 503  # deregistered at the end
    assert httpx.get(f"{reg.url}/instances", timeout=5).json()["instances"] == []


class _OldRegistry(BaseHTTPRequestHandler):
    """A registry that knows no ``draining`` (an older one of ours, SGLang's): every PUT is answered ``OK``."""

    requests: list[tuple[str, dict[str, Any]]] = []

    def _record(self) -> None:
        length = int(self.headers.get("content-length") or 0)
        self.requests.append((self.command, msgspec.json.decode(self.rfile.read(length))))
        body = b"OK" if self.command == "PUT" else b'{"deregistered": true}'
        self.send_response(200)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_PUT = _record
    do_DELETE = _record

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def old_registry() -> Iterator[str]:
    _OldRegistry.requests = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _OldRegistry)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()
    thread.join(timeout=5)


def test_a_registry_that_does_not_confirm_draining_gets_the_goodbye_at_once(old_registry: str) -> None:
    async def run() -> None:
        registrar = BootstrapRegistrar(old_registry, _registration(), interval_s=0.2)
        await registrar.start()
        assert await registrar.drain() is False and not registrar.is_draining
        await asyncio.sleep(0.5)  # (no renewals after the goodbye)
        await registrar.aclose()  # (a second close: nothing more sent)

    asyncio.run(run())
    kinds = [command for command, _ in _OldRegistry.requests]
    assert kinds == ["PUT", "PUT", "DELETE"], kinds
    assert _OldRegistry.requests[1][1]["draining"] is True
    assert "draining" not in _OldRegistry.requests[2][1]  # (the goodbye as any registry knows it)


def test_a_successor_registers_at_once_over_a_draining_registrar_which_does_not_take_it_back(
    start_registry: Callable[..., RegistryProc],
) -> None:
    """A rolling restart with one --instance-id: the new prefill is not held off for 5 s (then refused for good after
    15 s of a drain that keeps renewing); the old one's renewals (refused, and re-sent until its drain ends, in case
    the successor goes without a goodbye: tests/bootstrap/test_goodbye_is_final.py) and its goodbye leave the new
    entry alone."""
    reg = start_registry()

    async def run() -> None:
        old = BootstrapRegistrar(reg.url, _registration(instance_id="r", registrant="old"), interval_s=0.1)
        new = BootstrapRegistrar(reg.url, _registration(instance_id="r", registrant="new", rank_port=51001),
                                 interval_s=0.1, start_timeout_s=10.0)
        await old.start()
        assert await old.drain() is True
        await new.start()
        assert new.num_failures == 0  # (its first PUT was taken)
        for _ in range(200):  # (a hang guard: the old one's renewals are refused, it keeps trying)
            if old.num_failures >= 3:
                break
            await asyncio.sleep(0.05)
        assert old.num_failures >= 3 and old.last_code == "instance_conflict"
        assert old._task is not None and not old._task.done() and old.is_draining
        instance = httpx.get(f"{reg.url}/instances", timeout=5).json()["instances"][0]
        assert instance["draining"] is False and instance["ranks"][0]["rank_port"] == 51001, instance
        await old.aclose()
        instance = httpx.get(f"{reg.url}/instances", timeout=5).json()["instances"][0]
        assert instance["draining"] is False and instance["ranks"][0]["rank_port"] == 51001, instance
        await new.aclose()

    asyncio.run(run())
