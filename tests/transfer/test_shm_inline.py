"""The same-host path's inline copy: a small batch to an idle peer is copied in the writer's own thread
(the scheduler's), so the room is Success when ``send`` returns; when the fence board's gate is held the
batch goes to the peer's thread instead, and a decode that keeps the gate while the writer leaves the
fence gets the peer dropped rather than the writer's thread held.

In-process KV managers on real shared memory (as ``test_shm.test_the_worker_flag_chooses_the_kv_manager_path``).
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from transfer import KVArgs, KVManager, KVPoll, TransferErrorKind, create_backend
from transfer.shm_fences import FenceBoard, _gate_byte, try_lock, unlock
from transfer.shm_peer import ShmPeer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "contracts"))
from kvpeer import FAST, SHAPE, fill, skip_reason

pytestmark = pytest.mark.skipif(bool(skip_reason("shm")), reason=str(skip_reason("shm")))


def _until(predicate: Any, timeout_s: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.002)
    return bool(predicate())


class Pair:
    """A prefill and a decode KV manager over shm in this process, one room at a time."""

    def __init__(self) -> None:
        self.prefill_pool, self.decode_pool = SHAPE.pool(), SHAPE.pool(shared=True)
        fill(self.prefill_pool, seed=9)
        self.prefill = KVManager("prefill", KVArgs.from_pool(self.prefill_pool), create_backend("shm"), timeouts=FAST)
        self.decode = KVManager("decode", KVArgs.from_pool(self.decode_pool), create_backend("shm"), timeouts=FAST)
        self.settled = threading.Event()  # the prefill backend's completion listener was called
        self.room = 0

    def open_room(self, dst_pages: list[int]) -> tuple[Any, Any]:
        """A sender and a receiver with the page list delivered (the sender is WaitingForInput)."""
        self.room += 1
        host, port = self.prefill.control_address
        sender, receiver = self.prefill.create_sender(self.room), self.decode.create_receiver(self.room, host, port)
        assert _until(lambda: receiver.poll() == KVPoll.WaitingForInput), receiver.poll()
        receiver.send_metadata(dst_pages, 1)
        assert _until(lambda: sender.poll() == KVPoll.WaitingForInput), sender.poll()
        return sender, receiver

    def peer(self) -> ShmPeer:
        (peer,) = self.prefill.backend._peers.values()  # type: ignore[attr-defined]
        assert isinstance(peer, ShmPeer)
        return peer

    def decode_board(self) -> FenceBoard:
        board = self.decode.backend.board  # type: ignore[attr-defined]
        assert board is not None
        return board

    def same_pages(self, src: list[int], dst: list[int]) -> bool:
        return all(np.array_equal(self.decode_pool.page_view(b, d), self.prefill_pool.page_view(b, s))
                   for b in range(2 * SHAPE.num_layers) for s, d in zip(src, dst, strict=True))

    def close(self) -> None:
        self.prefill.close()
        self.decode.close()
        self.decode_pool.close()
        self.prefill_pool.close()


@pytest.fixture
def pair() -> Iterator[Pair]:
    made = Pair()
    yield made
    made.close()


def test_a_small_batch_is_copied_before_send_returns(pair: Pair) -> None:
    sender, receiver = pair.open_room([7, 8])
    pair.prefill.backend.set_completion_listener(lambda: pair.settled.set())
    sender.send([1, 2], last=True, aux=b"tok")
    assert sender.poll() == KVPoll.Success, sender.failure()  # no hand-off to a thread and back
    assert pair.same_pages([1, 2], [7, 8]) and bytes(pair.decode_pool.aux[1, :3]) == b"tok"
    assert not pair.settled.is_set()  # settled inside write(): nothing to notify
    assert _until(lambda: receiver.poll() == KVPoll.Success), receiver.failure()
    receiver.release()
    sender.release()
    assert pair.prefill.num_rooms() == pair.decode.num_rooms() == 0


def test_a_batch_goes_to_the_peers_thread_while_the_gate_is_held(pair: Pair) -> None:
    sender, receiver = pair.open_room([9, 10])
    board, slot = pair.decode_board(), pair.peer().slot
    assert try_lock(board.fd, _gate_byte(slot))  # as the decode does while it closes a fence
    try:
        sender.send([3, 4], last=True, aux=b"abc")
        time.sleep(0.05)
        assert sender.poll() == KVPoll.Transferring  # queued: the peer's thread waits for the gate
        assert receiver.poll() == KVPoll.WaitingForInput
    finally:
        unlock(board.fd, _gate_byte(slot))
    assert _until(lambda: receiver.poll() == KVPoll.Success), receiver.failure()
    assert sender.poll() == KVPoll.Success
    assert pair.same_pages([3, 4], [9, 10]) and bytes(pair.decode_pool.aux[1, :3]) == b"abc"
    receiver.release()
    sender.release()


def test_a_gate_held_past_the_copy_drops_the_peer(pair: Pair, monkeypatch: pytest.MonkeyPatch) -> None:
    """The decode frozen inside our gate after we entered the fence: the writer's thread (the scheduler's)
    must not wait for it; the peer is dropped (PEER_GONE) and the room fails on both sides."""
    sender, receiver = pair.open_room([11])
    peer = pair.peer()
    assert peer.board is not None
    monkeypatch.setattr(peer.board, "leave", lambda slot, give_up: False)  # (the gate never came back)
    sender.send([5], last=True, aux=b"x")
    assert sender.poll() == KVPoll.Failed
    failure = sender.failure()
    assert failure is not None and failure.kind == TransferErrorKind.PEER_GONE and "fence gate" in str(failure)
    assert _until(lambda: receiver.poll() == KVPoll.Failed), receiver.poll()
    assert _until(lambda: peer.thread is not None and not peer.thread.is_alive())  # it ended and unmapped
    assert not peer.maps
    receiver.release()
    sender.release()


def test_aux_of_any_byte_buffer_lands_whole_in_its_room_s_slot(pair: Pair) -> None:
    """The aux record is staged by address (each staging slot's, computed once) from bytes, a bytearray or a
    memoryview, up to a whole slot: the decode's aux slot holds exactly the bytes sent, room after room."""
    rooms = pair.prefill._prefill.rooms  # type: ignore[union-attr]
    assert rooms._slot_addrs == [int(rooms.staging[slot].ctypes.data) for slot in range(len(rooms.staging))]
    slot_bytes = pair.prefill.args.aux_slot_bytes
    payloads = [b"abc", bytearray(b"\x00\xff" * 5), memoryview(bytes(range(slot_bytes))), bytes([7]) * slot_bytes]
    for payload in payloads:
        sender, receiver = pair.open_room([4, 5])
        sender.send([1, 2], last=True, aux=payload)
        assert _until(lambda: receiver.poll() == KVPoll.Success), receiver.failure()  # noqa: B023
        assert receiver.aux_len == len(payload)
        assert bytes(pair.decode_pool.aux[1, : len(payload)]) == bytes(payload)
        sender.release()
        receiver.release()
