"""The gateway's error hierarchy and its one mapping to OpenAI-shaped JSON responses."""

from __future__ import annotations

import msgspec
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response

_json = msgspec.json.Encoder()


class APIError(Exception):
    """An error a client sees: HTTP status + OpenAI ``{"error": {...}}`` body."""

    status = 500
    type = "internal_error"
    close_connection = False  # the request could not be read to its end: the connection closes after the answer

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None,
                 retry_after_s: float | None = None, final: bool = False) -> None:
        """``final``: sending the same request again would end the same way (the request's own deadline): its
        answer says ``x-should-retry: false``, which OpenAI's SDKs obey (they retry every 5xx otherwise)."""
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        self.retry_after_s = retry_after_s
        self.final = final

    def body(self) -> dict[str, object]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def headers(self) -> list[tuple[bytes, bytes]]:
        out = []
        if self.retry_after_s is not None:
            out.append((b"retry-after", b"%d" % max(1, round(self.retry_after_s))))
        if self.close_connection:
            out.append((b"connection", b"close"))
        if self.final:
            out.append((b"x-should-retry", b"false"))
        return out

    def to_response(self) -> Response:
        return Response(_json.encode(self.body()), status_code=self.status, media_type="application/json",
                        headers={name.decode(): value.decode() for name, value in self.headers()})


class BadRequest(APIError):
    status = 400
    type = "invalid_request_error"


class NotFound(APIError):
    status = 404
    type = "not_found_error"


class RequestTimeout(APIError):
    """The client did not send its request (head or body) in time."""

    status = 408
    type = "invalid_request_error"
    close_connection = True


class PayloadTooLarge(APIError):
    status = 413
    type = "invalid_request_error"


class UnsupportedMediaType(APIError):
    status = 415
    type = "invalid_request_error"


class HeadersTooLarge(APIError):
    status = 431
    type = "invalid_request_error"


class Overloaded(APIError):
    status = 429
    type = "rate_limit_error"


class BadGateway(APIError):
    """A worker failed the request (transfer failure, worker died)."""

    status = 502
    type = "upstream_error"


class NoWorkers(APIError):
    status = 503
    type = "service_unavailable"


class UpstreamTimeout(APIError):
    status = 504
    type = "timeout_error"


_BY_WORKER_CODE: dict[str, type[APIError]] = {
    "bad_request": BadRequest,
    "overloaded": Overloaded,
    "shutting_down": NoWorkers,
    "timeout": UpstreamTimeout,
}


def from_worker_error(code: str, message: str, side: str, param: str | None = None) -> APIError:
    """Map a worker's ``Error`` message to the client-facing error (``param``: the field it names)."""
    cls = _BY_WORKER_CODE.get(code, BadGateway)
    retry_after_s = 1.0 if cls in (Overloaded, NoWorkers) else None
    return cls(f"{side} worker: {message}", param=param, code=code, retry_after_s=retry_after_s)


async def http_error(request: Request, exc: Exception) -> Response:
    """Starlette's own 404 / 405 (no such route, wrong method), OpenAI-shaped."""
    assert isinstance(exc, HTTPException)
    code = exc.status_code
    kind = {404: "not_found_error", 405: "invalid_request_error"}.get(code, "internal_error")
    body = {"error": {"message": f"{exc.detail}: {request.method} {request.url.path}", "type": kind, "param": None,
                      "code": None}}
    response = Response(msgspec.json.encode(body), status_code=code, media_type="application/json")
    response.headers.update(exc.headers or {})  # 405: Allow
    return response


async def api_error(_: Request, exc: Exception) -> Response:
    """An ``APIError`` raised in a plain route: its own answer."""
    assert isinstance(exc, APIError)
    return exc.to_response()
