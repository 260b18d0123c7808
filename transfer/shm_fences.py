"""The fence board of the same-host KV path: a small shared file through which a decode fences the
writes that co-located prefills make straight into its memory.

A prefill that maps the decode's pool copies bytes with nothing the decode could refuse on the way, so
the check happens here, in shared memory, under a lock both sides take:

* the decode keeps its open fences in a table (slot ``generation % NUM_FENCES``: room, generation,
  open), plus a random nonce a peer must read back to prove it maps this very file;
* each writer (one per prefill connection) claims a slot: it holds an OFD lock on the slot's liveness
  byte for as long as it lives (the kernel drops it when the process dies, SIGKILL included). Before
  each sub-batch, holding its slot's gate byte, it marks the slot with the fence it is about to write
  and reads the table (``enter``): fence closed -> mark cleared, nothing copied. Once the bytes are in,
  it clears the mark under the gate (``leave``);
* ``close_fence`` marks the fence closed, then (after a full barrier) takes each claimed slot's gate in
  turn and reads its mark. Either a writer's gate section came first (its mark is visible: the decode
  waits for it to clear, or for the writer to die) or the decode's did (its closed entry is visible to
  the writer, which copies nothing more of it): no byte of a closed fence lands after the decode was
  told none can. A writer frozen inside its gate makes its slot unknown (retry later), never a wedge;
  a frozen writer never blocks another writer.

Locks are OFD ``fcntl`` locks (per open file, released when the owner dies), held for microseconds,
never while copying, and always taken without blocking (retried briefly). The argument above needs a
full memory barrier from each lock operation, which the kernel's locked instructions give on x86-64.
Lifecycle: the decode ``create()``s the board (and ``close()``s it: unlink); a prefill ``attach()``es
with the path and nonce from the decode's endpoint, ``claim()``s a writer slot, then ``enter``/``leave``.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import os
import struct
import threading
import time
from collections.abc import Callable, Iterator

import numpy as np

from transfer.shm_files import SharedFile, check_private

MAGIC = 0x70642D6B762D6631  # "pd-kv-f1"
NUM_WRITERS = 64
NUM_FENCES = 1 << 16
_HEADER_WORDS = 8  # magic, nonce (2 words), fencing on, reserved
_CLAIMED = _HEADER_WORDS  # 1 per writer slot in use (a dead writer's stays 1 until the decode sees it)
_MARKS = _CLAIMED + NUM_WRITERS  # writer marks: (room, generation) per slot, (0, 0) = not writing
_TABLE = _MARKS + 2 * NUM_WRITERS  # fences: (room, generation, open) per slot
BOARD_BYTES = 8 * (_TABLE + 3 * NUM_FENCES)
NONCE_BYTES = 16
_BARRIER_BYTE = 0  # the decode locks it for its full barrier; writer slot i: liveness 1 + i, gate 1 + W + i
_F_OFD_SETLK = 37
_RETRY_S = 0.00005


def _flock(kind: int, start: int) -> bytes:
    return struct.pack("hhqqi4x", kind, os.SEEK_SET, start, 1, 0)


_NUM_BYTES = 1 + 2 * NUM_WRITERS  # the barrier byte, then each slot's liveness and gate bytes
_LOCK = [_flock(fcntl.F_WRLCK, byte) for byte in range(_NUM_BYTES)]  # (packed once: a lock is taken per copy)
_UNLOCK = [_flock(fcntl.F_UNLCK, byte) for byte in range(_NUM_BYTES)]


def try_lock(fd: int, byte: int) -> bool:
    """Take an exclusive OFD lock on one byte without waiting; False if someone else holds it."""
    try:
        fcntl.fcntl(fd, _F_OFD_SETLK, _LOCK[byte])
    except OSError as exc:
        if exc.errno in (errno.EAGAIN, errno.EACCES):
            return False
        raise
    return True


def unlock(fd: int, byte: int) -> None:
    fcntl.fcntl(fd, _F_OFD_SETLK, _UNLOCK[byte])


def _live_byte(slot: int) -> int:
    return 1 + slot


def _gate_byte(slot: int) -> int:
    return 1 + NUM_WRITERS + slot


class FenceBoard:
    """One mapping of a decode's board (the decode's own, or a prefill's view of it)."""

    def __init__(self, fd: int, mm: mmap.mmap, owner: SharedFile | None) -> None:
        self.fd = fd
        self._mm = mm
        self._owner = owner
        self._words = np.frombuffer(mm, dtype=np.uint64, count=BOARD_BYTES // 8)
        self._claimed = self._words[_CLAIMED:_MARKS]
        self._marks = self._words[_MARKS:_TABLE].reshape(NUM_WRITERS, 2)
        self._table = self._words[_TABLE:].reshape(NUM_FENCES, 3)
        # the same words for one-word reads and writes on the hot paths (a numpy scalar costs ~10x more)
        self._w = memoryview(mm)[:BOARD_BYTES].cast("Q")
        self._thread_lock = threading.Lock()  # OFD locks do not exclude threads sharing our descriptor
        self._slot: int | None = None  # a writer's claimed slot
        self._closed = False

    @property
    def path(self) -> str:
        return self._owner.path if self._owner is not None else ""

    @property
    def nonce(self) -> bytes:
        return self._words[1:3].tobytes()

    def _take_gate(self, byte: int, give_up: Callable[[], bool]) -> bool:
        """Take a slot's gate (its ``byte``) and this mapping's thread lock: True, held (``_drop_gate`` it);
        False once ``give_up()`` says so (nothing held)."""
        self._thread_lock.acquire()
        try:
            while not try_lock(self.fd, byte):
                if give_up():
                    self._thread_lock.release()
                    return False
                time.sleep(_RETRY_S)
        except BaseException:
            self._thread_lock.release()
            raise
        return True

    def _drop_gate(self, byte: int) -> None:
        try:
            unlock(self.fd, byte)
        finally:
            self._thread_lock.release()

    @contextlib.contextmanager
    def _gate(self, slot: int, give_up: Callable[[], bool]) -> Iterator[bool]:
        """Hold the slot's gate (yields True), or yield False once ``give_up()`` says so."""
        byte = _gate_byte(slot)
        if not self._take_gate(byte, give_up):
            yield False
            return
        try:
            yield True
        finally:
            self._drop_gate(byte)

    # -- decode ----------------------------------------------------------------------------------
    @classmethod
    def create(cls, directory: str | None = None) -> FenceBoard:
        shared = SharedFile.create("pd-kv-fences-", BOARD_BYTES, directory)
        board = cls(shared.fd, shared.mm, shared)
        board._words[1:3] = np.frombuffer(os.urandom(NONCE_BYTES), dtype=np.uint64)
        board._words[0] = MAGIC
        return board

    def set_fencing(self, on: bool) -> None:
        """With fencing off (no listener on the decode), writers ignore the table."""
        self._words[3] = 1 if on else 0

    def open_fence(self, room: int, generation: int) -> None:
        """Admit writes of (room, generation) (call before the page list leaves). A slot still held by an
        older open fence is taken over: that fence then reads as closed to writers (its room fails)."""
        w, at = self._w, _TABLE + 3 * (generation % NUM_FENCES)
        w[at + 2] = 0  # (entry words change one by one: closed while they do)
        w[at] = room
        w[at + 1] = generation
        w[at + 2] = 1

    def close_fence(self, room: int, generation: int, wait_s: float = 0.005) -> list[int] | None:
        """Close the fence; answer the live writer slots still writing it ([] = nothing can land any
        more), or None when a slot's gate was not had within ``wait_s`` (a writer frozen inside it)."""
        w, at = self._w, _TABLE + 3 * (generation % NUM_FENCES)
        if w[at + 1] == generation:
            w[at + 2] = 0
        with self._thread_lock:  # a full barrier: the closed entry is visible before we read the slots
            if try_lock(self.fd, _BARRIER_BYTE):
                unlock(self.fd, _BARRIER_BYTE)
        deadline = time.monotonic() + wait_s
        busy: list[int] = []
        for slot in (int(i) for i in np.nonzero(self._claimed)[0]):
            with self._gate(slot, lambda: time.monotonic() > deadline) as held:
                if not held:
                    return None
                hit = w[_MARKS + 2 * slot] == room and w[_MARKS + 2 * slot + 1] == generation
            if hit and self._is_live(slot):
                busy.append(slot)
        return busy

    def writers_of(self, room: int, generation: int) -> list[int]:
        """The live writer slots still marked with a fence already closed by ``close_fence`` (a writer
        cannot newly mark a closed fence and copy: reading the marks needs no gate)."""
        hits = np.nonzero((self._marks[:, 0] == room) & (self._marks[:, 1] == generation))[0]
        return [slot for slot in (int(i) for i in hits) if self._is_live(slot)]

    def _is_live(self, slot: int) -> bool:
        """Whether the slot's writer lives; a dead one's mark and claim are cleared."""
        byte = _live_byte(slot)
        with self._thread_lock:
            if not try_lock(self.fd, byte):
                return True
            try:
                self._marks[slot] = (0, 0)
                self._claimed[slot] = 0
            finally:
                unlock(self.fd, byte)
        return False

    # -- prefill ---------------------------------------------------------------------------------
    @classmethod
    def attach(cls, path: str, nonce: bytes) -> FenceBoard:
        """Map a decode's board; ValueError unless it holds ``nonce`` (the proof we map the decode's file) and
        is our own user's, open to no other (else another user could have written the nonce)."""
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        try:
            check_private(fd, path)
            if os.fstat(fd).st_size < BOARD_BYTES:
                raise ValueError(f"{path} is not a fence board (too small)")
            mm = mmap.mmap(fd, BOARD_BYTES, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            raise
        board = cls(fd, mm, None)
        if int(board._words[0]) != MAGIC or board.nonce != nonce:
            board.close()
            raise ValueError(f"{path} does not hold the decode's nonce: not the decode's memory")
        return board

    def owner_alive(self) -> bool:
        """A writer's check that the decode which made the board still lives: its owner holds a shared
        ``flock`` on the file until it closes or dies, so an exclusive one (taken and dropped at once)
        is refused while it does. (Writers lock with OFD ``fcntl`` locks, which never conflict with it.)"""
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno in (errno.EAGAIN, errno.EACCES):
                return True
            raise
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        return False

    def claim(self) -> int:
        """Take a free writer slot for the life of this mapping; ValueError when all are taken."""
        for slot in range(NUM_WRITERS):
            if try_lock(self.fd, _live_byte(slot)):
                with self._gate(slot, lambda: False):
                    self._marks[slot] = (0, 0)
                    self._claimed[slot] = 1
                self._slot = slot
                return slot
        raise ValueError(f"all {NUM_WRITERS} writer slots of the decode's fence board are taken")

    def enter(self, slot: int, room: int, generation: int, give_up: Callable[[], bool]) -> bool | None:
        """Before copying bytes of (room, generation): True = fence open, slot marked (copy now);
        False = fence closed (copy nothing); None = ``give_up()`` said stop while waiting for the gate."""
        byte = _gate_byte(slot)
        if not self._take_gate(byte, give_up):
            return None
        try:
            w, mark = self._w, _MARKS + 2 * slot
            w[mark] = room
            w[mark + 1] = generation
            if w[3]:
                at = _TABLE + 3 * (generation % NUM_FENCES)
                if not (w[at + 2] == 1 and w[at + 1] == generation and w[at] == room):
                    w[mark] = 0
                    w[mark + 1] = 0
                    return False
            return True
        finally:
            self._drop_gate(byte)

    def leave(self, slot: int, give_up: Callable[[], bool]) -> bool:
        """The marked bytes are in: clear the mark (under the gate, so they are visible first). If
        ``give_up()`` stops the wait (answer False), the mark stays until this mapping is closed (the
        writer is gone)."""
        byte = _gate_byte(slot)
        if not self._take_gate(byte, give_up):
            return False
        try:
            mark = _MARKS + 2 * slot
            self._w[mark] = 0
            self._w[mark + 1] = 0
        finally:
            self._drop_gate(byte)
        return True

    def close(self) -> None:
        """Unmap (the decode also unlinks its file); a writer's slot is released with its locks."""
        if self._closed:
            return
        self._closed = True
        if self._slot is not None:  # a writer's clean goodbye (a dead one's slot is cleared by the decode)
            deadline = time.monotonic() + 0.01
            with self._gate(self._slot, lambda: time.monotonic() > deadline) as held:
                if held:
                    self._marks[self._slot] = (0, 0)
                    self._claimed[self._slot] = 0
        self._w.release()
        del self._claimed, self._marks, self._table, self._words, self._w
        with contextlib.suppress(BufferError, ValueError):
            self._mm.close()
        if self._owner is not None:
            self._owner.close()
        else:
            with contextlib.suppress(OSError):
                os.close(self.fd)
