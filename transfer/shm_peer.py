"""A prefill's view of a co-located decode's memory (the same-host path, ``transfer.shm``): the offer it
gets, the mapping it proves (``map_offer``), the background pre-fault, and the fenced copy.

Lifecycle: ``map_offer(offer)`` maps the decode's fence board and pool files and checks the nonce in
each (ValueError/OSError otherwise: no proof, no shared memory); the backend then runs ``prefault`` in a
thread of its own and ``copy_blocks`` in the peer's sender thread, or ``copy_inline`` for a small batch
in the writer's own thread (the scheduler's: no hand-off); ``unmap`` when the peer ends.
"""

from __future__ import annotations

import bisect
import ctypes
import logging
import mmap
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np

from transfer.base import Block, Fence, fenced
from transfer.errors import TransferError, TransferErrorKind
from transfer.peer_threads import SenderPeer
from transfer.shm_fences import FenceBoard
from transfer.shm_files import check_private

log = logging.getLogger(__name__)

SUB_BATCH_BYTES = 4 << 20  # bytes copied between two fence checks
INLINE_MAX_BYTES = 1 << 20  # a batch up to this size may be copied in the writer's thread (copy_inline)
# copy_inline's longest wait for the gate after copying. The decode holds it for µs, but from Python: a
# thread switch inside that moment (the interpreter's switch interval is 5 ms; a busy 2-core machine
# preempts for longer) holds it that much longer, and at 5 ms a busy decode lost whole links to PEER_GONE
# (7 in ~677k writes with 3 CPU-bound threads beside it). A frozen decode still drops the peer.
INLINE_LEAVE_S = 0.1
PREFAULT_STEP_BYTES = 32 << 20
_MADV_POPULATE_WRITE = 23  # Linux 5.14+


class Offer(msgspec.Struct, array_like=True, frozen=True):
    """What a decode's endpoint offers a co-located prefill (see ``transfer.shm``)."""

    board: str
    nonce: bytes
    files: list[tuple[str, int]]  # (path, offset of the nonce)
    regions: list[tuple[int, int, int, int]]  # (decode address, length, file index, file offset)


@dataclass(eq=False)
class ShmPeer(SenderPeer):
    board: FenceBoard | None = None
    slot: int = 0
    maps: list[mmap.mmap] = field(default_factory=list)
    anchors: list[Any] = field(default_factory=list)  # ctypes views pinning the maps' addresses
    starts: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    ends: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    deltas: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # local = decode address + delta
    start_list: list[int] = field(default_factory=list)  # starts, ends and deltas again as Python ints:
    bounds: list[tuple[int, int]] = field(default_factory=list)  # (end, delta); a small batch skips numpy
    spans: list[tuple[int, int, int]] = field(default_factory=list)  # (map index, file offset, length) to pre-fault
    prefaulted: threading.Event = field(default_factory=threading.Event)
    stop: threading.Event = field(default_factory=threading.Event)
    prefaulter: threading.Thread | None = None


def prefault(peer: ShmPeer) -> None:
    """Map every page of the decode's regions into our page tables ahead of the writes (a first touch
    costs a page fault, several microseconds on a VM: most of a cold copy). Runs in its own thread after
    connect, in steps, until done or the peer is dropped; writes meanwhile fault what they touch first."""
    try:
        for index, offset, length in peer.spans:
            mm = peer.maps[index]
            start = offset - offset % mmap.PAGESIZE
            end = offset + length
            while start < end and not peer.stop.is_set():
                step = min(PREFAULT_STEP_BYTES, end - start)
                try:
                    mm.madvise(_MADV_POPULATE_WRITE, start, step)
                except OSError:  # (Linux < 5.14) read one byte per page: a read fault maps it writable
                    int(np.frombuffer(mm, np.uint8, step, start)[:: mmap.PAGESIZE].max())
                start += step
    except (OSError, ValueError) as exc:
        log.info("shm: pre-faulting %s stopped: %s", peer.label, exc)
    finally:
        peer.prefaulted.set()


def map_offer(offer: Offer) -> ShmPeer:
    """Map the decode's board and files; ValueError/OSError unless each holds the nonce, is a private file of
    our own user (``check_private``: the offer comes over the network) and every region lies inside its file."""
    board = FenceBoard.attach(offer.board, offer.nonce)
    peer = ShmPeer(label=offer.board, board=board)
    try:
        peer.slot = board.claim()
        bases = []
        for path, nonce_at in offer.files:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
            try:
                check_private(fd, path)
                if nonce_at < 0 or os.fstat(fd).st_size < nonce_at + len(offer.nonce):
                    raise ValueError(f"{path} is shorter than the decode's")
                mm = mmap.mmap(fd, nonce_at + len(offer.nonce), mmap.MAP_SHARED,
                               mmap.PROT_READ | mmap.PROT_WRITE)
            finally:
                os.close(fd)
            peer.maps.append(mm)
            if mm[nonce_at : nonce_at + len(offer.nonce)] != offer.nonce:
                raise ValueError(f"{path} does not hold the decode's nonce: not the decode's memory")
            anchor = ctypes.c_char.from_buffer(mm)
            peer.anchors.append(anchor)
            bases.append(ctypes.addressof(anchor))
        regions = sorted(offer.regions)
        for (addr, length, index, offset) in regions:
            if (not 0 <= index < len(offer.files) or addr < 0 or length < 0 or offset < 0
                    or offset + length > offer.files[index][1]):
                raise ValueError(f"region at {addr:#x} lies outside its file")
        peer.starts = np.array([r[0] for r in regions], np.int64)
        peer.ends = np.array([r[0] + r[1] for r in regions], np.int64)
        peer.deltas = np.array([bases[r[2]] + r[3] - r[0] for r in regions], np.int64)
        peer.start_list = [r[0] for r in regions]
        peer.bounds = [(r[0] + r[1], bases[r[2]] + r[3] - r[0]) for r in regions]
        peer.spans = [(index, offset, length) for (_, length, index, offset) in regions]
    except BaseException:
        unmap(peer)
        raise
    return peer


def unmap(peer: ShmPeer) -> None:
    """Drop the mappings and the board (releases our writer slot)."""
    peer.anchors.clear()
    for mm in peer.maps:
        try:
            mm.close()
        except (BufferError, ValueError):
            log.warning("shm: a mapping of %s is still in use; left mapped", peer.label)
    peer.maps.clear()
    if peer.board is not None:
        peer.board.close()


def copy_blocks(peer: ShmPeer, blocks: list[Block], fence: Fence) -> TransferError | None:
    """Range-check every block against the decode's regions (RANGE_REJECTED, nothing copied), then copy
    sub-batches of ``SUB_BATCH_BYTES`` with ``memmove`` (GIL released), each inside the fence board's
    ``enter``/``leave``. None = every byte is in the decode's memory, which still lives (a decode that died makes
    the peer dead: PEER_GONE). (The peer's sender thread.)"""
    assert peer.board is not None
    if not blocks:
        return None
    table = np.array(blocks, dtype=np.int64).reshape(-1, 3)
    dst, lengths = table[:, 1], table[:, 2]
    index = np.searchsorted(peer.starts, dst, side="right") - 1
    inside = (index >= 0) & (lengths >= 0) & (dst + lengths <= peer.ends[np.maximum(index, 0)])
    if not inside.all():
        return TransferError(
            TransferErrorKind.RANGE_REJECTED,
            f"shm: a block writes outside the memory {peer.label} registered",
        )
    local = (dst + peer.deltas[index]).tolist()
    sources, sizes = table[:, 0].tolist(), lengths.tolist()
    cuts = np.searchsorted(np.cumsum(lengths), np.arange(SUB_BATCH_BYTES, int(lengths.sum()), SUB_BATCH_BYTES),
                           side="left").tolist()
    given_up = lambda: peer.dead is not None  # noqa: E731
    start = 0
    for end in [*[c + 1 for c in cuts], len(sizes)]:
        if end <= start:
            continue
        if peer.dead is not None:
            return peer.dead
        if not fence.live():
            return fenced("shm", fence)
        entered = peer.board.enter(peer.slot, fence.room, fence.generation, given_up)
        if entered is None:
            return peer.dead or TransferError(TransferErrorKind.PEER_GONE, f"shm: {peer.label} dropped")
        if not entered:
            return fenced("shm", fence)
        try:
            for i in range(start, end):
                ctypes.memmove(local[i], sources[i], sizes[i])
        finally:
            peer.board.leave(peer.slot, given_up)
        start = end
    if not peer.board.owner_alive():
        # (as ``copy_inline``) the copy may beat our control connection's news of the decode's end: a batch
        # into a dead decode's memory is not DONE, and the peer (its mapping of the dead pool) is dropped
        peer.dead = peer.dead or TransferError(TransferErrorKind.PEER_GONE, f"shm: the decode of {peer.label} is gone")
        return peer.dead
    return None


def _at_once() -> bool:
    return True


def copy_inline(peer: ShmPeer, blocks: list[Block], fence: Fence) -> tuple[bool, TransferError | None]:
    """``copy_blocks`` for one batch of at most ``INLINE_MAX_BYTES`` (one sub-batch) in the caller's
    thread, without waiting on the decode: (False, None) when the fence board's gate is held (by the
    decode closing a fence: nothing was copied, the peer's thread takes the batch), else (True, None =
    every byte is in the decode's memory, or the error). The gate is needed again to leave the fence
    once the bytes are in: a decode that holds it for ``INLINE_LEAVE_S`` (frozen inside it) makes the
    peer dead (PEER_GONE) rather than keep the writer's thread waiting; its mark then stays until the
    peer is unmapped, when the decode sees the writer gone. A decode that died makes the peer dead too
    (checked once the bytes are in: completing at once, the copy may beat the control connection's
    news of its end)."""
    assert peer.board is not None
    if not blocks:
        return True, None
    local = []
    starts, bounds = peer.start_list, peer.bounds
    for _, dst, length in blocks:
        index = bisect.bisect_right(starts, dst) - 1
        if index < 0 or length < 0 or dst + length > bounds[index][0]:
            return True, TransferError(
                TransferErrorKind.RANGE_REJECTED, f"shm: a block writes outside the memory {peer.label} registered"
            )
        local.append(dst + bounds[index][1])
    entered = peer.board.enter(peer.slot, fence.room, fence.generation, _at_once)
    if entered is None:
        return False, None
    if not entered:
        return True, fenced("shm", fence)
    try:
        for dst, (src, _, length) in zip(local, blocks, strict=True):
            ctypes.memmove(dst, src, length)
    finally:
        deadline = time.monotonic() + INLINE_LEAVE_S
        left = peer.board.leave(peer.slot, lambda: peer.dead is not None or time.monotonic() > deadline)
    if not left:
        peer.dead = peer.dead or TransferError(
            TransferErrorKind.PEER_GONE,
            f"shm: {peer.label} held the fence gate for over {INLINE_LEAVE_S * 1e3:g} ms (frozen?); peer dropped",
        )
        return True, peer.dead
    if not peer.board.owner_alive():
        # Done before our control connection noticed: a room must not complete into a decode that is gone.
        peer.dead = peer.dead or TransferError(TransferErrorKind.PEER_GONE, f"shm: the decode of {peer.label} is gone")
        return True, peer.dead
    return True, None
