"""The short paths of the gateway's own HTTP cycle (``gateway.hot_cycle``, ``gateway.http_protocol``) and of the
gatekeeper (``gateway.middleware``) give what their general paths give: byte for byte, status for status."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from gateway.errors import PayloadTooLarge
from gateway.hot_cycle import HotCycle, HotRoutes
from gateway.http_protocol import GuardedHttpProtocol, _expects_100
from gateway.middleware import GatekeeperMiddleware, _error, _key_ok, bearer_key, request_id_from, request_id_of
from gateway.responder import check_length

DEFAULTS = [(b"server", b"uvicorn"), (b"date", b"Mon, 07 Dec 2026 05:00:00 GMT")]


class Transport:
    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        self.writes.append(data)

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True


def _cycle(headers: list[tuple[bytes, bytes]] | None = None, *, keep_alive: bool = True, expect: bool = False,
           chunked: bool = True, cors_head: bytes = b"") -> tuple[HotCycle, Transport, list[int]]:
    transport = Transport()
    responses: list[int] = []
    protocol = SimpleNamespace(transport=transport, loop=None, flow=SimpleNamespace(write_paused=False),
                               server_state=SimpleNamespace(default_headers=DEFAULTS),
                               on_response_complete=lambda: responses.append(1))
    hot = HotCycle(protocol, None, None, "/v1/chat/completions", headers or [], keep_alive, expect,  # type: ignore[arg-type]
                   chunked)
    hot.request_id = b"rid-1"
    hot.cors_head = cors_head
    return hot, transport, responses


@pytest.mark.parametrize("cors_head", [b"", b"access-control-allow-origin: https://a.example\r\nvary: origin\r\n"])
@pytest.mark.parametrize("status", [200, 400, 503])
@pytest.mark.parametrize(("keep_alive", "expect", "headers"), [
    (True, False, []), (False, False, []), (True, True, []), (True, False, [(b"retry-after", b"1")]),
    (True, False, [(b"connection", b"close")]),
])
def test_send_json_writes_what_the_general_head_writes(cors_head: bytes, status: int, keep_alive: bool, expect: bool,
                                                       headers: list[tuple[bytes, bytes]]) -> None:
    """``send_json``'s one-step head (no header of the caller's, the connection kept) is ``_head``'s, and its
    response ends as ``_complete`` ends it (the connection closed when not kept alive)."""
    body = b'{"id": "x", "percent": "100%"}'
    hot, transport, responses = _cycle(keep_alive=keep_alive, expect=expect, cors_head=cors_head)
    reference, _, _ = _cycle(keep_alive=keep_alive, expect=expect, cors_head=cors_head)
    asyncio.run(hot.send_json(body, status, headers))
    expected = reference._head(status, headers, b"content-type: application/json\r\ncontent-length: %d\r\n"
                               % len(body)) + body
    assert transport.writes == [expected]
    assert hot.response_started and hot.response_complete and responses == [1]
    assert hot.keep_alive is reference.keep_alive
    assert transport.closed is (not reference.keep_alive)


@pytest.mark.parametrize("first", [b"", b"data: {\"x\": \"100%\"}\n\n"])
@pytest.mark.parametrize(("keep_alive", "expect", "chunked"), [
    (True, False, True), (False, False, True), (True, True, True), (False, False, False),
])
def test_a_streams_start_is_the_general_heads(first: bytes, keep_alive: bool, expect: bool, chunked: bool) -> None:
    from gateway.hot_cycle import _SSE_HEAD, _SSE_HEAD_CLOSE

    hot, transport, _ = _cycle(keep_alive=keep_alive, expect=expect, chunked=chunked,
                               cors_head=b"access-control-allow-origin: *\r\n")
    reference, _, _ = _cycle(keep_alive=keep_alive, expect=expect, chunked=chunked,
                             cors_head=b"access-control-allow-origin: *\r\n")
    hot.start_now(first)
    if chunked:
        expected = reference._head(200, [], _SSE_HEAD) + (b"%x\r\n%b\r\n" % (len(first), first) if first else b"")
    else:
        expected = reference._head(200, [], _SSE_HEAD_CLOSE) + first
    assert transport.writes == [expected] and hot.keep_alive is reference.keep_alive


@pytest.mark.parametrize("headers", [
    [], [(b"content-length", b"10")], [(b"content-length", b"11")], [(b"content-length", b"1x")],
    [(b"content-length", b"11"), (b"content-length", b"5")], [(b"content-length", b"5"), (b"content-length", b"11")],
    [(b"host", b"a"), (b"content-length", b"0012")], [(b"content-length", b"")],
])
def test_check_length_on_the_cycles_fields_is_the_header_lists(headers: list[tuple[bytes, bytes]]) -> None:
    """Once ``run_asgi`` has read the headers into ``fields`` (the first value of each name), ``check_length``
    refuses exactly what ``responder.check_length`` refuses on the list (the first ``content-length``)."""
    def outcome(check: Any) -> str | None:
        try:
            check()
        except PayloadTooLarge as exc:
            return str(exc)
        return None

    expected = outcome(lambda: check_length(headers, 10))
    hot, _, _ = _cycle(headers)
    assert outcome(lambda: hot.check_length(10)) == expected  # (before run_asgi: the list itself)
    hot.fields = dict(reversed(headers))  # (as run_asgi reads them)
    assert outcome(lambda: hot.check_length(10)) == expected


@pytest.mark.parametrize("value", [b"", b"req-42", b"x" * 128, b"x" * 129, b"caf\xc3\xa9", b"a b", b"a\tb", b"\x7f",
                                   b"\xa0"])
def test_request_id_from_a_value_is_request_id_of_its_header(value: bytes) -> None:
    of = request_id_of([(b"host", b"h"), (b"x-request-id", value), (b"x-request-id", b"second")])
    given = request_id_from(value)
    if of == value.decode("latin-1"):
        assert given == of
    else:  # (a fresh one each time: 32 hex digits)
        assert len(given) == 32 and int(given, 16) >= 0 and given != value.decode("latin-1")


def _reference_refusal(gate: GatekeeperMiddleware, path: str, headers: list[tuple[bytes, bytes]]) -> Any:
    """``GatekeeperMiddleware.refusal`` before its short path for the client API."""
    from gateway.middleware import ADMIN_PATHS, OPEN_PATHS

    if path in OPEN_PATHS:
        return None
    if gate.is_draining() and path != "/metrics":
        return _error(503, "the gateway is shutting down", "service_unavailable", None,
                      [(b"connection", b"close"), (b"retry-after", b"1")])
    if gate.admin_off is not None and path in ADMIN_PATHS:
        return _error(403, f"the admin API is off: {gate.admin_off}", "permission_error", "admin_api_off", [])
    if path in ADMIN_PATHS or (path == "/metrics" and gate.metrics_require_admin):
        keys, what = gate.admin_api_keys, "admin"
    elif path == "/metrics":
        keys, what = [], ""
    else:
        keys, what = gate.api_keys, "API"
    if keys and not _key_ok(bearer_key(headers), keys):
        return _error(401, f"Incorrect or missing {what} key: send 'Authorization: Bearer <key>'",
                      "invalid_request_error", "invalid_api_key", [(b"www-authenticate", b"Bearer")])
    return None


@pytest.mark.parametrize("draining", [False, True])
@pytest.mark.parametrize(("api", "admin", "metrics_admin", "admin_off"), [
    ((), (), False, None), (("k",), (), False, None), (("k",), ("a",), True, None), ((), (), False, "no key"),
])
def test_the_gatekeepers_refusals_are_unchanged_on_every_path(draining: bool, api: tuple[str, ...],
                                                              admin: tuple[str, ...], metrics_admin: bool,
                                                              admin_off: str | None) -> None:
    refused: list[str] = []
    gate = GatekeeperMiddleware(None, api_keys=api, admin_api_keys=admin,  # type: ignore[arg-type]
                                metrics_require_admin=metrics_admin, is_draining=lambda: draining,
                                on_refused=refused.append, admin_off=admin_off)
    paths = ["/v1/chat/completions", "/v1/completions", "/generate", "/v1/responses", "/health", "/readiness",
             "/metrics", "/workers", "/add_worker", "/remove_worker", "/list_workers", "/v1/models", "/"]
    for path in paths:
        for headers in ([], [(b"authorization", b"Bearer k")], [(b"authorization", b"Bearer a")],
                        [(b"authorization", b"bearer  k ")], [(b"authorization", b"Basic k")]):
            assert gate.refusal(path, headers) == _reference_refusal(gate, path, headers), (path, headers)


def test_hot_routes_find_a_route_by_its_request_target() -> None:
    """``HotRoutes.cycle`` takes the request target as parsed: a route's path itself, or with a query string, or an
    absolute URL; anything else is no route's (None); a malformed target raises as ``httptools.parse_url``."""
    import httptools

    responder = SimpleNamespace()
    routes = HotRoutes({"/v1/chat/completions": responder, "/generate": responder}, None)  # type: ignore[arg-type,dict-item]
    transport = Transport()
    protocol = SimpleNamespace(transport=transport, loop=None, flow=SimpleNamespace(write_paused=False),
                               server_state=SimpleNamespace(default_headers=[]), on_response_complete=None)
    for url, path in ((b"/v1/chat/completions", "/v1/chat/completions"), (b"/generate?x=1", "/generate"),
                      (b"http://h:1/v1/chat/completions", "/v1/chat/completions")):
        cycle = routes.cycle(url, protocol, [], True, False, True)  # type: ignore[arg-type]
        assert cycle is not None and cycle.path == path and cycle.responder is responder
        via_path = routes.cycle(httptools.parse_url(url).path, protocol, [], True, False, True)  # type: ignore[arg-type]
        assert via_path is not None and via_path.path == cycle.path
    for url in (b"/v1/completions", b"/generate/", b"/GENERATE"):
        assert routes.cycle(url, protocol, [], True, False, True) is None  # type: ignore[arg-type]
    with pytest.raises(httptools.HttpParserInvalidURLError):
        routes.cycle(b"http://[bad", protocol, [], True, False, True)  # type: ignore[arg-type]


@pytest.mark.parametrize(("headers", "expects"), [
    ([], False), ([(b"expect", b"100-continue")], True), ([(b"expect", b"100-Continue")], True),
    ([(b"expect", b"other")], False), ([(b"expect", b"other"), (b"expect", b"100-continue")], True),
    ([(b"expect", b"100-continue"), (b"expect", b"other")], True), ([(b"x-expect", b"100-continue")], False),
])
def test_the_expectation_is_uvicorns(headers: list[tuple[bytes, bytes]], expects: bool) -> None:
    """``Expect: 100-continue`` is looked for once per head (``_expects_100``), as uvicorn's ``on_header`` looks
    at each: any ``expect`` header whose value is ``100-continue`` in any case."""
    assert _expects_100(headers) is expects
    assert (b"expect" in dict(headers) and _expects_100(headers)) is expects


def test_on_header_keeps_names_lower_case_and_values_as_sent() -> None:
    protocol = SimpleNamespace(headers=[])
    GuardedHttpProtocol.on_header(protocol, b"X-Request-ID", b"AbC")  # type: ignore[arg-type]
    GuardedHttpProtocol.on_header(protocol, b"Expect", b"100-Continue")  # type: ignore[arg-type]
    assert protocol.headers == [(b"x-request-id", b"AbC"), (b"expect", b"100-Continue")]


@pytest.mark.parametrize("chunked", [True, False])
def test_the_lane_frames_before_and_after_holding_a_percent_sign(chunked: bool) -> None:
    """``text_lane`` puts ``before`` and ``after`` into its chunk's format once: a ``%`` in them is text."""
    import msgspec

    from workers.protocol import StepOutput

    hot, transport, _ = _cycle(chunked=chunked)
    hot.response_started = True
    before, after = b'data: {"x%d%%":', b'}%s\n\n'
    lane = hot.text_lane(lambda output: "t%s", msgspec.json.encode, before, after)
    assert lane(StepOutput(0, [1])) is True
    data = before + b'"t%s"' + after
    assert transport.writes == [b"%x\r\n%b\r\n" % (len(data), data) if chunked else data]
