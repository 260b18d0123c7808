"""A batch too large to copy inline (the peer's sender thread, ``copy_blocks``) into a decode that died must
not end DONE: DONE says every byte is in the decode's memory, and the room would be Success at the prefill
(``RoomStatus(ok)`` to nobody) when the copy beats the control connection's news of the decode's end. The
small batch's path (``copy_inline``) already checks that the board's owner lives; the thread's must too.

A real decode process (its pool in /dev/shm), killed with SIGKILL; the prefill's shm backend in this process."""

from __future__ import annotations

import base64
import signal
import sys
import time
from pathlib import Path

import pytest

from transfer import Fence, KVArgs, TransferErrorKind, WriteState, create_backend
from transfer.shm_peer import INLINE_MAX_BYTES

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "contracts"))
from kvpeer import FAST, PeerProcess, Shape, fill, skip_reason

pytestmark = pytest.mark.skipif(bool(skip_reason("shm")), reason=str(skip_reason("shm")))

BIG = Shape(num_layers=1, num_pages=16, page_size=64, num_kv_heads=8, head_dim=128)  # 256 KiB pages


def _wait(backend, handle, timeout_s=20.0):
    deadline = time.monotonic() + timeout_s
    while (state := backend.poll(handle)) == WriteState.PENDING and time.monotonic() < deadline:
        time.sleep(0.001)
    return state


def test_a_thread_copied_batch_into_a_dead_decode_fails() -> None:
    decode = PeerProcess("decode", "shm", BIG, FAST)
    backend = create_backend("shm")
    pool = BIG.pool()
    try:
        fill(pool, seed=3)
        backend.register(KVArgs.from_pool(pool).regions())
        peer_id = backend.connect(base64.b64decode(decode.info["endpoint"]))
        assert backend.path_of(peer_id) == "shm"  # type: ignore[attr-defined]
        assert decode.call("open_fence", room=1, generation=1)
        blocks = [(s + p * pool.page_bytes, d + p * pool.page_bytes, pool.page_bytes)
                  for s, d in zip(pool.kv_ptrs(), decode.info["kv_ptrs"], strict=True) for p in range(8)]
        assert sum(length for _, _, length in blocks) > INLINE_MAX_BYTES  # the sender thread's path
        handle = backend.write(peer_id, blocks, Fence(1, 1))
        assert _wait(backend, handle) == WriteState.DONE, backend.error(handle)  # (alive: it lands)

        decode.signal(signal.SIGKILL)
        decode.proc.wait(timeout=30)
        handle = backend.write(peer_id, blocks, Fence(1, 1))
        assert _wait(backend, handle) == WriteState.FAILED, "a batch into a dead decode's memory ended DONE"
        error = backend.error(handle)
        assert error is not None and error.kind == TransferErrorKind.PEER_GONE, error
        assert not backend.probe(peer_id)  # the peer is dropped (its mapping of the dead pool let go)
    finally:
        backend.close()
        decode.kill()
        pool.close()
