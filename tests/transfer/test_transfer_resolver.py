"""The decode's resolver cache and a restarted prefill (found by the chaos runner, loadtests/chaos.py).

A restarted prefill listens on a new control port. The decode's registry client caches the old
address for ``cache_ttl_s``; before the fix nothing ever called its ``invalidate``, so every room sent
to that prefill within the cache's lifetime failed with ``peer_unreachable`` (and the gateway held
those failures against the decodes, whose breakers opened: the whole cluster answered 503).
"""

from __future__ import annotations

import threading
import time

from kvunit import make_args, wait_for

from transfer import KVManager, KVPoll, KVTimeouts
from transfer.errors import TransferErrorKind
from transfer.fake import FakeBackend

QUICK = KVTimeouts(bootstrap_s=5.0, waiting_s=5.0, transfer_s=5.0, heartbeat_interval_s=0.1,
                   heartbeat_timeout_s=2.0)


class CachingRegistry:
    """A resolver that caches like ``bootstrap.client.BootstrapResolver`` (no expiry within a test):
    ``registered`` is what the registry holds, ``cache`` what the decode remembers."""

    def __init__(self, address: tuple[str, int]) -> None:
        self.registered = address
        self.cache: dict[tuple[str, int | None, str | None], tuple[str, int]] = {}
        self.invalidated: list[tuple[str, int | None, str | None]] = []

    def __call__(self, host: str, port: int | None, instance_id: str | None) -> tuple[str, int]:
        return self.cache.setdefault((host, port, instance_id), self.registered)

    def cached(self, host: str, port: int | None, instance_id: str | None) -> tuple[str, int] | None:
        return self.cache.get((host, port, instance_id))

    def invalidate(self, host: str, port: int | None, instance_id: str | None) -> None:
        self.invalidated.append((host, port, instance_id))
        self.cache.pop((host, port, instance_id), None)


def test_a_restarted_prefill_is_found_at_its_new_address() -> None:
    made: list[KVManager] = []

    def manager(role: str, **kw: object) -> KVManager:
        made.append(KVManager(role, make_args(), FakeBackend(), timeouts=QUICK, **kw))  # type: ignore[arg-type]
        return made[-1]

    try:
        old = manager("prefill")
        registry = CachingRegistry(old.control_address)
        decode = manager("decode", resolver=registry)
        first = decode.create_receiver(1, "registry.local", 8998, "prefill-0")
        assert wait_for(lambda: first.poll() == KVPoll.WaitingForInput)

        old.close()  # the prefill dies: its connection breaks, its rooms fail
        assert wait_for(lambda: first.poll() == KVPoll.Failed)
        new = manager("prefill")  # restarted: same instance, another control port, registered again
        registry.registered = new.control_address
        assert wait_for(lambda: bool(registry.invalidated))
        assert registry.invalidated[0] == ("registry.local", 8998, "prefill-0")

        second = decode.create_receiver(2, "registry.local", 8998, "prefill-0")
        assert wait_for(lambda: second.poll() != KVPoll.Bootstrapping)
        assert second.poll() == KVPoll.WaitingForInput, second.failure()
    finally:
        for m in made:
            m.close()


def _dead_then_restarted(registered_after: str) -> tuple[list[KVManager], CachingRegistry, KVManager]:
    """A decode whose resolver has a dead prefill's address cached; the prefill restarted elsewhere and
    the registry holds ``registered_after`` ("new": its new address, "old": still the dead one)."""
    made: list[KVManager] = []
    old = KVManager("prefill", make_args(), FakeBackend(), timeouts=QUICK)
    made.append(old)
    registry = CachingRegistry(old.control_address)
    registry.cache[("registry.local", 8998, "prefill-0")] = old.control_address
    old.close()
    new = KVManager("prefill", make_args(), FakeBackend(), timeouts=QUICK)
    made.append(new)
    registry.registered = new.control_address if registered_after == "new" else old.control_address
    decode = KVManager("decode", make_args(), FakeBackend(), timeouts=QUICK, resolver=registry)
    made.append(decode)
    return made, registry, decode


def test_a_room_whose_cached_address_refuses_asks_the_registry_again() -> None:
    """The prefill restarted between two rooms (no connection open to see it break): the rooms sent to
    its old address ask the registry again and go to the new one, instead of failing (the chaos run's
    'breaker opened during no fault': a burst of such rooms, blamed on the restarted prefill)."""
    made, registry, decode = _dead_then_restarted("new")
    try:
        rooms = [decode.create_receiver(room, "registry.local", 8998, "prefill-0") for room in (1, 2, 3)]
        assert wait_for(lambda: all(r.poll() != KVPoll.Bootstrapping for r in rooms))
        assert [r.poll() for r in rooms] == [KVPoll.WaitingForInput] * 3, [r.failure() for r in rooms]
        assert registry.invalidated[0] == ("registry.local", 8998, "prefill-0")
    finally:
        for m in made:
            m.close()


def test_a_room_fails_once_the_registry_names_the_same_dead_address() -> None:
    made, registry, decode = _dead_then_restarted("old")
    try:
        stale = decode.create_receiver(1, "registry.local", 8998, "prefill-0")
        assert wait_for(lambda: stale.poll() == KVPoll.Failed)
        failure = stale.failure()
        assert failure is not None and failure.kind == TransferErrorKind.PEER_UNREACHABLE
        registry.registered = made[1].control_address  # the registry learns of the restart
        fresh = decode.create_receiver(2, "registry.local", 8998, "prefill-0")
        assert wait_for(lambda: fresh.poll() != KVPoll.Bootstrapping)
        assert fresh.poll() == KVPoll.WaitingForInput, fresh.failure()
    finally:
        for m in made:
            m.close()


SLOW = KVTimeouts(bootstrap_s=30.0, waiting_s=30.0, transfer_s=5.0, heartbeat_interval_s=0.1,
                  heartbeat_timeout_s=2.0)


def _aborted_meanwhile(made: list[KVManager], resolver: object, under_way: object) -> None:
    """A decode over ``resolver`` opens room 9, whose sender the restarted prefill (``made[1]``) has; the
    room is aborted and released once ``under_way`` (a ``threading.Event``) is set: the prefill must hear
    of it at once (ABORTED), not wait for a page list until its bootstrap timeout (30 s)."""
    decode = KVManager("decode", make_args(), FakeBackend(), timeouts=SLOW, resolver=resolver)  # type: ignore[arg-type]
    made.append(decode)
    try:
        sender = made[1].create_sender(9)
        receiver = decode.create_receiver(9, "registry.local", 8998, "prefill-0")
        assert under_way.wait(10)  # type: ignore[attr-defined]
        receiver.abort("the client left")
        receiver.release()
        assert wait_for(lambda: sender.poll() == KVPoll.Failed, 10), "the prefill waits for a page list"
        failure = sender.failure()
        assert failure is not None and failure.kind == TransferErrorKind.ABORTED
    finally:
        for m in made:
            m.close()


def test_an_abort_while_the_registry_is_asked_again_reaches_the_restarted_prefill() -> None:
    """A room's cached prefill address refuses, so the decode asks the registry again; the room is
    aborted during that second look-up (its client left): the restarted prefill, which has the room's
    sender already, hears of the abort."""
    import threading

    made, registry, _ = _dead_then_restarted("new")
    asking = threading.Event()

    class SlowSecondLookUp(CachingRegistry):
        def __call__(self, host: str, port: int | None, instance_id: str | None) -> tuple[str, int]:
            if (host, port, instance_id) not in self.cache:  # (the second look-up, after ``invalidate``)
                asking.set()
                time.sleep(1.0)
            return super().__call__(host, port, instance_id)

    slow_registry = SlowSecondLookUp(registry.registered)
    slow_registry.cache.update(registry.cache)
    _aborted_meanwhile(made, slow_registry, asking)


def test_an_abort_while_the_dead_address_is_connecting_reaches_the_restarted_prefill(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The room's cached address is black-holed (the prefill moved to another host): the connect to it
    hangs until it times out. The room is aborted meanwhile: once the connect has failed and the registry
    names the new address, the abort goes there (it was queued on the dead connection and lost)."""
    import socket
    import threading

    import transfer.decode as decode_side

    made, registry, _ = _dead_then_restarted("new")
    dead = registry.cache[("registry.local", 8998, "prefill-0")]
    connecting = threading.Event()
    connect = socket.create_connection

    def black_holed(address, *args, **kwargs):  # type: ignore[no-untyped-def]
        if tuple(address) == tuple(dead):
            connecting.set()
            time.sleep(1.0)
            raise TimeoutError("timed out")
        return connect(address, *args, **kwargs)

    monkeypatch.setattr(decode_side.socket, "create_connection", black_holed)
    _aborted_meanwhile(made, registry, connecting)


class FailingRegistry(CachingRegistry):
    """A registry that answers until ``down`` is set, and then fails every look-up (its stale replies gone)."""

    down = False

    def __call__(self, host: str, port: int | None, instance_id: str | None) -> tuple[str, int]:
        if self.down:
            raise ConnectionRefusedError("the registry is unreachable")
        return super().__call__(host, port, instance_id)

    def cached(self, host: str, port: int | None, instance_id: str | None) -> tuple[str, int] | None:
        return None  # (nothing fresh in the cache: every room asks)


def test_a_registry_down_for_good_does_not_fail_rooms_of_a_connected_prefill() -> None:
    """The registry unreachable past its stale replies' window: every room failed (a 502 for every request)
    although the decode's registered, heartbeating connection to that very prefill was up; it is used."""
    made: list[KVManager] = []
    try:
        prefill = KVManager("prefill", make_args(), FakeBackend(), timeouts=QUICK)
        made.append(prefill)
        registry = FailingRegistry(prefill.control_address)
        decode = KVManager("decode", make_args(), FakeBackend(), timeouts=QUICK, resolver=registry)
        made.append(decode)
        first = decode.create_receiver(1, "registry.local", 8998, "prefill-0")
        assert wait_for(lambda: first.poll() == KVPoll.WaitingForInput)
        registry.down = True
        second = decode.create_receiver(2, "registry.local", 8998, "prefill-0")
        assert wait_for(lambda: second.poll() != KVPoll.Bootstrapping)
        assert second.poll() == KVPoll.WaitingForInput, second.failure()
        other = decode.create_receiver(3, "registry.local", 8998, "prefill-1")  # never met: nothing to go on
        assert wait_for(lambda: other.poll() == KVPoll.Failed)
        assert other.failure().kind == TransferErrorKind.BOOTSTRAP  # type: ignore[union-attr]
    finally:
        for m in made:
            m.close()


class HangingRegistry(CachingRegistry):
    """Look-ups of ``hung`` block until ``release`` is set, then fail (a registry that accepts and never
    answers, until its client's timeout); the rest answer at once. ``calls`` counts look-ups per target."""

    def __init__(self, address: tuple[str, int], hung: str) -> None:
        super().__init__(address)
        self.hung = hung
        self.release = threading.Event()
        self.calls: dict[str, int] = {}

    def __call__(self, host: str, port: int | None, instance_id: str | None) -> tuple[str, int]:
        self.calls[host] = self.calls.get(host, 0) + 1
        if host == self.hung:
            self.release.wait(30)
            raise TimeoutError("the registry did not answer")
        return super().__call__(host, port, instance_id)

    def cached(self, host: str, port: int | None, instance_id: str | None) -> tuple[str, int] | None:
        return None  # (every room asks)


def _behind_a_hanging_registry(made: list[KVManager], hung: str) -> tuple[HangingRegistry, KVManager]:
    """A prefill, and a decode whose registry hangs on look-ups of ``hung`` (both added to ``made``)."""
    prefill = KVManager("prefill", make_args(), FakeBackend(), timeouts=QUICK)
    made.append(prefill)
    registry = HangingRegistry(prefill.control_address, hung=hung)
    decode = KVManager("decode", make_args(), FakeBackend(), timeouts=QUICK, resolver=registry)
    made.append(decode)
    return registry, decode


def test_rooms_of_a_hung_registry_do_not_hold_up_other_prefills_rooms() -> None:
    """One look-up per target at a time, shared by the rooms that wait for it: a registry that hangs holds one
    of the decode's bootstrap threads, not one per room (with 8 rooms behind it, a room for a healthy prefill
    waited two of its timeouts: found by review), and its failure fails them all at once."""
    made: list[KVManager] = []
    registry = None
    try:
        registry, decode = _behind_a_hanging_registry(made, hung="frozen.local")
        stuck = [decode.create_receiver(100 + i, "frozen.local", 8998, None) for i in range(12)]
        healthy = decode.create_receiver(1, "registry.local", 8998, None)
        assert wait_for(lambda: healthy.poll() == KVPoll.WaitingForInput)
        assert all(r.poll() == KVPoll.Bootstrapping for r in stuck)  # (their look-up still hangs)
        assert registry.calls == {"frozen.local": 1, "registry.local": 1}
        registry.release.set()
        assert wait_for(lambda: all(r.poll() == KVPoll.Failed for r in stuck))
        assert {r.failure().kind for r in stuck} == {TransferErrorKind.BOOTSTRAP}  # type: ignore[union-attr]
        assert all(f"room {r.room}:" in r.failure().message for r in stuck)  # type: ignore[union-attr]
        assert registry.calls["frozen.local"] == 1
    finally:
        if registry is not None:
            registry.release.set()
        for m in made:
            m.close()


def test_a_room_of_a_connected_prefill_does_not_wait_for_a_registry_that_hangs() -> None:
    """Once the registry's answer is no longer cached, a room for a prefill the decode holds a registered,
    heartbeating connection to joins that connection at once: it asked the registry first, and a frozen one
    made every such room wait its look-up timeouts (~10 s to the first token, found by review)."""
    made: list[KVManager] = []
    registry = None
    try:
        registry, decode = _behind_a_hanging_registry(made, hung="nobody")
        first = decode.create_receiver(1, "registry.local", 8998, "prefill-0")
        assert wait_for(lambda: first.poll() == KVPoll.WaitingForInput)
        registry.hung = "registry.local"  # frozen from now on
        second = decode.create_receiver(2, "registry.local", 8998, "prefill-0")
        assert second.poll() == KVPoll.WaitingForInput  # (joined at once)
        assert registry.calls == {"registry.local": 1}
    finally:
        if registry is not None:
            registry.release.set()
        for m in made:
            m.close()


def test_a_fresh_cached_answer_wins_over_the_old_live_connection() -> None:
    """The live connection stands in for the registry only when its answer is not cached: one that is, naming
    another address (the instance registered again elsewhere), is followed (the first version joined the old
    connection whenever the cached address had no ready connection yet: found by review)."""
    made: list[KVManager] = []
    try:
        old = KVManager("prefill", make_args(), FakeBackend(), timeouts=QUICK)
        made.append(old)
        new = KVManager("prefill", make_args(), FakeBackend(), timeouts=QUICK)
        made.append(new)
        registry = CachingRegistry(old.control_address)
        decode = KVManager("decode", make_args(), FakeBackend(), timeouts=QUICK, resolver=registry)
        made.append(decode)
        first = decode.create_receiver(1, "registry.local", 8998, "prefill-0")
        assert wait_for(lambda: first.poll() == KVPoll.WaitingForInput)
        registry.cache[("registry.local", 8998, "prefill-0")] = registry.registered = new.control_address
        second = decode.create_receiver(2, "registry.local", 8998, "prefill-0")
        assert wait_for(lambda: second.poll() == KVPoll.WaitingForInput)
        assert second.conn is not None and second.conn.address == new.control_address
    finally:
        for m in made:
            m.close()
