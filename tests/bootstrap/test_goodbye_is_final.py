"""A prefill's goodbye to the registry is final: no ghost entry from a renewal that arrives after it.

The registrar cancelled a heartbeat PUT in flight and sent ``DELETE /route`` at once; the cancelled PUT could still
reach the registry after the goodbye (a proxy or a slow link holding it, a loaded registry) and register the dead
prefill again, until its lease lapsed (for ever with ``--ttl-s 0``), and decodes looked their rooms up there. Now the
registrar waits for a PUT in flight before its goodbye, and the registry refuses a PUT from a registrant that said
goodbye to the rank (410 ``deregistered``), while a new process, or an SGLang prefill (no registrant), registers as
before. Also: a draining prefill whose rank a successor took keeps renewing (refused) until its drain ends, so it is
findable again if that successor dies without a goodbye.

The registry is a real process; a small TCP proxy in the test's loop holds one PUT back deterministically.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import subprocess
from collections.abc import Callable
from typing import Any

import httpx
import msgspec
import pytest
from conftest import RegistryProc, rank_body, topology, wait_until

import bootstrap.client
import bootstrap.registry
from bootstrap import BootstrapError, BootstrapRegistrar, RankRegistration
from bootstrap.errors import ApiError
from bootstrap.messages import RankPut
from bootstrap.registry import TOMBSTONE_MIN_S, Registry
from bootstrap.tombstones import Tombstones

HANG_GUARD_S = 20.0


def put(**kw: Any) -> RankPut:
    return msgspec.convert(rank_body(**kw), RankPut)


def _registration(*, instance_id: str, registrant: str | None, rank_port: int = 51000) -> RankRegistration:
    return RankRegistration(rank_ip="127.0.0.1", rank_port=rank_port, page_size=16, kv_cache_dtype="auto",
                            instance_id=instance_id, registrant=registrant)


class HoldingProxy:
    """An HTTP/1.1 relay in front of the registry that holds the ``hold_put``-th PUT /route (1-based) until
    ``release()``, then forwards it on its own connection, also when the client has given up on it (as a proxy or a
    slow link does). ``forwarded`` lists (method, status) in the order the registry answered them."""

    def __init__(self, upstream_port: int, hold_put: int) -> None:
        self.upstream_port = upstream_port
        self.hold_put = hold_put
        self.num_puts = 0
        self.held = asyncio.Event()
        self.saw_delete = asyncio.Event()
        self.held_forwarded = asyncio.Event()
        self._release = asyncio.Event()
        self.forwarded: list[tuple[str, int]] = []
        self.held_status: int | None = None
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def url(self) -> str:
        assert self._server is not None
        return f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)

    def release(self) -> None:
        self._release.set()

    async def aclose(self) -> None:
        assert self._server is not None
        self._server.close()
        for task in list(self._tasks):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                method = head.split(b" ", 1)[0].decode()
                length = 0
                for line in head.split(b"\r\n")[1:]:
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value.strip())
                request = head + await reader.readexactly(length)
                is_held = False
                if method == "PUT":
                    self.num_puts += 1
                    is_held = self.num_puts == self.hold_put
                elif method == "DELETE":
                    self.saw_delete.set()
                if is_held:
                    self.held.set()
                    await self._release.wait()
                status, response = await self._forward(request)
                self.forwarded.append((method, status))
                if is_held:
                    self.held_status = status
                    self.held_forwarded.set()
                try:
                    writer.write(response)
                    await writer.drain()
                except ConnectionError:
                    return  # (the client gave up on it: the registry got it all the same)
        finally:
            self._tasks.discard(task)
            writer.close()

    async def _forward(self, request: bytes) -> tuple[int, bytes]:
        reader, writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        try:
            writer.write(request)
            await writer.drain()
            head = await reader.readuntil(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value.strip())
            body = await reader.readexactly(length)
            return int(head.split(b" ", 2)[1]), head + body
        finally:
            writer.close()


def _ranks(reg: RegistryProc) -> list[dict[str, Any]]:
    listing = httpx.get(f"{reg.url}/instances", timeout=5).json()
    return [rank for instance in listing["instances"] for rank in instance["ranks"]]


# -- the registry's state, explicit clock ------------------------------------------------------------------------


def test_a_put_after_the_registrants_goodbye_is_refused_and_others_are_not() -> None:
    reg = Registry(ttl_s=0, max_ranks=10)  # (no leases: a ghost would stay for ever)
    reg.register(put(instance_id="p"), {"registrant": "a"}, now=0.0)
    assert reg.deregister(put(instance_id="p"), now=1.0, extra={"registrant": "a"})
    for late in (put(instance_id="p"), put(instance_id="p", draining=True)):
        with pytest.raises(ApiError) as refused:  # the renewal that was on its way
            reg.register(late, {"registrant": "a"}, now=1.5)
        assert refused.value.status == 410 and refused.value.code == "deregistered"
    assert reg.instances == {} and reg.num_puts_after_goodbye == 2
    # another rank, or another instance, of the same registrant is not its goodbye's business
    reg.register(put(instance_id="q"), {"registrant": "a"}, now=2.0)
    # a new process on the same address registers at once; so does an SGLang prefill (no registrant)
    reg.register(put(instance_id="p"), {"registrant": "b"}, now=2.0)
    assert reg.lookup(reg.find_instance("p", now=2.0), (0, 0, 0, 0)).rank_port == 40000
    assert reg.deregister(put(instance_id="p"), now=3.0, extra={"registrant": "b"})
    reg.register(put(instance_id="p"), {}, now=3.0)
    assert reg.deregister(put(instance_id="p"), now=3.5)  # (an unmarked goodbye leaves no tombstone)
    reg.register(put(instance_id="p"), {}, now=4.0)
    # the tombstone lasts max(ttl, TOMBSTONE_MIN_S): a's PUT is taken again after it
    reg.deregister(put(instance_id="p"), now=4.0)
    with pytest.raises(ApiError):
        reg.register(put(instance_id="p"), {"registrant": "a"}, now=1.0 + TOMBSTONE_MIN_S - 0.01)
    reg.register(put(instance_id="p"), {"registrant": "a"}, now=1.0 + TOMBSTONE_MIN_S)
    assert reg.num_puts_after_goodbye == 3


def test_a_goodbye_is_remembered_when_the_entry_is_already_gone_and_for_as_long_as_a_lease() -> None:
    reg = Registry(ttl_s=100, max_ranks=10)
    assert reg.tombstones.lifetime_s == 100  # (a lease longer than TOMBSTONE_MIN_S)
    # a registry restarted (empty) or a lapsed lease: nothing to remove, but the PUT on its way must not register
    assert not reg.deregister(put(instance_id="p"), now=0.0, extra={"registrant": "a"})
    with pytest.raises(ApiError) as refused:
        reg.register(put(instance_id="p"), {"registrant": "a"}, now=99.0)
    assert refused.value.status == 410
    # the successor's entry outlives its predecessor's late goodbye, which still buries the predecessor's PUTs
    reg.register(put(instance_id="p", rank_port=40001), {"registrant": "b"}, now=99.0)
    assert not reg.deregister(put(instance_id="p"), now=99.5, extra={"registrant": "c"})
    assert reg.find_instance("p", now=99.5).is_ready
    assert reg.sweep(now=100.5) == 0 and len(reg.tombstones) == 1  # (a's has gone, c's stays)
    reg.register(put(instance_id="p", rank_port=40001), {"registrant": "a"}, now=100.5)


def test_a_goodbye_outlasts_a_renewal_whose_body_may_still_be_dribbling_in() -> None:
    """A renewal's body may take up to --body-timeout-s to arrive and still be served: its tombstone lasts that long."""
    reg = Registry(ttl_s=10, max_ranks=10, body_timeout_s=300.0)
    assert reg.tombstones.lifetime_s == 300.0
    reg.deregister(put(instance_id="p"), now=0.0, extra={"registrant": "a"})
    with pytest.raises(ApiError) as refused:
        reg.register(put(instance_id="p"), {"registrant": "a"}, now=299.0)
    assert refused.value.status == 410
    assert Registry(ttl_s=10, max_ranks=10, body_timeout_s=5.0).tombstones.lifetime_s == TOMBSTONE_MIN_S
    # (the registry's app passes its --body-timeout-s on)
    from bootstrap.app import RegistryState
    from bootstrap.config import BootstrapConfig
    assert RegistryState(BootstrapConfig(body_timeout_s=300.0)).registry.tombstones.lifetime_s == 300.0


def test_tombstones_are_bounded_oldest_first(monkeypatch: pytest.MonkeyPatch) -> None:
    tombs = Tombstones(lifetime_s=10, max_count=2)
    tombs.bury(("p", (0, 0, 0, 0), "a"), now=0.0)
    tombs.bury(("p", (0, 0, 0, 0), "b"), now=1.0)
    tombs.bury(("p", (0, 0, 0, 0), "a"), now=2.0)  # (said again: now the newest)
    tombs.bury(("p", (0, 0, 0, 0), "c"), now=3.0)
    assert len(tombs) == 2
    assert not tombs.is_buried(("p", (0, 0, 0, 0), "b"), now=3.0)
    assert tombs.is_buried(("p", (0, 0, 0, 0), "a"), now=11.9)
    assert tombs.sweep(now=12.0) == 1 and len(tombs) == 1
    monkeypatch.setattr(bootstrap.registry, "MAX_TOMBSTONES", 3)
    reg = Registry(ttl_s=10, max_ranks=10)
    for n in range(10):
        reg.deregister(put(instance_id="p"), now=float(n), extra={"registrant": f"r{n}"})
    assert len(reg.tombstones) == 3


# -- a registrar and a real registry process, one PUT held back -------------------------------------------------


def test_a_renewal_landing_after_the_goodbye_does_not_register_the_prefill_again(
    start_registry: Callable[..., RegistryProc], monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The registrar gives up on the renewal in flight (its registry took longer than the goodbye waits) and says
    goodbye; the renewal reaches the registry after it. With leases off the ghost entry would stay for ever."""
    reg = start_registry("--ttl-s", "0")
    monkeypatch.setattr(bootstrap.client, "PUT_SETTLE_TIMEOUT_S", 0.05, raising=False)

    async def run() -> None:
        proxy = HoldingProxy(reg.port, hold_put=2)  # (the 1st PUT registers, the 2nd is the first renewal)
        await proxy.start()
        try:
            registrar = BootstrapRegistrar(proxy.url, _registration(instance_id="g", registrant="leaver"),
                                           interval_s=0.05)
            await registrar.start()
            await asyncio.wait_for(proxy.held.wait(), HANG_GUARD_S)
            await asyncio.wait_for(registrar.aclose(), HANG_GUARD_S)
            assert ("DELETE", 200) in proxy.forwarded and topology(reg.url, "g").status_code == 503
            proxy.release()  # the renewal reaches the registry now, after the goodbye
            await asyncio.wait_for(proxy.held_forwarded.wait(), HANG_GUARD_S)
            assert proxy.forwarded == [("PUT", 200), ("DELETE", 200), ("PUT", proxy.held_status)]
        finally:
            await proxy.aclose()
        assert topology(reg.url, "g").status_code == 503, f"a ghost entry: {_ranks(reg)}"
        assert proxy.held_status == 410
        # a new process at the same address (its own registrant) is taken at once, as is SGLang's unmarked PUT
        assert httpx.put(f"{reg.url}/route", json=rank_body(instance_id="g", rank_port=51000, registrant="next"),
                         timeout=5).status_code == 200
        assert topology(reg.url, "g").status_code == 200
        sglang = rank_body(instance_id="s", rank_port=51002)
        assert httpx.put(f"{reg.url}/route", json=sglang, timeout=5).status_code == 200
        assert httpx.request("DELETE", f"{reg.url}/route", json=sglang, timeout=5).json() == {"deregistered": True}
        assert httpx.put(f"{reg.url}/route", json=sglang, timeout=5).status_code == 200  # (restarted)
        metrics = httpx.get(f"{reg.url}/metrics", timeout=5).text
        assert "bootstrap_rank_puts_after_goodbye_total 1.0" in metrics

    asyncio.run(run())


def test_the_goodbye_waits_for_the_renewal_in_flight(
    start_registry: Callable[..., RegistryProc], monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A registration without a ``registrant`` (nothing for the registry to tell its late PUT by): the registrar must
    not send its goodbye while its renewal is unanswered, so the renewal cannot land after it."""
    reg = start_registry("--ttl-s", "0")
    monkeypatch.setattr(bootstrap.client, "PUT_SETTLE_TIMEOUT_S", HANG_GUARD_S, raising=False)

    async def run() -> None:
        proxy = HoldingProxy(reg.port, hold_put=2)
        await proxy.start()
        try:
            registrar = BootstrapRegistrar(proxy.url, _registration(instance_id="w", registrant=None),
                                           interval_s=0.05)
            await registrar.start()
            await asyncio.wait_for(proxy.held.wait(), HANG_GUARD_S)
            closing = asyncio.create_task(registrar.aclose())
            # (a goodbye sent now would overtake the held renewal; give it the chance, then let the renewal through)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(proxy.saw_delete.wait(), 0.5)
            proxy.release()
            await asyncio.wait_for(closing, HANG_GUARD_S)
            assert [method for method, _ in proxy.forwarded] == ["PUT", "PUT", "DELETE"], proxy.forwarded
        finally:
            await proxy.aclose()
        assert topology(reg.url, "w").status_code == 503, f"a ghost entry: {_ranks(reg)}"

    asyncio.run(run())


def test_a_restarted_registrar_reusing_a_registrant_that_said_goodbye_fails_at_once(
    start_registry: Callable[..., RegistryProc],
) -> None:
    reg = start_registry("--ttl-s", "10")

    async def run() -> None:
        registrar = BootstrapRegistrar(reg.url, _registration(instance_id="x", registrant="once"), interval_s=60,
                                       start_timeout_s=HANG_GUARD_S)
        await registrar.start()
        await registrar.aclose()
        with pytest.raises(BootstrapError) as refused:
            await registrar.start()
        assert refused.value.status_code == 410 and "deregistered" in str(refused.value)

    asyncio.run(run())


# -- a draining prefill whose rank a successor took ---------------------------------------------------------------


def test_a_draining_prefill_is_findable_again_once_its_successor_dies_without_a_goodbye(
    start_registry: Callable[..., RegistryProc], start_rank: Callable[..., subprocess.Popen[bytes]],
) -> None:
    """A successor (here an unmarked one, on another port) takes the draining prefill's rank; the leaver's renewals are
    refused, but it keeps sending them until its drain ends: when the successor is SIGKILLed and its lease lapses,
    decodes holding rooms for the leaver find it again (it used to stop at the first refusal: 503 for the rest of its
    drain)."""
    reg = start_registry("--ttl-s", "1")

    async def run() -> None:
        leaver = BootstrapRegistrar(reg.url, _registration(instance_id="d", registrant="leaver"), interval_s=0.1)
        await leaver.start()
        try:
            assert await leaver.drain() is True
            successor = start_rank(reg.url, rank_port=51001, instance_id="d", interval_s=0.1)
            assert await asyncio.to_thread(
                wait_until, lambda: leaver.last_code == "instance_conflict", HANG_GUARD_S)
            assert [rank["rank_port"] for rank in _ranks(reg)] == [51001]
            successor.send_signal(signal.SIGKILL)
            successor.wait(timeout=10)

            def found_again() -> bool:
                ranks = _ranks(reg)
                return len(ranks) == 1 and ranks[0]["rank_port"] == 51000 and ranks[0]["draining"] is True

            assert await asyncio.to_thread(wait_until, found_again, HANG_GUARD_S), _ranks(reg)
            address = httpx.get(f"{reg.url}/route", params={"prefill_dp_rank": 0, "prefill_cp_rank": 0,
                                                             "target_tp_rank": 0, "target_pp_rank": 0,
                                                             "instance_id": "d"}, timeout=5)
            assert address.status_code == 200 and json.loads(address.content)["rank_port"] == 51000
        finally:
            await leaver.aclose()
        assert topology(reg.url, "d").status_code == 503

    asyncio.run(run())
