"""Per-request context carried through the gateway's tasks: the request id and arrival time.

Set by ``RequestContextMiddleware`` for each HTTP request; ``contextvars`` copy into every task the
request spawns, so the dispatcher and log lines see them without passing them around. The logging
filter adds ``request_id`` to every record (``-`` outside a request).
"""

from __future__ import annotations

import logging
import random
import re
from contextvars import ContextVar

_ids = random.Random()  # seeded from the OS once; ids must be unique, not secret


def random_hex() -> str:
    """128 random bits as 32 hex digits (for ids: ~40x cheaper than ``uuid4().hex``, half an f-string's ``:032x``)."""
    return _ids.getrandbits(128).to_bytes(16, "big").hex()


def random_room() -> int:
    """A fresh 63-bit bootstrap room (unique per attempt with overwhelming odds; a syscall cheaper than ``secrets``)."""
    return _ids.getrandbits(63)


REQUEST_ID: ContextVar[str] = ContextVar("request_id", default="")
REQUEST_T0: ContextVar[float] = ContextVar("request_t0", default=0.0)  # time.monotonic() at arrival


class RequestIdFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = REQUEST_ID.get() or "-"
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, request id, message (and the exception)."""

    def format(self, record: logging.LogRecord) -> str:
        import json

        entry = {
            "ts": self.formatTime(record, "%Y-%m-%dT%H:%M:%S") + f".{int(record.msecs):03d}",
            "level": record.levelname,
            "logger": record.name,
            "request_id": getattr(record, "request_id", "-"),
            "message": record.getMessage(),
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry)


_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


class TextFormatter(logging.Formatter):
    """One line per record: control characters in the message (client input echoed by an error: a newline
    would start a forged line, ESC drive the operator's terminal) are escaped; a traceback keeps its lines."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        record.message = _CONTROL.sub(lambda m: m.group().encode("unicode_escape").decode(), record.message)
        return super().formatMessage(record)


def configure_logging(level: str, fmt: str) -> None:
    """Root logging for the gateway process: ``text`` or ``json``, every record with its request id."""
    handler = logging.StreamHandler()
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(TextFormatter("%(asctime)s %(levelname)s %(name)s [%(request_id)s]: %(message)s"))
    handler.addFilter(RequestIdFilter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
