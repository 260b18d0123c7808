"""Leases and restarts with real processes: killed ranks expire, restarted ranks replace, a restarted
registry is refilled by heartbeats, and 64 ranks register concurrently."""

from __future__ import annotations

import asyncio
import signal
import subprocess
from collections.abc import Callable

import httpx
from conftest import RegistryProc, free_port, topology, wait_until

from bootstrap import BootstrapRegistrar, BootstrapResolver, RankRegistration

TTL_S = 2.5  # heartbeats every 0.2 s: a loaded CPU must not expire live ranks


def _rank(url: str, tp: int, instance_id: str | None = None) -> httpx.Response:
    params: dict[str, object] = {"prefill_dp_rank": 0, "prefill_cp_rank": 0, "target_tp_rank": tp, "target_pp_rank": 0}
    if instance_id:
        params["instance_id"] = instance_id
    return httpx.get(f"{url}/route", params=params, timeout=5)


def test_sigkilled_rank_expires_and_instance_goes_back_to_503(
    start_registry: Callable[..., RegistryProc], start_rank: Callable[..., subprocess.Popen[bytes]]
) -> None:
    url = start_registry("--ttl-s", str(TTL_S)).url
    survivor = start_rank(url, rank_port=47000, tp_size=2, tp_rank=0)
    victim = start_rank(url, rank_port=47001, tp_size=2, tp_rank=1)
    assert topology(url).status_code == 200
    assert _rank(url, 1).json() == {"rank_ip": "127.0.0.1", "rank_port": 47001}

    victim.send_signal(signal.SIGKILL)  # no goodbye: only the lease can notice
    victim.wait(timeout=5)
    assert wait_until(lambda: topology(url).status_code == 503, timeout_s=TTL_S + 3)
    assert _rank(url, 1).status_code == 503  # the dead address is never handed out
    assert _rank(url, 0).status_code == 503  # nor the live one of a now-incomplete instance
    listing = httpx.get(f"{url}/instances", timeout=5).json()["instances"]
    assert [(r["target_tp_rank"], r["rank_port"]) for r in listing[0]["ranks"]] == [(0, 47000)]
    assert survivor.poll() is None
    # The survivor keeps heartbeating; a replacement for tp=1 makes the instance ready again.
    start_rank(url, rank_port=47002, tp_size=2, tp_rank=1)
    assert topology(url).status_code == 200
    assert _rank(url, 1).json()["rank_port"] == 47002


def test_restarted_rank_replaces_its_old_entry(
    start_registry: Callable[..., RegistryProc], start_rank: Callable[..., subprocess.Popen[bytes]]
) -> None:
    url = start_registry("--ttl-s", "30").url  # long TTL: replacement must not depend on expiry
    old = start_rank(url, rank_port=48000, instance_id="p1")
    assert _rank(url, 0, "p1").json()["rank_port"] == 48000
    old.send_signal(signal.SIGKILL)
    old.wait(timeout=5)
    start_rank(url, rank_port=48001, instance_id="p1")
    assert _rank(url, 0, "p1").json()["rank_port"] == 48001
    ranks = httpx.get(f"{url}/instances", timeout=5).json()["instances"][0]["ranks"]
    assert len(ranks) == 1 and ranks[0]["rank_port"] == 48001


def test_registry_restart_is_refilled_by_heartbeats(
    start_registry: Callable[..., RegistryProc], start_rank: Callable[..., subprocess.Popen[bytes]]
) -> None:
    port = free_port()
    first = start_registry("--ttl-s", str(TTL_S), port=port)
    start_rank(first.url, rank_port=49000, tp_size=2, tp_rank=0)
    start_rank(first.url, rank_port=49001, tp_size=2, tp_rank=1)
    assert topology(first.url).status_code == 200
    first.stop(signal.SIGKILL)  # crash: all state lost
    second = start_registry("--ttl-s", str(TTL_S), port=port)
    assert wait_until(lambda: topology(second.url).status_code == 200, timeout_s=10)
    assert _rank(second.url, 1).json() == {"rank_ip": "127.0.0.1", "rank_port": 49001}


def test_sigterm_rank_deregisters_at_once(
    start_registry: Callable[..., RegistryProc], start_rank: Callable[..., subprocess.Popen[bytes]]
) -> None:
    url = start_registry("--ttl-s", "60").url  # expiry would take a minute; DELETE takes effect now
    proc = start_rank(url, rank_port=49500)
    assert topology(url).status_code == 200
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=10) == 0
    assert topology(url).status_code == 503


def test_64_ranks_register_concurrently(start_registry: Callable[..., RegistryProc]) -> None:
    url = start_registry("--ttl-s", "10").url
    layouts = [(dp, tp, pp) for dp in range(4) for tp in range(4) for pp in range(4)]

    def registration(i: int, dp: int, tp: int, pp: int) -> RankRegistration:
        return RankRegistration(
            rank_ip="127.0.0.1",
            rank_port=50000 + i,
            page_size=16,
            kv_cache_dtype="auto",
            instance_id="big",
            attn_dp_size=4,
            attn_dp_rank=dp,
            attn_tp_size=4,
            attn_tp_rank=tp,
            pp_size=4,
            pp_rank=pp,
        )

    async def run() -> None:
        registrars = [
            BootstrapRegistrar(url, registration(i, *layout), interval_s=0.5) for i, layout in enumerate(layouts)
        ]
        await asyncio.gather(*(r.start() for r in registrars))
        try:
            resolver = BootstrapResolver(cache_ttl_s=0)
            try:
                topo = await asyncio.to_thread(resolver.topology, "127.0.0.1", int(url.rsplit(":", 1)[1]), "big")
                assert (topo.dp_size, topo.attn_tp_size, topo.pp_size, topo.num_ranks) == (4, 4, 4, 64)

                def resolve_all() -> list[tuple[str, int]]:
                    port = int(url.rsplit(":", 1)[1])
                    return [
                        resolver.resolve("127.0.0.1", port, "big", dp_rank=dp, tp_rank=tp, pp_rank=pp)
                        for dp, tp, pp in layouts
                    ]

                addresses = await asyncio.to_thread(resolve_all)
                assert addresses == [("127.0.0.1", 50000 + i) for i in range(64)]
            finally:
                resolver.close()
            metrics = httpx.get(f"{url}/metrics", timeout=5).text
            assert 'bootstrap_instance_ranks{instance_id="big"} 64.0' in metrics
        finally:
            await asyncio.gather(*(r.aclose() for r in registrars))

    asyncio.run(run())
    assert topology(url, "big").status_code == 503  # every rank said goodbye
    assert httpx.get(f"{url}/instances", timeout=5).json()["instances"] == []
