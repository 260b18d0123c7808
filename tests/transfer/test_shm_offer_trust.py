"""Whom a prefill's same-host path trusts: the offer in a decode's ``Register`` names files by path, and the
prefill maps them read-write and copies KV into them. Anyone who reaches the prefill's control port may
send one (tests/transfer/test_transfer_hostile.py), so the proof must be one only the prefill's own user can
give: the fence board and pool files must be its own user's, not open to others (mode 0600, as a decode
makes them), and each region must lie inside its file's mapping.

Before, another local user could write a board of their own (world-writable, in ``/dev/shm``) holding
16 bytes known to sit at some offset of a file of the prefill's user (any file with public contents),
offer that file as the "pool", and the prefill wrote KV bytes over it; a region with a negative file offset
pointed the copy outside the mapping (into the prefill's own heap).
"""

from __future__ import annotations

import os

import msgspec
import numpy as np
import pytest

from transfer import Fence, WriteState
from transfer.fake import FakeBackend
from transfer.shm import ShmBackend, _Endpoint
from transfer.shm_fences import BOARD_BYTES, MAGIC, FenceBoard
from transfer.shm_peer import Offer

pytestmark = pytest.mark.timeout(60)

KNOWN = b"known 16 bytes!!"  # bytes of the victim file anyone can know (public contents)
KNOWN_AT = 8192


def _forged_board(path: str, nonce: bytes, *, uid: int | None, mode: int) -> None:
    """A fence board as another user would write it: magic + the nonce, fencing off."""
    words = np.zeros(BOARD_BYTES // 8, np.uint64)
    words[0] = MAGIC
    words[1:3] = np.frombuffer(nonce, np.uint64)
    with open(path, "wb") as f:
        f.write(words.tobytes())
    os.chmod(path, mode)
    if uid is not None:
        os.chown(path, uid, uid)


def _victim(path: str) -> bytes:
    content = b"#" * KNOWN_AT + KNOWN + b"#" * 4096
    with open(path, "wb") as f:
        f.write(content)
    os.chmod(path, 0o600)  # the prefill's user's own, private file
    return content


def _prefill() -> tuple[ShmBackend, np.ndarray]:
    backend = ShmBackend(FakeBackend())
    src = np.full(4096, ord("X"), np.uint8)
    backend.register([(int(src.ctypes.data), src.nbytes)])
    return backend, src


def _write(backend: ShmBackend, peer: int, src: np.ndarray, dst: int) -> WriteState:
    handle = backend.write(peer, [(int(src.ctypes.data), dst, 4096)], Fence(1, 1))
    for _ in range(2000):
        if (state := backend.poll(handle)) != WriteState.PENDING:
            return state
        os.sched_yield()
    return backend.poll(handle)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to make a file owned by another user")
def test_another_users_board_cannot_make_the_prefill_write_its_files(tmp_path):
    board, victim = str(tmp_path / "pd-kv-fences-evil"), str(tmp_path / "victim.conf")
    _forged_board(board, KNOWN, uid=65534, mode=0o666)  # another user's, open to anyone
    content = _victim(victim)
    offer = Offer(board, KNOWN, [(victim, KNOWN_AT)], [(0x10000, 4096, 0, 0)])
    backend, src = _prefill()
    try:
        peer = backend.connect(msgspec.msgpack.encode(_Endpoint("fake", b"fake", offer)))
        assert backend.path_of(peer) == "fake", "another user's offer was trusted"
        _write(backend, peer, src, 0x10000)
    finally:
        backend.close()
    with open(victim, "rb") as f:
        assert f.read() == content, "the prefill wrote KV bytes over its own user's file"


def test_a_board_open_to_other_users_is_not_trusted(tmp_path):
    """Our own user's board, but world-writable: anyone could have written the nonce (or open fences)."""
    board, victim = str(tmp_path / "pd-kv-fences-open"), str(tmp_path / "victim.conf")
    _forged_board(board, KNOWN, uid=None, mode=0o666)
    content = _victim(victim)
    offer = Offer(board, KNOWN, [(victim, KNOWN_AT)], [(0x10000, 4096, 0, 0)])
    backend, src = _prefill()
    try:
        peer = backend.connect(msgspec.msgpack.encode(_Endpoint("fake", b"fake", offer)))
        assert backend.path_of(peer) == "fake"
        _write(backend, peer, src, 0x10000)
    finally:
        backend.close()
    with open(victim, "rb") as f:
        assert f.read() == content


def test_a_region_outside_its_file_is_refused(tmp_path):
    """A real board and pool file, but a region at a negative file offset: the copy would land before the
    mapping, in the prefill's own memory. The offer is refused; the network path serves."""
    board = FenceBoard.create(str(tmp_path))
    pool = str(tmp_path / "pd-kv-pool-x")
    fd = os.open(pool, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, 1 << 20)
        os.pwrite(fd, board.nonce, 1 << 20)
    finally:
        os.close(fd)
    backend, src = _prefill()
    try:
        for region in [(0x10000, 4096, 0, -(1 << 30)), (0x10000, -4096, 0, 8192), (0x10000, 4096, 0, (1 << 20) - 4095)]:
            offer = Offer(board.path, board.nonce, [(pool, 1 << 20)], [region])
            peer = backend.connect(msgspec.msgpack.encode(_Endpoint("fake", b"fake", offer)))
            assert backend.path_of(peer) == "fake", f"region {region} accepted"
        good = Offer(board.path, board.nonce, [(pool, 1 << 20)], [(0x10000, 4096, 0, 8192)])
        peer = backend.connect(msgspec.msgpack.encode(_Endpoint("fake", b"fake", good)))
        assert backend.path_of(peer) == "shm"  # (the decode's own board: trusted)
        assert _write(backend, peer, src, 0x10000) == WriteState.DONE
    finally:
        backend.close()
        board.close()
    with open(pool, "rb") as f:
        f.seek(8192)
        assert f.read(4096) == b"X" * 4096
