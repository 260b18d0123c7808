"""The transfer layer's own error type: every backend maps its library errors into these kinds."""

from __future__ import annotations

from enum import StrEnum


class TransferErrorKind(StrEnum):
    """Why a transfer (or a whole room) failed; stable strings that also travel on the wire."""

    PEER_UNREACHABLE = "peer_unreachable"  # could not connect / register with the peer
    PEER_GONE = "peer_gone"  # a working connection broke (peer died, reset, closed)
    RANGE_REJECTED = "range_rejected"  # a write or page list outside registered memory
    TIMEOUT = "timeout"  # a deadline passed (bootstrap, waiting, transfer, heartbeat)
    ABORTED = "aborted"  # one side called abort() or the manager closed
    # malformed or unexpected message, version or shape mismatch, the workers' key refused or not supported (on the
    # control channel or a tcp data port): a configuration error of the pair, not a transient loss of the peer
    PROTOCOL = "protocol"
    BOOTSTRAP = "bootstrap"  # resolving the peer's control address failed

    @classmethod
    def parse(cls, value: str) -> TransferErrorKind:
        """The kind named ``value``; unknown strings (a newer peer) read as PROTOCOL."""
        try:
            return cls(value)
        except ValueError:
            return cls.PROTOCOL


class TransferError(Exception):
    """A failed transfer or room. ``str(e)`` reads ``"<kind>: <message>"``; the message names the
    room and/or peer concerned."""

    def __init__(self, kind: TransferErrorKind, message: str) -> None:
        super().__init__(f"{kind.value}: {message}")
        self.kind = kind
        self.message = message

    def __reduce__(self) -> tuple[type[TransferError], tuple[TransferErrorKind, str]]:
        return (type(self), (self.kind, self.message))


class PeerReport(TransferError):
    """A room's failure as its peer reported it (the prefill's ``RoomStatus``): ``kind`` is the peer's
    judgement, so a peer kind there (``PEER_GONE``, ``TIMEOUT``, ...) names this side, not the peer."""


class RoomAborted(TransferError):
    """A room ended on purpose (either side's ``abort()`` or ``Abort`` message, a release before its end, a
    KV manager closing), not by a transfer failure: metrics count it apart (``num_rooms_aborted``)."""

    def __init__(self, message: str) -> None:
        super().__init__(TransferErrorKind.ABORTED, message)

    def __reduce__(self) -> tuple[type[RoomAborted], tuple[str]]:  # type: ignore[override]
        return (type(self), (self.message,))
