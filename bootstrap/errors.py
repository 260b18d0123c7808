"""Server-side errors of the registry: one exception type carrying its HTTP status and JSON body.

Handlers and the registry raise ``ApiError``; the app's single handler (and the ASGI middleware,
which answers before the app runs) render it as ``{"error": {"message", "type", "code"}}``.
"""

from __future__ import annotations

import msgspec

from bootstrap.messages import ErrorBody, ErrorDetail

_ENCODER = msgspec.json.Encoder()


class ApiError(Exception):
    """An error reply: ``status`` is the HTTP status, ``code`` a stable machine-readable string."""

    def __init__(self, status: int, type_: str, code: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.type = type_
        self.code = code
        self.message = message

    def body(self) -> bytes:
        return _ENCODER.encode(ErrorBody(ErrorDetail(message=self.message, type=self.type, code=self.code)))


def bad_request(code: str, message: str) -> ApiError:
    return ApiError(400, "invalid_request_error", code, message)


def unauthorized(message: str) -> ApiError:
    return ApiError(401, "authentication_error", "invalid_token", message)


def not_found(code: str, message: str) -> ApiError:
    return ApiError(404, "not_found_error", code, message)


def conflict(code: str, message: str) -> ApiError:
    return ApiError(409, "conflict_error", code, message)


def too_large(limit: int) -> ApiError:
    return ApiError(413, "invalid_request_error", "body_too_large", f"request body exceeds {limit} bytes")


def body_timeout(timeout_s: float) -> ApiError:
    return ApiError(408, "invalid_request_error", "body_timeout",
                    f"the request body did not arrive within {timeout_s:g}s")


def unavailable(code: str, message: str) -> ApiError:
    return ApiError(503, "unavailable_error", code, message)
