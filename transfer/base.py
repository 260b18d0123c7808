"""The engine-neutral data-plane seam every transfer backend implements.

Lifecycle of a backend (the KV manager drives it; backends never see rooms or pages):
1. Construct it (``create_backend(name, **options)``); it may open listeners (on 127.0.0.1).
2. ``register(regions)`` once, with every memory region it will read from or be written into.
3. ``endpoint()`` -> opaque bytes the peer needs to reach this side; it travels over the control plane.
4. The initiator calls ``connect(peer_endpoint)`` once per peer (may block briefly; pays wire-up).
5. ``write(peer, blocks, fence)`` posts one batch and never blocks; ``poll(handle)`` until DONE or
   FAILED, ``error(handle)`` says why, ``release(handle)`` forgets it (also while still pending). The
   ``Fence`` names the room incarnation the bytes belong to; a backend checks ``fence.live()`` right
   before bytes go on the wire and fails the write (ABORTED) once the room is dead on the writer's side.
6. ``disconnect(peer)`` drops one peer (pending writes to it fail); ``close()`` drops everything,
   unregisters the memory and joins the backend's threads. ``close()`` is idempotent.

Every method may be called from any thread. Library errors never escape: they become
``TransferError`` with a ``TransferErrorKind`` at this boundary.

Optional abilities: ``NotifiesCompletion`` (a listener called when a write leaves PENDING), so the KV
manager waits for completions instead of polling pending writes (``WriteTable`` provides it); and, on
the receiving side, ``FencesWrites``: the backend admits only writes whose fence the decode opened, so a
room the decode gave up on can take no late byte (the decode then frees its pages without waiting for
the prefill to confirm); ``ProvesKey``: its own data connections prove the workers' key.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, runtime_checkable

from transfer.errors import TransferError, TransferErrorKind

if TYPE_CHECKING:
    from transfer.auth import KVKeys

PeerId = int
WriteHandle = int
Block = tuple[int, int, int]  # (local source address, remote destination address, length in bytes)
Region = tuple[int, int]  # (address, length)


def _always_live() -> bool:
    return True


@dataclass(frozen=True, slots=True)
class Fence:
    """The room incarnation a write belongs to: the decode's room id and the generation the decode gave
    this room's page list (unique per decode manager, so a reused room id is another incarnation).
    ``live()`` is the writer's own view: False once the room failed on its side."""

    room: int
    generation: int
    live: Callable[[], bool] = _always_live


UNFENCED = Fence(0, 0)  # a write outside any room (a backend's warm-up, tests of the bare seam)


class WriteState(IntEnum):
    PENDING = 0
    DONE = 1  # every byte of the batch is in the peer's memory
    FAILED = 2


class TransferBackend(ABC):
    """Moves (src, dst, length) blocks from this process's registered memory into a peer's."""

    name: ClassVar[str] = "abstract"
    # False for a backend that moves no bytes (``fake``): the contract suite's data tests skip it.
    MOVES_BYTES: ClassVar[bool] = True

    @classmethod
    def unavailable_reason(cls) -> str | None:
        """Why this backend cannot run on this machine (a missing library, a network namespace it needs),
        or None. The contract suite skips a backend with its reason; override where it applies."""
        return None

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
    def write(self, peer: PeerId, blocks: Sequence[Block], fence: Fence = UNFENCED) -> WriteHandle:
        """Post one batch of writes into the peer's memory; never blocks. Errors show up through
        ``poll`` (FAILED) and ``error``, not as exceptions (except for an unknown peer id). Check
        ``fence.live()`` before bytes of the batch go out (before each sub-batch, if it is split) and
        fail the write with ``fenced(...)`` when it is False; carry ``fence`` to the peer if the peer
        ``FencesWrites``."""

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
    locks. The listener must not block for long and must not call back into the backend. A write that
    is no longer PENDING when ``write`` returns (a backend that completed it inline) is not notified:
    the caller polls it."""

    def set_completion_listener(self, listener: Callable[[], None] | None) -> None: ...


@runtime_checkable
class FencesWrites(Protocol):
    """Optional receiving-side ability: the backend refuses every incoming write whose fence is not
    open, and knows whether a write of a fence is being received at this moment. The decode opens a
    room's fence before it sends the page list and closes it when the room ends; a closed fence takes
    no byte any more once ``close_fence`` returned True or the listener was called for it. A backend
    whose ``cut`` cannot stop a silent (frozen) writer says so with ``CUTS_SILENT_WRITERS = False``."""

    def set_fence_listener(self, listener: Callable[[int, int], None] | None) -> None:
        """``listener(room, generation)``: a fence closed while one of its writes was being received is
        quiet now (no byte of it can land any more). Called from a backend thread holding no lock."""
        ...

    def open_fence(self, room: int, generation: int) -> None:
        """Admit writes of this room incarnation from now on (before its page list leaves)."""
        ...

    def close_fence(self, room: int, generation: int, *, cut: bool) -> bool:
        """Refuse this fence's writes from now on. True: none can land any more. False: a write of it
        is being received right now; the listener is called once it is out (``cut``: shut that
        connection down rather than let the write finish, because its writer is silent)."""
        ...


@runtime_checkable
class ProvesKey(Protocol):
    """Optional ability: the backend's own data connections prove the workers' key (``transfer.auth``): one
    opened to it that does not is closed before a byte of it is written anywhere. The KV manager calls
    ``set_kv_keys`` once, before ``register`` (a backend whose engine does its own connections, Mooncake's,
    NIXL's, cannot have it)."""

    def set_kv_keys(self, keys: KVKeys | None) -> None: ...


def fenced(backend: str, fence: Fence) -> TransferError:
    """The error of a write refused because its room is dead (writer's view) or its fence closed."""
    return TransferError(
        TransferErrorKind.ABORTED, f"{backend}: room {fence.room} (generation {fence.generation}) is fenced off"
    )


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
