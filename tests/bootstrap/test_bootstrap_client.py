"""BootstrapRegistrar, BootstrapResolver, RankRegistration and check_compatible against real servers."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import msgspec
import pytest
from conftest import RegistryProc, free_port, rank_body, topology, wait_until

from bootstrap import (
    BootstrapError,
    BootstrapNotReady,
    BootstrapRegistrar,
    BootstrapResolver,
    BootstrapUnreachable,
    RankRegistration,
    Topology,
    check_compatible,
)

SGLANG_PUT_FIELDS = {
    "attn_tp_size",
    "attn_tp_rank",
    "attn_cp_size",
    "attn_cp_rank",
    "attn_dp_size",
    "attn_dp_rank",
    "pp_size",
    "pp_rank",
    "system_dp_size",
    "system_dp_rank",
    "rank_ip",
    "rank_port",
    "page_size",
    "kv_cache_dtype",
    "load_balance_method",
    "enable_dsa_cache_layer_split",
    "prefill_http_port",
}


def _registration(**kw: object) -> RankRegistration:
    base: dict[str, object] = {"rank_ip": "127.0.0.1", "rank_port": 51000, "page_size": 16, "kv_cache_dtype": "auto"}
    base.update(kw)
    return RankRegistration(**base)  # type: ignore[arg-type]


def test_rank_registration_json_uses_sglang_names() -> None:
    plain = json.loads(_registration().to_json())
    assert set(plain) == SGLANG_PUT_FIELDS  # absent instance_id = SGLang's single instance
    named = json.loads(
        _registration(instance_id="p0", attn_tp_size=4, attn_tp_rank=3, prefill_http_port=30000).to_json()
    )
    assert set(named) == SGLANG_PUT_FIELDS | {"instance_id"}
    assert (named["instance_id"], named["attn_tp_size"], named["attn_tp_rank"], named["prefill_http_port"]) == (
        "p0",
        4,
        3,
        30000,
    )


@pytest.mark.parametrize(
    "kw",
    [
        {"attn_tp_rank": 1},
        {"pp_size": 0},
        {"rank_port": 0},
        {"page_size": 0},
        {"rank_ip": ""},
        {"attn_dp_size": 2, "attn_dp_rank": -1},
    ],
)
def test_rank_registration_rejects_bad_values(kw: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        _registration(**kw)


def test_check_compatible_names_each_mismatch() -> None:
    topo = Topology(
        attn_tp_size=1,
        attn_cp_size=1,
        dp_size=1,
        pp_size=1,
        page_size=16,
        kv_cache_dtype="auto",
        follow_bootstrap_room=True,
    )
    check_compatible(topo, page_size=16, kv_cache_dtype="auto")
    with pytest.raises(BootstrapError, match="page_size: prefill has 16, decode has 32"):
        check_compatible(topo, page_size=32, kv_cache_dtype="auto")
    with pytest.raises(BootstrapError, match="kv_cache_dtype: prefill has 'auto', decode has 'fp8_e5m2'"):
        check_compatible(topo, page_size=16, kv_cache_dtype="fp8_e5m2")
    unknown = msgspec.structs.replace(topo, page_size=None, kv_cache_dtype=None)
    check_compatible(unknown, page_size=64, kv_cache_dtype="anything")  # unreported fields are not checked


def test_resolver_caches_until_invalidated(start_registry: Callable[..., RegistryProc]) -> None:
    reg = start_registry("--ttl-s", "0")
    httpx.put(f"{reg.url}/route", json=rank_body(instance_id="c", rank_port=52000), timeout=5)
    resolver = BootstrapResolver(cache_ttl_s=60)
    fresh = BootstrapResolver(cache_ttl_s=0)
    try:
        assert resolver.cached_address("127.0.0.1", reg.port, "c") is None  # never asked: a miss, no I/O
        assert resolver.resolve("127.0.0.1", reg.port, "c") == ("127.0.0.1", 52000)
        assert resolver.cached_topology("127.0.0.1", reg.port, "c") is None
        assert resolver.topology("127.0.0.1", reg.port, "c").page_size == 16
        assert resolver.cached_address("127.0.0.1", reg.port, "c") == ("127.0.0.1", 52000)
        assert resolver.cached_topology("127.0.0.1", reg.port, "c").page_size == 16  # type: ignore[union-attr]
        httpx.put(f"{reg.url}/route", json=rank_body(instance_id="c", rank_port=52001, page_size=32), timeout=5)
        assert resolver.resolve("127.0.0.1", reg.port, "c") == ("127.0.0.1", 52000)  # cached
        assert fresh.resolve("127.0.0.1", reg.port, "c") == ("127.0.0.1", 52001)
        assert fresh.cached_address("127.0.0.1", reg.port, "c") is None  # caching off
        resolver.invalidate("127.0.0.1", reg.port, "other")  # another instance: no effect
        assert resolver.resolve("127.0.0.1", reg.port, "c") == ("127.0.0.1", 52000)
        resolver.invalidate("127.0.0.1", reg.port, "c")
        assert resolver.cached_address("127.0.0.1", reg.port, "c") is None
        assert resolver.resolve("127.0.0.1", reg.port, "c") == ("127.0.0.1", 52001)
        assert resolver.topology("127.0.0.1", reg.port, "c").page_size == 32
    finally:
        resolver.close()
        fresh.close()


def test_resolver_errors(start_registry: Callable[..., RegistryProc]) -> None:
    reg = start_registry("--ttl-s", "0")
    resolver = BootstrapResolver(cache_ttl_s=60, timeout_s=2)
    try:
        with pytest.raises(BootstrapNotReady) as not_ready:
            resolver.topology("127.0.0.1", reg.port)
        assert not_ready.value.status_code == 503
        httpx.put(f"{reg.url}/route", json=rank_body(attn_tp_size=2), timeout=5)
        with pytest.raises(BootstrapNotReady, match="1/2"):
            resolver.resolve("127.0.0.1", reg.port)  # errors are not cached: the next call asks again
        httpx.put(f"{reg.url}/route", json=rank_body(attn_tp_size=2, attn_tp_rank=1, rank_port=40001), timeout=5)
        assert resolver.resolve("127.0.0.1", reg.port, tp_rank=1) == ("127.0.0.1", 40001)
        with pytest.raises(BootstrapError, match="HTTP 404") as missing:
            resolver.resolve("127.0.0.1", reg.port, tp_rank=5)
        assert missing.value.status_code == 404 and not isinstance(missing.value, BootstrapNotReady)
        with pytest.raises(BootstrapUnreachable):
            resolver.topology("127.0.0.1", free_port())
        with pytest.raises(ValueError):
            resolver.resolve("127.0.0.1", reg.port, dp_rank=-1)
    finally:
        resolver.close()


class _BadRegistry(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = b'{"rank_ip": 5}' if "target_tp_rank=0" in self.path else b"<html>not json</html>"
        self.send_response(200)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def bad_registry() -> Iterator[int]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _BadRegistry)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield int(server.server_address[1])
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def test_resolver_rejects_malformed_replies(bad_registry: int) -> None:
    resolver = BootstrapResolver()
    try:
        with pytest.raises(BootstrapError, match="malformed topology reply"):
            resolver.topology("127.0.0.1", bad_registry)
        with pytest.raises(BootstrapError, match="malformed rank"):
            resolver.resolve("127.0.0.1", bad_registry)
    finally:
        resolver.close()


def test_resolver_is_thread_safe(start_registry: Callable[..., RegistryProc]) -> None:
    reg = start_registry("--ttl-s", "0")
    for tp in range(4):
        httpx.put(f"{reg.url}/route", json=rank_body(attn_tp_size=4, attn_tp_rank=tp, rank_port=53000 + tp), timeout=5)
    errors: list[BaseException] = []
    for cache_ttl_s in (0.0, 60.0):
        resolver = BootstrapResolver(cache_ttl_s=cache_ttl_s)

        def work(resolver: BootstrapResolver = resolver) -> None:
            try:
                for i in range(40):
                    tp = i % 4
                    assert resolver.resolve("127.0.0.1", reg.port, tp_rank=tp) == ("127.0.0.1", 53000 + tp)
                    if i % 10 == 0:
                        resolver.invalidate("127.0.0.1", reg.port)
                        assert resolver.topology("127.0.0.1", reg.port).attn_tp_size == 4
            except BaseException as exc:  # collected and re-raised in the main thread
                errors.append(exc)

        threads = [threading.Thread(target=work) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        resolver.close()
    assert not errors, errors[:3]


def test_registrar_fails_fast_on_refusal(start_registry: Callable[..., RegistryProc]) -> None:
    reg = start_registry("--token", "right")

    async def run() -> None:
        registrar = BootstrapRegistrar(reg.url, _registration(), token="wrong", start_timeout_s=30)
        with pytest.raises(BootstrapError, match="refused") as refused:
            await registrar.start()
        assert refused.value.status_code == 401
        await registrar.aclose()  # safe after a failed start

    asyncio.run(run())
    metrics = httpx.get(f"{reg.url}/metrics", headers={"Authorization": "Bearer right"}, timeout=5).text
    assert 'bootstrap_http_requests_total{method="PUT",route="/route",status="401"} 1.0' in metrics  # no retries


def test_registrar_start_retries_until_registry_is_up(start_registry: Callable[..., RegistryProc]) -> None:
    port = free_port()

    async def run() -> None:
        registrar = BootstrapRegistrar(
            f"127.0.0.1:{port}", _registration(instance_id="late"), interval_s=0.2, start_timeout_s=20
        )
        starting = asyncio.create_task(registrar.start())
        await asyncio.sleep(0.5)
        assert not starting.done()  # still retrying: nothing listens yet
        reg = await asyncio.to_thread(start_registry, "--ttl-s", "1", port=port)
        await starting
        assert registrar.is_registered
        # Heartbeats keep the 1 s lease alive well past its TTL.
        await asyncio.sleep(2.0)
        assert (await asyncio.to_thread(topology, reg.url, "late")).status_code == 200
        listing = (await asyncio.to_thread(httpx.get, f"{reg.url}/instances")).json()
        assert listing["instances"][0]["ranks"][0]["num_puts"] >= 5
        assert registrar._task is not None and registrar._task.get_name().startswith("bootstrap-heartbeat-")
        # Registry gone: the registrar notices and keeps trying.
        await asyncio.to_thread(reg.stop)
        await asyncio.sleep(0.6)
        assert not registrar.is_registered and registrar.num_failures >= 1
        await registrar.aclose()

    asyncio.run(run())


def test_registrar_start_gives_up_after_its_bound() -> None:
    async def run() -> None:
        registrar = BootstrapRegistrar(f"http://127.0.0.1:{free_port()}", _registration(), start_timeout_s=0.5)
        with pytest.raises(BootstrapError, match=r"within 0\.5s"):
            await registrar.start()

    asyncio.run(run())


def test_registrar_reregisters_after_registry_restart(
    start_registry: Callable[..., RegistryProc],
) -> None:
    port = free_port()
    first = start_registry("--ttl-s", "5", port=port)

    async def run() -> None:
        registrar = BootstrapRegistrar(first.url, _registration(instance_id="rr"), interval_s=0.2)
        await registrar.start()
        await asyncio.to_thread(first.stop)
        second = await asyncio.to_thread(start_registry, "--ttl-s", "5", port=port)
        # (the registry has the entry a moment before the registrar has read the PUT's answer: both are waited for)
        ok = await asyncio.to_thread(
            wait_until, lambda: topology(second.url, "rr").status_code == 200 and registrar.is_registered, 10.0)
        assert ok, (registrar.is_registered, registrar.last_error)
        await registrar.aclose()

    asyncio.run(run())


def test_address_formatting() -> None:
    from bootstrap.client import _host_port, registry_url

    assert _host_port("::1", None) == "[::1]:8998"
    assert _host_port("[::1]", 9000) == "[::1]:9000"
    assert _host_port("10.0.0.1", None) == "10.0.0.1:8998"
    assert registry_url("127.0.0.1:8998/") == "http://127.0.0.1:8998"
    assert registry_url("https://reg.example:443") == "https://reg.example:443"


def test_a_registry_known_in_full_is_asked_at_its_own_url(start_registry: Callable[..., RegistryProc]) -> None:
    """A registry behind a proxy (its own scheme and a path, as ``--bootstrap https://proxy/pd``): prefills
    register at that URL and announce only its host and port; a decode given the URL (its own
    ``--bootstrap``) looks those prefills up there, not at ``http://host:port/route``."""
    reg = start_registry("--ttl-s", "0")
    httpx.put(f"{reg.url}/route", json=rank_body(instance_id="c", rank_port=52000), timeout=5)

    class PathProxy(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if not self.path.startswith("/pd/"):
                self.send_error(404)
                return
            answer = httpx.get(f"{reg.url}{self.path[len('/pd'):]}", timeout=5)
            self.send_response(answer.status_code)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(answer.content)))
            self.end_headers()
            self.wfile.write(answer.content)

        def log_message(self, *args: object) -> None:
            pass

    proxy = ThreadingHTTPServer(("127.0.0.1", 0), PathProxy)
    thread = threading.Thread(target=proxy.serve_forever, daemon=True)
    thread.start()
    port = int(proxy.server_address[1])
    knows = BootstrapResolver(cache_ttl_s=0, registries=[f"http://127.0.0.1:{port}/pd"])
    plain = BootstrapResolver(cache_ttl_s=0)
    try:
        assert knows.resolve("127.0.0.1", port, "c") == ("127.0.0.1", 52000)
        with pytest.raises(BootstrapError):
            plain.resolve("127.0.0.1", port, "c")  # (http://host:port/route: the proxy's 404)
        assert knows.resolve("127.0.0.1", reg.port, "c") == ("127.0.0.1", 52000)  # (other registries: as before)
    finally:
        knows.close()
        plain.close()
        proxy.shutdown()
        proxy.server_close()
        thread.join(timeout=5)


def test_a_registrar_closing_after_a_failed_renewal_still_deregisters(
    start_registry: Callable[..., RegistryProc],
) -> None:
    """One renewal timed out (a registry frozen a moment): the entry lives on until its lease ends, so a
    prefill stopping now deregisters all the same (it skipped that, and decodes found a gone prefill for
    the rest of the lease)."""
    import os
    import signal

    reg = start_registry("--ttl-s", "30")

    async def run() -> None:
        registrar = BootstrapRegistrar(reg.url, _registration(instance_id="brief"), interval_s=0.2)
        await registrar.start()
        assert reg.proc is not None
        os.kill(reg.proc.pid, signal.SIGSTOP)
        try:
            await asyncio.sleep(1.6)  # (a renewal times out after 1 s)
            assert registrar.num_failures >= 1
        finally:
            os.kill(reg.proc.pid, signal.SIGCONT)
        await registrar.aclose()

    asyncio.run(run())
    assert topology(reg.url, "brief").status_code != 200


def test_the_token_goes_only_to_the_registries_the_resolver_was_given(
    start_registry: Callable[..., RegistryProc],
) -> None:
    """A decode looks prefills up at the ``bootstrap_host:bootstrap_port`` a request names, and anyone who can
    reach a decode's HTTP port (``POST /generate``, no key) or native port (``Submit``) names them: the
    decode's ``--bootstrap-token`` must not go to such a host, which could then write the real registry
    (take over a prefill's rank: decodes fetch their KV from it)."""
    reg = start_registry("--ttl-s", "0", "--token", "s3cret", "--token-scope", "all")
    httpx.put(f"{reg.url}/route", json=rank_body(instance_id="c", rank_port=52000), timeout=5,
              headers={"authorization": "Bearer s3cret"})
    seen: list[str | None] = []

    class Elsewhere(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            seen.append(self.headers.get("authorization"))
            self.send_error(404)

        def log_message(self, *args: object) -> None:
            pass

    other = ThreadingHTTPServer(("127.0.0.1", 0), Elsewhere)
    thread = threading.Thread(target=other.serve_forever, daemon=True)
    thread.start()
    resolver = BootstrapResolver(cache_ttl_s=0, token="s3cret", registries=[reg.url])
    try:
        assert resolver.resolve("127.0.0.1", reg.port, "c") == ("127.0.0.1", 52000)  # (its own registry: the token)
        with pytest.raises(BootstrapError):
            resolver.resolve("127.0.0.1", int(other.server_address[1]), "c")
        assert seen == [None], f"the registry token went to a host the request named: {seen}"
    finally:
        resolver.close()
        other.shutdown()
        other.server_close()
        thread.join(timeout=5)
