"""Request ids: what the gateway takes from a client's ``x-request-id``, and the worker's SGLang side
taking the id its router sent (its log lines name the request by it)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from gateway.context import REQUEST_ID
from gateway.middleware import request_id_of
from workers.sglang_api import _WhenReady


def test_a_usable_client_id_is_kept_and_anything_else_replaced() -> None:
    assert request_id_of([(b"x-request-id", b"req-42")]) == "req-42"
    for bad in ("caf\xe9".encode("latin-1"), b"a\x01b", b"x" * 129, b""):
        replaced = request_id_of([(b"x-request-id", bad)])
        assert len(replaced) == 32 and replaced.isalnum(), bad  # (a non-ASCII id came back re-encoded)


def test_the_workers_sglang_routes_take_the_routers_request_id() -> None:
    seen: list[str | None] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        seen.append(REQUEST_ID.get())

    async def ready() -> None:
        return None

    async def main() -> None:
        route = _WhenReady(SimpleNamespace(ensure_ready=ready), app)  # type: ignore[arg-type]
        await route({"type": "http", "headers": [(b"x-request-id", b"router-7")]}, None, None)  # type: ignore[arg-type]

    asyncio.run(main())
    assert seen == ["router-7"]


def test_random_ids_are_32_lowercase_hex_digits_leading_zeros_kept() -> None:
    """``random_hex``: always 32 digits (a value with leading zero bytes keeps them), each a fresh 128 bits."""
    import random

    from gateway import context

    ids = {context.random_hex() for _ in range(2000)}
    assert len(ids) == 2000 and all(len(i) == 32 and i == i.lower() and int(i, 16) >= 0 for i in ids)
    small = random.Random()
    small.getrandbits = lambda _bits: 0x2a  # type: ignore[method-assign]
    original, context._ids = context._ids, small
    try:
        assert context.random_hex() == "0" * 30 + "2a"
    finally:
        context._ids = original
