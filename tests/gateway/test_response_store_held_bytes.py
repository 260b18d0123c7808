"""The response store's byte bound (``--responses-store-max-mib``) bounds the memory its entries hold, not only their
JSON: a stored response is kept as its JSON (as ``msgspec`` encoded it) and as its output items and own input items
(Python dicts and lists, which hold more than their JSON), each entry with its bookkeeping. Counted as their JSON
alone, a store at its bound held 2.5 to 4 times the bytes it was allowed (small responses, a long output, many tiny
input items; measured here with ``tracemalloc`` through ``ResponsesShape._kept``, what the route stores)."""

from __future__ import annotations

import contextvars
import gc
import secrets
import tracemalloc
from collections.abc import Callable
from typing import Any

import pytest

from gateway.response_store import PENDING, ResponseStore
from gateway.responses import ResponsesShape

BOUND = 2 << 20  # bytes


def _body(text: str) -> Callable[[], dict[str, Any]]:
    def make() -> dict[str, Any]:
        rid = f"resp_{secrets.token_hex(16)}"
        output = [{"id": "msg_" + rid[5:], "type": "message", "status": "completed", "role": "assistant",
                   "content": [{"type": "output_text", "text": text + rid, "annotations": [], "logprobs": []}]}]
        return {"id": rid, "object": "response", "status": "completed", "output": output, "store": True,
                "model": "m", "usage": {"input_tokens": 5, "output_tokens": 1, "total_tokens": 6}, "tools": [],
                "metadata": {}, "instructions": None, "previous_response_id": None}
    return make


def _store(store: ResponseStore, make: Callable[[], dict[str, Any]], given: Any, n: int) -> None:
    shape = ResponsesShape(store)

    def one() -> None:
        pending = store.pending([])
        PENDING.set(pending)
        pending.conversation = ([], given)  # (what ``prepare`` notes for a request to be stored)
        shape._kept(make())

    for _ in range(n):
        contextvars.Context().run(one)


@pytest.mark.parametrize(("make", "given", "n"), [
    (_body("ok"), "hi", 6000),  # small responses: their bookkeeping and dicts are most of them
    (_body("x" * 20_000), "hi", 300),  # a long output: its text is in the JSON and in the output items
    (_body("ok"), [{"role": "user", "content": ""}] * 500, 150),  # many tiny input items (the context allows them)
], ids=["small", "long-output", "many-items"])
def test_a_full_store_holds_about_its_byte_bound(make: Callable[[], dict[str, Any]], given: Any, n: int) -> None:
    store = ResponseStore(10**6, 3600.0, BOUND)
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        _store(store, make, given, n)  # (past the bound: the oldest evicted)
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert store.num_evicted > 0 and store.num_bytes <= BOUND
    assert held <= 1.25 * BOUND, f"{len(store)} entries hold {held / BOUND:.2f} times the byte bound"
