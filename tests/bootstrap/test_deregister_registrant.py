"""A late ``DELETE /route`` from an old prefill process must not remove its replacement's registration, also
when the replacement came back on the same host:port (a restart on a fixed --kv-port, or a reused pod IP).

The registry told a rank's processes apart only by address on a goodbye, although every registration of ours
carries the process's own ``registrant`` mark: the old process's goodbye (sent late: a registry that answered
slowly, a proxy that retried it) removed the new process's entry, and decodes without a cached reply could not
look the prefill up (503 ``not_registered``) until its next heartbeat.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import httpx
import pytest
from conftest import RegistryProc, rank_body, topology

from bootstrap import BootstrapNotReady, BootstrapRegistrar, BootstrapResolver, RankRegistration


def _registration(registrant: str) -> RankRegistration:
    return RankRegistration(rank_ip="127.0.0.1", rank_port=47123, page_size=16, kv_cache_dtype="auto",
                            instance_id="restarted", registrant=registrant)


def test_an_old_processs_late_goodbye_keeps_its_same_address_replacement(
    start_registry: Callable[..., RegistryProc],
) -> None:
    # (a long heartbeat interval: the replacement does not re-register before the checks below)
    reg = start_registry("--ttl-s", "30")

    async def run() -> None:
        old = BootstrapRegistrar(reg.url, _registration("old-process"), interval_s=60)
        await old.start()
        new = BootstrapRegistrar(reg.url, _registration("new-process"), interval_s=60)
        await new.start()  # (the same address: the old one is gone, it takes over at once)
        try:
            await old.aclose()  # the old process's goodbye, arriving after its replacement registered
            assert topology(reg.url, "restarted").status_code == 200, "the replacement's registration was removed"
            resolver = BootstrapResolver()  # a decode that has not looked this prefill up before
            try:
                assert resolver.resolve("127.0.0.1", reg.port, "restarted") == ("127.0.0.1", 47123)
            except BootstrapNotReady as exc:
                pytest.fail(f"a decode cannot find the restarted prefill: {exc}")
            finally:
                resolver.close()
        finally:
            await new.aclose()
        assert topology(reg.url, "restarted").status_code == 503  # its own goodbye still deregisters it

    asyncio.run(run())


def test_delete_route_with_another_registrant_is_refused(start_registry: Callable[..., RegistryProc]) -> None:
    reg = start_registry("--ttl-s", "0")
    old = rank_body(instance_id="r", rank_port=47200, registrant="a")
    new = {**old, "registrant": "b"}
    assert httpx.put(f"{reg.url}/route", json=old, timeout=5).status_code == 200
    assert httpx.put(f"{reg.url}/route", json=new, timeout=5).status_code == 200
    late = httpx.request("DELETE", f"{reg.url}/route", json=old, timeout=5)
    assert late.status_code == 200 and late.json() == {"deregistered": False}
    assert topology(reg.url, "r").status_code == 200
    # an SGLang prefill (no mark) restarted on the address: not ours to remove either
    assert httpx.put(f"{reg.url}/route", json=rank_body(instance_id="r", rank_port=47200), timeout=5).status_code == 200
    assert httpx.request("DELETE", f"{reg.url}/route", json=new, timeout=5).json() == {"deregistered": False}
    # a goodbye without a mark (an operator's, an older client's) goes by address, as before
    gone = httpx.request("DELETE", f"{reg.url}/route", json=rank_body(instance_id="r", rank_port=47200), timeout=5)
    assert gone.json() == {"deregistered": True}
    assert topology(reg.url, "r").status_code == 503
