"""The engine-neutral data-plane seam every transfer backend implements.

Lifecycle of a backend (the KV manager drives it; backends never see rooms or pages):
1. Construct it (``create_backend(name, **options)``); it may open listeners (on 127.0.0.1).
2. ``register(regions)`` once, with every memory region it will read from or be written into.
3. ``endpoint()`` -> opaque bytes the peer needs to reach this side; it travels over the control plane.
4. The initiator calls ``connect(peer_endpoint)`` once per peer (may block briefly; pays wire-up).
5. ``write(peer, blocks)`` posts one batch and never blocks; ``poll(handle)`` until DONE or FAILED,
   ``error(handle)`` says why, ``release(handle)`` forgets it (also while still pending).
6. ``disconnect(peer)`` drops one peer (pending writes to it fail); ``close()`` drops everything,
   unregisters the memory and joins the backend's threads. ``close()`` is idempotent.

Every method may be called from any thread. Library errors never escape: they become
``TransferError`` with a ``TransferErrorKind`` at this boundary.

Optional ability: ``NotifiesCompletion`` (a listener called when a write leaves PENDING), so the KV
manager waits for completions instead of polling pending writes. ``WriteTable`` provides it.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from enum import IntEnum
from typing import Any, ClassVar, Protocol, runtime_checkable

from transfer.errors import TransferError, TransferErrorKind

PeerId = int
WriteHandle = int
Block = tuple[int, int, int]  # (local source address, remote destination address, length in bytes)
Region = tuple[int, int]  # (address, length)


class WriteState(IntEnum):
    PENDING = 0
    DONE = 1  # every byte of the batch is in the peer's memory
    FAILED = 2


class TransferBackend(ABC):
    """Moves (src, dst, length) blocks from this process's registered memory into a peer's."""

    name: ClassVar[str] = "abstract"

    @abstractmethod
    def register(self, regions: Sequence[Region]) -> None:
        """Register every region once, before ``endpoint()``. Writes may only target a peer's registered
        regions; a backend that needs it also registers the sources here."""

    @abstractmethod
    def endpoint(self) -> bytes:
        """Opaque bytes a peer passes to ``connect`` to reach this side (host:port, session id, agent
        metadata...). Valid after ``register``."""

    @abstractmethod
    def connect(self, endpoint: bytes) -> PeerId:
        """Open the data path to the peer behind ``endpoint``; may block briefly (pays the wire-up).
        Raises ``TransferError(PEER_UNREACHABLE)`` when the peer cannot be reached."""

    @abstractmethod
    def write(self, peer: PeerId, blocks: Sequence[Block]) -> WriteHandle:
        """Post one batch of writes into the peer's memory; never blocks. Errors show up through
        ``poll`` (FAILED) and ``error``, not as exceptions (except for an unknown peer id)."""

    @abstractmethod
    def poll(self, handle: WriteHandle) -> WriteState:
        """The batch's state; cheap and non-blocking."""

    @abstractmethod
    def error(self, handle: WriteHandle) -> TransferError | None:
        """Why a FAILED batch failed (None otherwise)."""

    @abstractmethod
    def release(self, handle: WriteHandle) -> None:
        """Forget a handle. Releasing a PENDING handle is allowed: the bytes may still land."""

    @abstractmethod
    def probe(self, peer: PeerId) -> bool:
        """Whether the data path to the peer looks alive (cheap; may be optimistic)."""

    @abstractmethod
    def disconnect(self, peer: PeerId) -> None:
        """Drop the peer: its pending writes fail with PEER_GONE; later writes to it fail at once."""

    @abstractmethod
    def close(self) -> None:
        """Drop every peer, unregister memory, join threads. Idempotent."""


@runtime_checkable
class NotifiesCompletion(Protocol):
    """Optional backend ability: it calls ``listener()`` each time a write leaves PENDING (DONE or
    FAILED, also when a disconnect or close fails it), from any of its threads, holding none of its
    locks. The listener must not block for long and must not call back into the backend."""

    def set_completion_listener(self, listener: Callable[[], None] | None) -> None: ...


def unknown_peer(backend: str, peer: PeerId) -> TransferError:
    """The error for a write/poll against a peer id the backend does not (or no longer) know."""
    return TransferError(TransferErrorKind.PEER_GONE, f"{backend}: unknown or disconnected peer {peer}")


class WriteTable:
    """``poll``/``error``/``release`` for backends that keep their writes in ``self._writes``
    (handle -> a record with ``state`` and ``error``) under their own ``self._lock``, and
    ``NotifiesCompletion``: the backend calls ``_settled()`` (without its lock) after a write left PENDING.

    Mix in before ``TransferBackend``; a backend with more to free on release overrides ``release``.
    """

    name: ClassVar[str]
    _lock: threading.Lock
    _writes: dict[WriteHandle, Any]
    _on_settled: Callable[[], None] | None = None

    def set_completion_listener(self, listener: Callable[[], None] | None) -> None:
        self._on_settled = listener

    def _settled(self) -> None:
        listener = self._on_settled
        if listener is not None:
            listener()

    def poll(self, handle: WriteHandle) -> WriteState:
        with self._lock:
            record = self._writes.get(handle)
        if record is None:
            raise KeyError(f"{self.name}: unknown write handle {handle}")
        state: WriteState = record.state
        return state

    def error(self, handle: WriteHandle) -> TransferError | None:
        with self._lock:
            record = self._writes.get(handle)
            return record.error if record is not None else None

    def release(self, handle: WriteHandle) -> None:
        with self._lock:
            self._writes.pop(handle, None)
