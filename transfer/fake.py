"""A backend that moves no bytes and succeeds at everything: for unit tests of the control plane only."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Sequence

from transfer.base import (
    UNFENCED,
    Block,
    Fence,
    PeerId,
    Region,
    TransferBackend,
    WriteHandle,
    WriteState,
    unknown_peer,
)
from transfer.errors import TransferError


class FakeBackend(TransferBackend):
    name = "fake"
    MOVES_BYTES = False

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._peers: set[PeerId] = set()
        self._writes: dict[WriteHandle, WriteState] = {}
        self._errors: dict[WriteHandle, TransferError] = {}
        self.regions: list[Region] = []
        self.blocks_written = 0
        self.bytes_written = 0

    def register(self, regions: Sequence[Region]) -> None:
        self.regions = list(regions)

    def endpoint(self) -> bytes:
        return b"fake"

    def connect(self, endpoint: bytes) -> PeerId:
        with self._lock:
            peer = next(self._ids)
            self._peers.add(peer)
            return peer

    def write(self, peer: PeerId, blocks: Sequence[Block], fence: Fence = UNFENCED) -> WriteHandle:
        with self._lock:
            handle = next(self._ids)
            if peer in self._peers:
                self._writes[handle] = WriteState.DONE
                self.blocks_written += len(blocks)
                self.bytes_written += sum(length for _, _, length in blocks)
            else:
                self._writes[handle] = WriteState.FAILED
                self._errors[handle] = unknown_peer("fake", peer)
            return handle

    def poll(self, handle: WriteHandle) -> WriteState:
        with self._lock:
            return self._writes[handle]

    def error(self, handle: WriteHandle) -> TransferError | None:
        with self._lock:
            return self._errors.get(handle)

    def release(self, handle: WriteHandle) -> None:
        with self._lock:
            self._writes.pop(handle, None)
            self._errors.pop(handle, None)

    def probe(self, peer: PeerId) -> bool:
        with self._lock:
            return peer in self._peers

    def disconnect(self, peer: PeerId) -> None:
        with self._lock:
            self._peers.discard(peer)

    def close(self) -> None:
        with self._lock:
            self._peers.clear()
