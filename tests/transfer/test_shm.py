"""The same-host path (transfer.shm): chosen only on proof, falls back to the network, can be forced off;
its fence board keeps a closed fence's bytes out; shared files of dead owners are swept.

Real processes where the property is about two processes (a decode child maps nothing of ours; a
prefill killed mid-fence); the contract suite (tests/contracts, backend "shm") covers data and failures.
"""

from __future__ import annotations

import base64
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import msgspec
import numpy as np
import pytest

from transfer import Fence, KVArgs, KVManager, KVPoll, WriteState, create_backend
from transfer.shm import ShmBackend, _Endpoint
from transfer.shm_fences import FenceBoard
from transfer.shm_files import SharedFile, mapping_of, sweep_stale
from transfer.shm_peer import Offer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "contracts"))
from kvpeer import FAST, SHAPE, PeerProcess, fill, pattern, skip_reason

pytestmark = pytest.mark.skipif(bool(skip_reason("shm")), reason=str(skip_reason("shm")))


def _wait(backend, handle, timeout_s=20.0):
    deadline = time.monotonic() + timeout_s
    while (state := backend.poll(handle)) == WriteState.PENDING and time.monotonic() < deadline:
        time.sleep(0.001)
    return state


@pytest.fixture
def shm_backends():
    made = []

    def make(**kwargs):
        backend = create_backend("shm", **kwargs)
        made.append(backend)
        return backend

    yield make
    for backend in made:
        backend.close()


def _connect_and_write(backend, peer, endpoint: bytes) -> tuple[int, np.ndarray]:
    """Connect to the decode child, write page 3 of every buffer into its page 5, check the bytes."""
    pool = SHAPE.pool()
    fill(pool, seed=31)
    backend.register(KVArgs.from_pool(pool).regions())
    peer_id = backend.connect(endpoint)
    blocks = [(s + 3 * pool.page_bytes, d + 5 * pool.page_bytes, pool.page_bytes)
              for s, d in zip(pool.kv_ptrs(), peer.info["kv_ptrs"], strict=True)]
    assert peer.call("open_fence", room=1, generation=1)  # the decode's manager fences: admit this write
    handle = backend.write(peer_id, blocks, Fence(1, 1))
    assert _wait(backend, handle) == WriteState.DONE, backend.error(handle)
    kv = peer.read_memory()[0]
    for b in range(2 * SHAPE.num_layers):
        assert np.array_equal(kv[b, 5], pattern(31, b, 3, pool.page_bytes))
    return peer_id, kv


def test_a_decode_in_shared_memory_is_written_through_it(shm_backends):
    decode = PeerProcess("decode", "shm", SHAPE, FAST)  # its pool lives in /dev/shm (SHARED_POOL)
    try:
        endpoint = base64.b64decode(decode.info["endpoint"])
        offer = msgspec.msgpack.decode(endpoint, type=_Endpoint).offer
        assert offer is not None and offer.board.startswith("/dev/shm/")
        backend = shm_backends()
        peer_id, _ = _connect_and_write(backend, decode, endpoint)
        assert backend.path_of(peer_id) == "shm"
    finally:
        decode.close()


def test_no_proof_no_shared_memory(shm_backends):
    """An offer whose nonce the files do not hold (another machine's /dev/shm, a stale or forged path)
    is not used: the network backend carries the writes."""
    decode = PeerProcess("decode", "shm", SHAPE, FAST)
    try:
        remote = msgspec.msgpack.decode(base64.b64decode(decode.info["endpoint"]), type=_Endpoint)
        assert remote.offer is not None
        forged = Offer(remote.offer.board, os.urandom(len(remote.offer.nonce)), remote.offer.files,
                        remote.offer.regions)
        endpoint = msgspec.msgpack.encode(_Endpoint(remote.network, remote.net, forged))
        backend = shm_backends()
        peer_id, _ = _connect_and_write(backend, decode, endpoint)
        assert backend.path_of(peer_id) == "tcp"
    finally:
        decode.close()


def test_private_memory_is_not_offered_and_falls_back(shm_backends):
    """A decode whose pool is private memory offers nothing; the prefill uses the network."""
    decode_backend = shm_backends()
    pool = SHAPE.pool()  # private
    decode_backend.register(KVArgs.from_pool(pool).regions())
    assert msgspec.msgpack.decode(decode_backend.endpoint(), type=_Endpoint).offer is None


@pytest.mark.parametrize("side", ["prefill", "decode"])
def test_same_host_can_be_forced_off(side, shm_backends):
    decode = PeerProcess("decode", "shm", SHAPE, FAST)
    try:
        endpoint = base64.b64decode(decode.info["endpoint"])
        if side == "decode":  # a decode with same_host off offers nothing
            local = shm_backends(same_host="off")
            shared = SHAPE.pool(shared=True)
            try:
                local.register(KVArgs.from_pool(shared).regions())
                assert msgspec.msgpack.decode(local.endpoint(), type=_Endpoint).offer is None
            finally:
                shared.close()
            return
        backend = shm_backends(same_host="off")
        peer_id, _ = _connect_and_write(backend, decode, endpoint)
        assert backend.path_of(peer_id) == "tcp"
    finally:
        decode.close()


def test_bad_same_host_value_is_refused():
    with pytest.raises(ValueError, match="same_host"):
        ShmBackend(same_host="sometimes")


def test_the_worker_flag_chooses_the_kv_manager_path():
    """KVManager end to end in one process: a shared decode pool is written through shared memory."""
    prefill_pool, decode_pool = SHAPE.pool(), SHAPE.pool(shared=True)
    fill(prefill_pool, seed=5)
    prefill = KVManager("prefill", KVArgs.from_pool(prefill_pool), create_backend("shm"))
    decode = KVManager("decode", KVArgs.from_pool(decode_pool), create_backend("shm"))
    try:
        host, port = prefill.control_address
        sender, receiver = prefill.create_sender(1), decode.create_receiver(1, host, port)
        deadline = time.monotonic() + 20
        while receiver.poll() == KVPoll.Bootstrapping and time.monotonic() < deadline:
            time.sleep(0.002)
        receiver.send_metadata([7, 8], 1)
        while sender.poll() == KVPoll.Bootstrapping and time.monotonic() < deadline:
            time.sleep(0.002)
        sender.send([1, 2], last=True, aux=b"tok")
        while receiver.poll() not in (KVPoll.Success, KVPoll.Failed) and time.monotonic() < deadline:
            time.sleep(0.002)
        assert receiver.poll() == KVPoll.Success, receiver.failure()
        assert prefill.backend.path_of(1) == "shm"  # type: ignore[attr-defined]
        assert bytes(decode_pool.aux[1, :3]) == b"tok"
        for b in range(2 * SHAPE.num_layers):
            assert np.array_equal(decode_pool.page_view(b, 7), prefill_pool.page_view(b, 1))
        receiver.release()
        sender.release()
    finally:
        prefill.close()
        decode.close()
        decode_pool.close()


# -- fence board -------------------------------------------------------------------------------------
def test_fence_board_admits_only_open_fences():
    board = FenceBoard.create()
    writer = FenceBoard.attach(board.path, board.nonce)
    try:
        board.set_fencing(True)
        slot = writer.claim()
        never = lambda: False  # noqa: E731
        assert writer.enter(slot, 4, 9, never) is False, "never opened"
        board.open_fence(4, 9)
        assert writer.enter(slot, 4, 8, never) is False, "another generation"
        assert writer.enter(slot, 4, 9, never) is True
        assert board.close_fence(4, 9) == [slot], "the writer is inside: the decode must wait"
        writer.leave(slot, never)
        assert board.writers_of(4, 9) == []
        assert writer.enter(slot, 4, 9, never) is False, "closed"
        board.open_fence(5, 9 + (1 << 16))  # takes over the same table slot
        assert board.close_fence(4, 9) == [], "an old generation closes nothing of the new"
        assert writer.enter(slot, 5, 9 + (1 << 16), never) is True
        writer.leave(slot, never)
    finally:
        writer.close()
        board.close()
    assert not os.path.exists(board.path)


def test_wrong_nonce_is_refused():
    board = FenceBoard.create()
    try:
        with pytest.raises(ValueError, match="nonce"):
            FenceBoard.attach(board.path, b"x" * 16)
    finally:
        board.close()


def test_a_dead_writers_mark_does_not_hold_the_fence():
    """A prefill killed inside a fence leaves its mark; the decode sees its slot unlocked and goes on."""
    board = FenceBoard.create()
    board.set_fencing(True)
    board.open_fence(1, 1)
    code = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(Path(__file__).resolve().parents[2])!r})
        from transfer.shm_fences import FenceBoard
        w = FenceBoard.attach({board.path!r}, bytes.fromhex({board.nonce.hex()!r}))
        slot = w.claim()
        assert w.enter(slot, 1, 1, lambda: False)
        print(slot, flush=True)
        time.sleep(60)
    """)
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        slot = int(child.stdout.readline())  # type: ignore[union-attr]
        assert board.close_fence(1, 1) == [slot]  # alive and inside
        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=10)
        assert board.writers_of(1, 1) == []
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        board.close()


# -- shared files ------------------------------------------------------------------------------------
def test_shared_files_of_dead_owners_are_swept(tmp_path):
    prefix = "pd-kv-test-"
    live = SharedFile.create(prefix, 4096, str(tmp_path))
    code = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(Path(__file__).resolve().parents[2])!r})
        from transfer.shm_files import SharedFile
        print(SharedFile.create({prefix!r}, 4096, {str(tmp_path)!r}).path, flush=True)
    """)
    dead = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert os.path.exists(dead) and os.path.exists(live.path)
    assert sweep_stale(str(tmp_path), prefix) == 1
    assert not os.path.exists(dead) and os.path.exists(live.path)
    view = np.frombuffer(live.mm, np.uint8)
    found = mapping_of(int(view.ctypes.data) + 100)
    assert found is not None and found.path == live.path and found.file_offset(int(view.ctypes.data)) == 0
    assert mapping_of(int(np.zeros(10).ctypes.data)) is None  # private memory
    del view
    live.close()
    assert not os.path.exists(live.path)


def test_a_file_being_created_is_not_swept_by_a_concurrent_sweeper(tmp_path, monkeypatch):
    """Another worker starting at the same moment sweeps between our ``open`` and our ``flock``."""
    import fcntl

    from transfer import shm_files

    prefix = "pd-kv-test-"
    real_flock = fcntl.flock
    swept: list[int] = []

    def sweep_first(fd: int, op: int) -> None:
        if op == fcntl.LOCK_SH and not swept:
            swept.append(sweep_stale(str(tmp_path), prefix))  # the other worker's sweep, just before our lock
        real_flock(fd, op)

    monkeypatch.setattr(shm_files.fcntl, "flock", sweep_first)
    made = SharedFile.create(prefix, 4096, str(tmp_path))
    monkeypatch.setattr(shm_files.fcntl, "flock", real_flock)
    try:
        assert swept == [0] and os.path.exists(made.path) and os.path.basename(made.path).startswith(prefix)
        assert os.listdir(tmp_path) == [os.path.basename(made.path)]
        assert sweep_stale(str(tmp_path), prefix) == 0  # its owner lives
    finally:
        made.close()
