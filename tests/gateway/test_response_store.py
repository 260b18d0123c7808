"""``gateway/response_store.py``: the count bound (least recently used first), expiry after last use, owners."""

from __future__ import annotations

import contextvars
import hashlib
from typing import Any

import pytest

from gateway.response_store import ResponseStore, owner_of, store_of


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _put(store: ResponseStore, rid: str, owner: bytes = b"", size: int = 0) -> None:
    store.put(owner, rid, b'{"id": "%s"}' % rid.encode() + b" " * size, [{"type": "message"}],
              [{"role": "user", "content": rid}], own_bytes=0, conversation_bytes=0)


def test_the_count_bound_evicts_the_least_recently_used() -> None:
    store = ResponseStore(3, 60.0, clock=Clock())
    for rid in ("a", "b", "c"):
        _put(store, rid)
    assert store.get(b"", "a") is not None  # a: used last
    _put(store, "d")
    assert store.get(b"", "b") is None and len(store) == 3 and store.num_evicted == 1
    assert [rid for rid in ("a", "c", "d") if store.get(b"", rid) is not None] == ["a", "c", "d"]


def test_an_entry_expires_ttl_after_its_last_use() -> None:
    clock = Clock()
    store = ResponseStore(10, 60.0, clock=clock)
    _put(store, "a")
    _put(store, "b")
    clock.now += 50
    assert store.get(b"", "a") is not None  # renewed: 60 s from now
    clock.now += 20  # b unused for 70 s
    assert store.get(b"", "b") is None and len(store) == 1
    assert store.get(b"", "a") is not None
    clock.now += 61
    _put(store, "c")  # (a put sweeps the expired end too)
    assert len(store) == 1 and store.get(b"", "a") is None


def test_owners_cannot_see_each_others_entries() -> None:
    store = ResponseStore(10, 60.0, keyed=True)
    alice = owner_of([(b"authorization", b"Bearer key-a")], keyed=True)
    bob = owner_of([(b"authorization", b"bearer  key-b ")], keyed=True)
    assert alice == hashlib.sha256(b"key-a").digest() and bob == hashlib.sha256(b"key-b").digest()
    _put(store, "a", alice)
    assert store.get(bob, "a") is None and not store.delete(bob, "a")
    assert store.get(b"", "a") is None
    entry = store.get(alice, "a")
    assert entry is not None and entry.conversation == [{"role": "user", "content": "a"}]
    assert store.delete(alice, "a") and store.get(alice, "a") is None and not store.delete(alice, "a")
    assert owner_of([(b"authorization", b"Bearer key-a")], keyed=False) == b""  # (no keys: one owner)


def test_flags() -> None:
    assert store_of(0, 60.0, keyed=False) is None
    with pytest.raises(ValueError):
        ResponseStore(1, 0.0)
    store = store_of(5, float("inf"), keyed=False)
    assert store is not None
    _put(store, "a")
    assert store.get(b"", "a") is not None


def test_a_stored_conversation_goes_in_front_of_the_new_input() -> None:
    """A call in the stored output, its result in the new input; the new input's refusals name its own items."""
    from gateway.errors import BadRequest
    from gateway.responses import ResponsesRequest, _messages

    prefix = [{"type": "message", "role": "user", "content": "Weather in Paris?"},
              {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "get_weather",
               "arguments": '{"city": "Paris"}', "status": "completed"}]
    answer = ResponsesRequest(input=[{"type": "function_call_output", "call_id": "call_1", "output": "sunny"}],
                              instructions="Be brief.")
    messages, origins = _messages(answer, prefix)
    assert [m.role for m in messages] == ["system", "user", "assistant", "tool"]
    assert messages[2].tool_calls == [{"id": "call_1", "type": "function",
                                       "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]
    assert origins == ["instructions", "previous_response_id", "previous_response_id", "input[0]"]
    with pytest.raises(BadRequest) as caught:
        _messages(ResponsesRequest(input=[{"type": "function_call_output", "call_id": "call_9", "output": "x"}]),
                  prefix)
    assert caught.value.param == "input[0].call_id"


def test_what_is_stored_of_an_input_is_what_makes_the_prompt() -> None:
    """(Fields the route ignores are not kept: they would cost the store memory the prompt never bounded.)"""
    from gateway.responses import _stored_items

    junk = "x" * 1000
    given = [{"role": "user", "content": [{"type": "input_text", "text": "hi", "junk": junk}], "junk": junk},
             {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}", "junk": junk},
             {"type": "function_call_output", "call_id": "c", "output": [{"type": "input_text", "text": "1"}]},
             {"type": "message", "role": "assistant", "content": "ok", "id": "msg_1", "status": "completed"}]
    assert _stored_items(given) == [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]},
        {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c", "output": [{"type": "input_text", "text": "1"}]},
        {"type": "message", "role": "assistant", "content": "ok"}]
    assert _stored_items("hello") == [{"type": "message", "role": "user", "content": "hello"}]


def test_the_byte_bound_evicts_the_least_recently_used() -> None:
    """(A stored response echoes request fields the prompt never bounded: the count bound alone held gigabytes.)"""
    probe = ResponseStore(100, 60.0)
    _put(probe, "a", size=300)
    one = probe.num_bytes  # (an entry: its JSON, its items as held, its bookkeeping: test_response_store_held_bytes)
    assert one > 300
    bound = int(3.5 * one)
    store = ResponseStore(100, 60.0, bound, clock=Clock())
    for rid in ("a", "b", "c"):
        _put(store, rid, size=300)
    assert len(store) == 3 and store.get(b"", "a") is not None  # a: used last
    _put(store, "d", size=300)  # 4 entries > 3.5: b goes, the least recently used
    assert store.get(b"", "b") is None and len(store) == 3 and store.num_bytes <= bound and store.num_evicted == 1
    _put(store, "e", size=5 * one)  # larger than the bound alone: kept, all else gone
    assert [rid for rid in "acde" if store.get(b"", rid) is not None] == ["e"]
    assert store.delete(b"", "e") and store.num_bytes == 0
    clock = Clock()
    store = ResponseStore(100, 60.0, bound, clock=clock)
    _put(store, "a", size=300)
    clock.now += 61
    assert store.get(b"", "a") is None and store.num_bytes == 0  # (expired: its bytes given back too)


def test_a_long_stored_conversation_is_prepared_off_the_event_loop() -> None:
    """A continuation's body is short but its prompt is the stored conversation: tokenized on the event loop, a
    long one stalled every other request's stream (hundreds of ms for a long context); the responder prepares it
    again on a thread on ``CheckOffLoop``, as it does a long body."""
    from gateway.api import Frontend
    from gateway.responses import ResponsesShape
    from gateway.tokenizer import ByteTokenizer

    frontend = Frontend(None, ByteTokenizer(), "m", 1 << 20)  # type: ignore[arg-type]
    store = ResponseStore(10, 60.0)
    shape = ResponsesShape(store, prepare_thread_bytes=8192)
    contextvars.Context().run(_continue_a_long_conversation, frontend, store, shape)


def _continue_a_long_conversation(frontend: Any, store: ResponseStore, shape: Any) -> None:
    import asyncio

    import msgspec

    from gateway.response_store import PENDING
    from gateway.responses import ResponsesRequest, ResponsesShape
    from gateway.structured_output import CheckOffLoop

    PENDING.set(store.pending([]))  # (what ``ResponsesResponder`` sets for the request it serves)
    first = msgspec.json.decode(msgspec.json.encode({"input": "x" * 20_000, "max_output_tokens": 1}),
                                type=ResponsesRequest)
    prep, rid = shape.prepare(frontend, first)  # (a long body: on a thread, as here)
    assert rid is not None
    shape._kept({"id": rid, "output": [{"type": "message", "role": "assistant",
                                        "content": [{"type": "output_text", "text": "ok"}]}]})
    then = msgspec.json.decode(msgspec.json.encode({"input": "and?", "previous_response_id": rid}),
                               type=ResponsesRequest)

    async def on_loop() -> None:
        with pytest.raises(CheckOffLoop):
            shape.prepare(frontend, then)

    asyncio.run(on_loop())
    prep, _ = shape.prepare(frontend, then)  # (the thread's call)
    assert len(prep.input_ids) > 20_000
    short = ResponsesShape(store, prepare_thread_bytes=1 << 20)

    async def short_enough() -> None:
        short.prepare(frontend, then)

    asyncio.run(short_enough())


def test_input_items_are_listed_as_openai_lists_them_a_page_at_a_time() -> None:
    """``GET /v1/responses/{id}/input_items``: the stored conversation (earlier output as answered, input with ids
    and a status), ``desc`` newest first by default, ``after`` an item's id, ``has_more`` when items are left."""
    from gateway.errors import BadRequest
    from gateway.response_store import input_items_page
    from gateway.responses import _stored_items, _with_ids

    earlier = _with_ids(_stored_items("Weather in Paris?"), "resp_aa")
    output = [{"id": "fc_1", "type": "function_call", "status": "completed", "call_id": "call_1",
               "name": "get_weather", "arguments": "{}"}]
    own = _with_ids(_stored_items([
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny", "id": "mine"},
        {"role": "assistant", "content": "It is sunny."},
        {"role": "user", "content": [{"type": "input_text", "text": "Thanks"}]}]), "resp_bb")
    conversation = [*earlier, *output, *own]
    asc = input_items_page(conversation, 20, "asc", None)
    assert asc == {"object": "list", "first_id": "msg_aa_0", "last_id": "msg_bb_2", "has_more": False, "data": [
        {"id": "msg_aa_0", "type": "message", "role": "user", "status": "completed",
         "content": [{"type": "input_text", "text": "Weather in Paris?"}]},
        output[0],
        {"id": "fco_bb_0", "type": "function_call_output", "call_id": "call_1", "output": "sunny",
         "status": "completed"},  # (the client's id is not kept: the gateway's ids are unique)
        {"id": "msg_bb_1", "type": "message", "role": "assistant", "status": "completed",
         "content": [{"type": "output_text", "text": "It is sunny.", "annotations": []}]},
        {"id": "msg_bb_2", "type": "message", "role": "user", "status": "completed",
         "content": [{"type": "input_text", "text": "Thanks"}]}]}
    ids = [item["id"] for item in asc["data"]]
    desc = input_items_page(conversation, 2, "desc", None)
    assert [i["id"] for i in desc["data"]] == ids[::-1][:2] and desc["has_more"] is True
    assert (desc["first_id"], desc["last_id"]) == (ids[4], ids[3])
    rest = input_items_page(conversation, 2, "desc", desc["last_id"])
    assert [i["id"] for i in rest["data"]] == [ids[2], ids[1]] and rest["has_more"] is True
    last = input_items_page(conversation, 2, "desc", rest["last_id"])
    assert [i["id"] for i in last["data"]] == [ids[0]] and last["has_more"] is False
    empty = input_items_page(conversation, 2, "desc", ids[0])
    assert empty["data"] == [] and empty["has_more"] is False and empty["first_id"] is None
    with pytest.raises(BadRequest) as caught:
        input_items_page(conversation, 2, "asc", "msg_nope")
    assert caught.value.param == "after"
    assert conversation[2] == {"id": "fco_bb_0", "type": "function_call_output", "call_id": "call_1",
                               "output": "sunny"}  # (stored as the prompt needs it; listed with a status)


def test_response_failed_says_whether_it_is_stored() -> None:
    """``response.failed`` of a request to be stored says ``store: false`` (nothing kept); true only where its
    completed answer was stored before the stream was cut (the shutdown's cut while it went out)."""
    import json
    from types import SimpleNamespace

    from gateway.errors import BadGateway
    from gateway.response_store import PENDING
    from gateway.responses import ResponsesShape

    store = ResponseStore(10, 60.0)
    shape = ResponsesShape(store)

    def failed(conversation: Any, store_echo: bool) -> bool:
        pending = store.pending([])
        pending.conversation = conversation
        PENDING.set(pending)
        run = SimpleNamespace(rid="resp_1", created=0, frontend=SimpleNamespace(model_name="m"), sequence=0,
                              prep=SimpleNamespace(echo_fields={"store": store_echo}))
        event = shape.failure(run, BadGateway("decode worker: gone"))  # type: ignore[arg-type]
        response = json.loads(event.split(b"data: ", 1)[1])["response"]
        assert response["status"] == "failed" and response["error"]["code"] == "server_error"
        return bool(response["store"])

    def check() -> None:
        assert failed(([], "hi"), True) is False  # to be stored, never was
        assert failed(None, True) is True  # stored already (``_kept`` clears what was to be stored)
        assert failed(None, False) is False  # store: false

    contextvars.Context().run(check)


def test_the_store_is_measured_at_scrape_time_and_swept_then() -> None:
    """``pd_gateway_responses_stored{,_bytes}`` and ``..._evicted_total`` from ``ResponseStore.stats`` (via the
    gateway's collector), the expired entries swept at the scrape itself (nothing else would sweep them)."""
    from prometheus_client import CollectorRegistry, generate_latest

    from gateway.metrics import ResponseStoreCollector

    now = [0.0]
    store = ResponseStore(max_responses=2, ttl_s=10.0, clock=lambda: now[0])
    registry = CollectorRegistry()
    registry.register(ResponseStoreCollector(store.stats))

    def scraped() -> dict[str, float]:
        lines = generate_latest(registry).decode().splitlines()
        return {name: float(value) for name, value in (line.split() for line in lines if not line.startswith("#"))}

    for i in range(3):  # (the third pushes the first out)
        store.put(b"", f"resp_{i}", b'{"id": "x"}', [], [], own_bytes=0, conversation_bytes=0)
    figures = scraped()
    assert figures["pd_gateway_responses_stored"] == 2 and figures["pd_gateway_responses_evicted_total"] == 1
    assert figures["pd_gateway_responses_stored_bytes"] == store.num_bytes > 0
    now[0] = 11.0  # both expire; no request comes to sweep them: the scrape does
    figures = scraped()
    assert figures["pd_gateway_responses_stored"] == 0 and figures["pd_gateway_responses_stored_bytes"] == 0
    assert figures["pd_gateway_responses_evicted_total"] == 1  # (expiry is not eviction)
