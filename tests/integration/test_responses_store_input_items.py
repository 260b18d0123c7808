"""The stored responses' routes, finished (review of 2026-12-06), on a real gateway over sim workers with the real
openai client: ``GET /v1/responses/{id}/input_items`` (``responses.input_items.list``: OpenAI's list of items with
ids, pages, key isolation, 404s and 400s); the store's routes counted under their own ``route="responses_store"``,
their 405s included; a stream that ends ``response.failed`` says ``store: false`` (nothing is kept); a response is
stored once its answer is complete, whether or not its client takes it, and not when its client leaves first."""

from __future__ import annotations

import json
import socket
from collections.abc import Callable
from typing import Any

import httpx
import openai
import pytest
from openai.types.responses import ResponseItemList
from pdtest import SimCluster
from test_requests_counted import GENEROUS_S, SLOW, changed, counts, delta
from test_responses_api import broken_stream
from test_responses_store import _client, _not_found

FN = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
      "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


def test_input_items_listed_with_the_openai_client(sim_cluster: Callable[..., SimCluster]) -> None:
    cluster = sim_cluster(gateway_args=("--api-key", "key-a", "--api-key", "key-b"))
    alice, bob = _client(cluster, "key-a"), _client(cluster, "key-b")
    r1 = alice.responses.create(model="default", instructions="Be brief.", input="Weather in Paris?",
                                max_output_tokens=4, tools=[FN])
    turn = [{"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
            {"type": "function_call_output", "call_id": "call_1", "output": '{"sky": "sunny"}'},
            {"role": "user", "content": [{"type": "input_text", "text": "Thanks"}]}]
    r2 = alice.responses.create(model="default", previous_response_id=r1.id, input=turn,  # type: ignore[arg-type]
                                max_output_tokens=3, tools=[FN])

    # the whole conversation before r2's output (its instructions are not an item), newest first by default
    items = list(alice.responses.input_items.list(r2.id))
    assert [(i.type, getattr(i, "role", None)) for i in items] == [
        ("message", "user"), ("function_call_output", None), ("function_call", None), *(
            (o.type, getattr(o, "role", None)) for o in reversed(r1.output)), ("message", "user")]
    assert [i.id for i in items[-1 - len(r1.output):-1]] == [o.id for o in reversed(r1.output)]  # (as answered)
    first, call, output, last = items[-1], items[2], items[1], items[0]
    assert first.id.startswith("msg_") and first.content[0].text == "Weather in Paris?"  # type: ignore[union-attr]
    assert first.content[0].type == "input_text" and first.status == "completed"  # type: ignore[union-attr]
    assert call.id.startswith("fc_") and call.call_id == "call_1" and call.status == "completed"  # type: ignore[union-attr]
    assert output.output == '{"sky": "sunny"}' and output.status == "completed"  # type: ignore[union-attr]
    assert last.content[0].text == "Thanks"  # type: ignore[union-attr]
    assert len({i.id for i in items}) == len(items)
    # pages: asc, one item each, followed by the SDK through has_more and after
    assert [i.id for i in alice.responses.input_items.list(r2.id, limit=1, order="asc")] == [i.id for i in
                                                                                          reversed(items)]
    page = alice.responses.input_items.list(r2.id, limit=2)
    assert [i.id for i in page.data] == [items[0].id, items[1].id] and page.has_more is True
    raw = httpx.get(f"{cluster.base_url}/v1/responses/{r2.id}/input_items", timeout=30,
                    params={"limit": 2, "after": items[1].id}, headers={"authorization": "Bearer key-a"}).json()
    assert raw["object"] == "list" and (raw["first_id"], raw["last_id"]) == (items[2].id, items[3].id)
    ResponseItemList.model_validate(raw)  # (every field as the API types it: strictly)
    assert [i.id for i in alice.responses.input_items.list(r1.id)] == [items[-1].id]  # (r1's own: one message)

    # the 404s of GET: another key's, unknown, not stored; no key a 401
    _not_found(lambda: bob.responses.input_items.list(r2.id))
    _not_found(lambda: alice.responses.input_items.list("resp_nope"))
    unstored = alice.responses.create(model="default", input="Off the record", max_output_tokens=1, store=False)
    _not_found(lambda: alice.responses.input_items.list(unstored.id))
    assert httpx.get(f"{cluster.base_url}/v1/responses/{r2.id}/input_items", timeout=30).status_code == 401
    # what is not supported or not valid: a 400 naming its param
    for kwargs, param in (({"include": ["message.input_image.image_url"]}, "include"), ({"limit": 0}, "limit"),
                          ({"limit": 101}, "limit"), ({"order": "newest"}, "order"), ({"after": "msg_nope"}, "after")):
        with pytest.raises(openai.BadRequestError) as caught:
            alice.responses.input_items.list(r2.id, **kwargs)
        assert isinstance(caught.value.body, dict) and caught.value.body["param"] == param, (kwargs, caught.value.body)
    cluster.wait_pools_full()


def test_the_store_routes_are_counted_as_their_own_route(sim_cluster: Callable[..., SimCluster]) -> None:
    """A lookup's 404 is not a generation's: ``GET``/``DELETE /v1/responses/{id}`` and ``.../input_items`` count under
    ``responses_store``, a method they lack (405, with the methods they have in ``Allow``) too."""
    cluster = sim_cluster()
    client = _client(cluster)
    before, generations = counts(cluster, "responses_store"), counts(cluster, "responses")
    response = client.responses.create(model="default", input="Hello", max_output_tokens=2)
    url = f"{cluster.base_url}/v1/responses/{response.id}"
    assert httpx.get(url, timeout=30).status_code == 200
    assert _gauge(cluster, "pd_gateway_responses_stored") == 1 and _gauge(cluster, "pd_gateway_responses_stored_bytes")
    assert httpx.get(f"{url}/input_items", timeout=30).status_code == 200
    assert httpx.get(f"{url}/input_items", params={"order": "sideways"}, timeout=30).status_code == 400
    assert httpx.get(f"{cluster.base_url}/v1/responses/resp_nope", timeout=30).status_code == 404
    for method, path, allow in (("POST", "", {"GET", "HEAD", "DELETE"}), ("PUT", "/input_items", {"GET", "HEAD"})):
        r = httpx.request(method, f"{url}{path}", timeout=30)
        assert r.status_code == 405 and set(r.headers["allow"].split(", ")) == allow, (r.status_code, r.headers)
        assert r.json()["error"]["type"] == "invalid_request_error"
    assert httpx.delete(url, timeout=30).status_code == 200
    assert _gauge(cluster, "pd_gateway_responses_stored") == 0 == _gauge(cluster, "pd_gateway_responses_stored_bytes")
    after = counts(cluster, "responses_store")  # (counted before each answer went out)
    assert delta(before, after) == {"200": 3, "400": 1, "404": 1, "405": 2}, (before, after)
    assert delta(generations, counts(cluster, "responses")) == {"200": 1}  # (the POST alone)
    cluster.wait_pools_full()


def _gauge(cluster: SimCluster, name: str) -> float:
    """An unlabelled sample of the gateway's /metrics."""
    for line in httpx.get(f"{cluster.base_url}/metrics", timeout=30).text.splitlines():
        sample, _, value = line.partition(" ")
        if sample == name:
            return float(value)
    raise AssertionError(f"{name} not in /metrics")


def test_a_failed_stream_says_it_is_not_stored(sim_cluster: Callable[..., SimCluster]) -> None:
    """``response.failed`` of a request to be stored: ``store`` is what is true (false: a failed response is not
    kept, GET is a 404), where it said true, the request's wish, when the stream began."""
    cluster = sim_cluster(decode_args=("--engine-option", "decode_step_s=0.05"))
    client = _client(cluster)
    events = broken_stream(client, cluster)
    created, failed = events[0], events[-1]
    assert created.type == "response.created" and created.response.store is True  # type: ignore[union-attr]
    assert failed.type == "response.failed", [e.type for e in events[-3:]]
    assert failed.response.store is False and failed.response.id == created.response.id  # type: ignore[union-attr]
    _not_found(lambda: client.responses.retrieve(failed.response.id))  # type: ignore[union-attr]


def _post(body: dict[str, Any]) -> bytes:
    data = json.dumps(body).encode()
    return (b"POST /v1/responses HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%b" % (len(data), data))


def _read_until(sock: socket.socket, marker: bytes) -> bytes:
    got = b""
    while marker not in got:
        chunk = sock.recv(4096)
        assert chunk, got[-300:]
        got += chunk
    return got


def test_a_response_is_stored_once_complete_whatever_its_client_does(sim_cluster: Callable[..., SimCluster]) -> None:
    """As OpenAI: a response whose answer is complete is stored whether or not its client takes it (here a client
    that reads its id and leaves while the rest of a 6 MiB answer is still on its way); a client that leaves while
    it is generated stops it (aborted on its workers, 499) and nothing is stored."""
    cluster = sim_cluster(decode_args=SLOW)
    junk = "x" * (6 * 1024 * 1024)  # (echoed in the answer, not in the prompt)
    body = {"model": "default", "input": "Hello", "max_output_tokens": 2,
            "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}, "x-notes": junk}]}
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.settimeout(GENEROUS_S)
        sock.connect(("127.0.0.1", cluster.gateway_port))
        sock.sendall(_post(body))
        head = _read_until(sock, b'"status"')  # (the id is the body's first field)
    rid = head.split(b'"id":"', 1)[1].split(b'"', 1)[0].decode()
    stored = httpx.get(f"{cluster.base_url}/v1/responses/{rid}", timeout=30)
    assert stored.status_code == 200 and stored.json()["tools"][0]["x-notes"] == junk
    assert stored.json()["id"] == rid and stored.json()["usage"]["output_tokens"] == 2

    before = counts(cluster, "responses")
    with socket.create_connection(("127.0.0.1", cluster.gateway_port), timeout=GENEROUS_S) as sock:
        sock.sendall(_post({"model": "default", "input": "Hello", "max_output_tokens": 400, "stream": True}))
        created = _read_until(sock, b"event: response.in_progress")
    rid = created.split(b'"id":"', 1)[1].split(b'"', 1)[0].decode()
    after = changed(cluster, "responses", before, "499")
    assert delta(before, after) == {"499": 1}, (before, after)
    cluster.wait_pools_full()  # (aborted on its workers)
    _not_found(lambda: _client(cluster).responses.retrieve(rid))
