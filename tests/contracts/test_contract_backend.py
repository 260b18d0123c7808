"""Contract of the ``TransferBackend`` seam itself, for every backend (fake where meaningful).

Writes from this process into a peer process's registered memory, a write outside the peer's registered
ranges rejected (and the connection still usable afterwards), unreachable endpoints, unknown peers,
disconnect, idempotent close. Plus the prefill's own validation of what a decode sends it.
"""

from __future__ import annotations

import base64
import ctypes
import socket
import threading
import time

import numpy as np
import pytest
from kvpeer import ALL_BACKENDS, BACKENDS, SHAPE, fill, pattern, skip_reason

from transfer import (
    Fence,
    KVArgs,
    NotifiesCompletion,
    RegionSet,
    TransferError,
    TransferErrorKind,
    WriteState,
    create_backend,
)
from transfer.messages import (
    PROTOCOL_VERSION,
    FrameReader,
    Register,
    RegisterAck,
    RoomRequest,
    RoomStatus,
    encode_frame,
)


def _wait(backend, handle, timeout_s=30.0):
    deadline = time.monotonic() + timeout_s
    while (state := backend.poll(handle)) == WriteState.PENDING and time.monotonic() < deadline:
        time.sleep(0.001)
    return state


@pytest.fixture
def local_backend():
    made = []

    def make(name):
        backend = create_backend(name)
        made.append(backend)
        return backend

    yield make
    for backend in made:
        backend.close()


def _fence(peer, room=1, generation=1):
    """A fence the decode peer admits (it is a KV manager's backend: with fencing on, it refuses every
    write outside a room it opened)."""
    peer.call("open_fence", room=room, generation=generation)
    return Fence(room, generation)


def test_writes_land_and_bad_ranges_are_rejected(backend_name, spawn_peer, local_backend):
    peer = spawn_peer("decode", backend_name)  # its manager registered its pool with its backend
    fence = _fence(peer)
    pool = SHAPE.pool()
    fill(pool, seed=21)
    backend = local_backend(backend_name)
    backend.register(KVArgs.from_pool(pool).regions())
    peer_id = backend.connect(base64.b64decode(peer.info["endpoint"]))
    assert backend.probe(peer_id)
    page_bytes = pool.page_bytes
    src = pool.kv_ptrs()
    dst = peer.info["kv_ptrs"]
    regions = RegionSet([tuple(r) for r in peer.info["regions"]])
    bad_dst = dst[0] + SHAPE.num_pages * page_bytes  # just past buffer 0 of the peer...
    if regions.contains(bad_dst, page_bytes):  # ...unless the allocator put another buffer right there
        bad_dst = dst[0] - page_bytes
    assert not regions.contains(bad_dst, page_bytes)
    bad = backend.write(peer_id, [(src[0], bad_dst, page_bytes)], fence)
    assert _wait(backend, bad) == WriteState.FAILED
    error = backend.error(bad)
    assert error is not None and error.kind == TransferErrorKind.RANGE_REJECTED, error
    backend.release(bad)
    straddling = backend.write(peer_id, [(src[1], dst[1] + page_bytes, page_bytes),
                                         (src[1], dst[1] + (SHAPE.num_pages - 1) * page_bytes, 2 * page_bytes)],
                               fence)
    assert _wait(backend, straddling) == WriteState.FAILED
    assert backend.error(straddling).kind == TransferErrorKind.RANGE_REJECTED
    backend.release(straddling)
    # the connection stays usable: a good batch (page 3 of every buffer -> page 8) lands
    blocks = [(s + 3 * page_bytes, d + 8 * page_bytes, page_bytes) for s, d in zip(src, dst, strict=True)]
    good = backend.write(peer_id, blocks, fence)
    assert _wait(backend, good) == WriteState.DONE, backend.error(good)
    assert backend.error(good) is None
    backend.release(good)
    kv = peer.read_memory()[0].copy()
    for b in range(2 * SHAPE.num_layers):
        assert np.array_equal(kv[b, 8], pattern(21, b, 3, page_bytes))
    kv[:, 8] = 0
    assert not kv.any()  # nothing else was written, not even by the rejected batches
    backend.disconnect(peer_id)
    after = backend.write(peer_id, [(src[0], dst[0], 8)])
    assert backend.poll(after) == WriteState.FAILED and backend.error(after).kind == TransferErrorKind.PEER_GONE
    backend.close()
    backend.close()  # idempotent


def test_two_connections_to_one_peer_end_independently(backend_name, spawn_peer, local_backend):
    """A reconnect to a peer while the old connection is still ending (a prefill that was frozen, then
    reconnected to the same decode): ending the old one must not break the new one's writes (NIXL
    shares one remote agent's metadata between them)."""
    peer = spawn_peer("decode", backend_name)
    fence = _fence(peer)
    pool = SHAPE.pool()
    fill(pool, seed=5)
    backend = local_backend(backend_name)
    backend.register(KVArgs.from_pool(pool).regions())
    endpoint = base64.b64decode(peer.info["endpoint"])
    old = backend.connect(endpoint)
    new = backend.connect(endpoint)
    backend.disconnect(old)
    time.sleep(0.2)  # (the old connection's thread ends in the background)
    page_bytes = pool.page_bytes
    src, dst = pool.kv_ptrs(), peer.info["kv_ptrs"]
    handle = backend.write(new, [(s + 2 * page_bytes, d + 5 * page_bytes, page_bytes)
                                 for s, d in zip(src, dst, strict=True)], fence)
    assert _wait(backend, handle) == WriteState.DONE, backend.error(handle)
    backend.release(handle)
    kv = peer.read_memory()[0]
    for b in range(2 * SHAPE.num_layers):
        assert np.array_equal(kv[b, 5], pattern(5, b, 2, page_bytes))
    backend.disconnect(new)


def test_completion_listener_fires_when_a_write_settles(backend_name, spawn_peer, local_backend):
    """A backend that notifies completions calls its listener after every write left PENDING (DONE or
    FAILED): the KV manager then sleeps until told instead of polling pending writes."""
    backend = local_backend(backend_name)
    if not isinstance(backend, NotifiesCompletion):
        pytest.skip(f"{backend_name} does not notify completions (the KV manager polls it)")
    peer = spawn_peer("decode", backend_name)
    fence = _fence(peer)
    pool = SHAPE.pool()
    backend.register(KVArgs.from_pool(pool).regions())
    peer_id = backend.connect(base64.b64decode(peer.info["endpoint"]))
    fired = threading.Event()
    backend.set_completion_listener(fired.set)
    src, dst, page_bytes = pool.kv_ptrs(), peer.info["kv_ptrs"], pool.page_bytes

    def settles(handle: int) -> WriteState:
        """Wait on the listener alone (re-check only when it fired)."""
        deadline = time.monotonic() + 30
        while True:
            fired.clear()
            if (state := backend.poll(handle)) != WriteState.PENDING:
                return state
            if not fired.wait(max(0.0, deadline - time.monotonic())):
                return WriteState.PENDING  # settled without a call, or never: both break the contract

    good = backend.write(peer_id, [(s, d + 2 * page_bytes, page_bytes) for s, d in zip(src, dst, strict=True)],
                         fence)
    assert settles(good) == WriteState.DONE, backend.error(good)
    regions = RegionSet([tuple(r) for r in peer.info["regions"]])
    bad_dst = next(a for a in (dst[0] + SHAPE.num_pages * page_bytes, dst[0] - page_bytes, 1 << 40)
                   if not regions.contains(a, page_bytes))
    bad = backend.write(peer_id, [(src[0], bad_dst, page_bytes)], fence)
    assert settles(bad) == WriteState.FAILED
    backend.set_completion_listener(None)
    after = backend.write(peer_id, [(src[0], dst[0], page_bytes)], fence)
    assert _wait(backend, after) == WriteState.DONE  # without a listener nothing is called, all still works
    for handle in (good, bad, after):
        backend.release(handle)


@pytest.mark.parametrize("name", BACKENDS)
def test_connect_to_a_closed_peer_is_unreachable(name, local_backend):
    if reason := skip_reason(name):
        pytest.skip(reason)
    buf = np.zeros(4096, np.uint8)
    gone = local_backend(name)
    gone.register([(int(buf.ctypes.data), buf.nbytes)])
    endpoint = gone.endpoint()
    gone.close()
    backend = local_backend(name)
    backend.register([(int(buf.ctypes.data), buf.nbytes)])
    with pytest.raises(TransferError) as info:
        backend.connect(endpoint)
    assert info.value.kind == TransferErrorKind.PEER_UNREACHABLE


def test_a_write_lands_only_under_an_open_fence(backend_name, spawn_peer, local_backend):
    """A receiving backend that fences admits a write only while the decode holds its (room, generation)
    open: a closed fence, another generation of the room, or a room the writer itself knows is dead
    takes no byte, and the connection keeps serving open fences."""
    peer = spawn_peer("decode", backend_name)
    if not peer.call("open_fence", room=2, generation=7):
        pytest.skip(f"{backend_name} does not fence writes (the decode waits for the prefill's Quiesced)")
    pool = SHAPE.pool()
    fill(pool, seed=23)
    backend = local_backend(backend_name)
    backend.register(KVArgs.from_pool(pool).regions())
    peer_id = backend.connect(base64.b64decode(peer.info["endpoint"]))
    src, dst, page_bytes = pool.kv_ptrs(), peer.info["kv_ptrs"], pool.page_bytes

    def write_page(page: int, fence: Fence) -> WriteState:
        handle = backend.write(peer_id, [(src[0] + page * page_bytes, dst[0] + page * page_bytes, page_bytes)], fence)
        state = _wait(backend, handle)
        if state == WriteState.FAILED:
            error = backend.error(handle)
            assert error is not None and error.kind == TransferErrorKind.ABORTED and "fenced" in error.message, error
        backend.release(handle)
        return state

    assert write_page(1, Fence(2, 7)) == WriteState.DONE
    assert write_page(2, Fence(2, 8)) == WriteState.FAILED, "another generation of the room"
    assert write_page(3, Fence(5, 1)) == WriteState.FAILED, "a room never opened"
    assert write_page(4, Fence(2, 7, live=lambda: False)) == WriteState.FAILED, "dead on the writer's side"
    assert peer.call("close_fence", room=2, generation=7) is True, "nothing of it was being received"
    assert write_page(5, Fence(2, 7)) == WriteState.FAILED, "closed"
    peer.call("open_fence", room=9, generation=9)
    assert write_page(6, Fence(9, 9)) == WriteState.DONE, "the connection still serves open fences"
    kv = peer.read_memory()[0]
    written = [p for p in range(SHAPE.num_pages) if kv[0, p].any()]
    assert written == [1, 6]
    for page in written:
        assert np.array_equal(kv[0, page], pattern(23, 0, page, page_bytes))


@pytest.mark.parametrize("name", ALL_BACKENDS)
def test_unknown_peer_and_empty_batch(name, local_backend):
    if reason := skip_reason(name):
        pytest.skip(reason)
    backend = local_backend(name)
    buf = np.zeros(4096, np.uint8)
    backend.register([(int(buf.ctypes.data), buf.nbytes)])
    handle = backend.write(12345, [(int(buf.ctypes.data), int(buf.ctypes.data), 8)])
    assert backend.poll(handle) == WriteState.FAILED
    assert backend.error(handle).kind == TransferErrorKind.PEER_GONE
    backend.release(handle)
    backend.release(handle)  # releasing twice is harmless
    assert not backend.probe(12345)


# -- the prefill validates what a decode sends (raw protocol over a real socket) -----------------
class _RawDecode:
    def __init__(self, address):
        self.sock = socket.create_connection(address, timeout=20)
        self.reader = FrameReader(self.sock)

    def send(self, msg):
        self.sock.sendall(encode_frame(msg))

    def read(self, kind):
        while True:
            msg = self.reader.read()
            if msg is None or isinstance(msg, kind):
                return msg


def _register(args: KVArgs, endpoint: bytes, backend_: str, **changes) -> Register:
    fields = dict(version=PROTOCOL_VERSION, backend=backend_, endpoint=endpoint, kv_ptrs=args.kv_ptrs,
                  kv_data_lens=args.kv_data_lens, kv_item_lens=args.kv_item_lens, aux_ptrs=args.aux_ptrs,
                  aux_data_lens=args.aux_data_lens, aux_item_lens=args.aux_item_lens, page_size=args.page_size,
                  kv_dtype=args.kv_dtype)
    fields.update(changes)
    return Register(**fields)


@pytest.mark.parametrize(
    ("change", "needle"),
    [({"page_size": 8}, "page_size"), ({"kv_dtype": "bfloat16"}, "kv_dtype"), ({"version": 99}, "version"),
     ({"backend": "other"}, "backend"), ("layers", "layers")],
)
def test_prefill_rejects_a_mismatched_decode(backend_name, local_manager, local_backend, change, needle):
    prefill = local_manager("prefill", backend_name)
    pool = SHAPE.pool()
    args = KVArgs.from_pool(pool)
    data = local_backend(backend_name)
    data.register(args.regions())
    if change == "layers":
        change = {"kv_ptrs": args.kv_ptrs[:2], "kv_data_lens": args.kv_data_lens[:2],
                  "kv_item_lens": args.kv_item_lens[:2]}
    raw = _RawDecode(prefill.manager.control_address)
    raw.send(_register(args, data.endpoint(), backend_name, **change))
    ack = raw.read(RegisterAck)
    assert ack is not None and not ack.ok and needle in ack.reason, ack
    raw.sock.close()


def test_prefill_rejects_pages_outside_the_decode_pool(backend_name, local_manager, local_backend):
    prefill = local_manager("prefill", backend_name)
    pool = SHAPE.pool()
    args = KVArgs.from_pool(pool)
    data = local_backend(backend_name)
    data.register(args.regions())
    raw = _RawDecode(prefill.manager.control_address)
    raw.send(_register(args, data.endpoint(), backend_name))
    assert raw.read(RegisterAck).ok
    sender = prefill.manager.create_sender(5)
    raw.send(RoomRequest(5, [1, 2, SHAPE.num_pages], 0))
    status = raw.read(RoomStatus)
    assert status is not None and not status.ok and status.kind == TransferErrorKind.RANGE_REJECTED.value
    assert "room 5" in status.reason
    assert sender.poll() == 0 and sender.failure().kind == TransferErrorKind.RANGE_REJECTED
    raw.send(RoomRequest(6, [1], SHAPE.num_aux_slots))  # aux slot out of range
    status = raw.read(RoomStatus)
    assert status.room == 6 and not status.ok and status.kind == "range_rejected"
    # the connection is still fine: a valid room on it works
    sender7 = prefill.manager.create_sender(7)
    raw.send(RoomRequest(7, [0, 1], 1))
    deadline = time.monotonic() + 10
    while sender7.poll() != 2 and time.monotonic() < deadline:
        time.sleep(0.002)
    assert sender7.poll() == 2 and sender7.num_dst_pages == 2
    with pytest.raises(ValueError, match="reserved"):
        sender7.send([0, 1, 2], last=True)
    with pytest.raises(ValueError, match="source pages"):
        sender7.send([SHAPE.num_pages], last=False)
    raw.sock.close()


def test_mooncake_sends_no_batch_after_its_wait_for_the_budget_outlived_its_room(spawn_peer):
    """Mooncake keeps a budget of entries in flight per target: a batch waiting for it behind a frozen decode's
    writes (the same target through another connection: a reconnected peer whose old thread is still in a call)
    must not go out once its room died meanwhile (its bytes would land in pages that decode has given back).
    Before: sent as soon as the budget freed."""
    import signal

    reason = skip_reason("mooncake")
    if reason:
        pytest.skip(reason)
    frozen = spawn_peer("decode", "mooncake")
    pool = SHAPE.pool()
    fill(pool, seed=5)
    backend = create_backend("mooncake", options={"max_batch_blocks": 1, "max_inflight_blocks": 1})
    try:
        backend.register(KVArgs.from_pool(pool).regions())
        endpoint = base64.b64decode(frozen.info["endpoint"])
        first, second = backend.connect(endpoint), backend.connect(endpoint)  # (two connections, one target)
        src, page_bytes, dst = pool.kv_ptrs(), pool.page_bytes, frozen.info["kv_ptrs"][0]
        before = frozen.read_memory()[0].copy()
        fence = _fence(frozen)
        frozen.signal(signal.SIGSTOP)
        try:
            held = backend.write(first, [(src[0], dst, page_bytes)], fence)
            time.sleep(0.3)  # (it holds the target's whole budget while its decode is frozen)
            alive = [True]
            waiting = backend.write(second, [(src[0], dst + page_bytes, page_bytes)], Fence(2, 1, lambda: alive[0]))
            time.sleep(0.3)
            assert backend.poll(waiting) == WriteState.PENDING  # (waiting for the budget)
            alive[0] = False  # the room failed here, and that connection is dropped
            backend.disconnect(second)
            assert _wait(backend, waiting) == WriteState.FAILED
        finally:
            frozen.signal(signal.SIGCONT)
        assert _wait(backend, held) == WriteState.DONE  # (the budget frees)
        time.sleep(0.5)
        after, before = frozen.read_memory()[0].reshape(-1), before.reshape(-1)
        assert np.array_equal(after[page_bytes : 2 * page_bytes], before[page_bytes : 2 * page_bytes]), \
            "a failed batch's bytes landed after all"
    finally:
        backend.close()


def test_mooncake_a_frozen_decode_does_not_hold_up_another_decodes_writes(spawn_peer):
    """The budget of entries in flight is per target: a frozen decode's batch (held until Mooncake's own 30 s
    timeout) took an engine-wide one, so two frozen decodes stalled every other decode's transfers for 30 s
    (found by review)."""
    import signal

    reason = skip_reason("mooncake")
    if reason:
        pytest.skip(reason)
    frozen, other = spawn_peer("decode", "mooncake"), spawn_peer("decode", "mooncake")
    pool = SHAPE.pool()
    fill(pool, seed=6)
    backend = create_backend("mooncake", options={"max_batch_blocks": 1, "max_inflight_blocks": 1})
    try:
        backend.register(KVArgs.from_pool(pool).regions())
        to_frozen = backend.connect(base64.b64decode(frozen.info["endpoint"]))
        to_other = backend.connect(base64.b64decode(other.info["endpoint"]))
        src, page_bytes = pool.kv_ptrs(), pool.page_bytes
        other.call("open_fence", room=2, generation=1)
        frozen_fence = _fence(frozen)
        frozen.signal(signal.SIGSTOP)
        try:
            held = backend.write(to_frozen, [(src[0], frozen.info["kv_ptrs"][0], page_bytes)], frozen_fence)
            time.sleep(0.3)
            done = backend.write(to_other, [(src[0], other.info["kv_ptrs"][0], page_bytes)], Fence(2, 1))
            assert _wait(backend, done) == WriteState.DONE  # (while the frozen one's batch is still in flight)
            assert backend.poll(held) == WriteState.PENDING
        finally:
            frozen.signal(signal.SIGCONT)
        assert _wait(backend, held) == WriteState.DONE
        assert np.array_equal(other.read_memory()[0].reshape(-1)[:page_bytes], np.frombuffer(
            (ctypes.c_ubyte * page_bytes).from_address(src[0]), dtype=np.uint8))
    finally:
        backend.close()
