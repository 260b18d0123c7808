"""Every route and error code of a real registry process (``pd-bootstrap``), over loopback HTTP."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from conftest import RegistryProc, child_env, free_port, rank_body, reap, topology, wait_until

TOPOLOGY_KEYS = {
    "attn_tp_size",
    "attn_cp_size",
    "dp_size",
    "pp_size",
    "page_size",
    "kv_cache_dtype",
    "follow_bootstrap_room",
    "enable_dsa_cache_layer_split",
    "prefill_http_port",
}
_TIMING = {"age_s", "last_seen_s_ago", "expires_in_s", "registered_unix"}


@pytest.fixture(scope="module")
def registry() -> Iterator[RegistryProc]:
    """One registry for the tests that isolate themselves by instance_id (no lease expiry)."""
    reg = RegistryProc(port=free_port(), args=["--ttl-s", "0", "--max-body-bytes", "16384"], env=child_env())
    try:
        yield reg.start()
    finally:
        if reg.proc is not None:
            reap(reg.proc)
            if reg.proc.stderr:
                reg.proc.stderr.close()


def put(url: str, body: Any, **kwargs: Any) -> httpx.Response:
    if isinstance(body, dict | list):
        return httpx.put(f"{url}/route", json=body, timeout=5, **kwargs)
    return httpx.put(f"{url}/route", content=body, timeout=5, **kwargs)


def rank(url: str, dp: int, cp: int, tp: int, pp: int, instance_id: str | None = None) -> httpx.Response:
    params: dict[str, Any] = {"prefill_dp_rank": dp, "prefill_cp_rank": cp, "target_tp_rank": tp, "target_pp_rank": pp}
    if instance_id is not None:
        params["instance_id"] = instance_id
    return httpx.get(f"{url}/route", params=params, timeout=5)


def snapshot(url: str) -> dict[str, Any]:
    """The registry's state as /instances reports it, without the fields that move with time."""
    data = httpx.get(f"{url}/instances", timeout=5).json()
    for inst in data["instances"]:
        for r in inst["ranks"]:
            for key in _TIMING:
                r.pop(key)
    return data


def error_of(response: httpx.Response) -> dict[str, Any]:
    body = response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "code"}
    return body["error"]  # type: ignore[no-any-return]


def test_health_is_plain_ok(registry: RegistryProc) -> None:
    r = httpx.get(f"{registry.url}/health", timeout=5)
    assert r.status_code == 200 and r.text == "OK"


def test_topology_is_503_until_every_rank_registered(registry: RegistryProc) -> None:
    url, iid = registry.url, "t503"
    layout = [(tp, pp) for tp in range(2) for pp in range(2)]  # tp=2 x pp=2 = 4 ranks
    for i, (tp, pp) in enumerate(layout):
        assert topology(url, iid).status_code == 503
        r = put(
            url, rank_body(instance_id=iid, attn_tp_size=2, attn_tp_rank=tp, pp_size=2, pp_rank=pp, rank_port=41000 + i)
        )
        assert r.status_code == 200 and r.text == "OK"
        if i < len(layout) - 1:
            not_ready = topology(url, iid)
            assert not_ready.status_code == 503
            err = error_of(not_ready)
            assert err["code"] == "not_ready" and f"{i + 1}/4" in err["message"]
            assert rank(url, 0, 0, 0, 0, iid).status_code == 503  # no address before the instance is ready
    ready = topology(url, iid)
    assert ready.status_code == 200
    info = ready.json()
    assert set(info) == TOPOLOGY_KEYS
    assert info == {
        "attn_tp_size": 2,
        "attn_cp_size": 1,
        "dp_size": 1,
        "pp_size": 2,
        "page_size": 16,
        "kv_cache_dtype": "auto",
        "follow_bootstrap_room": True,
        "enable_dsa_cache_layer_split": False,
        "prefill_http_port": 30000,
    }
    for i, (tp, pp) in enumerate(layout):
        assert rank(url, 0, 0, tp, pp, iid).json() == {"rank_ip": "127.0.0.1", "rank_port": 41000 + i}
    for dp, cp, tp, pp in [(1, 0, 0, 0), (0, 1, 0, 0), (0, 0, 2, 0), (0, 0, 0, 2)]:
        missing = rank(url, dp, cp, tp, pp, iid)
        assert missing.status_code == 404 and error_of(missing)["code"] == "unknown_rank"


def test_instance_selection_without_instance_id(start_registry: Callable[..., RegistryProc]) -> None:
    url = start_registry("--ttl-s", "0").url
    none_yet = topology(url)
    assert none_yet.status_code == 503 and error_of(none_yet)["code"] == "not_registered"
    assert put(url, rank_body()).status_code == 200  # SGLang shape: no instance_id -> "default"
    assert topology(url).json()["attn_tp_size"] == 1
    assert rank(url, 0, 0, 0, 0).json() == {"rank_ip": "127.0.0.1", "rank_port": 40000}
    assert put(url, rank_body(instance_id="other", rank_port=40001, page_size=32)).status_code == 200
    ambiguous = topology(url)
    assert ambiguous.status_code == 400
    err = error_of(ambiguous)
    assert err["code"] == "instance_id_required" and "default" in err["message"] and "other" in err["message"]
    assert topology(url, "default").json()["page_size"] == 16
    assert topology(url, "other").json()["page_size"] == 32
    assert rank(url, 0, 0, 0, 0, "other").json()["rank_port"] == 40001
    unknown = topology(url, "nobody")
    assert unknown.status_code == 503 and "nobody" in error_of(unknown)["message"]


@pytest.mark.parametrize(
    ("query", "code"),
    [
        ({}, "missing_parameter"),
        ({"prefill_dp_rank": 0, "prefill_cp_rank": 0, "target_tp_rank": 0}, "missing_parameter"),
        ({"prefill_dp_rank": "", "prefill_cp_rank": 0, "target_tp_rank": 0, "target_pp_rank": 0}, "missing_parameter"),
        ({"prefill_dp_rank": "x", "prefill_cp_rank": 0, "target_tp_rank": 0, "target_pp_rank": 0}, "invalid_parameter"),
        *(({"prefill_dp_rank": odd, "prefill_cp_rank": 0, "target_tp_rank": 0, "target_pp_rank": 0},
           "invalid_parameter") for odd in (" 0", "0_0", "\u0660", "9" * 5000)),  # (int() takes (or chokes on) each)
        (
            {"prefill_dp_rank": "1.5", "prefill_cp_rank": 0, "target_tp_rank": 0, "target_pp_rank": 0},
            "invalid_parameter",
        ),
        (
            {
                "prefill_dp_rank": -1,
                "prefill_cp_rank": 0,
                "target_tp_rank": 0,
                "target_pp_rank": 0,
                "instance_id": "qry",
            },
            "invalid_parameter",
        ),
        (
            {
                "prefill_dp_rank": -1,
                "prefill_cp_rank": -1,
                "target_tp_rank": -1,
                "target_pp_rank": -1,
                "instance_id": "bad id!",
            },
            "invalid_instance_id",
        ),
    ],
)
def test_get_route_rejects_malformed_queries(registry: RegistryProc, query: dict[str, Any], code: str) -> None:
    assert put(registry.url, rank_body(instance_id="qry")).status_code == 200
    r = httpx.get(f"{registry.url}/route", params=query, timeout=5)
    assert r.status_code == 400
    assert error_of(r)["code"] == code


BAD_BODIES: list[tuple[str, Any, str]] = [
    ("not json", b"{nope", "not valid JSON"),
    ("empty", b"", "empty"),
    ("array", [1, 2], "JSON object"),
    ("string for int", rank_body(attn_tp_size="2"), "attn_tp_size"),
    ("bool for int", rank_body(rank_port=True), "rank_port"),
    ("float for int", rank_body(page_size=16.0), "page_size"),
    ("int for str", rank_body(rank_ip=127001), "rank_ip"),
    ("missing field", {k: v for k, v in rank_body().items() if k != "rank_port"}, "rank_port"),
    ("zero size", rank_body(attn_tp_size=0), "attn_tp_size"),
    ("negative size", rank_body(pp_size=-2), "pp_size"),
    ("negative rank", rank_body(attn_tp_rank=-1), "attn_tp_rank"),
    ("rank == size", rank_body(attn_tp_size=2, attn_tp_rank=2), "attn_tp_rank"),
    ("rank > size", rank_body(attn_cp_size=2, attn_cp_rank=5), "attn_cp_rank"),
    ("both dp", rank_body(attn_dp_size=2, system_dp_size=2), "system_dp_size"),
    ("huge layout", rank_body(attn_tp_size=65536, pp_size=8), "exceeds"),
    ("port 0", rank_body(rank_port=0), "rank_port"),
    ("port too big", rank_body(rank_port=70000), "rank_port"),
    ("port 10^30", rank_body(rank_port=10**30), "rank_port"),
    ("page 0", rank_body(page_size=0), "page_size"),
    ("empty ip", rank_body(rank_ip=""), "rank_ip"),
    ("whitespace ip", rank_body(rank_ip="1.2.3.4 evil"), "rank_ip"),
    ("bad http port", rank_body(prefill_http_port=-1), "prefill_http_port"),
    ("bad instance id", rank_body(instance_id="a b"), "instance_id"),
    ("empty instance id", rank_body(instance_id=""), "instance_id"),
    ("bool not bool", rank_body(enable_dsa_cache_layer_split="yes"), "enable_dsa_cache_layer_split"),
    ("extras too big", rank_body(blob="x" * 3000, blob2="y" * 3000), "bytes"),
]


def test_bad_registrations_get_400_and_change_nothing(registry: RegistryProc) -> None:
    url = registry.url
    assert put(url, rank_body(instance_id="bad", rank_port=42000)).status_code == 200
    before = snapshot(url)
    for name, body, needle in BAD_BODIES:
        if isinstance(body, dict):
            body = {"instance_id": "bad", **body}
        r = put(url, body)
        assert r.status_code == 400, f"{name}: {r.status_code} {r.text}"
        assert needle in error_of(r)["message"], f"{name}: {r.text}"
    assert snapshot(url) == before
    assert rank(url, 0, 0, 0, 0, "bad").json()["rank_port"] == 42000


def test_body_limit_413_declared_and_chunked(registry: RegistryProc) -> None:
    url = registry.url  # started with --max-body-bytes 16384
    before = snapshot(url)
    big = rank_body(instance_id="big", pad="z" * 20000)
    r = put(url, big)
    assert r.status_code == 413 and error_of(r)["code"] == "body_too_large"

    def chunks() -> Iterator[bytes]:  # no Content-Length: chunked transfer encoding
        yield b'{"bootstrap_rooms": ['
        for _ in range(1500):
            yield b"12345678901234,"
        yield b"1]}"

    r = httpx.post(f"{url}/query_dp_ranks", content=chunks(), timeout=5)
    assert r.status_code == 413
    r = httpx.post(
        f"{url}/register_dp_rank",
        content=b'{"bootstrap_room": 1, "dp_rank": 0, "p": "' + b"q" * 20000 + b'"}',
        timeout=5,
    )
    assert r.status_code == 413
    assert snapshot(url) == before
    assert httpx.get(f"{url}/health", timeout=5).status_code == 200  # the server survived


def test_reregistration_replaces_the_address(registry: RegistryProc) -> None:
    url = registry.url
    assert put(url, rank_body(instance_id="re", rank_port=43000)).status_code == 200
    assert put(url, rank_body(instance_id="re", rank_port=43000)).status_code == 200  # heartbeat
    listing = {i["instance_id"]: i for i in snapshot(url)["instances"]}
    assert listing["re"]["ranks"][0]["num_puts"] == 2
    assert put(url, rank_body(instance_id="re", rank_port=43001, rank_ip="127.0.0.2")).status_code == 200
    assert rank(url, 0, 0, 0, 0, "re").json() == {"rank_ip": "127.0.0.2", "rank_port": 43001}
    listing = {i["instance_id"]: i for i in snapshot(url)["instances"]}
    assert listing["re"]["num_ranks"] == 1 and listing["re"]["ranks"][0]["num_puts"] == 1


def test_topology_conflict_is_409_until_the_old_ranks_leave(registry: RegistryProc) -> None:
    url, iid = registry.url, "conflict"
    assert put(url, rank_body(instance_id=iid, attn_tp_size=2, attn_tp_rank=0, rank_port=44000)).status_code == 200
    before = snapshot(url)
    r = put(url, rank_body(instance_id=iid, attn_tp_size=2, attn_tp_rank=1, rank_port=44001, page_size=32))
    assert r.status_code == 409
    err = error_of(r)
    assert err["code"] == "topology_conflict" and "page_size=16 vs 32" in err["message"]
    assert snapshot(url) == before
    # The only live rank re-registering with a new layout (a restart with new flags) is accepted.
    assert put(url, rank_body(instance_id=iid, attn_tp_size=1, rank_port=44002)).status_code == 200
    assert topology(url, iid).json()["attn_tp_size"] == 1


def test_delete_route_deregisters_only_a_matching_address(registry: RegistryProc) -> None:
    url, iid = registry.url, "del"
    body = rank_body(instance_id=iid, rank_port=45000)
    assert put(url, body).status_code == 200
    stale = httpx.request("DELETE", f"{url}/route", json={**body, "rank_port": 45999}, timeout=5)
    assert stale.json() == {"deregistered": False}
    assert topology(url, iid).status_code == 200
    gone = httpx.request("DELETE", f"{url}/route", json=body, timeout=5)
    assert gone.json() == {"deregistered": True}
    assert topology(url, iid).status_code == 503


def test_dp_rank_rooms(registry: RegistryProc) -> None:
    url = registry.url
    room = 2**63 - 5
    assert httpx.post(f"{url}/register_dp_rank", json={"bootstrap_room": room, "dp_rank": 3}, timeout=5).text == "OK"
    assert httpx.post(f"{url}/register_dp_rank", json={"bootstrap_room": 7, "dp_rank": 1}, timeout=5).status_code == 200
    r = httpx.post(f"{url}/query_dp_ranks", json={"bootstrap_rooms": [room, 7, 8]}, timeout=5)
    assert r.status_code == 200 and r.json() == {str(room): 3, "7": 1}
    assert httpx.post(f"{url}/query_dp_ranks", json={"bootstrap_rooms": []}, timeout=5).json() == {}
    before = snapshot(url)
    for path, body in [
        ("/register_dp_rank", {"bootstrap_room": "7", "dp_rank": 1}),
        ("/register_dp_rank", {"bootstrap_room": -1, "dp_rank": 1}),
        ("/register_dp_rank", {"bootstrap_room": 2**64, "dp_rank": 1}),
        ("/register_dp_rank", {"bootstrap_room": 9, "dp_rank": -1}),
        ("/register_dp_rank", {"bootstrap_room": 9}),
        ("/register_dp_rank", [9, 1]),
        ("/query_dp_ranks", {"bootstrap_rooms": 7}),
        ("/query_dp_ranks", {"bootstrap_rooms": ["7"]}),
        ("/query_dp_ranks", {}),
    ]:
        r = httpx.post(f"{url}{path}", json=body, timeout=5)
        assert r.status_code == 400, f"{path} {body}: {r.status_code}"
        assert error_of(r)["type"] == "invalid_request_error"
    assert snapshot(url) == before
    assert httpx.post(f"{url}/query_dp_ranks", json={"bootstrap_rooms": [7]}, timeout=5).json() == {"7": 1}


def test_rooms_expire(start_registry: Callable[..., RegistryProc]) -> None:
    url = start_registry("--room-ttl-s", "0.5").url
    assert (
        httpx.post(f"{url}/register_dp_rank", json={"bootstrap_room": 11, "dp_rank": 2}, timeout=5).status_code == 200
    )
    assert httpx.post(f"{url}/query_dp_ranks", json={"bootstrap_rooms": [11]}, timeout=5).json() == {"11": 2}
    assert wait_until(
        lambda: httpx.post(f"{url}/query_dp_ranks", json={"bootstrap_rooms": [11]}, timeout=5).json() == {}, timeout_s=5
    )
    # The periodic sweep also frees the memory (not just hides the entry).
    assert wait_until(lambda: httpx.get(f"{url}/instances", timeout=5).json()["num_rooms"] == 0, timeout_s=5)
    assert "bootstrap_room_expirations_total 1.0" in httpx.get(f"{url}/metrics", timeout=5).text


def test_unknown_route_and_method_are_json_errors(registry: RegistryProc) -> None:
    r = httpx.get(f"{registry.url}/nope", timeout=5)
    assert r.status_code == 404 and error_of(r)["code"] == "unknown_route"
    r = httpx.post(f"{registry.url}/route", json={}, timeout=5)
    assert r.status_code == 405 and error_of(r)["code"] == "method_not_allowed"


def test_token_guards_everything_but_health(start_registry: Callable[..., RegistryProc]) -> None:
    url = start_registry("--token", "s3cret").url
    good = {"Authorization": "Bearer s3cret"}
    assert httpx.get(f"{url}/health", timeout=5).status_code == 200
    for headers in (
        {},
        {"Authorization": "Bearer wrong"},
        {"Authorization": "Basic s3cret"},
        {"Authorization": "s3cret"},
    ):
        r = put(url, rank_body(), headers=headers)
        assert r.status_code == 401 and error_of(r)["type"] == "authentication_error"
        assert r.headers["www-authenticate"] == "Bearer"
        assert topology(url, **headers).status_code == 401
        assert (
            httpx.post(
                f"{url}/register_dp_rank", json={"bootstrap_room": 1, "dp_rank": 0}, headers=headers, timeout=5
            ).status_code
            == 401
        )
        assert httpx.get(f"{url}/instances", headers=headers, timeout=5).status_code == 401
        assert httpx.get(f"{url}/metrics", headers=headers, timeout=5).status_code == 401
    assert httpx.get(f"{url}/instances", headers=good, timeout=5).json()["instances"] == []
    assert put(url, rank_body(), headers=good).status_code == 200
    assert topology(url, **good).status_code == 200
    assert (
        httpx.get(
            f"{url}/route",
            params={"prefill_dp_rank": 0, "prefill_cp_rank": 0, "target_tp_rank": 0, "target_pp_rank": 0},
            headers={"authorization": "bearer s3cret"},
            timeout=5,
        ).status_code
        == 200
    )


def test_token_scope_writes_leaves_reads_open(start_registry: Callable[..., RegistryProc]) -> None:
    url = start_registry("--token", "s3cret", "--token-scope", "writes").url
    assert put(url, rank_body()).status_code == 401
    assert httpx.post(f"{url}/register_dp_rank", json={"bootstrap_room": 1, "dp_rank": 0}, timeout=5).status_code == 401
    assert topology(url).status_code == 503  # readable without a token, and nothing was registered
    assert put(url, rank_body(), headers={"Authorization": "Bearer s3cret"}).status_code == 200
    assert topology(url).status_code == 200
    assert httpx.post(f"{url}/query_dp_ranks", json={"bootstrap_rooms": [1]}, timeout=5).json() == {}


def test_metrics_and_instances_listing(registry: RegistryProc) -> None:
    url, iid = registry.url, "metrics"
    assert put(url, rank_body(instance_id=iid, attn_tp_size=2, rank_port=46000, custom_field="kept")).status_code == 200
    text = httpx.get(f"{url}/metrics", timeout=5).text
    assert f'bootstrap_instance_ready{{instance_id="{iid}"}} 0.0' in text
    assert f'bootstrap_instance_ranks{{instance_id="{iid}"}} 1.0' in text
    assert f'bootstrap_instance_expected_ranks{{instance_id="{iid}"}} 2.0' in text
    assert 'bootstrap_http_requests_total{method="PUT",route="/route",status="200"}' in text
    assert put(url, rank_body(instance_id=iid, attn_tp_size=2, attn_tp_rank=1, rank_port=46001)).status_code == 200
    assert f'bootstrap_instance_ready{{instance_id="{iid}"}} 1.0' in httpx.get(f"{url}/metrics", timeout=5).text
    inst = {i["instance_id"]: i for i in httpx.get(f"{url}/instances", timeout=5).json()["instances"]}[iid]
    assert inst["ready"] is True and inst["num_ranks"] == 2 and inst["num_expected_ranks"] == 2
    first = inst["ranks"][0]
    assert first["extra"] == {"custom_field": "kept"}
    assert (first["target_tp_rank"], first["rank_port"], first["expires_in_s"]) == (0, 46000, None)


def test_odd_methods_do_not_grow_metric_labels(registry: RegistryProc) -> None:
    for method in ("PROPFIND", "PURGE", "MKCOL"):  # methods the HTTP parser accepts but nobody uses here
        r = httpx.request(method, f"{registry.url}/route", timeout=5)
        assert r.status_code == 405
    text = httpx.get(f"{registry.url}/metrics", timeout=5).text
    assert 'method="OTHER",route="/route",status="405"} 3.0' in text and "PROPFIND" not in text
