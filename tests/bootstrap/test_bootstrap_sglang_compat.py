"""Drive the registry exactly as SGLang's prefill and decode workers do, and check what they expect.

Written from reading sgl-project/sglang ``python/sglang/srt/disaggregation/common/conn.py``:
- prefill: ``CommonKVManager.register_to_bootstrap`` PUTs ``{url}/route`` with ``requests.put(url,
  json=payload, timeout=5)`` and treats only status 200 as success;
- prefill (DP, not ``follow_bootstrap_room``): ``CommonKVSender._register_prefill_dp_rank`` POSTs
  ``/register_dp_rank`` with ``{"bootstrap_room", "dp_rank"}``;
- decode: ``CommonKVManager.try_ensure_parallel_info`` GETs ``/route?prefill_dp_rank=-1&prefill_cp_rank=-1
  &target_tp_rank=-1&target_pp_rank=-1`` and builds ``PrefillServerInfo(**response.json())`` (a
  dataclass: any extra key is a TypeError), then fails on a page_size / kv_cache_dtype mismatch;
  non-200 means "not yet, try later";
- decode: ``CommonKVReceiver._get_bootstrap_info_from_server`` GETs the concrete ranks and uses
  ``rank_ip`` / ``rank_port`` from the JSON (adding its own ``is_dummy``);
- decode: ``CommonKVReceiver.query_prefill_dp_ranks`` POSTs ``{"bootstrap_rooms": [...]}`` and
  reads the reply with ``.get(str(room))``;
- decode heartbeat: ``session.get(f"http://{addr}/health", timeout=(2, 3), headers={"Connection":
  "keep-alive"})``, healthy iff 200.
And the write-auth test of SGLang's newest server (test for issue #39400): writes carry
``Authorization: Bearer <token>``, reads stay open.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
from conftest import RegistryProc

requests = pytest.importorskip("requests")


@dataclasses.dataclass
class PrefillServerInfo:
    """Our mirror of the fields of SGLang's decode-side dataclass (names and order as there)."""

    attn_tp_size: int
    attn_cp_size: int
    dp_size: int
    pp_size: int
    page_size: int | None
    kv_cache_dtype: str | None
    follow_bootstrap_room: bool
    enable_dsa_cache_layer_split: bool = False
    prefill_http_port: int | None = None
    target_tp_rank: int | None = None
    target_tp_ranks: list[int] | None = None
    target_cp_ranks: list[int] | None = None
    target_pp_ranks: list[int] | None = None
    required_dst_info_num: int | None = None
    required_prefill_response_num: int | None = None


def sglang_prefill_payload(
    *,
    tp_size: int,
    tp_rank: int,
    dp_size: int = 1,
    dp_rank: int = 0,
    system_dp_size: int = 1,
    system_dp_rank: int = 0,
    rank_port: int,
    load_balance_method: str = "follow_bootstrap_room",
) -> dict[str, object]:
    """The body ``register_to_bootstrap`` builds (values as a 1-node prefill server would send)."""
    return {
        "attn_tp_size": tp_size,
        "attn_tp_rank": tp_rank,
        "attn_cp_size": 1,
        "attn_cp_rank": 0,
        "attn_dp_size": dp_size,
        "attn_dp_rank": dp_rank,
        "pp_size": 1,
        "pp_rank": 0,
        "system_dp_size": system_dp_size,
        "system_dp_rank": system_dp_rank,
        "rank_ip": "127.0.0.1",
        "rank_port": rank_port,
        "page_size": 64,
        "kv_cache_dtype": "auto",
        "load_balance_method": load_balance_method,
        "enable_dsa_cache_layer_split": False,
        "prefill_http_port": 30000,
    }


def sglang_decode_try_ensure_parallel_info(
    bootstrap_addr: str, *, page_size: int, kv_cache_dtype: str
) -> PrefillServerInfo | None:
    url = f"http://{bootstrap_addr}/route?prefill_dp_rank={-1}&prefill_cp_rank={-1}&target_tp_rank={-1}&target_pp_rank={-1}"
    response = requests.get(url, timeout=5)
    if response.status_code != 200:
        return None
    info = PrefillServerInfo(**response.json())
    if info.page_size is not None and info.page_size != page_size:
        raise RuntimeError("Page size mismatch")
    if info.kv_cache_dtype is not None and info.kv_cache_dtype != kv_cache_dtype:
        raise RuntimeError("KV cache dtype mismatch")
    return info


def sglang_decode_bootstrap_info(bootstrap_addr: str, dp: int, cp: int, tp: int, pp: int) -> dict[str, object] | None:
    url = (
        f"http://{bootstrap_addr}/route?prefill_dp_rank={dp}&prefill_cp_rank={cp}"
        f"&target_tp_rank={tp}&target_pp_rank={pp}"
    )
    response = requests.get(url, timeout=5)
    if response.status_code != 200:
        return None
    info: dict[str, object] = response.json()
    info["is_dummy"] = False
    return info


def test_sglang_prefill_and_decode_round_trip(start_registry: Callable[..., RegistryProc]) -> None:
    reg = start_registry("--ttl-s", "0")  # SGLang ranks register once and never heartbeat
    addr = f"127.0.0.1:{reg.port}"
    session = requests.Session()
    health = session.get(f"http://{addr}/health", timeout=(2, 3), headers={"Connection": "keep-alive"})
    assert health.status_code == 200

    assert sglang_decode_try_ensure_parallel_info(addr, page_size=64, kv_cache_dtype="auto") is None  # 503
    put = requests.put(
        f"http://{addr}/route", json=sglang_prefill_payload(tp_size=2, tp_rank=0, rank_port=54000), timeout=5
    )
    assert put.status_code == 200
    assert sglang_decode_try_ensure_parallel_info(addr, page_size=64, kv_cache_dtype="auto") is None  # 1 of 2
    assert sglang_decode_bootstrap_info(addr, 0, 0, 0, 0) is None  # not ready: no address yet
    put = requests.put(
        f"http://{addr}/route", json=sglang_prefill_payload(tp_size=2, tp_rank=1, rank_port=54001), timeout=5
    )
    assert put.status_code == 200

    info = sglang_decode_try_ensure_parallel_info(addr, page_size=64, kv_cache_dtype="auto")
    assert info is not None
    assert (info.attn_tp_size, info.attn_cp_size, info.dp_size, info.pp_size) == (2, 1, 1, 1)
    assert info.follow_bootstrap_room is True and info.prefill_http_port == 30000
    with pytest.raises(RuntimeError, match="Page size mismatch"):
        sglang_decode_try_ensure_parallel_info(addr, page_size=16, kv_cache_dtype="auto")
    for tp in (0, 1):
        assert sglang_decode_bootstrap_info(addr, 0, 0, tp, 0) == {
            "rank_ip": "127.0.0.1",
            "rank_port": 54000 + tp,
            "is_dummy": False,
        }
    assert sglang_decode_bootstrap_info(addr, 0, 0, 2, 0) is None  # 404
    health = session.get(f"http://{addr}/health", timeout=(2, 3), headers={"Connection": "keep-alive"})
    assert health.status_code == 200 and health.text == "OK"


def test_sglang_dp_attention_and_room_dp_ranks(start_registry: Callable[..., RegistryProc]) -> None:
    reg = start_registry("--ttl-s", "0")
    addr = f"127.0.0.1:{reg.port}"
    for dp in range(2):  # DP attention: attn_dp_size=2, system_dp_size=1, round-robin dispatch
        payload = sglang_prefill_payload(
            tp_size=1, tp_rank=0, dp_size=2, dp_rank=dp, rank_port=55000 + dp, load_balance_method="round_robin"
        )
        assert requests.put(f"http://{addr}/route", json=payload, timeout=5).status_code == 200
    info = sglang_decode_try_ensure_parallel_info(addr, page_size=64, kv_cache_dtype="auto")
    assert info is not None and info.dp_size == 2 and info.follow_bootstrap_room is False
    assert sglang_decode_bootstrap_info(addr, 1, 0, 0, 0) == {
        "rank_ip": "127.0.0.1",
        "rank_port": 55001,
        "is_dummy": False,
    }
    # Not follow_bootstrap_room: the prefill registers each room's DP rank; decode queries them batched.
    rooms = [2**63 - 1, 12345, 0]
    for room, dp in zip(rooms, (1, 0, 1), strict=True):
        r = requests.post(f"http://{addr}/register_dp_rank", json={"bootstrap_room": room, "dp_rank": dp}, timeout=5)
        assert r.status_code == 200
    reply = requests.post(f"http://{addr}/query_dp_ranks", json={"bootstrap_rooms": [*rooms, 999]}, timeout=5)
    assert reply.status_code == 200
    room_to_rank = reply.json()
    assert [room_to_rank.get(str(room)) for room in [*rooms, 999]] == [1, 0, 1, None]


def test_sglang_system_dp_uses_system_dp_rank(start_registry: Callable[..., RegistryProc]) -> None:
    reg = start_registry("--ttl-s", "0")
    addr = f"127.0.0.1:{reg.port}"
    for dp in range(2):  # plain DP (no DP attention): system_dp_size=2, attn_dp_size=1
        payload = sglang_prefill_payload(
            tp_size=1, tp_rank=0, system_dp_size=2, system_dp_rank=dp, rank_port=56000 + dp
        )
        assert requests.put(f"http://{addr}/route", json=payload, timeout=5).status_code == 200
    info = sglang_decode_try_ensure_parallel_info(addr, page_size=64, kv_cache_dtype="auto")
    assert info is not None and info.dp_size == 2
    assert sglang_decode_bootstrap_info(addr, 1, 0, 0, 0) == {
        "rank_ip": "127.0.0.1",
        "rank_port": 56001,
        "is_dummy": False,
    }


def test_sglang_write_auth(start_registry: Callable[..., RegistryProc]) -> None:
    reg = start_registry("--ttl-s", "0", "--token", "bootstrap-test-secret", "--token-scope", "writes")
    addr = f"127.0.0.1:{reg.port}"
    payload = sglang_prefill_payload(tp_size=1, tp_rank=0, rank_port=57000)
    denied = requests.put(f"http://{addr}/route", json=payload, timeout=2)
    assert denied.status_code == 401
    denied = requests.post(f"http://{addr}/register_dp_rank", json={"bootstrap_room": 1, "dp_rank": 0}, timeout=2)
    assert denied.status_code == 401
    assert sglang_decode_try_ensure_parallel_info(addr, page_size=64, kv_cache_dtype="auto") is None  # still 503
    auth = {"Authorization": "Bearer bootstrap-test-secret"}
    assert requests.put(f"http://{addr}/route", json=payload, headers=auth, timeout=2).status_code == 200
    info = sglang_decode_try_ensure_parallel_info(addr, page_size=64, kv_cache_dtype="auto")  # no token on reads
    assert info is not None
    assert sglang_decode_bootstrap_info(addr, 0, 0, 0, 0) == {
        "rank_ip": "127.0.0.1",
        "rank_port": 57000,
        "is_dummy": False,
    }
