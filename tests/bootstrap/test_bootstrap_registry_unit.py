"""Unit tests of the pure state (Registry, RoomTable) with an explicit clock."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from bootstrap.errors import ApiError
from bootstrap.messages import RankPut
from bootstrap.registry import Registry
from bootstrap.rooms import RoomTable


def put(**kw: Any) -> RankPut:
    base: dict[str, Any] = {
        "attn_tp_size": 1,
        "attn_tp_rank": 0,
        "attn_cp_size": 1,
        "attn_cp_rank": 0,
        "attn_dp_size": 1,
        "attn_dp_rank": 0,
        "pp_size": 1,
        "pp_rank": 0,
        "system_dp_size": 1,
        "system_dp_rank": 0,
        "rank_ip": "10.0.0.1",
        "rank_port": 5000,
        "page_size": 16,
        "kv_cache_dtype": "auto",
    }
    base.update(kw)
    return msgspec.convert(base, RankPut)


def status_of(fn: Any, *args: Any) -> int:
    with pytest.raises(ApiError) as err:
        fn(*args)
    return err.value.status


def test_lease_expires_exactly_at_ttl_and_heartbeat_renews() -> None:
    reg = Registry(ttl_s=10, max_ranks=100)
    reg.register(put(attn_tp_size=2, attn_tp_rank=0), {}, now=0.0)
    reg.register(put(attn_tp_size=2, attn_tp_rank=1, rank_port=5001), {}, now=5.0)
    inst = reg.find_instance(None, now=9.9)
    assert reg.topology(inst).attn_tp_size == 2
    reg.register(put(attn_tp_size=2, attn_tp_rank=0), {}, now=9.9)  # heartbeat: lease until 19.9
    inst = reg.find_instance(None, now=14.9)
    assert reg.lookup(inst, (0, 0, 1, 0)).rank_port == 5001
    inst = reg.find_instance(None, now=15.0)  # rank 1's lease (5 + 10) ends now
    assert status_of(reg.topology, inst) == 503
    assert status_of(reg.lookup, inst, (0, 0, 1, 0)) == 503
    assert status_of(reg.lookup, inst, (0, 0, 0, 0)) == 503  # a live rank of an incomplete instance
    assert reg.num_ranks == 1 and reg.num_expirations == 1
    assert status_of(reg.find_instance, None, 19.9) == 503  # the whole instance is forgotten
    assert reg.instances == {} and reg.num_ranks == 0


def test_zero_ttl_never_expires() -> None:
    reg = Registry(ttl_s=0, max_ranks=10)
    reg.register(put(), {}, now=0.0)
    assert reg.sweep(now=1e12) == 0
    assert reg.lookup(reg.find_instance(None, 1e12), (0, 0, 0, 0)).rank_port == 5000


def test_forgotten_instance_comes_back_with_a_new_layout() -> None:
    reg = Registry(ttl_s=1, max_ranks=10)
    reg.register(put(attn_tp_size=2), {}, now=0.0)
    reg.register(put(attn_tp_size=2, attn_tp_rank=1, rank_port=5001), {}, now=0.0)
    with pytest.raises(ApiError) as err:
        reg.register(put(attn_tp_size=4, rank_port=6000), {}, now=0.5)
    assert err.value.status == 409
    assert reg.sweep(now=1.0) == 2
    reg.register(put(attn_tp_size=4, rank_port=6000), {}, now=1.0)
    assert reg.find_instance(None, 1.0).topology.attn_tp_size == 4


def test_capacity_and_deregistration() -> None:
    reg = Registry(ttl_s=0, max_ranks=2)
    reg.register(put(instance_id="a"), {}, now=0)
    reg.register(put(instance_id="b"), {}, now=0)
    reg.register(put(instance_id="b", rank_port=5001), {}, now=0)  # replacing needs no room
    assert status_of(reg.register, put(instance_id="c"), {}, 0) == 503
    assert reg.deregister(put(instance_id="b"), now=0) is False  # old address: not removed
    assert reg.deregister(put(instance_id="b", rank_port=5001), now=0) is True
    reg.register(put(instance_id="c"), {}, now=0)
    assert sorted(reg.instances) == ["a", "c"] and reg.num_ranks == 2


def test_room_table_expiry_and_renewal() -> None:
    rooms = RoomTable(ttl_s=10, max_rooms=2)
    rooms.register(1, 0, now=0)
    rooms.register(2, 1, now=5)
    rooms.register(1, 3, now=8)  # renewed (and re-pointed) until 18
    assert rooms.query([1, 2, 3], now=9) == {"1": 3, "2": 1}
    assert rooms.query([1, 2], now=15) == {"1": 3}  # room 2 hidden at once, before any sweep
    assert rooms.sweep(now=15) == 1  # the stale first entry of room 1 does not drop the renewed one
    assert len(rooms) == 1 and rooms.query([1], now=17.9) == {"1": 3}
    rooms.register(4, 0, now=16)
    with pytest.raises(ApiError) as err:
        rooms.register(5, 0, now=16)
    assert err.value.status == 503
    rooms.register(6, 0, now=18)  # full, but the sweep on insert frees room 1
    assert rooms.query([1, 4, 6], now=18) == {"4": 0, "6": 0}


def test_renewing_a_room_costs_no_memory() -> None:
    """The table stays within ``max_rooms`` entries however often a client renews one room (each renewal
    queued its own expiry entry until it expired: memory grew with the request rate x the TTL)."""
    import tracemalloc

    rooms = RoomTable(ttl_s=120, max_rooms=10)
    rooms.register(7, 0, now=0.0)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(100_000):
            rooms.register(7, i % 4, now=i * 1e-4)
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert grown < 100_000, f"{grown} bytes for one room"
    assert rooms.query([7], now=10.0) == {"7": 99_999 % 4} and rooms.sweep(now=200.0) == 1 and len(rooms) == 0


@pytest.mark.parametrize("rank_ip", ["a" * 64 + ".example", "a..b", "127.0.0.1\x00x", "host\x7f", "", "-bad.example",
                                     "10.0.0.1 ", "[::1]", "0.0.0.0", "::", "224.0.0.1"])
def test_a_rank_ip_no_peer_could_connect_to_is_refused(rank_ip: str) -> None:
    """Accepted, such an address failed only in the decode's connect (a NUL was cut off by the resolver:
    another host)."""
    assert status_of(Registry(ttl_s=10, max_ranks=100).register, put(rank_ip=rank_ip), {}, 0.0) == 400


@pytest.mark.parametrize("rank_ip", ["10.0.0.1", "::1", "fe80::1%eth0", "prefill-0.pd.svc.cluster.local", "node_7",
                                     "localhost", "Node-7.Example.", "2001:db8::5"])
def test_addresses_and_host_names_are_taken(rank_ip: str) -> None:
    reg = Registry(ttl_s=10, max_ranks=100)
    reg.register(put(rank_ip=rank_ip), {}, now=0.0)


def test_a_page_size_out_of_range_is_refused() -> None:
    assert status_of(Registry(ttl_s=10, max_ranks=100).register, put(page_size=10**40), {}, 0.0) == 400


def test_a_second_process_cannot_take_a_rank_its_holder_still_renews() -> None:
    """Two prefills given one instance id: the second is refused (409 ``instance_conflict``) while the first
    renews, instead of the two taking turns owning the rank; a restart (a new process) takes over once the
    old one has not renewed for the conflict window, and one on the same address at once."""
    from bootstrap.registry import CONFLICT_WINDOW_S

    reg = Registry(ttl_s=10.0, max_ranks=8)
    first, second = {"registrant": "a"}, {"registrant": "b"}
    reg.register(put(rank_port=5000), first, now=0.0)
    with pytest.raises(ApiError) as err:
        reg.register(put(rank_port=6000), second, now=1.0)
    assert err.value.status == 409 and err.value.code == "instance_conflict"
    reg.register(put(rank_port=5000), first, now=2.0)  # the holder renews
    assert status_of(reg.register, put(rank_port=6000), second, 2.0 + CONFLICT_WINDOW_S - 0.1) == 409
    instance, _ = reg.register(put(rank_port=6000), second, now=2.0 + CONFLICT_WINDOW_S)  # the holder went quiet
    assert [e.address.rank_port for e in instance.entries.values()] == [6000]
    reg.register(put(rank_port=6000), {"registrant": "c"}, now=2.0 + CONFLICT_WINDOW_S + 0.1)  # same address
    reg.register(put(rank_port=7000), {}, now=2.0 + CONFLICT_WINDOW_S + 0.2)  # no mark (SGLang): replaces
    assert [e.address.rank_port for e in reg.instances[next(iter(reg.instances))].entries.values()] == [7000]
