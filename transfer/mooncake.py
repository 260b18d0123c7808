"""Mooncake Transfer Engine backend (``mooncake-transfer-engine``; P2P handshake, ``tcp`` protocol here).

Mooncake binds its listeners to 0.0.0.0 whatever host it is given: run it only inside a private network
namespace (``unshare --net``) on a machine that must stay loopback-only.

Lifecycle:
1. ``MooncakeBackend(host="127.0.0.1", protocol="tcp", advertise_host=None, options=None)`` initializes
   one engine whose ``local_hostname`` (what peers connect to) is ``advertise_host`` (default ``host``);
   metadata by P2P handshake unless ``options["metadata_server"]`` names a server. ``options``
   (``--transfer-option``, ``OPTIONS``): protocol (tcp, rdma), RDMA device names, metadata server,
   batch sizes, ``turn_bytes`` (rooms to one target take turns: ``transfer.peer_threads``), ``drain_timeout_s``
   (the most a failed batch's drain waits: ``_drain``).
2. ``register(regions)`` batch-registers them plus a tiny scratch buffer used to warm up connections.
3. ``endpoint()`` = msgpack ``{session "host:rpc_port", scratch address, registered regions, a random id of the
   process}``.
4. ``connect`` does one 8-byte sync write into the peer's scratch (pays the handshake now; an
   unreachable peer raises PEER_UNREACHABLE).
5. ``write`` range-checks the blocks against the peer's advertised regions and queues them on the
   peer's sender thread, which moves them with ``batch_transfer_sync_write`` in sub-batches of at most
   ``max_batch_blocks`` entries while keeping at most ``max_inflight_blocks`` entries in flight per target
   session. (Measured with 0.3.13.post1 over tcp: batches in flight together to one target holding more
   than 2048 entries fail, some only after MC_TRANSFER_TIMEOUT; to different targets, 6 x 1024 at once
   succeed. An engine-wide budget let two frozen decodes' batches, each held until that timeout, stall
   every other decode's transfers for 30 s.) The blocking call runs in that thread because Mooncake has no
   non-blocking status for a multi-entry batch.
6. ``close`` unregisters the memory; sender threads end once their engine call returns.
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import importlib.util
import logging
import os
import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from transfer.base import (
    Block,
    Fence,
    PeerId,
    Region,
    fenced,
)
from transfer.blocks import RegionSet
from transfer.errors import TransferError, TransferErrorKind
from transfer.memkind import device_regions
from transfer.netaddr import is_wildcard
from transfer.options import (
    Option,
    TransferOptionError,
    choice,
    name_list,
    parse_options,
    positive_float_or_inf,
    positive_int,
)
from transfer.peer_threads import PeerThreadBackend, SenderPeer

log = logging.getLogger(__name__)

_SCRATCH_BYTES = 64
ENGINE_MAX_ENTRIES = 2048  # entries Mooncake's tcp transport accepts in flight to one target (lifecycle note)
# (of those, it queues 1024 at once: the rest wait for admission, at most 1 s, MC_TCP_ADMISSION_TIMEOUT_MS)
# A failed batch's drain re-sends this many of its entries (``MooncakeBackend._drain``): a few per lane (4 by default,
# MC_TCP_LANES_PER_PEER), few next to what a starved engine moves within the admission timeout.
_RESEND_ENTRIES = 64
RDMA_TURN_BYTES = 32 << 20  # ``turn_bytes`` over rdma (not measured here: no RDMA on this machine)
_PROBE_WAIT_S = 1.0  # send_probe blocks ~60 s on a frozen peer: give up waiting after this
# After a re-send of a failed batch completed (``MooncakeBackend._drain``): a connection that carried a timed-out
# call retransmits at the latest its backoff's interval later, which is at most the time since it first sent (plus
# the first timeout) and at most TCP's RTO_MAX; then its bytes land within a margin.
_FIRST_RTO_S = 1.0  # (a SYN's first retransmission timeout; a data segment's is at least 0.2 s)
_TCP_RTO_MAX_S = 120.0
_LANDING_MARGIN_S = 2.0
_WARM_UP_TRIES = 2
_DRAIN_WARN_EVERY_S = 10.0
# The most a failed batch's drain waits for the engine to move it (``drain_timeout_s``): past it, an engine that never
# completes a re-send (a decode frozen for good) no longer holds the peer's sender thread, its budget and the decode's
# control connection for good; the write fails (TIMEOUT) and the peer is dropped.
DRAIN_TIMEOUT_S = 300.0


class _Endpoint(msgspec.Struct, array_like=True, frozen=True):
    session: str
    scratch: int
    regions: list[tuple[int, int]]
    process: int = 0  # random per backend: one process's endpoints are equal, two processes' are not


@dataclass(eq=False)
class _McPeer(SenderPeer):
    regions: RegionSet = field(default_factory=lambda: RegionSet([]))  # what the peer registered
    target: str = ""  # the name engine calls give for its session (``MooncakeBackend._target_name``)

    @property
    def session(self) -> str:
        return self.label


def _transfer_timeout_s() -> float:
    try:
        return max(5.0, float(os.environ.get("MC_TRANSFER_TIMEOUT", "30")))
    except ValueError:
        return 30.0


def _metadata_server(raw: object) -> str:
    text = str(raw).strip()
    if text != "P2PHANDSHAKE" and not text.startswith(("etcd://", "http://", "https://", "redis://")):
        raise ValueError("must be P2PHANDSHAKE or a URL etcd://host:port, http(s)://host:port/path, redis://...")
    return text


def in_private_netns() -> bool:
    """True inside a network namespace holding only loopback (``unshare --net``)."""
    try:
        return [name for _, name in socket.if_nameindex()] == ["lo"]
    except OSError:
        return False


def _check_rdma_devices(device_name: str, root: str = "/sys/class/infiniband") -> None:
    """protocol=rdma needs RDMA devices, and the ones named must exist (Mooncake itself would initialize
    without any and fail every transfer later)."""
    have = sorted(os.listdir(root)) if os.path.isdir(root) else []
    if not have:
        raise TransferOptionError(f"transfer backend 'mooncake': option protocol=rdma: this machine has no RDMA "
                                  f"device ({root} is empty); use protocol=tcp")
    missing = [dev for dev in device_name.split(",") if dev and dev not in have]
    if missing:
        raise TransferOptionError(f"transfer backend 'mooncake': option device_name: no RDMA device "
                                  f"{', '.join(missing)} here (have: {', '.join(have)})")


def _cpu_only_build() -> bool:
    try:
        importlib.metadata.distribution("mooncake-transfer-engine-non-cuda")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


class MooncakeBackend(PeerThreadBackend):
    name = "mooncake"
    thread_name = "kv-mc-send"
    # a sync engine call may run for MC_TRANSFER_TIMEOUT on a frozen peer: fail its write at once, and
    # let disconnect return without waiting for it (close waits 2 s, then leaves the memory registered)
    fail_inflight_on_drop = True
    join_on_disconnect = False
    join_timeout_s = 2.0

    @classmethod
    def unavailable_reason(cls) -> str | None:
        if importlib.util.find_spec("mooncake") is None:
            return "mooncake-transfer-engine is not installed"
        if not in_private_netns():
            return ("Mooncake binds 0.0.0.0: run it only inside a private network namespace "
                    "(unshare --net -- sh -c 'ip link set lo up && exec ...')")
        return None

    OPTIONS = (
        Option("protocol", choice("tcp", "rdma"), "Mooncake transport (default tcp)"),
        Option("device_name", lambda raw: ",".join(name_list(raw, what="RDMA device")),
               "RDMA devices to use, comma-separated (e.g. mlx5_0,mlx5_1; rdma only; default: all)"),
        Option("metadata_server", _metadata_server, "P2PHANDSHAKE (default) or the metadata server's URL"),
        Option("max_batch_blocks", positive_int, "entries per sub-batch (default 1024)"),
        Option("max_inflight_blocks", positive_int, "entries in flight to one target (default 2048)"),
        Option("turn_bytes", positive_int, "the most of one room's batch sent before another room's turn to the "
               "same target (default 4 MiB over tcp, 32 MiB over rdma)"),
        Option("drain_timeout_s", positive_float_or_inf, "the most a failed batch's drain waits for the engine to "
               "complete a re-send before the write fails and the peer is dropped (default 300; inf: until one "
               "completes, never telling a decode Quiesced with bytes still held)"),
    )

    def __init__(
        self,
        host: str = "127.0.0.1",
        protocol: str = "tcp",
        device_name: str = "",
        max_batch_blocks: int = 1024,
        max_inflight_blocks: int = ENGINE_MAX_ENTRIES,
        *,
        advertise_host: str | None = None,
        options: dict[str, object] | None = None,
    ) -> None:
        opts = parse_options(self.name, options, self.OPTIONS)
        protocol = opts.get("protocol", protocol)
        device_name = opts.get("device_name", device_name)
        metadata = opts.get("metadata_server", "P2PHANDSHAKE")
        max_batch_blocks = opts.get("max_batch_blocks", max_batch_blocks)
        max_inflight_blocks = opts.get("max_inflight_blocks", max_inflight_blocks)
        self._drain_timeout_s: float = opts.get("drain_timeout_s", DRAIN_TIMEOUT_S)
        if advertise_host is None and is_wildcard(host):
            raise ValueError(f"mooncake: bound to {host!r}, so it needs an advertise_host peers can reach")
        local = (advertise_host or host).strip("[]")
        if metadata == "P2PHANDSHAKE" and ":" in local:  # (an IPv6 literal: a host name has no colon)
            # (its handshake cannot reach a session "addr:port" with an IPv6 literal, bracketed or not: every
            # decode's registration would fail, the worker looking healthy)
            raise TransferError(
                TransferErrorKind.PROTOCOL,
                f"mooncake: peers would reach this worker at the IPv6 address {local}, which Mooncake's P2P "
                "handshake does not support; advertise an IPv4 address (--advertise-host) or use another transfer "
                "backend (tcp, nixl)",
            )
        if protocol == "rdma":
            _check_rdma_devices(device_name)
        if not 0 < max_batch_blocks <= max_inflight_blocks:
            raise ValueError(
                f"mooncake: need 0 < max_batch_blocks ({max_batch_blocks}) <= max_inflight_blocks "
                f"({max_inflight_blocks})"
            )
        self._max_batch = max_batch_blocks
        self._max_inflight = max_inflight_blocks
        # target session -> entries in flight to it (one sender thread per peer sends one batch at a time: two
        # meet here when a reconnected peer's old thread is still in a call to the same session)
        self._inflight: dict[str, int] = {}
        self._budget = threading.Condition()
        try:
            from mooncake.engine import TransferEngine
        except ImportError as exc:
            raise TransferError(
                TransferErrorKind.PEER_UNREACHABLE, f"mooncake: cannot import mooncake.engine: {exc}"
            ) from exc
        # With a metadata server our segment is registered there under the name we initialize with, which must be
        # unique: named by the host alone, a second worker on this host failed to start (a duplicate), and its
        # failed start deleted the first one's entry, so that a third took the first one's name. "host:N" with N a
        # port number this backend holds (bound, never listening) for its lifetime: no other one on this host has it.
        self._name_lease: socket.socket | None = None
        name = local
        if metadata != "P2PHANDSHAKE":
            self._name_lease = socket.socket(socket.AF_INET6 if ":" in local else socket.AF_INET)
            self._name_lease.bind(("", 0))
            name = f"{local}:{self._name_lease.getsockname()[1]}"
        self._engine: Any = TransferEngine()
        rc = self._engine.initialize(name, metadata, protocol, device_name)
        if rc != 0:
            if self._name_lease is not None:
                self._name_lease.close()
            raise TransferError(
                TransferErrorKind.PEER_UNREACHABLE,
                f"mooncake: initialize(local_hostname={name}, metadata_server={metadata}, protocol={protocol}, "
                f"device_name={device_name!r}) -> {rc}",
            )
        # P2P handshake: peers name us "host:rpc_port"; with a metadata server, by our segment name.
        self._session = f"{local}:{self._engine.get_rpc_port()}" if metadata == "P2PHANDSHAKE" else name
        self._p2p = metadata == "P2PHANDSHAKE"
        # session -> (the name its last connection used, that connection's endpoint) (``_target_name``)
        self._names: dict[str, tuple[str, bytes]] = {}
        self._process = int.from_bytes(os.urandom(8), "little")
        super().__init__()  # peers, sender threads, write records (transfer.peer_threads)
        # (each turn is one more engine call and its wait: larger over rdma, where 4 MiB moves in ~0.2 ms)
        self.turn_bytes = opts.get("turn_bytes", RDMA_TURN_BYTES if protocol == "rdma" else self.turn_bytes)
        self._registered: list[int] = []
        self._regions: list[Region] = []
        self._scratch = (ctypes.c_ubyte * _SCRATCH_BYTES)()

    def register(self, regions: Sequence[Region]) -> None:
        on_device = device_regions(regions)  # a KV pool built with --device cuda
        if on_device and _cpu_only_build():
            raise TransferError(
                TransferErrorKind.PROTOCOL,
                f"mooncake: the KV pool is in GPU memory (cuda:{on_device[0][2]}) but the installed Mooncake is "
                "the CPU build (mooncake-transfer-engine-non-cuda): install mooncake-transfer-engine instead",
            )
        # Location "*" (the batch call's): Mooncake's CUDA build finds each buffer's device itself.
        scratch = ctypes.addressof(self._scratch)
        all_regions = [*regions, (scratch, _SCRATCH_BYTES)]
        addrs = [addr for addr, _ in all_regions]
        rc = self._engine.batch_register_memory(addrs, [length for _, length in all_regions])
        if rc != 0:
            raise TransferError(TransferErrorKind.RANGE_REJECTED, f"mooncake: batch_register_memory -> {rc}")
        self._registered = addrs
        self._regions = list(all_regions)

    def endpoint(self) -> bytes:
        return msgspec.msgpack.encode(
            _Endpoint(self._session, ctypes.addressof(self._scratch), [(a, n) for a, n in self._regions],
                      self._process)
        )

    def connect(self, endpoint: bytes) -> PeerId:
        try:
            remote = msgspec.msgpack.decode(endpoint, type=_Endpoint)
        except msgspec.DecodeError as exc:
            raise TransferError(TransferErrorKind.PEER_UNREACHABLE, f"mooncake: bad endpoint: {exc}") from exc
        target = self._target_name(remote.session, bytes(endpoint))
        rc = -1
        for _ in range(_WARM_UP_TRIES):  # (the first one may fail on a pooled connection to a dead process)
            rc = self._engine.transfer_sync_write(target, ctypes.addressof(self._scratch), remote.scratch, 8)
            if rc == 0:
                break
        if rc != 0:
            raise TransferError(
                TransferErrorKind.PEER_UNREACHABLE, f"mooncake: warm-up write to {remote.session} -> {rc}"
            )
        return self._add_peer(_McPeer(label=remote.session, regions=RegionSet(remote.regions), target=target))

    def _target_name(self, session: str, endpoint: bytes) -> str:
        """The name to give the engine for ``session`` on a new connection. The engine caches a session's segment
        descriptor (its data port, its buffers) for as long as it runs, and never refreshes it: a decode restarted
        under its predecessor's session (the same "host:rpc_port") on another data port was unreachable for the
        life of this process, its writes dialling the old data port (or whatever now listens there). So a
        connection whose endpoint (buffers, scratch) differs from the last one's under that session names it anew,
        its port with one more leading zero (the same address to the handshake; a name the engine has not cached,
        so it fetches the peer's descriptor afresh); a reconnection to the same process keeps its name. With a
        metadata server the name is the key of its entry there and stays as it is."""
        host, sep, port = session.rpartition(":")
        with self._budget:
            last = self._names.get(session)
            if last is None or not self._p2p or not sep or not port.isdigit():
                name = session
            elif last[1] == endpoint:
                name = last[0]
            else:
                name = f"{host}:0{last[0].rpartition(':')[2]}"
            self._names[session] = (name, endpoint)
        return name

    def _refuse(self, peer: SenderPeer, blocks: Sequence[Block]) -> TransferError | None:
        # (after a target rejects a write, the next one to it stalls ~1 s: check here instead)
        assert isinstance(peer, _McPeer)
        if peer.regions.all_contain([(dst, length) for _, dst, length in blocks]):
            return None
        return TransferError(
            TransferErrorKind.RANGE_REJECTED, f"mooncake: a block writes outside the memory {peer.session} registered"
        )

    def _send(self, peer: SenderPeer, blocks: list[Block], fence: Fence) -> TransferError | None:
        timeout_s = _transfer_timeout_s()
        for start in range(0, len(blocks), self._max_batch):
            if peer.dead is not None:
                return peer.dead
            if not fence.live():  # the room died on our side: send none of the rest
                return fenced("mooncake", fence)
            part = blocks[start : start + self._max_batch]
            started = time.monotonic()
            rc = self._call(peer, part, fence)
            if isinstance(rc, TransferError):
                return rc
            if rc != 0:
                # (not only a timeout: the engine answers -1 as soon as one slice failed, while the others go on;
                # measured: a batch of more than 1024 entries to a decode stalled for a second fails after 1 s, the
                # tcp lanes' admission timeout, and the slices the lanes had in hand land once the decode runs)
                error = self._classify(peer.label, rc, time.monotonic() - started, timeout_s)
                return self._drain(peer, part, error, started)
        return peer.dead

    def _call(self, peer: SenderPeer, part: list[Block], fence: Fence | None) -> int | TransferError:
        """One engine call for ``part`` within the target's in-flight budget: its return code, or why it was not
        made (the peer dropped, or, given a ``fence``, the room died while it waited for the budget)."""
        assert isinstance(peer, _McPeer)
        # (the budget is the target's, whichever name a connection calls it by)
        session, inflight = peer.label, self._inflight
        # The wait for the budget may outlast the peer or the room (the same target's other batch held it: a
        # frozen decode): a batch sent after that could land in pages its decode has already given back.
        while True:
            with self._budget:
                held = inflight.get(session, 0)
                if held + len(part) <= self._max_inflight:
                    inflight[session] = held + len(part)
                    break
                self._budget.wait(0.05)  # (woken by a batch ending; a dropped peer or dead room ends none)
            if peer.dead is not None:  # (``fence.live`` outside the budget's lock: it may take the manager's)
                return peer.dead
            if fence is not None and not fence.live():
                return fenced("mooncake", fence)
        try:
            rc: int = self._engine.batch_transfer_sync_write(
                peer.target, [b[0] for b in part], [b[1] for b in part], [b[2] for b in part]
            )
        finally:
            with self._budget:
                left = inflight[session] - len(part)
                if left:
                    inflight[session] = left
                else:
                    del inflight[session]
                self._budget.notify_all()
        return rc

    def _drain(self, peer: SenderPeer, part: list[Block], error: TransferError, began: float) -> TransferError:
        """The engine failed a batch (timed it out, or failed one of its slices), but that does not stop the
        batch: the engine goes on moving the rest of it, and those bytes land once the target runs again (a frozen
        decode resumed, a path that cleared; measured with 0.3.13.post1 over tcp: 256 MiB landed after a timeout's
        -1, and the slices in hand after a quick -1). A decode that does not fence writes frees a room's
        pages once told its writes are over, so the write stays in flight until the batch is: its first entries
        are sent again (harmless: the same source into the same pages, still the room's) until a call completes,
        queued behind what is left of the batch in the engine. (A few of them, ``_RESEND_ENTRIES``: a batch of more
        than 1024 entries, re-sent whole every 0.1 s, filled the engine's admission queue with its own copies and
        never completed, each call failing at once and leaving slices in flight; and re-sends of the engine's whole
        queue, 1024 entries, never completed on a starved prefill (measured under a 3% cpu quota; a loaded CI host
        saw it): each waited for admission behind what the last one left queued, which the starved engine did not
        move within the admission timeout, 1 s, and later ones were refused at once, the admission queue full,
        while the connections sat idle; re-sends of 8 or 64 entries completed within 4 s of the decode resuming.)
        That call's bytes do not follow the failed ones on one connection: they go over connections of their own,
        fresh while the failed calls' (``began``: the first of them) backed their retransmissions off on a dark path
        (measured: a whole timed-out batch landed 7 s after a re-send completed). So the write ends only once those
        retransmit too:
        at most as long after the path cleared as they had been sending (TCP doubles the wait each time), at most
        TCP's RTO_MAX. Writes queued behind it fail now (nothing of them is on the wire). Ends early only when the
        peer is dropped, or after ``drain_timeout_s`` (an engine that never completes a re-send: a decode frozen for
        good): the peer is then dropped (its sender thread, budget and control connection freed; a later room
        connects afresh) and the write fails TIMEOUT. Bytes the engine still holds may then land should that decode
        ever run again: bounded, not fenced (docs/transfer.md)."""
        stalled = f"mooncake: the data path to {peer.label} failed or stalled behind another room's write"
        self.fail_queued(peer.peer_id, TransferError(TransferErrorKind.PEER_GONE, stalled))
        resend = part[:_RESEND_ENTRIES]
        failed, said = 0, time.monotonic()
        give_up_at = began + self._drain_timeout_s
        while peer.dead is None:
            called = time.monotonic()
            if called >= give_up_at:
                return self._give_up(peer, error, called - began, failed)
            rc = self._call(peer, resend, None)
            if isinstance(rc, TransferError):
                return rc
            if rc != 0:
                failed += 1
                if time.monotonic() - said >= _DRAIN_WARN_EVERY_S:  # (a drain that does not end says why)
                    said = time.monotonic()
                    log.warning("mooncake: a failed batch to %s is still draining %.0fs on: %d re-sends failed, "
                                "the last (%d) after %.1fs", peer.label, said - began, failed, rc, said - called)
            if rc == 0:
                now = time.monotonic()
                until = now + min(now - began + _FIRST_RTO_S, _TCP_RTO_MAX_S) + _LANDING_MARGIN_S
                while peer.dead is None and time.monotonic() < until:
                    time.sleep(0.1)
                break
            if peer.dead is None:
                time.sleep(0.1)  # (a dead path fails at once: no busy loop)
        return peer.dead or error

    def _give_up(self, peer: SenderPeer, error: TransferError, waited_s: float, failed: int) -> TransferError:
        """The drain's bound passed with no re-send completed: drop the peer (its thread ends, new rooms connect
        afresh) and fail the write TIMEOUT."""
        message = (f"mooncake: a failed batch to {peer.label} did not drain within drain_timeout_s "
                   f"({self._drain_timeout_s:g}s; {waited_s:.0f}s, {failed} re-sends failed): the engine never "
                   f"completed a re-send (a decode frozen or unreachable for good); peer dropped ({error.message})")
        log.error("%s", message)
        gave_up = TransferError(TransferErrorKind.TIMEOUT, message)
        peer.dead = peer.dead or gave_up
        return peer.dead

    @staticmethod
    def _classify(session: str, rc: int, elapsed: float, timeout_s: float) -> TransferError:
        # -1 covers a dead peer, a reset connection, a server-side reject and the engine's own timeout;
        # probing would block for a minute on a frozen peer, so tell them apart by time.
        if elapsed >= timeout_s - 0.5:
            return TransferError(
                TransferErrorKind.TIMEOUT, f"mooncake: batch to {session} timed out after {elapsed:.1f}s"
            )
        return TransferError(
            TransferErrorKind.PEER_GONE,
            f"mooncake: batch to {session} failed ({rc}): peer gone, reset or refusing",
        )

    def probe(self, peer: PeerId) -> bool:
        target = self._peer(peer)
        if not isinstance(target, _McPeer) or target.dead is not None:
            return False
        result: list[int] = []
        thread = threading.Thread(
            target=lambda: result.append(self._engine.send_probe(target.target)), name="kv-mc-probe", daemon=True
        )
        thread.start()
        thread.join(_PROBE_WAIT_S)
        return bool(result) and result[0] == 0

    def _close_resources(self, threads_ended: bool) -> None:
        if not threads_ended:
            # An engine call is still running against this memory: leave it registered (the engine is
            # torn down with the process) rather than pull it from under the call.
            log.warning("mooncake: closing with a batch still in flight; memory stays registered")
        elif self._registered:
            self._engine.batch_unregister_memory(self._registered)
            self._registered = []
        if self._name_lease is not None:
            self._name_lease.close()
