"""Stored responses of ``/v1/responses``: ``store``, ``previous_response_id``, ``GET``/``DELETE /v1/responses/{id}``,
``GET /v1/responses/{id}/input_items``.

A bounded, in-memory store, one per gateway process (not shared between gateway replicas, lost on restart):

1. ``gateway.app`` makes it from ``--responses-store-max`` (how many responses are kept at most; 0: none, the route
   is stateless), ``--responses-store-max-mib`` (how many bytes they hold at most) and ``--responses-store-ttl-s``
   (a response unused for this long is gone) and hands it to the route's responder (``ResponsesResponder``) and to
   the ``GET``/``DELETE`` and ``input_items`` routes (``response_endpoint``, ``input_items_endpoint``: a route of
   their own in ``pd_gateway_requests_total``, ``responses_store``, a method they lack a 405 counted there).
2. The responder marks each ``POST /v1/responses`` with a ``Pending`` (a context variable: the request's headers,
   whose key owns what it stores, and, once prepared, the conversation to store with its answer).
3. ``ResponsesShape.prepare`` (``gateway/responses.py``, on the event loop or a prepare thread) looks up
   ``previous_response_id`` (``get``: its conversation and output go in front of the new input) and, unless the
   request says ``store: false``, notes what the answer will be stored with (that conversation and its own input, of
   which only the fields that make the prompt are kept, with an id each: ``input_items`` lists them by it).
4. The final response object (the whole answer, or a stream's ``response.completed``/``response.incomplete``) is
   ``put`` once, when its generation has ended, before it goes out (as OpenAI, a completed response is stored
   whatever its client does next): as its JSON (what ``GET`` answers), its output items (what a continuation puts
   in front of its input) and its conversation. A stream that fails stores nothing (its ``response.failed`` says
   ``store: false``); a client that leaves while its response is generated stops the generation: nothing to store.
5. ``GET /v1/responses/{id}`` answers the stored object, ``DELETE`` forgets it, ``GET .../input_items`` lists its
   conversation (OpenAI's list, a page at a time: ``input_items_page``); each 404s for an id unknown, expired,
   evicted, or stored under another key.

Bounds: at most ``max_responses`` entries and ``max_bytes`` bytes (least recently used evicted first, the newest
kept whatever its size). An entry's bytes: the memory it holds (``put``): its response object's JSON (which echoes
fields of the request that never reach the prompt, a tool's unknown fields or ``user`` say: the context does not
bound it, the request body's limit does), its output items and its own input items (the prompt's) as the Python
objects they are (``held_bytes``: more than their JSON), and its bookkeeping. Its conversation refers to the
earlier turns' items, shared with them (counted by their own entries; once those are gone, what a conversation keeps
of them is bounded by the model's context). The expiry counts from an entry's last use (stored, read, continued),
so least recently used is also soonest expired and expiry is swept from the old end. Keys: with ``--api-key``, an
entry belongs to the key (its SHA-256) that created it and only that key can read, continue or delete it; without
keys there is one owner. All methods are synchronous and short (no I/O), under a lock (prepare threads).
"""

from __future__ import annotations

import hashlib
import hmac
import math
import sys
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
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from gateway.errors import APIError, BadRequest, NotFound
from gateway.middleware import bearer_key

DEFAULT_MAX_RESPONSES = 1000
DEFAULT_TTL_S = 3600.0
DEFAULT_MAX_BYTES = 256 * 1024 * 1024
ENTRY_BYTES = 112  # an entry's place in the store's ordered dict (its slot, its node in the order)
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
    key = bearer_key(headers) if keyed else b""
    return hashlib.sha256(key).digest() if key else b""


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
        which its own input's hold ``own_bytes`` (``held_bytes``); ``conversation_bytes``, the JSON bytes of
        ``conversation`` and ``output`` (see ``StoredResponse``). The least recently used entries past the bounds
        are evicted."""
        now = self.clock()
        # (an exact copy: msgspec's bytes keep the buffer it grew, up to half as much again as the JSON)
        encoded = bytes(memoryview(encoded))
        entry = StoredResponse(owner, encoded, output, conversation, conversation_bytes, 0, now + self.ttl_s)
        # what the entry holds: its JSON, its output items (as dicts, besides their JSON), its own input items, the
        # list of its conversation (a reference per item: the earlier turns' items are their entries'), itself
        entry.size = (sys.getsizeof(encoded) + held_bytes(output) + own_bytes + sys.getsizeof(conversation)
                      + sys.getsizeof(entry) + sys.getsizeof(response_id) + ENTRY_BYTES)
        size = entry.size
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

    def stats(self) -> tuple[int, int, int]:
        """(entries, the bytes they hold, entries evicted so far), the expired ones swept first (read at scrape
        time: with no traffic, nothing else sweeps them)."""
        with self._lock:
            self._sweep(self.clock())
            return len(self._entries), self.num_bytes, self.num_evicted

    def _sweep(self, now: float) -> None:
        """Drop the expired entries: the least recently used end (expiry follows last use, so they are there)."""
        entries = self._entries
        while entries:
            oldest = next(iter(entries.values()))
            if oldest.expires_at > now:
                return
            entries.popitem(last=False)
            self.num_bytes -= oldest.size


def held_bytes(value: Any) -> int:
    """The memory a decoded JSON value holds (``sys.getsizeof`` of it and all it contains; dict keys, shared by
    every item of a kind, not counted): what a stored item costs the store, which is more than its JSON."""
    size = _sizeof(value)
    kind = type(value)
    if kind is dict or kind is list:
        for inner in value.values() if kind is dict else value:
            size += held_bytes(inner) if type(inner) in _CONTAINERS else _sizeof(inner)
    return size


_sizeof = sys.getsizeof
_CONTAINERS = (dict, list)


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
MAX_LIST_LIMIT = 100  # OpenAI's bounds on ``input_items``' ``limit`` (1..100, default 20)
DEFAULT_LIST_LIMIT = 20


class MethodNotAllowed(APIError):
    """A stored-response route asked with another method: counted under its route (``_guarded``), as a generation
    route's 405 is, and shaped as Starlette's own 405 (``gateway.errors.http_error``)."""

    status = 405
    type = "invalid_request_error"

    def __init__(self, message: str, allow: bytes) -> None:
        super().__init__(message)
        self.allow = allow

    def headers(self) -> list[tuple[bytes, bytes]]:
        return [*super().headers(), (b"allow", self.allow)]


def _by_method(handlers: dict[str, Endpoint]) -> Endpoint:
    """One endpoint for a ``StoreRoute`` (which passes every method on): ``handlers`` by method, any other a 405 (an
    ``APIError``, so that ``_guarded`` counts it; Starlette's own 405 would be raised before the endpoint)."""
    allow = ", ".join(handlers).encode()

    async def endpoint(request: Request) -> Response:
        handler = handlers.get(request.method)
        if handler is None:
            raise MethodNotAllowed(f"Method Not Allowed: {request.method} {request.url.path}", allow)
        return await handler(request)

    return endpoint


class StoreRoute(Route):
    """A stored-response route: its ``methods`` are those it serves (the OpenAPI document's), but a request with
    another reaches its endpoint (whose 405 is counted, ``_by_method``) instead of Starlette's own 405 before it."""

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.app(scope, receive, send)


def _no_store(response_id: str) -> ResponseNotFound:
    return ResponseNotFound(f"No response found with id {response_id!r}: this gateway stores no responses "
                            "(--responses-store-max 0).")


def _lookup(store: ResponseStore | None, request: Request) -> StoredResponse:
    """The stored response the path names, for the key of the request (its use renewed); else its 404."""
    response_id = request.path_params["response_id"]
    if store is None:
        raise _no_store(response_id)
    entry = store.get(owner_of(request.headers.raw, store.keyed), response_id)
    if entry is None:
        raise not_found(response_id)
    return entry


def response_endpoint(store: ResponseStore | None) -> Endpoint:
    """``GET`` (and ``HEAD``) and ``DELETE /v1/responses/{response_id}``: one Starlette endpoint (one route, so that
    another method's 405 allows all three; counted, ``_by_method``); an ``APIError`` is its answer."""

    async def retrieve(request: Request) -> Response:
        stream = request.query_params.get("stream")
        if stream is not None and stream.lower() not in ("false", "0"):  # (the SDK's ``retrieve(id, stream=True)``)
            # OpenAI streams a background response's events; answered as JSON, the SDK's stream would yield nothing
            raise BadRequest("stream is not supported on GET /v1/responses/{id}: responses here are never "
                             "background ones; retrieve the stored response without it", param="stream")
        return Response(_lookup(store, request).encoded, media_type="application/json")

    async def delete(request: Request) -> Response:
        response_id = request.path_params["response_id"]
        if store is None:
            raise _no_store(response_id)
        if not store.delete(owner_of(request.headers.raw, store.keyed), response_id):
            raise not_found(response_id)
        return Response(_json.encode({"id": response_id, "object": "response.deleted", "deleted": True}),
                        media_type="application/json")

    return _by_method({"GET": retrieve, "HEAD": retrieve, "DELETE": delete})


def input_items_endpoint(store: ResponseStore | None) -> Endpoint:
    """``GET /v1/responses/{response_id}/input_items`` (the SDK's ``responses.input_items.list``): a page of the
    stored response's input items, OpenAI's list (``input_items_page``); the 404s of ``GET /v1/responses/{id}``."""

    async def listing(request: Request) -> Response:
        limit, order, after = _list_params(request)
        entry = _lookup(store, request)
        return Response(_json.encode(input_items_page(entry.conversation, limit, order, after)),
                        media_type="application/json")

    return _by_method({"GET": listing, "HEAD": listing})


def _list_params(request: Request) -> tuple[int, str, str | None]:
    """``limit``, ``order`` and ``after`` of an ``input_items`` request; ``include`` (values that add fields this
    gateway never has: hosted tools' results, images, logprobs, reasoning) is a 400 naming it, as on ``POST``."""
    query = request.query_params
    included = [value for name in ("include", "include[]") for value in query.getlist(name)]
    if included:
        raise BadRequest(f"include {included[0]!r} is not supported: input items are listed as they were given "
                         "(text and function calls), with nothing to include", param="include")
    given = query.get("limit")
    limit = DEFAULT_LIST_LIMIT
    if given is not None:
        limit = int(given) if given.isascii() and given.isdigit() and len(given) <= 4 else 0
        if not 1 <= limit <= MAX_LIST_LIMIT:
            raise BadRequest(f"limit must be an integer from 1 to {MAX_LIST_LIMIT}, got {given!r}", param="limit")
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise BadRequest(f"order must be 'asc' or 'desc', got {order!r}", param="order")
    return limit, order, query.get("after")


def input_items_page(conversation: list[Any], limit: int, order: str, after: str | None) -> dict[str, Any]:
    """OpenAI's list of a stored response's input items: its whole conversation before its output (earlier turns'
    input and output, then its own input), ``order`` ``asc`` as they were given, ``desc`` newest first; ``after``:
    the id of the item the page starts after (an id not among them is a 400 naming ``after``)."""
    items = conversation if order == "asc" else conversation[::-1]
    start = 0
    if after is not None:
        start = next((i + 1 for i, item in enumerate(items) if item.get("id") == after), -1)
        if start < 0:
            raise BadRequest(f"after {after!r} is not the id of an input item of this response", param="after")
    page = [listed_item(item) for item in items[start:start + limit]]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": start + limit < len(items)}


def listed_item(item: dict[str, Any]) -> dict[str, Any]:
    """A stored conversation item as ``input_items`` lists it (OpenAI's items with ids and a status): an earlier
    response's output item as it was answered; an input message with its content as the parts of its role (the route
    takes any text part for any role; OpenAI's items, and the SDK's types, have an assistant's ``output_text`` or
    ``refusal``, another role's ``input_text``: a part of another kind is listed as its role's, its text as given); a
    function call or its output ``completed`` (an output's text parts ``input_text``)."""
    if "status" in item:  # (an output item: already in OpenAI's shape)
        return item
    if item["type"] != "message":
        output = item.get("output")
        if isinstance(output, list):
            item = {**item, "output": [{"type": "input_text", "text": part["text"]} for part in output]}
        return {**item, "status": "completed"}
    role, content = item["role"], item["content"]
    if isinstance(content, str):
        content = [{"type": "output_text" if role == "assistant" else "input_text", "text": content}]
    if role == "assistant":
        parts = [part if part["type"] == "refusal" else {"type": "output_text", "text": part["text"], "annotations": []}
                 for part in content]
    else:
        parts = [{"type": "input_text", "text": part.get("text", part.get("refusal"))} for part in content]
    return {"id": item["id"], "type": "message", "role": role, "content": parts, "status": "completed"}
