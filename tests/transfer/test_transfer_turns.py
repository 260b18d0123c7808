"""Rooms writing to one peer take turns (``transfer.peer_threads``): a small request's KV waits for one turn
(at most ``turn_bytes``) of each room queued ahead of it, not for every byte queued before it.

Before, a thread-per-peer backend sent one peer's batches first in, first out: on a slow link a 9-token
request's one chunk waited behind three long prompts' whole KV (review: KV over a 20 mbit link, 39 s).
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from kvunit import StubPeerBackend

from transfer.base import UNFENCED, Block, Fence, WriteState
from transfer.errors import TransferError, TransferErrorKind
from transfer.peer_threads import SenderPeer, TurnQueue, _LinkRate, split_blocks
from transfer.tcp import TcpBackend

MiB = 1 << 20


def _job(room: int, n: int) -> tuple[int, list[tuple[int, int, int]], Fence]:
    return (n, [(0, 0, 1)], Fence(room, 1))


def test_turn_queue_serves_rooms_in_turns_and_each_room_in_order() -> None:
    q = TurnQueue()
    for room, n in ((1, 10), (1, 11), (1, 12), (2, 20), (3, 30), (2, 21)):
        q.put(_job(room, n))
    first = q.get_nowait()
    assert first is not None and first[0] == 10
    q.put_back((10, [(0, 0, 1)], Fence(1, 1)))  # the rest of 10: first in room 1's line, room 1 last in turn
    order = []
    while True:
        try:
            job = q.get_nowait()
        except queue.Empty:
            break
        assert job is not None
        order.append(job[0])
    assert order == [20, 30, 10, 21, 11, 12]
    # another incarnation of a room (a reused room id) is another line
    q.put(_job(1, 1))
    q.put((2, [(0, 0, 1)], Fence(1, 2)))
    q.put(_job(1, 3))
    got = [q.get_nowait(), q.get_nowait(), q.get_nowait()]
    assert [j[0] for j in got if j is not None] == [1, 2, 3]


def test_turn_queue_stop_wakes_a_waiting_get_and_leaves_the_rest_to_take_all() -> None:
    q = TurnQueue()
    with pytest.raises(queue.Empty):
        q.get(timeout=0.01)
    got: list[object] = []
    waiter = threading.Thread(target=lambda: got.append(q.get()))
    waiter.start()
    q.put(_job(1, 1))
    waiter.join(5)
    assert [j[0] for j in got] == [1]  # type: ignore[index]
    q.put(_job(1, 2))
    q.put(_job(2, 3))
    q.put(None)
    assert q.get() is None and q.get_nowait() is None  # (stopped: the rest is failed by the peer's thread)
    assert sorted(j[0] for j in q.take_all()) == [2, 3]
    assert q.take_all() == []


@given(st.lists(st.integers(0, 5000), max_size=12), st.integers(1, 9000))
def test_split_blocks_cuts_the_first_limit_bytes(lengths: list[int], limit: int) -> None:
    blocks, at = [], 0
    for length in lengths:
        blocks.append((1_000_000 + at, 5_000_000 + at, length))
        at += length + 7  # (gaps: blocks are not contiguous)
    head, rest = split_blocks(blocks, limit)
    assert sum(b[2] for b in head) == min(limit, sum(lengths))

    def spans(bs: list[tuple[int, int, int]]) -> list[tuple[int, int]]:
        return [(src + i, dst + i) for src, dst, n in bs for i in range(n)]

    assert spans(head) + spans(rest) == spans(blocks)  # every byte once, in order, to where it went before


def _wait(backend: TcpBackend, handles: list[int], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while any(backend.poll(h) == WriteState.PENDING for h in handles):
        assert time.monotonic() < deadline, [backend.poll(h) for h in handles]
        time.sleep(0.005)


@pytest.fixture
def tcp_pair():
    src = np.random.default_rng(5).integers(0, 255, size=40 * MiB, dtype=np.uint8)
    dst = np.zeros_like(src)
    sender = TcpBackend(options={"turn_bytes": str(MiB)})
    receiver = TcpBackend()
    try:
        sender.register([(src.ctypes.data, src.nbytes)])
        receiver.register([(dst.ctypes.data, dst.nbytes)])
        peer = sender.connect(receiver.endpoint())
        yield sender, peer, src, dst
    finally:
        sender.close()
        receiver.close()


def _batch(src: np.ndarray, dst: np.ndarray, start: int, size: int, block: int) -> list[tuple[int, int, int]]:
    """``size`` bytes from ``start`` in blocks of ``block`` (the last one shorter), to the same offsets."""
    return [(src.ctypes.data + at, dst.ctypes.data + at, min(block, start + size - at))
            for at in range(start, start + size, block)]


def test_a_small_room_waits_one_turn_of_a_big_one_not_its_whole_queue(tcp_pair) -> None:
    sender, peer, src, dst = tcp_pair
    seen: dict[str, object] = {}
    handles: dict[str, int] = {}

    def settled() -> None:  # (the peer's thread, right after a write ended, before it takes the next turn)
        if "small" in handles and "at_small" not in seen and sender.poll(handles["small"]) == WriteState.DONE:
            seen["at_small"] = {name: sender.poll(h) for name, h in handles.items()}
            seen["big1_started"] = sender.started_at(handles["big1"], -1.0)

    sender.set_completion_listener(settled)
    big = 12 * MiB + 12_345  # (blocks of 3 MiB + 1 KiB: turns end inside blocks)
    lock = sender._peer(peer).send_lock  # held: the peer's thread takes big1 and waits while the rest queues
    with lock:
        for i, name in enumerate(("big1", "big2", "big3")):
            handles[name] = sender.write(peer, _batch(src, dst, i * big, big, 3 * MiB + 1024), Fence(1, 1))
        handles["small"] = sender.write(peer, _batch(src, dst, 3 * big, 9_000, 4096), Fence(2, 1))
    _wait(sender, list(handles.values()))
    assert all(sender.poll(h) == WriteState.DONE for h in handles.values())
    assert np.array_equal(dst[: 3 * big + 9_000], src[: 3 * big + 9_000])  # every piece landed where it belongs
    at_small = seen["at_small"]
    assert at_small == {"big1": WriteState.PENDING, "big2": WriteState.PENDING, "big3": WriteState.PENDING,
                        "small": WriteState.DONE}, "the small room's batch waited for the big room's queue"
    assert seen["big1_started"] is None  # (waiting for its next turn: not timed by ``transfer_s``)


def test_a_room_keeps_its_order_and_a_drop_between_turns_sends_no_more(tcp_pair) -> None:
    sender, peer, src, dst = tcp_pair  # (turns of 1 MiB)
    handles: dict[str, int] = {}

    def settled() -> None:  # a1 done: other has had one turn of three, a2 none (it waits for a1, its room's first)
        if sender.poll(handles["a1"]) == WriteState.DONE:
            sender.disconnect(peer)  # (from the peer's own thread: it ends after this turn)

    sender.set_completion_listener(settled)
    with sender._peer(peer).send_lock:
        handles["a1"] = sender.write(peer, _batch(src, dst, 0, 2 * MiB, MiB), UNFENCED)
        handles["a2"] = sender.write(peer, _batch(src, dst, 2 * MiB, 100, 100), UNFENCED)
        handles["other"] = sender.write(peer, _batch(src, dst, 3 * MiB, 3 * MiB, MiB), Fence(7, 1))
    _wait(sender, list(handles.values()))
    states = {name: sender.poll(h) for name, h in handles.items()}
    assert states == {"a1": WriteState.DONE, "a2": WriteState.FAILED, "other": WriteState.FAILED}, states
    assert np.array_equal(dst[: 2 * MiB], src[: 2 * MiB]) and not dst[2 * MiB : 3 * MiB].any()
    # other's one turn landed; nothing of it after the drop
    assert np.array_equal(dst[3 * MiB : 4 * MiB], src[3 * MiB : 4 * MiB]) and not dst[4 * MiB :].any()


class _Pipelined(StubPeerBackend):
    """A pipelined backend whose turns end when the test says (``finish``), recording what was posted."""

    name = "pipelined-fake"
    pipelined = True
    turn_bytes = 1000
    pipeline_bytes = 2500

    def __init__(self) -> None:
        super().__init__()
        self.posted: list[tuple[int, int]] = []  # (room, bytes) per turn, in order
        self.open: dict[int, str] = {}  # token -> "pending" | "done" | "failed"
        self.tokens = iter(range(1, 10**6))
        self.lock = threading.Lock()

    def _post(self, peer: SenderPeer, blocks: list[Block], fence: Fence) -> tuple[Any, TransferError | None, bool]:
        with self.lock:
            token = next(self.tokens)
            self.posted.append((fence.room, sum(n for _, _, n in blocks)))
            self.open[token] = "pending"
        return token, None, False

    def _check(self, peer: SenderPeer, token: Any) -> tuple[WriteState, TransferError | None]:
        with self.lock:
            state = self.open[token]
        if state == "failed":
            return WriteState.FAILED, TransferError(TransferErrorKind.PEER_GONE, "fake: failed")
        return (WriteState.DONE if state == "done" else WriteState.PENDING), None

    def finish(self, how: str = "done") -> None:
        """End the oldest pending turn."""
        with self.lock:
            token = min(t for t, state in self.open.items() if state == "pending")
            self.open[token] = how

    def wait_posted(self, count: int) -> None:
        deadline = time.monotonic() + 10
        while len(self.posted) < count:
            assert time.monotonic() < deadline, self.posted
            time.sleep(0.002)
        time.sleep(0.02)  # (nothing more may be posted: checked by the caller)


def _until(check: Any) -> None:
    deadline = time.monotonic() + 10
    while not check():
        assert time.monotonic() < deadline
        time.sleep(0.002)


def test_a_pipelined_backend_posts_turns_in_turn_within_its_budget() -> None:
    backend = _Pipelined()  # (turns of 1,000 bytes, posted while less than 2,500 are in flight)
    try:
        peer = backend.connect(b"")
        big = backend.write(peer, [(0, 0, 2200), (5000, 5000, 1800)], Fence(1, 1))  # 4,000 bytes: four turns
        backend.wait_posted(3)
        assert backend.posted == [(1, 1000)] * 3  # (3,000 in flight: no more)
        other = backend.write(peer, [(20000, 20000, 3000)], Fence(3, 1))
        small = backend.write(peer, [(9000, 9000, 10)], Fence(2, 1))
        for count in (4, 5, 7):  # each turn that ends lets the next in line go
            backend.finish()
            backend.wait_posted(count)
            assert len(backend.posted) == count
        # big's last turn (its room was in line first), one of the other room's, then the small one: it waited
        # for a turn of each room ahead of it, not for the 3,000 bytes of the other room queued before it
        assert backend.posted[3:] == [(1, 1000), (3, 1000), (2, 10), (3, 1000)]
        backend.finish()  # big's fourth turn was the oldest still pending (big's first three: ended)
        _until(lambda: backend.poll(big) == WriteState.DONE)
        assert backend.poll(other) == WriteState.PENDING
        backend.wait_posted(8)  # (the other room's third turn: posted by the peer's thread once big's ended)
        for _ in range(4):
            backend.finish()
        _until(lambda: backend.poll(small) == WriteState.DONE and backend.poll(other) == WriteState.DONE)
        assert [n for room, n in backend.posted if room == 3] == [1000] * 3
        # a failed turn fails its batch, and its rest is never posted
        failing = backend.write(peer, [(0, 0, 3500)], Fence(4, 1))
        backend.wait_posted(len(backend.posted) + 3)
        backend.finish("failed")
        time.sleep(0.05)
        assert backend.poll(failing) == WriteState.PENDING  # (two of its turns are still in flight)
        for _ in range(2):
            backend.finish()
        _until(lambda: backend.poll(failing) == WriteState.FAILED)
        time.sleep(0.05)
        assert [n for room, n in backend.posted if room == 4] == [1000] * 3  # (its last 500 bytes: not posted)
    finally:
        backend.close()


class _Forgetful(_Pipelined):
    """Records the tokens forgotten (freed) while still pending in the engine."""

    def __init__(self) -> None:
        super().__init__()
        self.forgot_pending: list[int] = []

    def _forget(self, peer: SenderPeer, token: Any) -> None:
        with self.lock:
            if token is not None and self.open.get(token) == "pending":
                self.forgot_pending.append(token)


def test_a_pipelined_write_whose_room_dies_between_turns_fails_once_its_turns_in_flight_ended() -> None:
    """(Review.) The room dies after its write's first turn was posted, before the rest's turn: FAILED at once,
    the KV sender would retire it and tell the decode the room is quiet (nixl does not fence writes): the decode
    would reuse the room's pages while the first turn's bytes were still on their way."""
    backend = _Forgetful()
    calls = {"n": 0}

    def live() -> bool:  # alive for the first turn's take, dead from the second on (the room was aborted)
        calls["n"] += 1
        return calls["n"] == 1

    try:
        peer = backend.connect(b"")
        handle = backend.write(peer, [(0, 0, 2000)], Fence(1, 1, live))
        backend.wait_posted(1)
        time.sleep(0.05)  # (the rest's turn was taken: its fence is dead, nothing more posted)
        assert backend.posted == [(1, 1000)]
        assert backend.poll(handle) == WriteState.PENDING, "FAILED while its first turn is still in flight"
        assert backend.forgot_pending == [], "a turn still in flight was released"
        backend.finish()
        _until(lambda: backend.poll(handle) == WriteState.FAILED)
    finally:
        backend.close()


def test_a_pipelined_write_with_a_failed_turn_fails_once_its_other_turns_ended() -> None:
    backend = _Forgetful()
    try:
        peer = backend.connect(b"")
        handle = backend.write(peer, [(0, 0, 2000)], Fence(1, 1))
        backend.wait_posted(2)
        with backend.lock:  # the second turn fails first; the first is still in the engine
            backend.open[2] = "failed"
        time.sleep(0.05)
        assert backend.poll(handle) == WriteState.PENDING, "FAILED while another turn is still in flight"
        assert backend.forgot_pending == [], "a turn still in flight was released"
        backend.finish()
        _until(lambda: backend.poll(handle) == WriteState.FAILED)
    finally:
        backend.close()


def test_a_pipelined_peer_keeps_two_turns_in_flight_before_its_rate_is_known() -> None:
    """(Review.) With one turn in flight at a time the link idled for every post and poll between turns."""
    backend = _Pipelined()
    backend.pipeline_bytes = None  # (measured: nothing has ended yet, so at least two turns)
    try:
        peer = backend.connect(b"")
        backend.write(peer, [(0, 0, 5000)], Fence(1, 1))
        backend.wait_posted(2)
        assert backend.posted == [(1, 1000)] * 2
    finally:
        backend.close()


def test_link_rate_averages_completions_that_bunch_up() -> None:
    """(Review.) Transfers that move side by side end together: the bytes of one poll over the gap since the
    previous completion read as a rate hundreds of times the link's, and the budget ran away with it."""
    link = _LinkRate()
    link.posted(False, now=0.0)
    t = 0.0
    for _ in range(20):  # a 100 MB/s link: eight 1 MB transfers side by side end together every 80 ms,
        t += 0.08        # in two polls 0.2 ms apart
        link.ended(4_000_000, now=t)
        link.ended(4_000_000, now=t + 0.0002)
        t += 0.0002
    assert 50e6 < link.rate < 200e6, link.rate
