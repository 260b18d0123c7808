"""Server-side errors of the registry: one exception type carrying its HTTP status and JSON body.

Handlers and the registry raise ``ApiError``; the app's single handler (and the ASGI middleware,
which answers before the app runs) render it as ``{"error": {"message", "type", "code"}}``.
"""

from __future__ import annotations

import math

import msgspec

from bootstrap.messages import ErrorBody, ErrorDetail

_ENCODER = msgspec.json.Encoder()


class ApiError(Exception):
    """An error reply: ``status`` is the HTTP status, ``code`` a stable machine-readable string."""

    def __init__(self, status: int, type_: str, code: str, message: str, *,
                 retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.type = type_
        self.code = code
        self.message = message
        self.retry_after_s = retry_after_s  # (when a retry can succeed: ``retry_after_s`` in the body, Retry-After)

    def body(self) -> bytes:
        retry_after_s = None if self.retry_after_s is None else round(self.retry_after_s, 3)
        return _ENCODER.encode(ErrorBody(ErrorDetail(message=self.message, type=self.type, code=self.code,
                                                     retry_after_s=retry_after_s)))

    def headers(self) -> dict[str, str] | None:
        """``Retry-After`` (whole seconds, rounded up: HTTP has no fractions) when the error says when to retry."""
        if self.retry_after_s is None:
            return None
        return {"retry-after": str(max(0, math.ceil(self.retry_after_s)))}


def bad_request(code: str, message: str) -> ApiError:
    return ApiError(400, "invalid_request_error", code, message)


def unauthorized(message: str) -> ApiError:
    return ApiError(401, "authentication_error", "invalid_token", message)


def not_found(code: str, message: str) -> ApiError:
    return ApiError(404, "not_found_error", code, message)


def conflict(code: str, message: str, *, retry_after_s: float | None = None) -> ApiError:
    return ApiError(409, "conflict_error", code, message, retry_after_s=retry_after_s)


def gone(code: str, message: str) -> ApiError:
    return ApiError(410, "conflict_error", code, message)


def too_large(limit: int) -> ApiError:
    return ApiError(413, "invalid_request_error", "body_too_large", f"request body exceeds {limit} bytes")


def body_timeout(timeout_s: float) -> ApiError:
    return ApiError(408, "invalid_request_error", "body_timeout",
                    f"the request body did not arrive within {timeout_s:g}s")


def unavailable(code: str, message: str) -> ApiError:
    return ApiError(503, "unavailable_error", code, message)
