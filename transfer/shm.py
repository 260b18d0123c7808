"""Same-host KV path: a co-located prefill copies straight into the decode's pool in shared memory.

It wraps the configured network backend (tcp, mooncake, nixl...) and takes over per peer when the peer
proves it maps the decode's memory; every other peer goes over the network backend unchanged.

Lifecycle:
1. ``ShmBackend(network="tcp", same_host=True, **network_options)`` (or ``create_shm_backend``, which
   picks the fencing flavour when the network backend fences) builds the network backend.
2. ``register(regions)`` registers them with the network backend too. ``endpoint()`` (the decode's)
   carries the network endpoint plus, when every region lies in a shared file mapping (the worker puts
   a decode's pool in ``/dev/shm``) and ``same_host`` is on, an *offer*: the path of a fence board
   holding a random nonce (``transfer.shm_fences``), each pool file's path with the same nonce written
   just past its end, and where each region lies in its file.
3. ``connect(endpoint)`` (the prefill's) maps the offered files and reads the nonce back from each: the
   same bytes the decode sent over the control plane prove this process maps the decode's memory (a
   private ``/dev/shm``, another host, a stale path all fail it). Then the peer is a shared-memory peer
   with a sender thread; otherwise (no offer, proof failed, ``same_host`` off) the network backend
   connects and carries every write to that peer. ``path_of(peer)`` says which.
4. ``write`` on a shared-memory peer queues the batch; the sender thread range-checks every block
   against the decode's registered regions (RANGE_REJECTED, nothing copied), then copies sub-batches of
   at most ``SUB_BATCH_BYTES`` with ``memmove`` (the GIL is released while copying), each under the
   fence board's ``enter``/``leave`` (a closed fence or a dead room copies nothing more). DONE means
   every byte is in the decode's memory. A batch of at most ``INLINE_MAX_BYTES`` to a peer whose thread
   is idle is copied the same way in the writer's thread (``copy_inline``; ``write`` returns it DONE),
   unless the board's gate is held at that moment: then the thread takes it.
5. ``close`` drops the peers (joining their threads), closes the network backend, unmaps and unlinks.
Fencing: with a network backend that ``FencesWrites`` (tcp), ``FencingShmBackend`` fences both paths:
``close_fence`` is True once neither path can land a byte of the fence (a shared-memory writer still
inside the fence, maybe frozen mid-copy, makes it False until it leaves or dies; it cannot be cut).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any, cast

import msgspec

from transfer.auth import KVKeys
from transfer.base import (
    UNFENCED,
    Block,
    Fence,
    FencesWrites,
    NotifiesCompletion,
    PeerId,
    ProvesKey,
    Region,
    TransferBackend,
    WriteHandle,
    WriteState,
)
from transfer.errors import TransferError, TransferErrorKind
from transfer.memkind import device_regions
from transfer.peer_threads import PeerThreadBackend, SenderPeer
from transfer.shm_fences import FenceBoard
from transfer.shm_files import SHM_DIR, mapping_of
from transfer.shm_peer import INLINE_MAX_BYTES, Offer, ShmPeer, copy_blocks, copy_inline, map_offer, prefault, unmap

log = logging.getLogger(__name__)

_WATCH_S = 0.001  # how often the decode re-reads the marks of fences it waits on...
_WATCH_MAX_S = 0.02  # ...backing off to this while nothing changes


class _Endpoint(msgspec.Struct, array_like=True, frozen=True):
    network: str
    net: bytes
    offer: Offer | None = None


def _parse_same_host(value: object) -> bool:
    text = str(value).strip().lower()
    if text in ("1", "true", "on", "auto", "yes"):
        return True
    if text in ("0", "false", "off", "no"):
        return False
    raise ValueError(f"same_host must be auto or off, got {value!r}")


class ShmBackend(PeerThreadBackend):
    name = "shm"
    thread_name = "kv-shm-send"
    # a copy into shared memory needs no CPU of the decode: a write to a frozen decode completes
    WRITES_WITHOUT_TARGET = True
    inline_max_bytes = INLINE_MAX_BYTES  # small batches: copied in the writer's thread (copy_inline)

    def __init__(self, network: str | TransferBackend = "tcp", *, same_host: bool | str = True,
                 directory: str | None = None, **network_options: Any) -> None:
        super().__init__()
        self.same_host = _parse_same_host(same_host)  # (before the network backend exists: no leak)
        if isinstance(network, str):
            from transfer.registry import create_backend

            network = create_backend(network, **network_options)
        self.network: TransferBackend = network
        self._directory = directory
        self._regions: list[Region] = []
        self._offer: Offer | None = None
        self._fencing = False  # the decode fences (applied to the board once it exists)
        self.board: FenceBoard | None = None
        self._net_peers: dict[PeerId, int] = {}  # our peer id -> the network backend's
        self._net_writes: dict[WriteHandle, int] = {}  # our handle -> the network backend's

    # -- target side -----------------------------------------------------------------------------
    def register(self, regions: Sequence[Region]) -> None:
        self.network.register(regions)
        self._regions = list(regions)
        if self.same_host and self._offer is None:
            self._offer = self._make_offer()
            if self.board is not None:
                self.board.set_fencing(self._fencing)

    def set_kv_keys(self, keys: KVKeys | None) -> None:
        """(``ProvesKey``) passed on to the network backend where it has the ability; the shared-memory path
        needs none (its peer proves it maps our files, which only our host's user can)."""
        if isinstance(self.network, ProvesKey):
            self.network.set_kv_keys(keys)

    @property
    def num_peers_refused(self) -> int:
        """The network backend's data connections refused for not proving the workers' key."""
        return int(getattr(self.network, "num_peers_refused", 0))

    @property
    def num_refused_by_peers(self) -> int:
        """The network backend's data connections whose proof of the workers' key the peer refused."""
        return int(getattr(self.network, "num_refused_by_peers", 0))

    def endpoint(self) -> bytes:
        return msgspec.msgpack.encode(_Endpoint(self.network.name, self.network.endpoint(), self._offer))

    def _make_offer(self) -> Offer | None:
        """Offer our memory when every registered region lies in a shared file mapping."""
        files: list[str] = []
        placed: list[tuple[int, int, int, int]] = []
        for addr, length in self._regions:
            where = mapping_of(addr)
            if where is None or addr + length > where.end:
                log.info("shm: region at %#x is not in a shared file mapping: no same-host offer", addr)
                return None
            if where.path not in files:
                files.append(where.path)
            placed.append((addr, length, files.index(where.path), where.file_offset(addr)))
        try:
            self.board = FenceBoard.create(self._directory)
            nonce = self.board.nonce
            stamped = []
            for path in files:
                fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
                try:
                    size = os.fstat(fd).st_size
                    os.pwrite(fd, nonce, size)  # just past the pool: proves a peer maps this very file
                finally:
                    os.close(fd)
                stamped.append((path, size))
        except (OSError, ValueError) as exc:
            log.warning("shm: cannot offer same-host transfer: %s", exc)
            return None
        return Offer(self.board.path, nonce, stamped, placed)

    # -- initiator side --------------------------------------------------------------------------
    def connect(self, endpoint: bytes) -> PeerId:
        try:
            remote = msgspec.msgpack.decode(endpoint, type=_Endpoint)
        except msgspec.DecodeError as exc:
            raise TransferError(TransferErrorKind.PEER_UNREACHABLE, f"shm: bad endpoint: {exc}") from exc
        if remote.network != self.network.name:
            raise TransferError(
                TransferErrorKind.PROTOCOL,
                f"shm: the peer's network backend is {remote.network!r}, ours {self.network.name!r}",
            )
        on_device = device_regions(self._regions)  # our KV in GPU memory: memmove cannot read it
        if on_device and remote.offer is not None:
            log.info("shm: our KV is in GPU memory (cuda:%d): using %s", on_device[0][2], self.network.name)
        if self.same_host and remote.offer is not None and not on_device:
            try:
                peer = map_offer(remote.offer)
            except (OSError, ValueError) as exc:
                log.info("shm: no same-host path to the peer (%s): using %s", exc, self.network.name)
            else:
                log.info("shm: the peer's memory is mapped (nonce read back from %s): KV goes through shared "
                         "memory", remote.offer.board)
                peer_id = self._add_peer(peer)
                peer.prefaulter = threading.Thread(target=prefault, args=(peer,), name="kv-shm-prefault",
                                                   daemon=True)
                peer.prefaulter.start()
                return peer_id
        inner = self.network.connect(remote.net)
        with self._lock:
            if self._closed:
                closed = True
            else:
                closed = False
                peer_id = next(self._peer_ids)
                self._net_peers[peer_id] = inner
        if closed:
            self.network.disconnect(inner)
            raise TransferError(TransferErrorKind.ABORTED, "shm: backend closed")
        return peer_id

    def path_of(self, peer: PeerId) -> str:
        """``"shm"`` for a peer written through shared memory, else the network backend's name."""
        with self._lock:
            if peer in self._net_peers:
                return self.network.name
            if peer in self._peers:
                return "shm"
        raise KeyError(f"shm: unknown peer {peer}")

    def peer_paths(self) -> dict[str, int]:
        """Connected peers by data path: ``{"shm": n, <network backend>: m}`` (for metrics)."""
        with self._lock:
            return {"shm": len(self._peers), self.network.name: len(self._net_peers)}

    # -- writes ----------------------------------------------------------------------------------
    def write(self, peer: PeerId, blocks: Sequence[Block], fence: Fence = UNFENCED) -> WriteHandle:
        with self._lock:
            inner_peer = self._net_peers.get(peer)
        if inner_peer is None:
            return super().write(peer, blocks, fence)
        inner = self.network.write(inner_peer, blocks, fence)
        with self._lock:
            handle = next(self._handle_ids)
            self._net_writes[handle] = inner
        return handle

    def poll(self, handle: WriteHandle) -> WriteState:
        with self._lock:
            inner = self._net_writes.get(handle)
        return super().poll(handle) if inner is None else self.network.poll(inner)

    def error(self, handle: WriteHandle) -> TransferError | None:
        with self._lock:
            inner = self._net_writes.get(handle)
        return super().error(handle) if inner is None else self.network.error(inner)

    def started_at(self, handle: WriteHandle, unknown: float) -> float | None:
        with self._lock:
            inner = self._net_writes.get(handle)
        if inner is None:
            return super().started_at(handle, unknown)
        network = getattr(self.network, "started_at", None)  # (a backend that cannot tell: timed from its post)
        return unknown if network is None else cast(float | None, network(inner, unknown))

    def release(self, handle: WriteHandle) -> None:
        with self._lock:
            inner = self._net_writes.pop(handle, None)
        if inner is None:
            super().release(handle)
        else:
            self.network.release(inner)

    def set_completion_listener(self, listener: Callable[[], None] | None) -> None:
        super().set_completion_listener(listener)
        if isinstance(self.network, NotifiesCompletion):
            self.network.set_completion_listener(listener)

    def _send(self, peer: SenderPeer, blocks: list[Block], fence: Fence) -> TransferError | None:
        assert isinstance(peer, ShmPeer)
        return copy_blocks(peer, blocks, fence)

    def _send_small(self, peer: SenderPeer, blocks: list[Block], fence: Fence) -> tuple[bool, TransferError | None]:
        assert isinstance(peer, ShmPeer)
        return copy_inline(peer, blocks, fence)

    # -- peers and shutdown ----------------------------------------------------------------------
    def probe(self, peer: PeerId) -> bool:
        with self._lock:
            inner = self._net_peers.get(peer)
        return super().probe(peer) if inner is None else self.network.probe(inner)

    def fail_queued(self, peer: PeerId, error: TransferError) -> None:
        with self._lock:
            inner = self._net_peers.get(peer)
        if inner is None:
            super().fail_queued(peer, error)
        elif (fail := getattr(self.network, "fail_queued", None)) is not None:
            fail(inner, error)

    def disconnect(self, peer: PeerId) -> None:
        with self._lock:
            inner = self._net_peers.pop(peer, None)
        if inner is None:
            super().disconnect(peer)
        else:
            self.network.disconnect(inner)

    def _peer_ended(self, peer: SenderPeer) -> None:
        if isinstance(peer, ShmPeer):
            peer.stop.set()
            if peer.prefaulter is not None:
                peer.prefaulter.join(timeout=5.0)
            unmap(peer)

    def is_warm(self, peer: PeerId) -> bool:
        """Whether a shared-memory peer's mapping is fully pre-faulted (network peers: always True)."""
        with self._lock:
            target = self._peers.get(peer)
        return not isinstance(target, ShmPeer) or target.prefaulted.is_set()

    def _close_resources(self, threads_ended: bool) -> None:
        with self._lock:
            self._net_peers.clear()
        self.network.close()
        if self.board is not None:
            self.board.close()


class FencingShmBackend(ShmBackend):
    """``ShmBackend`` over a network backend that fences (tcp): the decode fences both paths. A writer
    frozen mid-copy cannot be cut off from shared memory: ``close_fence(cut=True)`` answers False until
    it resumes and leaves the fence (or dies), hence ``CUTS_SILENT_WRITERS = False``."""

    CUTS_SILENT_WRITERS = False

    def __init__(self, network: str | TransferBackend = "tcp", **kwargs: Any) -> None:
        super().__init__(network, **kwargs)
        if not isinstance(self.network, FencesWrites):
            raise TypeError(f"FencingShmBackend needs a network backend that fences, not {self.network.name!r}")
        self._fenced_net: FencesWrites = self.network
        self._fence_listener: Callable[[int, int], None] | None = None
        self._awaited: dict[tuple[int, int], set[str]] = {}  # fence -> parts still landing: shm, retry, net
        self._watch_wake = threading.Condition(self._lock)
        self._watcher: threading.Thread | None = None

    def set_fence_listener(self, listener: Callable[[int, int], None] | None) -> None:
        self._fence_listener = listener
        self._fenced_net.set_fence_listener(self._on_net_quiet if listener is not None else None)
        self._fencing = listener is not None
        if self.board is not None:
            self.board.set_fencing(listener is not None)

    def open_fence(self, room: int, generation: int) -> None:
        if self.board is not None:
            self.board.open_fence(room, generation)
        self._fenced_net.open_fence(room, generation)

    def close_fence(self, room: int, generation: int, *, cut: bool) -> bool:
        fence = (room, generation)
        with self._lock:
            parts: set[str] = set()
            if self.board is not None:
                writers = self.board.close_fence(room, generation)
                if writers is None:
                    parts.add("retry")
                elif writers:
                    parts.add("shm")
            if not self._fenced_net.close_fence(room, generation, cut=cut):
                parts.add("net")
            if not parts:
                return True
            self._awaited[fence] = parts
            if parts - {"net"}:
                self._start_watcher()
            return False

    def _on_net_quiet(self, room: int, generation: int) -> None:
        self._part_quiet((room, generation), "net")

    def _part_quiet(self, fence: tuple[int, int], part: str) -> None:
        with self._lock:
            parts = self._awaited.get(fence)
            if parts is None:
                return
            parts.discard(part)
            quiet = not parts
            if quiet:
                del self._awaited[fence]
        listener = self._fence_listener
        if quiet and listener is not None:
            listener(*fence)

    def _start_watcher(self) -> None:
        """(lock held) Run the thread that re-reads the board for fences still being written."""
        if self._watcher is None or not self._watcher.is_alive():
            self._watcher = threading.Thread(target=self._watch, name="kv-shm-fences", daemon=True)
            self._watcher.start()
        self._watch_wake.notify_all()

    def _watch(self) -> None:
        """Re-read the board for fences still being written: every ms at first, backing off to
        ``_WATCH_MAX_S`` while nothing changes (a writer frozen inside a fence); a new fence wakes it."""
        delay = _WATCH_S
        while True:
            with self._lock:
                while not self._closed and not any(parts - {"net"} for parts in self._awaited.values()):
                    self._watch_wake.wait()
                if self._closed:
                    return
                todo = [(fence, set(parts)) for fence, parts in self._awaited.items() if parts - {"net"}]
            board = self.board
            assert board is not None
            changed = False
            for fence, parts in todo:
                if "retry" in parts:
                    writers = board.close_fence(*fence)
                    if writers is None:
                        continue
                    changed = True
                    with self._lock:
                        if fence in self._awaited:
                            self._awaited[fence].discard("retry")
                            if writers:
                                self._awaited[fence].add("shm")
                    if not writers:
                        self._part_quiet(fence, "shm")
                elif not board.writers_of(*fence):
                    changed = True
                    self._part_quiet(fence, "shm")
            delay = _WATCH_S if changed else min(2 * delay, _WATCH_MAX_S)
            with self._lock:
                if not self._closed:
                    self._watch_wake.wait(delay)

    def _close_resources(self, threads_ended: bool) -> None:
        with self._lock:
            self._watch_wake.notify_all()
        if self._watcher is not None:
            self._watcher.join(timeout=2.0)
        super()._close_resources(threads_ended)


class ShmPlugin:
    """The ``shm`` entry point: ``create_backend("shm", network="tcp", same_host="auto", **network
    options)`` builds a ``FencingShmBackend`` when the network backend fences, else a ``ShmBackend``.
    ``SHARED_POOL``: a decode using it should put its KV pool in shared memory (``KVPool(shared=True)``)."""

    name = "shm"
    SHARED_POOL = True

    def __call__(self, network: str | TransferBackend = "tcp", **kwargs: Any) -> ShmBackend:
        _parse_same_host(kwargs.get("same_host", True))
        if isinstance(network, str):
            from transfer.registry import create_backend

            options = {k: kwargs.pop(k) for k in list(kwargs) if k not in ("same_host", "directory")}
            network = create_backend(network, **options)
        if isinstance(network, FencesWrites):
            return FencingShmBackend(network, **kwargs)
        return ShmBackend(network, **kwargs)

    @staticmethod
    def unavailable_reason() -> str | None:
        """Why the same-host path cannot work on this machine (None: it can)."""
        if not os.access(SHM_DIR, os.W_OK):
            return f"{SHM_DIR} is not writable"
        return None


create_shm_backend = ShmPlugin()
