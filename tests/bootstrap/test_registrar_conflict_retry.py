"""A restarted prefill on a new address (its control port is new) is refused as ``instance_conflict`` while its dead
predecessor's lease still counts as live (``bootstrap.registry.CONFLICT_WINDOW_S`` after its last renewal). The 409
now says when that ends (``error.retry_after_s``, ``Retry-After``) and the registrar retries right then: it used to
retry on a backoff doubling to 2 s, so it registered up to ~2 s after it could (chaos runs: 5.2 s / 7.2 s from a
kill -9 to the first request the restarted prefill served). Two live prefills sharing an instance id are still
refused. All against a real ``pd-bootstrap`` process; counts read from its ``/metrics``."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable

import httpx
import pytest
from conftest import RegistryProc, rank_body

from bootstrap import BootstrapError, BootstrapRegistrar, RankRegistration
from bootstrap.client import INSTANCE_CONFLICT_GIVE_UP_S, _retry_after_s
from bootstrap.registry import CONFLICT_WINDOW_S


def _puts(reg: RegistryProc, status: int) -> int:
    metrics = httpx.get(f"{reg.url}/metrics", timeout=5).text
    found = re.search(rf'bootstrap_http_requests_total{{method="PUT",route="/route",status="{status}"}} (\S+)',
                      metrics)
    return int(float(found.group(1))) if found else 0


def _registration(rank_port: int, registrant: str) -> RankRegistration:
    return RankRegistration(rank_ip="127.0.0.1", rank_port=rank_port, page_size=16, kv_cache_dtype="auto",
                            instance_id="p0", registrant=registrant)


def test_the_conflict_says_when_the_holder_stops_counting_as_live(start_registry: Callable[..., RegistryProc]) -> None:
    reg = start_registry()
    held = httpx.put(f"{reg.url}/route", json=rank_body(instance_id="p0", rank_port=47001, registrant="old"), timeout=5)
    assert held.status_code == 200
    refused = httpx.put(f"{reg.url}/route", json=rank_body(instance_id="p0", rank_port=47002, registrant="new"),
                        timeout=5)
    assert refused.status_code == 409
    error = refused.json()["error"]
    assert error["code"] == "instance_conflict"
    assert 0 < error["retry_after_s"] <= CONFLICT_WINDOW_S, error
    assert 1 <= int(refused.headers["retry-after"]) <= CONFLICT_WINDOW_S  # (whole seconds, rounded up)
    # Other errors carry neither
    bad = httpx.put(f"{reg.url}/route", json={"rank_ip": "x"}, timeout=5)
    assert bad.status_code == 400 and "retry_after_s" not in bad.json()["error"] and "retry-after" not in bad.headers


def test_a_restart_registers_right_when_its_dead_predecessors_lease_stops_counting(
    start_registry: Callable[..., RegistryProc],
) -> None:
    reg = start_registry()
    # The predecessor's last renewal (then kill -9: it renews no more)
    assert httpx.put(f"{reg.url}/route", json=rank_body(instance_id="p0", rank_port=47001, registrant="old"),
                     timeout=5).status_code == 200

    async def run() -> None:
        registrar = BootstrapRegistrar(reg.url, _registration(47002, "new"), interval_s=0.5, start_timeout_s=30)
        await registrar.start()
        try:
            assert registrar.is_registered
        finally:
            await registrar.aclose()

    asyncio.run(run())
    # One refusal, then the retry the refusal asked for: registered. (The backoff took 6 to 8 tries to get past
    # the 5 s window, the last up to 2 s after the window had ended.)
    assert _puts(reg, 409) == 1
    assert _puts(reg, 200) == 2  # (the predecessor's PUT and the restart's)


def test_a_live_holder_still_keeps_the_rank(start_registry: Callable[..., RegistryProc]) -> None:
    reg = start_registry()

    async def run() -> None:
        holder = BootstrapRegistrar(reg.url, _registration(47001, "a"), interval_s=0.2, start_timeout_s=10)
        await holder.start()
        try:
            second = BootstrapRegistrar(reg.url, _registration(47002, "b"), interval_s=0.2,
                                        start_timeout_s=CONFLICT_WINDOW_S + 1)
            with pytest.raises(BootstrapError) as refused:
                await second.start()
            assert refused.value.status_code == 409 and second.last_code == "instance_conflict"
            assert not second.is_registered and second.last_retry_after_s is not None
            answer = await asyncio.to_thread(httpx.get, f"{reg.url}/route", params={
                "prefill_dp_rank": 0, "prefill_cp_rank": 0, "target_tp_rank": 0, "target_pp_rank": 0,
                "instance_id": "p0"}, timeout=5)
            assert answer.json()["rank_port"] == 47001  # the live holder's, all along
        finally:
            await holder.aclose()

    asyncio.run(run())
    # Each retry came when the holder would have lapsed (it renewed meanwhile): a few tries, none accepted
    assert 2 <= _puts(reg, 409) <= 4


@pytest.mark.parametrize(("body", "headers", "expected"), [
    (b'{"error": {"message": "m", "type": "conflict_error", "code": "instance_conflict", "retry_after_s": 1.25}}',
     {"retry-after": "2"}, 1.25),  # (the body's exact figure first)
    (b'{"error": {"message": "m", "type": "conflict_error", "code": "instance_conflict"}}', {"retry-after": "3"}, 3.0),
    (b"not json", {"retry-after": "3"}, 3.0),
    (b'{"error": {"code": "instance_conflict"}}', {}, None),  # (says nothing: the backoff)
    (b'{"error": {"retry_after_s": "soon"}}', {"retry-after": "Wed, 21 Oct 2026 07:28:00 GMT"}, None),
    (b'{"error": {"retry_after_s": -4}}', {}, 0.0),
    (b'{"error": {"retry_after_s": 1e300}}', {}, INSTANCE_CONFLICT_GIVE_UP_S),  # (a hint must not park the start-up)
])
def test_the_registrars_reading_of_the_hint(body: bytes, headers: dict[str, str], expected: float | None) -> None:
    assert _retry_after_s(httpx.Response(409, content=body, headers=headers)) == expected
