"""Client-side errors: everything the registrar, resolver and embedded server raise."""

from __future__ import annotations


class BootstrapError(Exception):
    """A bootstrap registry call failed; ``status_code`` is the HTTP status when there was a reply."""

    def __init__(self, message: str, *, status_code: int | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.code = code  # the registry's error code, when it sent one (``not_registered``, ``not_ready``...)


class BootstrapNotReady(BootstrapError):
    """The registry answered 503: the prefill instance is not (or no longer) fully registered."""


class BootstrapUnreachable(BootstrapError):
    """No reply: connection refused, timeout, or the connection broke."""
