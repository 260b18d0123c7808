"""The skeleton the thread-per-peer backends share: peers with a sender thread and a job queue, write
records, disconnect and close. A backend subclasses ``PeerThreadBackend`` and overrides what differs.

Lifecycle:
1. The subclass's ``connect`` opens its data path, builds its peer (a ``SenderPeer`` subclass holding
   the socket, session, mapping...) and calls ``_add_peer``: the peer gets an id and a sender thread.
2. ``write`` records the batch (PENDING), asks ``_refuse`` whether to fail it at once (e.g. destinations
   outside what the peer registered), else queues it; it never blocks. A backend whose ``_send`` never
   waits on the peer (shm: a memcpy) sets ``inline_max_bytes``: a batch up to that size, to a peer whose
   thread has nothing queued or in hand, is sent right there in the caller's thread (no hand-off to the
   peer's thread and back: at one request at a time those wake-ups cost more than the copy), and
   ``write`` returns its handle already DONE or FAILED (not notified: the caller polls it).
3. The peer's thread takes jobs in turns (``TurnQueue``): in order within one room incarnation (fence), the
   rooms with queued jobs round-robin, at most ``turn_bytes`` of one room's batch per turn (the rest goes
   back to the head of its room's line), so a small request's KV waits for a turn of each room ahead of it,
   not for every byte queued before it. A job whose fence is dead fails (ABORTED, "fenced") without (more
   of) it sent; else ``_send(peer, blocks, fence)`` moves the turn's piece (blocking) and answers None (the
   batch is DONE after its last piece) or the ``TransferError``. A ``pipelined`` backend (nixl) instead
   starts turns with ``_post`` while less than its budget is in flight (``pipeline_bytes``, or ~10 ms of the
   link's measured rate and at least two turns) and polls those with ``_check`` between new ones
   (``_forget`` frees each at its end; a batch fails only once none of its turns is in flight). ``_send``
   marks the peer dead (``peer.dead = error``) when its data path broke; the thread then fails the rest of
   its queue and ends, and ``_peer_ended`` frees the peer's resources.
4. ``disconnect``/``close`` drop peers: queued writes fail at once; a write already being sent fails
   when ``_send`` returns (its bytes may still be landing until then), or at once when the subclass
   sets ``fail_inflight_on_drop`` (its engine call may outlive the drop); ``_interrupt`` unblocks a
   sender stuck on a frozen peer (tcp shuts its socket down). ``close`` then calls ``_close_resources``.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from transfer.base import (
    UNFENCED,
    Block,
    Fence,
    PeerId,
    TransferBackend,
    WriteHandle,
    WriteState,
    WriteTable,
    fenced,
    unknown_peer,
)
from transfer.errors import TransferError, TransferErrorKind

log = logging.getLogger(__name__)

Job = tuple[WriteHandle, list[Block], Fence]
TURN_BYTES = 4 << 20  # default: the most of one room's batch a peer's thread sends before another room's turn


class TurnQueue:
    """A peer's queued jobs: first in, first out within one room incarnation (its fence), the rooms served in
    turns. ``put(None)`` stops the queue: ``get`` answers None from then on, before any job still queued (the
    peer is dead by then, and its thread fails what is left). ``get`` raises ``queue.Empty`` past its
    ``timeout`` (or at once with ``block=False``), as ``queue.Queue``."""

    def __init__(self) -> None:
        self._ready = threading.Condition(threading.Lock())
        self._rooms: dict[tuple[int, int], deque[Job]] = {}  # in turn order: the first is next
        self._stopped = False

    def put(self, job: Job | None) -> None:
        with self._ready:
            if job is None:
                self._stopped = True
            else:
                fence = job[2]
                line = self._rooms.get((fence.room, fence.generation))
                if line is None:
                    self._rooms[(fence.room, fence.generation)] = deque((job,))
                else:
                    line.append(job)
            self._ready.notify()

    def put_back(self, job: Job) -> None:
        """The rest of a job whose turn ended: first in its room's line, the room last in turn."""
        with self._ready:
            key = (job[2].room, job[2].generation)
            line = self._rooms.pop(key, None)
            if line is None:
                line = deque()
            line.appendleft(job)
            self._rooms[key] = line
            self._ready.notify()

    def get(self, block: bool = True, timeout: float | None = None) -> Job | None:
        with self._ready:
            if block and not self._ready.wait_for(lambda: self._stopped or bool(self._rooms), timeout):
                raise queue.Empty
            if self._stopped:
                return None
            if not self._rooms:
                raise queue.Empty
            key = next(iter(self._rooms))
            line = self._rooms.pop(key)
            job = line.popleft()
            if line:
                self._rooms[key] = line  # its next job waits for the other rooms' turns
            return job

    def get_nowait(self) -> Job | None:
        return self.get(block=False)

    def take_all(self) -> list[Job]:
        """Every job still queued (the peer is ending)."""
        with self._ready:
            jobs = [job for line in self._rooms.values() for job in line]
            self._rooms.clear()
            return jobs


def split_blocks(blocks: list[Block], limit: int) -> tuple[list[Block], list[Block]]:
    """The first ``limit`` bytes of ``blocks`` and the rest (a block across the boundary is cut in two)."""
    total = 0
    for i, (src, dst, length) in enumerate(blocks):
        if total + length > limit:
            head_len = limit - total
            if head_len <= 0:
                return blocks[:i], blocks[i:]
            return ([*blocks[:i], (src, dst, head_len)],
                    [(src + head_len, dst + head_len, length - head_len), *blocks[i + 1:]])
        total += length
    return blocks, []


class _LinkRate:
    """A pipelined peer's link rate (bytes/s), from its turns' completions while it was busy: the bytes that
    ended over at least ``window_s`` of busy time (completions that bunch up, as transfers moved side by side
    end, are averaged over the time they took, not over the gap between two polls)."""

    window_s = 0.005

    def __init__(self) -> None:
        self.rate = 0.0
        self._since: float | None = None
        self._bytes = 0

    def posted(self, busy: bool, now: float | None = None) -> None:
        if not busy:  # (idle until now: time from here)
            self._since, self._bytes = time.monotonic() if now is None else now, 0

    def ended(self, num_bytes: int, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self._bytes += num_bytes
        if self._since is not None and now - self._since >= self.window_s:
            sample = self._bytes / (now - self._since)
            self.rate = sample if not self.rate else 0.75 * self.rate + 0.25 * sample
            self._since, self._bytes = now, 0


@dataclass(eq=False)
class SenderPeer:
    """One connected peer; subclasses add what their data path needs."""

    label: str  # for messages: an address, a session, a path
    peer_id: PeerId = 0
    jobs: TurnQueue = field(default_factory=TurnQueue)
    dead: TransferError | None = None
    thread: threading.Thread | None = None
    num_queued: int = 0  # jobs queued or in the thread's hands (the backend's lock guards it)
    # held around every ``_send`` (the thread's or an inline one) and ``_peer_ended``: one batch at a
    # time per peer, and the peer's resources are never freed under a batch being sent
    send_lock: threading.Lock = field(default_factory=threading.Lock)


@dataclass
class WriteRecord:
    peer: PeerId
    state: WriteState = WriteState.PENDING
    error: TransferError | None = None
    sending: bool = False  # a piece of it is in the peer's thread's hands (sent, or posted and in flight)
    # time.monotonic() when its bytes began to move, or last moved (a piece ended while another is in flight);
    # None while nothing of it is in hand (queued, or waiting for its next turn): ``started_at``
    started: float | None = None
    in_flight: int = 0  # pieces in hand (pipelined: posted, not ended; else at most one)
    rest_queued: bool = False  # the rest of it waits for its room's next turn
    failing: TransferError | None = None  # failed while a piece was in flight: FAILED once none is


class PeerThreadBackend(WriteTable, TransferBackend):
    """A backend with one sender thread per peer. Subclasses implement ``connect`` (ending in
    ``_add_peer``), ``_send``, and the target side (``register``, ``endpoint``)."""

    thread_name: ClassVar[str] = "kv-send"
    # pipelined: the thread starts each batch (``_post``) and polls those in flight (``_check``) between
    # new ones, instead of sending one batch at a time (``_send``); for engines with their own progress
    pipelined: ClassVar[bool] = False
    poll_sleep_s: ClassVar[float] = 0.0002  # between polls of batches in flight (spinning was slower)
    fail_inflight_on_drop: ClassVar[bool] = False
    join_on_disconnect: ClassVar[bool] = True  # False: disconnect returns without waiting for the thread
    join_timeout_s: ClassVar[float] = 5.0
    inline_max_bytes: ClassVar[int] = 0  # > 0: smaller batches to an idle peer go in the caller's thread
    # the most of one room's batch sent in one turn (one ``_send`` or ``_post``) while other rooms' batches wait
    # theirs; a backend may set it per instance (an option)
    turn_bytes: int = TURN_BYTES
    # pipelined: turns are started while less than this is in flight to the peer (beyond what keeps its link busy,
    # they would only queue in the engine, first in, first out, and be timed by ``transfer_s`` there); None:
    # ``pipeline_s`` of the link's rate as measured from the turns' completions, at least two turns in flight
    pipeline_bytes: int | None = None
    pipeline_s: ClassVar[float] = 0.01

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._writes: dict[WriteHandle, WriteRecord] = {}
        self._peers: dict[PeerId, SenderPeer] = {}
        self._handle_ids = itertools.count(1)
        self._peer_ids = itertools.count(1)
        self._closed = False

    # -- hooks -----------------------------------------------------------------------------------
    def _send(self, peer: SenderPeer, blocks: list[Block], fence: Fence) -> TransferError | None:
        """Move one batch (peer's thread; may block). None = every byte is in the peer's memory. Check
        ``fence.live()`` again between sub-batches if the batch is split."""
        raise NotImplementedError

    def _post(self, peer: SenderPeer, blocks: list[Block], fence: Fence) -> tuple[Any, TransferError | None, bool]:
        """Pipelined backends: start one batch (peer's thread). Answers (token, error, done): ``error`` it
        failed at once, ``done`` it completed inline; else ``_check(peer, token)`` follows it."""
        raise NotImplementedError

    def _check(self, peer: SenderPeer, token: Any) -> tuple[WriteState, TransferError | None]:
        """Pipelined backends: the state of a started batch (cheap, non-blocking)."""
        raise NotImplementedError

    def _forget(self, peer: SenderPeer, token: Any) -> None:
        """Pipelined backends: free a batch's token (it ended, or the peer's thread is ending)."""

    def _send_small(self, peer: SenderPeer, blocks: list[Block], fence: Fence) -> tuple[bool, TransferError | None]:
        """Backends with ``inline_max_bytes``: move a batch of at most that size in the caller's thread
        (``send_lock`` held) without waiting on the peer. Answers (False, None) when it would have to
        wait (nothing was sent: the batch is queued for the peer's thread instead), else (True, None
        when every byte is in the peer's memory, or the error, as ``_send``)."""
        raise NotImplementedError

    def _refuse(self, peer: SenderPeer, blocks: Sequence[Block]) -> TransferError | None:
        """A reason to fail a batch at once, before it is queued (caller's thread; cheap)."""
        return None

    def _interrupt(self, peer: SenderPeer) -> None:
        """Unblock the peer's thread if it waits on the peer (called once the peer is dropped)."""

    def _peer_ended(self, peer: SenderPeer) -> None:
        """The peer's thread is ending: free its resources (socket, mapping...)."""

    def _close_resources(self, threads_ended: bool) -> None:
        """After every peer was dropped: unregister memory, stop listeners. ``threads_ended`` is False
        when a sender thread outlived its join timeout (it may still touch registered memory)."""

    # -- peers -----------------------------------------------------------------------------------
    def _add_peer(self, peer: SenderPeer) -> PeerId:
        """Give the connected peer an id and start its sender thread (raises ABORTED once closed)."""
        with self._lock:
            if self._closed:
                closed = True
            else:
                closed = False
                peer.peer_id = next(self._peer_ids)
                self._peers[peer.peer_id] = peer
        if closed:
            self._peer_ended(peer)
            raise TransferError(TransferErrorKind.ABORTED, f"{self.name}: backend closed")
        peer.thread = threading.Thread(target=self._send_loop, args=(peer,), name=self.thread_name, daemon=True)
        peer.thread.start()
        return peer.peer_id

    def _peer(self, peer: PeerId) -> SenderPeer | None:
        with self._lock:
            return self._peers.get(peer)

    def write(self, peer: PeerId, blocks: Sequence[Block], fence: Fence = UNFENCED) -> WriteHandle:
        with self._lock:
            handle = next(self._handle_ids)
            record = WriteRecord(peer)
            self._writes[handle] = record
            target = self._peers.get(peer)
            if target is None or target.dead is not None:
                record.state = WriteState.FAILED
                record.error = target.dead if target is not None and target.dead else unknown_peer(self.name, peer)
                return handle
        refused = self._refuse(target, blocks)
        if refused is not None:
            with self._lock:
                record.state, record.error = WriteState.FAILED, refused
            return handle
        job = (handle, list(blocks), fence)
        small = 0 < sum(length for _, _, length in blocks) <= self.inline_max_bytes
        if small and self._send_inline(target, job):
            return handle
        with self._lock:
            target.num_queued += 1
        target.jobs.put(job)
        return handle

    def _send_inline(self, peer: SenderPeer, job: Job) -> bool:
        """Send ``job`` in the caller's thread if the peer's thread is idle with nothing queued and
        ``_send_small`` can do it without waiting; False (nothing done) otherwise. The write ends DONE or
        FAILED without a call to the listener."""
        with self._lock:
            if peer.num_queued:
                return False
        if not peer.send_lock.acquire(blocking=False):
            return False
        try:
            handle, blocks, fence = job
            if peer.dead is not None or not fence.live():
                self._take(peer, job, notify=False)  # fails it: nothing is sent
                return True
            self._mark_sending(handle, True)
            try:
                sent, error = self._send_small(peer, blocks, fence)
            except Exception as exc:
                sent, error = True, self._bug(peer, exc)
            if not sent:
                self._mark_sending(handle, False)
                return False
            self._finish(handle, WriteState.DONE if error is None else WriteState.FAILED, error, notify=False)
            if peer.dead is not None:
                peer.jobs.put(None)  # the data path broke: the peer's thread ends and frees it
        finally:
            peer.send_lock.release()
        return True

    def started_at(self, handle: WriteHandle, unknown: float) -> float | None:
        """When the batch was taken to be sent (``time.monotonic()``); None while it waits in its peer's queue
        behind other batches (``transfer_s`` times a batch from here: a busy link is not a stalled one);
        ``unknown`` for a handle this backend does not hold."""
        with self._lock:
            record = self._writes.get(handle)
            return record.started if record is not None else unknown

    def _mark_sending(self, handle: WriteHandle, sending: bool) -> None:
        with self._lock:
            record = self._writes.get(handle)
            if record is not None:
                record.sending = sending

    def _finish(self, handle: WriteHandle, state: WriteState, error: TransferError | None = None, *,
                notify: bool = True) -> None:
        with self._lock:
            record = self._writes.get(handle)
            changed = record is not None and record.state == WriteState.PENDING
            if record is not None and changed:
                record.state, record.error = state, error
        if changed and notify:
            self._settled()

    def _piece_ended(self, handle: WriteHandle, error: TransferError | None, rest: bool = False) -> None:
        """A piece of a batch ended (``rest``: and the rest of it goes back to wait for its room's next turn).
        The batch fails with the first error, and is DONE once no piece is in flight and no rest waits; with
        none in flight and a rest waiting, it counts as queued again (``started_at`` None; a drop fails it)."""
        with self._lock:
            record = self._writes.get(handle)
            if record is None or record.state != WriteState.PENDING:
                return
            record.in_flight -= 1
            record.rest_queued = record.rest_queued or rest
            error = record.failing or error
            if error is not None and record.in_flight:
                record.failing, record.rest_queued = error, False  # (its other pieces are still landing)
                return
            if error is not None:
                record.state, record.error = WriteState.FAILED, error
            elif record.in_flight:
                record.started = time.monotonic()  # (moving: a piece of it landed)
                return
            elif record.rest_queued:
                record.sending, record.started = False, None
                return
            else:
                record.state = WriteState.DONE
        self._settled()

    def _rest_queued(self, handle: WriteHandle) -> None:
        with self._lock:
            record = self._writes.get(handle)
            if record is not None:
                record.rest_queued = True

    def _take(self, peer: SenderPeer, job: Job, *, notify: bool = True) -> bool:
        """Mark a job (or the rest of one, at its next turn) taken by the peer's thread or an inline sender;
        False (nothing of it is sent) when the peer or its fence is dead (the job fails) or it already ended
        (failed while it waited for its next turn, or released: (review) a write ``fail_queued`` failed, whose
        room the KV manager then called quiet, went out when the thread took it after its release)."""
        handle, _, fence = job
        dead = peer.dead or (None if fence.live() else fenced(self.name, fence))
        with self._lock:
            record = self._writes.get(handle)
            if record is None:  # released: its end was reported and acted on (a FAILED one's room is quiet)
                return False
            if record.state != WriteState.PENDING or record.failing is not None:
                return False
            if dead is not None and record.in_flight:  # fails once its pieces in flight ended
                record.failing, record.rest_queued = dead, False
                return False
            if not record.in_flight:
                record.started = time.monotonic()
            record.sending, record.rest_queued = True, False
            record.in_flight += 1
        if dead is not None:  # the peer, or the room on our side: send nothing of it
            self._finish(handle, WriteState.FAILED, dead, notify=notify)
            return False
        return True

    def _bug(self, peer: SenderPeer, exc: Exception) -> TransferError:
        """A bug in a hook must not leave a write PENDING forever: the peer is dropped."""
        log.exception("%s: sending a batch to %s failed", self.name, peer.label)
        peer.dead = peer.dead or TransferError(TransferErrorKind.PEER_GONE, f"{self.name}: {exc!r}")
        return peer.dead

    def _send_loop(self, peer: SenderPeer) -> None:
        active: list[tuple[WriteHandle, Any, int]] = []  # pipelined: pieces started, not ended (and their bytes)
        try:
            if self.pipelined:
                self._pipeline(peer, active)
                return
            while peer.dead is None:
                job = peer.jobs.get()
                if job is None:
                    break
                rest: list[Block] = []
                try:
                    with peer.send_lock:
                        if not self._take(peer, job):
                            continue
                        handle, blocks, fence = job
                        blocks, rest = split_blocks(blocks, self.turn_bytes)
                        try:
                            error = self._send(peer, blocks, fence)
                        except Exception as exc:
                            error = self._bug(peer, exc)
                        if error is not None:
                            rest = []
                        self._piece_ended(handle, error, bool(rest))
                        if error is not None and error.kind == TransferErrorKind.TIMEOUT:
                            # (the engine's own verdict on a stalled path, before the KV manager's: what waits
                            # behind it would go into the engine in turn and wait out a timeout of its own)
                            self.fail_queued(peer.peer_id, TransferError(
                                TransferErrorKind.PEER_GONE, f"{self.name}: the data path to {peer.label} stalled "
                                "behind another room's write"))
                finally:
                    if rest:
                        peer.jobs.put_back((handle, rest, fence))
                    else:
                        with self._lock:
                            peer.num_queued -= 1
        finally:
            dead = peer.dead or TransferError(TransferErrorKind.PEER_GONE, f"{self.name}: peer {peer.label} dropped")
            peer.dead = dead  # an inline sender checks it under ``send_lock``: nothing is sent past here
            for handle, token, _ in active:
                self._finish(handle, WriteState.FAILED, dead)
                self._forget(peer, token)
            for job in peer.jobs.take_all():  # fail whatever is still queued
                self._finish(job[0], WriteState.FAILED, dead)
            with peer.send_lock:  # an inline batch being sent finishes first
                self._peer_ended(peer)

    def _pipeline(self, peer: SenderPeer, active: list[tuple[WriteHandle, Any, int]]) -> None:
        """The pipelined loop: start queued turns while less than the pipeline's budget is in flight, then poll
        those in flight, until dropped."""
        in_flight = 0
        link = _LinkRate()
        while peer.dead is None:
            job: Job | tuple[()] | None = ()
            if self.pipeline_bytes is not None:
                room = in_flight < self.pipeline_bytes
            else:  # (two turns at least: one moving while the next is posted)
                room = len(active) < 2 or in_flight < link.rate * self.pipeline_s
            if room:
                try:
                    job = peer.jobs.get(timeout=0.05) if not active else peer.jobs.get_nowait()
                except queue.Empty:
                    pass
            if job is None:
                return
            if job:
                handle, blocks, fence = job
                if not self._take(peer, job):
                    rest: list[Block] = []
                else:
                    blocks, rest = split_blocks(blocks, self.turn_bytes)
                    if rest:
                        self._rest_queued(handle)
                        peer.jobs.put_back((handle, rest, fence))
                    link.posted(bool(active))
                    try:
                        token, error, done = self._post(peer, blocks, fence)
                    except Exception as exc:
                        token, error, done = None, self._bug(peer, exc), False
                    if error is not None or done:
                        self._piece_ended(handle, error)
                        self._forget(peer, token)
                    else:
                        size = sum(length for _, _, length in blocks)
                        active.append((handle, token, size))
                        in_flight += size
                if not rest:
                    with self._lock:
                        peer.num_queued -= 1
                continue  # start what may start before polling
            still, ended = [], 0
            for handle, token, size in active:
                with self._lock:
                    record = self._writes.get(handle)
                    dropped = record is not None and record.state != WriteState.PENDING  # failed by a drop
                if dropped:
                    self._forget(peer, token)
                    in_flight -= size
                    continue  # (a released write is still polled: its token is freed once it ended)
                try:
                    state, error = self._check(peer, token)
                except Exception as exc:
                    state, error = WriteState.FAILED, self._bug(peer, exc)
                if state == WriteState.PENDING:
                    still.append((handle, token, size))
                    continue
                if state == WriteState.FAILED:
                    error = error or TransferError(TransferErrorKind.PEER_GONE, f"{self.name}: a write failed")
                else:
                    error, ended = None, ended + size
                self._piece_ended(handle, error)
                self._forget(peer, token)
                in_flight -= size
            active[:] = still
            if ended:
                link.ended(ended)
            if active:
                time.sleep(self.poll_sleep_s)

    def probe(self, peer: PeerId) -> bool:
        target = self._peer(peer)
        return target is not None and target.dead is None and target.thread is not None and target.thread.is_alive()

    def fail_queued(self, peer: PeerId, error: TransferError) -> None:
        """Fail the peer's writes nothing of which is on the wire now (queued, or waiting for their next turn),
        leaving the peer and the writes in hand as they are: they wait behind a stalled one (the KV manager
        closes the decode's connection once that one ended)."""
        with self._lock:
            failed = 0
            for record in self._writes.values():
                if record.peer == peer and record.state == WriteState.PENDING and not record.sending:
                    record.state, record.error = WriteState.FAILED, error
                    failed += 1
        if failed:
            self._settled()

    def disconnect(self, peer: PeerId) -> None:
        with self._lock:
            target = self._peers.pop(peer, None)
        if target is not None:
            error = TransferError(TransferErrorKind.PEER_GONE, f"{self.name}: peer {target.label} disconnected")
            self._drop(target, error, join=self.join_on_disconnect)

    def _drop(self, target: SenderPeer, error: TransferError, *, join: bool = True) -> None:
        """Fail the peer's writes (queued ones now; one being sent when ``_send`` returns, or now with
        ``fail_inflight_on_drop``), stop its thread and wait for it (up to ``join_timeout_s``)."""
        target.dead = target.dead or error
        target.jobs.put(None)
        with self._lock:
            for record in self._writes.values():
                if record.peer == target.peer_id and record.state == WriteState.PENDING and (
                    not record.sending or self.fail_inflight_on_drop
                ):
                    record.state, record.error = WriteState.FAILED, target.dead
        self._settled()
        self._interrupt(target)
        if join and target.thread is not None and target.thread is not threading.current_thread():
            target.thread.join(timeout=self.join_timeout_s)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            peers = list(self._peers.values())
            self._peers.clear()
        for target in peers:
            self._drop(target, TransferError(TransferErrorKind.ABORTED, f"{self.name}: backend closed"))
        with self._lock:
            for record in self._writes.values():
                if record.state == WriteState.PENDING:
                    record.state = WriteState.FAILED
                    record.error = TransferError(TransferErrorKind.ABORTED, f"{self.name}: backend closed")
        self._settled()
        self._close_resources(not any(t.thread is not None and t.thread.is_alive() for t in peers))
