"""A KV-manager peer in its own process, driven over a pipe, for the transfer contract suite.

Run as ``python tests/contracts/kvpeer.py --cmd-fd R --reply-fd W --role prefill|decode --backend NAME ...``.
Commands and replies are msgspec JSON lines on the two pipe fds (never stdout: NIXL logs there).
``PeerProcess`` (test side) starts it, sends commands and always reaps it.
"""

from __future__ import annotations

import argparse
import base64
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from transfer import FencesWrites, KVArgs, KVManager, KVPoll, KVTimeouts, create_backend  # noqa: E402
from transfer.registry import available_backends, load_backend, wants_shared_pool  # noqa: E402
from workers.kv_pool import KVPool  # noqa: E402


@dataclass(frozen=True)
class Shape:
    num_layers: int = 3
    num_pages: int = 64
    page_size: int = 4
    num_kv_heads: int = 2
    head_dim: int = 8
    dtype: str = "float32"
    num_aux_slots: int = 8
    aux_slot_bytes: int = 64

    def pool(self, shared: bool = False) -> KVPool:
        return KVPool(
            num_layers=self.num_layers, num_pages=self.num_pages, page_size=self.page_size,
            num_kv_heads=self.num_kv_heads, head_dim=self.head_dim, dtype=self.dtype,
            num_aux_slots=self.num_aux_slots, aux_slot_bytes=self.aux_slot_bytes, shared=shared,
        )

    def argv(self) -> list[str]:
        return [
            f"--layers={self.num_layers}", f"--pages={self.num_pages}", f"--page-size={self.page_size}",
            f"--heads={self.num_kv_heads}", f"--head-dim={self.head_dim}", f"--dtype={self.dtype}",
            f"--aux-slots={self.num_aux_slots}", f"--aux-bytes={self.aux_slot_bytes}",
        ]


def in_private_netns() -> bool:
    """True inside a network namespace holding only loopback (``unshare --net``)."""
    try:
        return [name for _, name in socket.if_nameindex()] == ["lo"]
    except OSError:
        return False


def skip_reason(name: str) -> str | None:
    """Why backend ``name`` cannot run here: it fails to load, or its own ``unavailable_reason()`` says
    so (a missing library, a network namespace it needs). Nothing about any backend is listed here."""
    try:
        factory = load_backend(name)
    except ValueError as exc:
        return str(exc)
    check = getattr(factory, "unavailable_reason", None)
    return check() if check is not None else None


def moves_bytes(name: str) -> bool:
    """False for a backend that declares it moves nothing (``MOVES_BYTES``; the fake)."""
    try:
        return bool(getattr(load_backend(name), "MOVES_BYTES", True))
    except ValueError:
        return True


def shared_pool(role: str, backend: str) -> bool:
    """Whether a peer's pool goes in shared memory: a decode whose backend asks for it (``SHARED_POOL``)."""
    try:
        return role == "decode" and wants_shared_pool(backend)
    except ValueError:
        return False


# Every backend registered by entry point (group pd_gateway.transfer), built-ins included: an
# out-of-tree backend joins the suite by being installed.
ALL_BACKENDS = available_backends()
BACKENDS = [name for name in ALL_BACKENDS if moves_bytes(name)]


# Short timeouts so that failure tests end fast; heartbeats still tolerate a loaded 2-core machine.
FAST = KVTimeouts(bootstrap_s=20.0, waiting_s=20.0, transfer_s=10.0, heartbeat_interval_s=0.25,
                  heartbeat_timeout_s=2.0)
SHAPE = Shape()


def pattern(seed: int, buffer_index: int, page: int, nbytes: int) -> np.ndarray:
    """Deterministic bytes for one page of one buffer (source data both sides can recompute)."""
    return np.random.default_rng([seed, buffer_index, page]).integers(0, 256, nbytes, dtype=np.uint8)


def fill(pool: KVPool, seed: int) -> None:
    for b in range(2 * pool.num_layers):
        for p in range(pool.num_pages):
            pool.page_view(b, p)[:] = pattern(seed, b, p, pool.page_bytes)


def expected_kv(shape: Shape, seed: int, src_pages: list[int], dst_pages: list[int],
                base: np.ndarray | None = None) -> np.ndarray:
    """The decode's whole KV memory as ``[buffer, page, page_bytes]`` after ``src_pages`` of a prefill
    filled with ``seed`` landed on ``dst_pages`` (everything else as in ``base``, zeros by default)."""
    page_bytes = shape.page_size * shape.num_kv_heads * shape.head_dim * np.dtype(
        {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16, "uint8": np.uint8}[shape.dtype]
    ).itemsize
    kv = np.zeros((2 * shape.num_layers, shape.num_pages, page_bytes), np.uint8) if base is None else base.copy()
    for b in range(2 * shape.num_layers):
        for src, dst in zip(src_pages, dst_pages, strict=True):
            kv[b, dst] = pattern(seed, b, src, page_bytes)
    return kv


def pool_kv(pool: KVPool) -> np.ndarray:
    """A local pool's KV memory as ``[buffer, page, page_bytes]`` (a copy)."""
    return np.stack([buf.view(np.uint8).reshape(pool.num_pages, -1) for buf in pool.kv_buffers()]).copy()


def wait_for(handle: Any, states: tuple[KVPoll, ...], timeout_s: float = 30.0) -> KVPoll:
    """Poll a local sender/receiver until its state is in ``states`` (or the time is up)."""
    deadline = time.monotonic() + timeout_s
    while handle.poll() not in states and time.monotonic() < deadline:
        time.sleep(0.002)
    return KVPoll(handle.poll())


def timeouts_argv(t: KVTimeouts) -> list[str]:
    return [
        f"--bootstrap-s={t.bootstrap_s}", f"--waiting-s={t.waiting_s}", f"--transfer-s={t.transfer_s}",
        f"--hb-interval-s={t.heartbeat_interval_s}", f"--hb-timeout-s={t.heartbeat_timeout_s}",
    ]


# -- child ---------------------------------------------------------------------------------------
class _Peer:
    def __init__(self, ns: argparse.Namespace) -> None:
        self.shape = Shape(ns.layers, ns.pages, ns.page_size, ns.heads, ns.head_dim, ns.dtype, ns.aux_slots,
                           ns.aux_bytes)
        self.pool = self.shape.pool(shared=shared_pool(ns.role, ns.backend))
        if ns.role == "prefill":
            fill(self.pool, ns.seed)
        timeouts = KVTimeouts(ns.bootstrap_s, ns.waiting_s, ns.transfer_s, ns.hb_interval_s, ns.hb_timeout_s)
        self.args = KVArgs.from_pool(self.pool)
        options = dict(item.split("=", 1) for item in ns.option)
        backend = create_backend(ns.backend, options=options) if options else create_backend(ns.backend)
        self.manager = KVManager(ns.role, self.args, backend, timeouts=timeouts)
        self.rooms: dict[int, Any] = {}

    def handle(self, cmd: dict[str, Any]) -> Any:
        op = cmd["op"]
        room = cmd.get("room")
        if op == "hello":
            endpoint = base64.b64encode(self.manager.backend.endpoint()).decode()
            info: dict[str, Any] = {"pid": os.getpid(), "endpoint": endpoint, "kv_ptrs": self.args.kv_ptrs,
                                    "aux_ptrs": self.args.aux_ptrs, "page_bytes": self.pool.page_bytes,
                                    "regions": self.args.regions()}
            if self.manager.role == "prefill":
                info["control"] = list(self.manager.control_address)
            return info
        if op == "create_sender":
            self.rooms[room] = self.manager.create_sender(room)
            return None
        if op == "create_receiver":
            self.rooms[room] = self.manager.create_receiver(room, cmd["host"], cmd["port"])
            return None
        if op == "poll":
            return self._status(self.rooms[room])
        if op == "wait":
            handle, deadline = self.rooms[room], time.monotonic() + cmd["timeout_s"]
            while handle.poll() not in cmd["states"] and time.monotonic() < deadline:
                time.sleep(0.002)
            return self._status(handle)
        if op == "send":
            aux = bytes.fromhex(cmd["aux"]) if cmd.get("aux") is not None else None
            self.rooms[room].send(cmd["pages"], last=cmd["last"], aux=aux)
            return None
        if op == "send_metadata":
            self.rooms[room].send_metadata(cmd["pages"], cmd["aux_index"])
            return None
        if op == "abort":
            self.rooms[room].abort(cmd["reason"])
            return None
        if op == "release":
            self.rooms.pop(room).release()
            return None
        if op == "open_fence":  # a decode peer admits raw writes of (room, generation); False: no fencing
            backend = self.manager.backend
            if not isinstance(backend, FencesWrites):
                return False
            backend.open_fence(cmd["room"], cmd["generation"])
            return True
        if op == "close_fence":
            backend = self.manager.backend
            assert isinstance(backend, FencesWrites)
            return backend.close_fence(cmd["room"], cmd["generation"], cut=cmd.get("cut", False))
        if op == "changed_after_quiesced":  # bytes of the pool that change once the room has ended, quiesced
            handle, deadline = self.rooms[room], time.monotonic() + cmd["timeout_s"]
            while not (handle.poll() in (KVPoll.Success, KVPoll.Failed) and handle.quiesced) \
                    and time.monotonic() < deadline:
                time.sleep(0.001)
            quiesced = bool(handle.quiesced)
            before = [buffer.view(np.uint8).copy() for buffer in self.pool.kv_buffers()]
            time.sleep(cmd["watch_s"])
            after = [buffer.view(np.uint8) for buffer in self.pool.kv_buffers()]
            changed = sum(int(np.count_nonzero(a != b)) for a, b in zip(before, after, strict=True))
            return {"quiesced": quiesced, "state": int(handle.poll()), "changed_bytes": changed}
        if op == "num_rooms":
            return self.manager.num_rooms()
        if op == "read":
            kv = b"".join(self.pool.page_view(b, p).tobytes() for b in range(2 * self.pool.num_layers)
                          for p in range(self.pool.num_pages))
            return {"kv": base64.b64encode(kv).decode(), "aux": base64.b64encode(self.pool.aux.tobytes()).decode()}
        if op == "close":
            self.manager.close()
            return None
        raise ValueError(f"unknown op {op!r}")

    @staticmethod
    def _status(handle: Any) -> dict[str, Any]:
        error = handle.failure()
        return {
            "state": int(handle.poll()),
            "kind": error.kind.value if error else None,
            "message": error.message if error else None,
            "metadata_sent": getattr(handle, "metadata_sent", None),
            "num_dst_pages": getattr(handle, "num_dst_pages", None),
            "aux_len": getattr(handle, "aux_len", None),
        }


def _child_main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cmd-fd", type=int, required=True)
    parser.add_argument("--reply-fd", type=int, required=True)
    parser.add_argument("--role", choices=["prefill", "decode"], required=True)
    parser.add_argument("--backend", required=True)
    parser.add_argument("--seed", type=int, default=0)
    for name, typ in (("layers", int), ("pages", int), ("page-size", int), ("heads", int), ("head-dim", int),
                      ("aux-slots", int), ("aux-bytes", int), ("bootstrap-s", float), ("waiting-s", float),
                      ("transfer-s", float), ("hb-interval-s", float), ("hb-timeout-s", float)):
        parser.add_argument(f"--{name}", type=typ, required=True)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--option", action="append", default=[])  # KEY=VALUE for the backend (``OPTIONS``)
    ns = parser.parse_args()
    cmd_in = os.fdopen(ns.cmd_fd, "rb")
    reply_out = os.fdopen(ns.reply_fd, "wb", buffering=0)
    peer = _Peer(ns)
    reply_out.write(msgspec.json.encode({"ok": True, "result": "ready"}) + b"\n")
    for line in cmd_in:
        cmd = msgspec.json.decode(line)
        try:
            reply = {"ok": True, "result": peer.handle(cmd)}
        except Exception as exc:
            reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        reply_out.write(msgspec.json.encode(reply) + b"\n")
        if cmd["op"] == "close":
            break
    peer.manager.close()
    peer.pool.close()


# -- test side -----------------------------------------------------------------------------------
class PeerError(RuntimeError):
    pass


class PeerProcess:
    """A running peer. ``call(op, **fields)`` returns the result or raises PeerError."""

    def __init__(self, role: str, backend: str, shape: Shape, timeouts: KVTimeouts, seed: int = 0,
                 env: dict[str, str] | None = None, start_timeout_s: float = 60.0,
                 options: dict[str, str] | None = None) -> None:
        cmd_r, cmd_w = os.pipe()
        reply_r, reply_w = os.pipe()
        argv = [sys.executable, str(Path(__file__).resolve()), f"--cmd-fd={cmd_r}", f"--reply-fd={reply_w}",
                f"--role={role}", f"--backend={backend}", f"--seed={seed}", *shape.argv(), *timeouts_argv(timeouts),
                *(f"--option={key}={value}" for key, value in (options or {}).items())]
        self.proc = subprocess.Popen(argv, pass_fds=(cmd_r, reply_w), env={**os.environ, **(env or {})},
                                     stdout=subprocess.DEVNULL)
        os.close(cmd_r)
        os.close(reply_w)
        self._cmd = os.fdopen(cmd_w, "wb", buffering=0)
        self._reply = os.fdopen(reply_r, "rb")
        self.role, self.shape, self.seed = role, shape, seed
        try:
            self._read(start_timeout_s)
            self.info = self.call("hello")
        except BaseException:
            self.kill()
            raise

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _read(self, timeout_s: float) -> Any:
        import select

        ready, _, _ = select.select([self._reply], [], [], timeout_s)
        if not ready:
            raise PeerError(f"peer {self.proc.pid} did not answer within {timeout_s}s")
        line = self._reply.readline()
        if not line:
            raise PeerError(f"peer {self.proc.pid} exited (code {self.proc.poll()})")
        reply = msgspec.json.decode(line)
        if not reply["ok"]:
            raise PeerError(reply["error"])
        return reply["result"]

    def call(self, op: str, reply_timeout_s: float = 60.0, **fields: Any) -> Any:
        self._cmd.write(msgspec.json.encode({"op": op, **fields}) + b"\n")
        return self._read(reply_timeout_s)

    def wait(self, room: int, states: tuple[KVPoll, ...], timeout_s: float = 30.0) -> dict[str, Any]:
        """Wait in the child until the room's state is in ``states``; returns its status dict."""
        return dict(self.call("wait", reply_timeout_s=timeout_s + 30, room=room, states=[int(s) for s in states],
                              timeout_s=timeout_s))

    def read_memory(self) -> tuple[np.ndarray, np.ndarray]:
        """(kv bytes as [buffer, page, page_bytes], aux as [slot, slot_bytes]) of the peer's pool."""
        got = self.call("read")
        kv = np.frombuffer(base64.b64decode(got["kv"]), dtype=np.uint8)
        aux = np.frombuffer(base64.b64decode(got["aux"]), dtype=np.uint8)
        n_buf = 2 * self.shape.num_layers
        return kv.reshape(n_buf, self.shape.num_pages, -1), aux.reshape(self.shape.num_aux_slots, -1)

    def signal(self, sig: int) -> None:
        """Send ``sig``; for SIGSTOP, return only once every thread of the child is stopped."""
        if self.proc.poll() is not None:
            return
        os.kill(self.proc.pid, sig)
        if sig == signal.SIGSTOP:
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and not self._all_stopped():
                time.sleep(0.005)

    def _all_stopped(self) -> bool:
        try:
            tasks = os.listdir(f"/proc/{self.proc.pid}/task")
            states = []
            for tid in tasks:
                with open(f"/proc/{self.proc.pid}/task/{tid}/stat") as f:
                    states.append(f.read().rsplit(")", 1)[1].split()[0])
        except OSError:
            return False
        return all(state in ("T", "t") for state in states)

    def kill(self) -> None:
        """SIGKILL (after SIGCONT, in case it was stopped) and reap; safe to call twice."""
        if self.proc.poll() is None:
            try:
                os.kill(self.proc.pid, signal.SIGKILL)
                os.kill(self.proc.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        self.proc.wait(timeout=30)
        for f in (self._cmd, self._reply):
            try:
                f.close()
            except OSError:
                pass

    def close(self) -> None:
        """Graceful close (manager.close in the child), then reap; falls back to kill."""
        if self.proc.poll() is None:
            try:
                self.call("close", reply_timeout_s=20)
                self.proc.wait(timeout=20)
            except (PeerError, OSError, subprocess.TimeoutExpired):
                pass
        self.kill()


if __name__ == "__main__":
    _child_main()
