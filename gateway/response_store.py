"""Stored responses of ``/v1/responses``: ``store``, ``previous_response_id``, ``GET``/``DELETE /v1/responses/{id}``.

A bounded, in-memory store, one per gateway process (not shared between gateway replicas, lost on restart):

1. ``gateway.app`` makes it from ``--responses-store-max`` (how many responses are kept at most; 0: none, the route
   is stateless), ``--responses-store-max-mib`` (how many bytes they hold at most) and ``--responses-store-ttl-s``
   (a response unused for this long is gone) and hands it to the route's responder (``ResponsesResponder``) and to
   the ``GET``/``DELETE`` routes (``response_endpoints``).
2. The responder marks each ``POST /v1/responses`` with a ``Pending`` (a context variable: the request's headers,
   whose key owns what it stores, and, once prepared, the conversation to store with its answer).
3. ``ResponsesShape.prepare`` (``gateway/responses.py``, on the event loop or a prepare thread) looks up
   ``previous_response_id`` (``get``: its conversation and output go in front of the new input) and, unless the
   request says ``store: false``, notes what the answer will be stored with (that conversation and its own input, of
   which only the fields that make the prompt are kept).
4. The final response object (the whole answer, or a stream's ``response.completed``/``response.incomplete``) is
   ``put`` once, before it goes out: as its JSON (what ``GET`` answers), its output items (what a continuation
   puts in front of its input) and its conversation. A stream that fails, or a client that leaves first, stores nothing.
5. ``GET /v1/responses/{id}`` answers the stored object, ``DELETE`` forgets it; both 404 for an id unknown, expired,
   evicted, or stored under another key.

Bounds: at most ``max_responses`` entries and ``max_bytes`` bytes (least recently used evicted first, the newest
kept whatever its size). An entry's bytes: its response object's JSON (which echoes fields of the request that
never reach the prompt, a tool's unknown fields or ``user`` say: the context does not bound it, the request body's
limit does) and its own input items' (the prompt's). Its conversation refers to the earlier turns' items, shared
with them (counted by their own entries; once those are gone, what a conversation keeps of them is bounded by the
model's context). The expiry counts from an entry's last use (stored, read, continued),
so least recently used is also soonest expired and expiry is swept from the old end. Keys: with ``--api-key``, an
entry belongs to the key (its SHA-256) that created it and only that key can read, continue or delete it; without
keys there is one owner. All methods are synchronous and short (no I/O), under a lock (prepare threads).
"""

from __future__ import annotations

import hashlib
import hmac
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from gateway.errors import NotFound

DEFAULT_MAX_RESPONSES = 1000
DEFAULT_TTL_S = 3600.0
DEFAULT_MAX_BYTES = 256 * 1024 * 1024
Headers = list[tuple[bytes, bytes]]
Endpoint = Callable[[Request], Awaitable[Response]]


class ResponseNotFound(NotFound):
    """OpenAI's 404 for a response id it does not have (or not for this key)."""

    type = "invalid_request_error"


@dataclass(slots=True)
class StoredResponse:
    owner: bytes  # the SHA-256 of the key that stored it (b"" on a gateway without keys)
    encoded: bytes  # the response object's JSON, as GET answers it
    output: list[Any]  # its output items
    conversation: list[Any]  # the input items before its output: earlier turns' input and output, then its own
    # the JSON bytes of ``conversation`` and ``output``: the prompt a continuation carries in front of its input
    conversation_bytes: int
    size: int  # what the store counts against its ``max_bytes``
    expires_at: float


def owner_of(headers: Headers, keyed: bool) -> bytes:
    """Who a request is, for the store: the SHA-256 of its bearer key on a gateway with keys (the gatekeeper has
    checked it by now), else b"" (one owner)."""
    if not keyed:
        return b""
    for name, value in headers:
        if name == b"authorization":
            scheme, _, token = value.partition(b" ")
            if scheme.lower() == b"bearer":
                return hashlib.sha256(token.strip(b" \t")).digest()
            break
    return b""


class Pending:
    """One ``POST /v1/responses`` on a gateway that stores: whose it is, and what to store with its answer."""

    __slots__ = ("_owner", "conversation", "headers", "keyed", "prefix_bytes")

    def __init__(self, headers: Headers, keyed: bool) -> None:
        self.headers, self.keyed = headers, keyed
        self._owner: bytes | None = None
        # set by prepare when the answer is to be stored (``store`` not false): the stored conversation it continues
        # and its own ``input``; cleared once stored
        self.conversation: tuple[list[Any], Any] | None = None
        self.prefix_bytes = 0  # the continued response's ``conversation_bytes`` (0: none continued)

    @property
    def owner(self) -> bytes:
        if self._owner is None:  # (hashed only when the store is used: a lookup, or the answer stored)
            self._owner = owner_of(self.headers, self.keyed)
        return self._owner


# Set by ``ResponsesResponder`` for the request it serves (prepare threads run in a copy: the same ``Pending``)
PENDING: ContextVar[Pending | None] = ContextVar("pd_gateway_response_pending", default=None)


class ResponseStore:
    """Responses by id, LRU-bounded by count and bytes, expiring ``ttl_s`` after their last use (the module doc)."""

    def __init__(self, max_responses: int = DEFAULT_MAX_RESPONSES, ttl_s: float = DEFAULT_TTL_S,
                 max_bytes: int = DEFAULT_MAX_BYTES, *, keyed: bool = False,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if max_responses < 1:
            raise ValueError("responses_store_max must be at least 1 (0: no store, made by nobody)")
        if not ttl_s > 0:
            raise ValueError("responses_store_ttl_s must be positive")
        if max_bytes < 1:
            raise ValueError("responses_store_max_bytes must be at least 1")
        self.max_responses, self.ttl_s, self.max_bytes, self.keyed, self.clock = (max_responses, ttl_s, max_bytes,
                                                                                  keyed, clock)
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()  # least recently used first
        self._lock = threading.Lock()
        self.num_bytes = 0  # the entries' ``size``s
        self.num_evicted = 0  # (pushed out by the count or byte bound; not expired ones)

    def __len__(self) -> int:
        return len(self._entries)

    def pending(self, headers: Headers) -> Pending:
        return Pending(headers, self.keyed)

    def put(self, owner: bytes, response_id: str, encoded: bytes, output: list[Any], conversation: list[Any], *,
            own_bytes: int, conversation_bytes: int) -> None:
        """Store a response: ``encoded``, its object's JSON; ``conversation``, the items in front of its output, of
        which its own input's are ``own_bytes`` of JSON; ``conversation_bytes``, the JSON bytes of ``conversation``
        and ``output`` (see ``StoredResponse``). The least recently used entries past the bounds are evicted."""
        now = self.clock()
        size = len(encoded) + own_bytes + 8 * len(conversation)  # (the list: a reference per item)
        entry = StoredResponse(owner, encoded, output, conversation, conversation_bytes, size, now + self.ttl_s)
        with self._lock:
            entries = self._entries
            old = entries.pop(response_id, None)
            if old is not None:
                self.num_bytes -= old.size
            entries[response_id] = entry
            self.num_bytes += size
            self._sweep(now)
            while len(entries) > self.max_responses or (self.num_bytes > self.max_bytes and len(entries) > 1):
                self.num_bytes -= entries.popitem(last=False)[1].size
                self.num_evicted += 1

    def get(self, owner: bytes, response_id: str) -> StoredResponse | None:
        """The entry (its use renewed), or None: unknown, expired, or another owner's."""
        now = self.clock()
        with self._lock:
            self._sweep(now)
            entry = self._entries.get(response_id)
            if entry is None or not hmac.compare_digest(entry.owner, owner):
                return None
            if math.isfinite(self.ttl_s):
                entry.expires_at = now + self.ttl_s
            self._entries.move_to_end(response_id)
            return entry

    def delete(self, owner: bytes, response_id: str) -> bool:
        with self._lock:
            self._sweep(self.clock())
            entry = self._entries.get(response_id)
            if entry is None or not hmac.compare_digest(entry.owner, owner):
                return False
            del self._entries[response_id]
            self.num_bytes -= entry.size
            return True

    def _sweep(self, now: float) -> None:
        """Drop the expired entries: the least recently used end (expiry follows last use, so they are there)."""
        entries = self._entries
        while entries:
            oldest = next(iter(entries.values()))
            if oldest.expires_at > now:
                return
            entries.popitem(last=False)
            self.num_bytes -= oldest.size


def store_of(max_responses: int, ttl_s: float, keyed: bool,
             max_bytes: int = DEFAULT_MAX_BYTES) -> ResponseStore | None:
    """The gateway's store for its flags; None when ``--responses-store-max 0`` (nothing stored)."""
    return ResponseStore(max_responses, ttl_s, max_bytes, keyed=keyed) if max_responses > 0 else None


def not_found(response_id: str, param: str | None = None) -> ResponseNotFound:
    if param == "previous_response_id":
        return ResponseNotFound(f"Previous response with id {response_id!r} not found (unknown, expired or evicted "
                                "from this gateway's store, or stored under another key).", param=param,
                                code="previous_response_not_found")
    return ResponseNotFound(f"No response found with id {response_id!r}.", param=param)


_json = msgspec.json.Encoder()


def response_endpoint(store: ResponseStore | None) -> Endpoint:
    """``GET`` (and ``HEAD``) and ``DELETE /v1/responses/{response_id}``: one Starlette endpoint (one route, so that
    another method's 405 allows all three); an ``APIError`` is its answer."""

    def lookup(request: Request) -> tuple[str, bytes]:
        response_id = request.path_params["response_id"]
        if store is None:
            raise ResponseNotFound(f"No response found with id {response_id!r}: this gateway stores no responses "
                                   "(--responses-store-max 0).")
        return response_id, owner_of(request.headers.raw, store.keyed)

    async def retrieve(request: Request) -> Response:
        response_id, owner = lookup(request)
        assert store is not None
        entry = store.get(owner, response_id)
        if entry is None:
            raise not_found(response_id)
        return Response(entry.encoded, media_type="application/json")

    async def delete(request: Request) -> Response:
        response_id, owner = lookup(request)
        assert store is not None
        if not store.delete(owner, response_id):
            raise not_found(response_id)
        return Response(_json.encode({"id": response_id, "object": "response.deleted", "deleted": True}),
                        media_type="application/json")

    async def endpoint(request: Request) -> Response:
        return await (delete if request.method == "DELETE" else retrieve)(request)

    return endpoint
