"""NIXL backend (UCX; DRAM, and VRAM for a KV pool on a GPU). ``nixl_cu12._api`` is imported directly,
so that torch is not pulled in.

Lifecycle:
1. ``NixlBackend(advertise_host=None, options=None)`` creates one agent (unique name, NIXL's progress
   thread, no listener thread: the agent metadata travels over our own control plane) with the NIXL
   backends of ``options["backends"]`` (default UCX). UCX settings
   come from ``options`` (``--transfer-option``, ``OPTIONS``): transports (``ucx_tls``), net devices
   (``ucx_net_devices``; by default the interface holding ``advertise_host``, so the addresses in our
   metadata are the ones the worker advertises), error handling mode, workers.
2. ``register(regions)`` registers them plus a small scratch buffer used for warm-up writes: host memory
   as DRAM, device memory (``transfer.memkind``: a KV pool built with ``--device cuda``) as VRAM with its
   device id. The endpoint lists the VRAM regions, so a writer knows the memory type of each destination;
   a batch mixing types (GPU KV pages and the host aux slot) becomes one NIXL transfer per pair of types
   (a part that fails fails the batch only once no other part of it moves: those bytes may still land).
3. ``endpoint()`` = msgpack ``{agent metadata, scratch address}``.
4. ``connect`` loads the peer's metadata (``add_remote_agent``) and makes one tiny WRITE into the peer's
   scratch, so the UCX wire-up (up to ~2 s) is paid here and not on a request's path.
5. ``write`` only queues the batch: building the descriptor lists, ``initialize_xfer("WRITE")`` and
   ``transfer`` take milliseconds (UCX may even push the bytes inline), so the peer's sender thread
   (``transfer.peer_threads``, pipelined) does them for queued batches in turns of at most ``turn_bytes``
   (rooms round-robin) while less than ``pipeline_bytes`` (default: 10 ms at the link's measured rate) is
   in flight, then polls ``check_xfer_state`` of every turn in flight, sleeping ~0.2 ms between rounds
   (spinning on it was slower on 2 cores). ``poll`` only reads the state it recorded. A destination the peer never
   registered is refused by NIXL (RANGE_REJECTED). NIXL imposes no deadline on a frozen peer (the
   write stays "PROC"): the KV manager's timeouts do.
6. ``disconnect`` fails the peer's writes at once; its thread releases their handles and removes the
   remote agent. ``close`` does that for every peer, then deregisters memory.
Every agent call is made under one lock.
"""

from __future__ import annotations

import ctypes
import importlib
import importlib.util
import os
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from transfer.base import (
    Block,
    Fence,
    PeerId,
    Region,
    WriteState,
)
from transfer.errors import TransferError, TransferErrorKind
from transfer.memkind import DeviceRegion, device_regions, find_device
from transfer.netaddr import interface_of
from transfer.options import (
    Option,
    TransferOptionError,
    choice,
    name_list,
    non_negative_int,
    parse_options,
    positive_int,
)
from transfer.peer_threads import PeerThreadBackend, SenderPeer

_SCRATCH_BYTES = 64
_WARMUP_TIMEOUT_S = 10.0
_POLL_SLEEP_S = 0.0002


class _Endpoint(msgspec.Struct, array_like=True, frozen=True):
    metadata: bytes
    scratch: int
    vram: list[tuple[int, int, int]] = []  # (addr, length, device) of registered device memory


def xfer_groups(
    blocks: Sequence[Block], local_vram: Sequence[DeviceRegion], remote_vram: Sequence[DeviceRegion]
) -> list[tuple[tuple[str, int, str, int], list[Block]]]:
    """Blocks grouped by (local memory type, device, remote memory type, device), in first-seen order:
    NIXL takes one memory type per descriptor list. On a CPU pool: one group, DRAM to DRAM."""
    groups: dict[tuple[str, int, str, int], list[Block]] = {}
    for block in blocks:
        src, dst, length = block
        local = find_device(local_vram, src, length)
        remote = find_device(remote_vram, dst, length)
        key = ("DRAM" if local is None else "VRAM", local or 0, "DRAM" if remote is None else "VRAM", remote or 0)
        groups.setdefault(key, []).append(block)
    return list(groups.items())


_ENDED = ("DONE", "ERR")  # NIXL transfer states past which no byte of it moves ("PROC": moving)


@dataclass(eq=False)
class _Posted:
    """One batch's NIXL transfers (one per memory-type pair: ``xfer_groups``)."""

    xfers: list[Any] = field(default_factory=list)  # every handle made (each released at the end)
    started: list[Any] = field(default_factory=list)  # those whose ``transfer`` returned (their bytes may move)
    states: list[str] = field(default_factory=list)  # what each started one's ``transfer`` answered
    error: TransferError | None = None  # a part failed: the batch fails once none of the others moves


@dataclass(eq=False)
class _NixlPeer(SenderPeer):
    name: Any = None  # what add_remote_agent returned
    vram: list[DeviceRegion] = field(default_factory=list)  # the peer's device memory (from its endpoint)


def _import_api() -> Any:
    # The meta package ``nixl`` picks a CUDA flavour at import time via torch; the flavoured module does not.
    errors = []
    for module in ("nixl_cu12._api", "nixl_cu13._api", "nixl._api"):
        try:
            return importlib.import_module(module)
        except ImportError as exc:
            errors.append(f"{module}: {exc}")
    raise TransferError(TransferErrorKind.PEER_UNREACHABLE, f"nixl: cannot import nixl ({'; '.join(errors)})")


def _map_error(exc: Exception, what: str) -> TransferError:
    name = type(exc).__name__
    if name == "nixlNotFoundError":
        kind = TransferErrorKind.RANGE_REJECTED
    elif name in ("nixlRemoteDisconnectError", "nixlBackendError"):
        kind = TransferErrorKind.PEER_GONE
    else:
        kind = TransferErrorKind.PROTOCOL
    return TransferError(kind, f"nixl: {what}: {name}: {exc}")


# UCX transport names accepted in ``ucx_tls`` (a leading ^ excludes; see ``ucx_info -d``).
UCX_TRANSPORTS = (
    "all", "tcp", "self", "sm", "shm", "posix", "sysv", "cma", "knem", "xpmem", "ib", "rc", "rc_v", "rc_x",
    "rc_mlx5", "ud", "ud_v", "ud_x", "ud_mlx5", "dc", "dc_x", "dc_mlx5", "cuda", "cuda_copy", "cuda_ipc",
    "gdr_copy", "rocm", "rocm_copy", "rocm_ipc", "mm",
)


def rdma_ports(root: str = "/sys/class/infiniband") -> list[str]:
    """Every RDMA device port of this machine as UCX names it (``mlx5_0:1``)."""
    if not os.path.isdir(root):
        return []
    ports = []
    for device in sorted(os.listdir(root)):
        port_dir = os.path.join(root, device, "ports")
        if os.path.isdir(port_dir):
            ports += [f"{device}:{port}" for port in sorted(os.listdir(port_dir), key=lambda p: (len(p), p))]
    return ports


def _backend_params(opts: dict[str, Any], num_threads: int, advertise_host: str | None) -> dict[str, str]:
    """The UCX plugin's init parameters for ``opts`` (its ``engine_config`` carries UCX settings)."""
    params: dict[str, str] = {}
    threads = opts.get("num_threads", num_threads)
    if threads:
        params["num_threads"] = str(threads)
    if "ucx_num_workers" in opts:
        params["num_workers"] = str(opts["ucx_num_workers"])
    if "ucx_error_handling_mode" in opts:
        params["ucx_error_handling_mode"] = opts["ucx_error_handling_mode"]
    devices = opts.get("ucx_net_devices")
    if devices is None and advertise_host is not None and "UCX_NET_DEVICES" not in os.environ:
        # Our metadata then holds the advertised address as the only IP one; RDMA ports stay usable.
        iface = interface_of(advertise_host)
        devices = ",".join([iface, *rdma_ports()]) if iface else None
    if devices:
        params["ucx_devices"] = devices
    if "ucx_tls" in opts:
        params["engine_config"] = f"TLS={opts['ucx_tls']}"
    return params


class NixlBackend(PeerThreadBackend):
    name = "nixl"
    thread_name = "kv-nixl-send"
    # NIXL progresses transfers itself: the peer's thread starts every queued batch, then polls
    pipelined = True
    poll_sleep_s = _POLL_SLEEP_S
    fail_inflight_on_drop = True  # (a frozen peer's write stays PROC: a drop fails it at once)

    @classmethod
    def unavailable_reason(cls) -> str | None:
        if not any(importlib.util.find_spec(m) is not None for m in ("nixl_cu12", "nixl_cu13", "nixl")):
            return "nixl is not installed"
        return None

    OPTIONS = (
        Option("backends", name_list, "NIXL backends (plugins) to create, comma-separated (default UCX)"),
        Option("ucx_tls", lambda raw: ",".join(name_list(raw, allowed=UCX_TRANSPORTS, what="UCX transport")),
               "UCX transports, comma-separated, as UCX_TLS (e.g. tcp; rc,cuda_copy,cuda_ipc); default: UCX's"),
        Option("ucx_net_devices", lambda raw: ",".join(name_list(raw, what="net device")),
               "UCX net devices, as UCX_NET_DEVICES (e.g. eth0, mlx5_0:1); default: the advertised interface "
               "and every RDMA port"),
        Option("ucx_error_handling_mode", choice("peer", "none"),
               "peer (default: a dead peer fails its writes) or none (needed by shared-memory-only UCX_TLS)"),
        Option("ucx_num_workers", positive_int, "UCX workers of the agent (default 1)"),
        Option("num_threads", non_negative_int, "NIXL backend threads (default 0: none)"),
        Option("turn_bytes", positive_int, "the most of one room's batch posted before another room's turn to the "
               "same peer (default 4 MiB)"),
        Option("pipeline_bytes", positive_int, "turns are posted to a peer while less than this is in flight to it "
               "(default: 10 ms of its link's measured rate, at least two turns in flight)"),
    )

    def __init__(self, num_threads: int = 0, *, host: str | None = None, advertise_host: str | None = None,
                 options: dict[str, object] | None = None) -> None:
        opts = parse_options(self.name, options, self.OPTIONS)
        api = _import_api()
        config = api.nixl_agent_config(enable_prog_thread=True, enable_listen_thread=False, backends=[])
        self._agent_name = f"pd-{uuid.uuid4().hex}"
        try:
            self._agent: Any = api.nixl_agent(self._agent_name, config)
        except Exception as exc:
            raise _map_error(exc, "creating the agent") from exc
        params = _backend_params(opts, num_threads, advertise_host or host)
        for backend in opts.get("backends", ["UCX"]):
            if backend not in self._agent.plugin_list:
                available = ", ".join(self._agent.plugin_list)
                raise TransferOptionError(
                    f"transfer backend 'nixl': option backends: no NIXL plugin {backend!r} (available: {available})"
                )
            try:
                self._agent.create_backend(backend, params if backend == "UCX" else {})
            except Exception as exc:
                raise _map_error(exc, f"creating backend {backend} with {params}") from exc
        self._agent_lock = threading.RLock()  # every agent call
        # Peers per remote agent: two connections to one process (a reconnect while the old one's thread
        # is still ending) share its loaded metadata, removed only when the last of them ends.
        self._remote_refs: dict[Any, int] = {}
        super().__init__()  # peers, sender threads, write records (transfer.peer_threads)
        self.turn_bytes = opts.get("turn_bytes", self.turn_bytes)
        self.pipeline_bytes = opts.get("pipeline_bytes", self.pipeline_bytes)
        self._reg: list[Any] | None = None
        self._vram: list[DeviceRegion] = []  # our registered device memory
        self._scratch = (ctypes.c_ubyte * _SCRATCH_BYTES)()

    def register(self, regions: Sequence[Region]) -> None:
        self._vram = device_regions(regions)
        on_device = {addr for addr, _, _ in self._vram}
        entries = [(addr, length, 0, "") for addr, length in regions if addr not in on_device]
        entries.append((ctypes.addressof(self._scratch), _SCRATCH_BYTES, 0, ""))
        with self._agent_lock:
            try:
                self._reg = [self._agent.register_memory(entries, "DRAM")]
                if self._vram:
                    vram = [(addr, length, device, "") for addr, length, device in self._vram]
                    self._reg.append(self._agent.register_memory(vram, "VRAM"))
            except Exception as exc:
                raise _map_error(exc, "register_memory") from exc

    def endpoint(self) -> bytes:
        with self._agent_lock:
            metadata = self._agent.get_agent_metadata()
        return msgspec.msgpack.encode(_Endpoint(metadata, ctypes.addressof(self._scratch), self._vram))

    def connect(self, endpoint: bytes) -> PeerId:
        try:
            remote = msgspec.msgpack.decode(endpoint, type=_Endpoint)
        except msgspec.DecodeError as exc:
            raise TransferError(TransferErrorKind.PEER_UNREACHABLE, f"nixl: bad endpoint: {exc}") from exc
        with self._agent_lock:
            if self._closed or self._agent is None:
                raise TransferError(TransferErrorKind.ABORTED, "nixl: backend closed")
            try:
                name = self._agent.add_remote_agent(remote.metadata)
            except Exception as exc:
                raise TransferError(
                    TransferErrorKind.PEER_UNREACHABLE, f"nixl: add_remote_agent failed: {exc!r}"
                ) from exc
            self._remote_refs[name] = self._remote_refs.get(name, 0) + 1
        vram = [tuple(r) for r in remote.vram]
        peer_id = self._add_peer(_NixlPeer(label=repr(name), name=name, vram=vram))  # type: ignore[arg-type]
        handle = self.write(peer_id, [(ctypes.addressof(self._scratch), remote.scratch, 8)])
        deadline = time.monotonic() + _WARMUP_TIMEOUT_S
        while (state := self.poll(handle)) == WriteState.PENDING and time.monotonic() < deadline:
            time.sleep(0.001)
        error = self.error(handle)
        self.release(handle)
        if state != WriteState.DONE:
            self.disconnect(peer_id)
            detail = error.message if error else f"no completion within {_WARMUP_TIMEOUT_S:g}s"
            raise TransferError(TransferErrorKind.PEER_UNREACHABLE, f"nixl: warm-up write to {name!r} failed: {detail}")
        return peer_id

    # -- the peer's thread (pipelined) -----------------------------------------------------------
    def _post(
        self, peer: SenderPeer, blocks: list[Block], fence: Fence
    ) -> tuple[Any, TransferError | None, bool]:
        """``initialize_xfer`` + ``transfer``: one NIXL transfer per memory-type pair of the batch. A part that
        fails does not end the batch while a part posted before it may still be moving (``_Posted``)."""
        assert isinstance(peer, _NixlPeer)
        posted = _Posted()
        try:
            for (lkind, ldev, rkind, rdev), part in xfer_groups(blocks, self._vram, peer.vram):
                with self._agent_lock:
                    local = self._agent.get_xfer_descs([(src, n, ldev) for src, _, n in part], lkind)
                    remote = self._agent.get_xfer_descs([(dst, n, rdev) for _, dst, n in part], rkind)
                    xfer = self._agent.initialize_xfer("WRITE", local, remote, peer.name, b"")
                    posted.xfers.append(xfer)
                    state = self._agent.transfer(xfer)
                posted.started.append(xfer)
                posted.states.append(state)
                if state == "ERR":
                    posted.error = TransferError(TransferErrorKind.PEER_GONE, f"nixl: write to {peer.name!r} failed")
                    break  # (the parts after it are not started)
        except Exception as exc:
            posted.error = _map_error(exc, f"write to {peer.name!r}")
        if posted.error is not None:
            moving = any(state not in _ENDED for state in posted.states)
            return posted, None if moving else posted.error, False  # (moving: failed by ``_check`` once none is)
        return posted, None, all(state == "DONE" for state in posted.states)

    def _check(self, peer: SenderPeer, token: Any) -> tuple[WriteState, TransferError | None]:
        assert isinstance(token, _Posted)
        try:
            with self._agent_lock:
                states = [self._agent.check_xfer_state(xfer) for xfer in token.started]
        except Exception as exc:
            return WriteState.FAILED, _map_error(exc, "check_xfer_state")
        if any(state not in _ENDED for state in states):
            return WriteState.PENDING, None  # (one part failed, another still moving: its bytes may still land)
        if token.error is not None:
            return WriteState.FAILED, token.error
        if "ERR" in states:
            return WriteState.FAILED, TransferError(TransferErrorKind.PEER_GONE, "nixl: write failed (ERR)")
        return WriteState.DONE, None

    def _forget(self, peer: SenderPeer, token: Any) -> None:
        for xfer in token.xfers if token is not None else ():
            try:
                with self._agent_lock:
                    self._agent.release_xfer_handle(xfer)
            except Exception:
                pass  # a handle of a broken connection may refuse release; nothing else to free

    def _peer_ended(self, peer: SenderPeer) -> None:
        if isinstance(peer, _NixlPeer) and peer.name is not None:
            with self._agent_lock:
                left = self._remote_refs.get(peer.name, 1) - 1
                if left > 0:  # another peer still writes to that process: keep its metadata
                    self._remote_refs[peer.name] = left
                    return
                self._remote_refs.pop(peer.name, None)
                try:
                    if self._agent is not None:
                        self._agent.remove_remote_agent(peer.name)
                except Exception:
                    pass

    def _close_resources(self, threads_ended: bool) -> None:
        with self._agent_lock:
            for reg in self._reg or []:
                try:
                    self._agent.deregister_memory(reg)
                except Exception:
                    pass
            self._reg = None
            self._agent = None
