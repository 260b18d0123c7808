"""Helpers shared by the transfer unit tests (a plain module: conftest names collide across test dirs)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from transfer import KVArgs, KVPoll, TransferErrorKind
from transfer.errors import TransferError
from transfer.peer_threads import PeerThreadBackend, SenderPeer
from transfer.tcp import TcpBackend
from workers.kv_pool import KVPool

_POOLS: list[KVPool] = []  # keep registered memory alive for the whole test session


def make_args(**changes: Any) -> KVArgs:
    """A small pool's KVArgs: 2 layers, 16 pages of 4 tokens, 4 aux slots of 32 bytes."""
    pool = KVPool(num_layers=2, num_pages=16, page_size=4, num_kv_heads=1, head_dim=4, num_aux_slots=4,
                  aux_slot_bytes=32)
    _POOLS.append(pool)
    args = KVArgs.from_pool(pool)
    return KVArgs(**{**args.__dict__, **changes}) if changes else args


def wait_for(predicate: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.002)
    return predicate()


def open_room(prefill: Any, decode: Any, room: int, dst_pages: list[int], aux_index: int) -> tuple[Any, Any]:
    """A room open on both sides, its page list sent and taken: (the prefill's sender, the decode's receiver),
    both waiting for input."""
    sender = prefill.create_sender(room)
    receiver = decode.create_receiver(room, *prefill.control_address)
    assert wait_for(lambda: receiver.poll() == KVPoll.WaitingForInput)
    receiver.send_metadata(dst_pages, aux_index)
    assert wait_for(lambda: sender.poll() == KVPoll.WaitingForInput)
    return sender, receiver


def warm_room(prefill: Any, decode: Any, room: int = 1) -> None:
    """One room's KV moved from ``prefill`` to ``decode`` (their data path is up and works)."""
    sender, _ = open_room(prefill, decode, room, [9, 10], 0)
    sender.send([3, 4], last=True)
    assert wait_for(lambda: sender.poll() == KVPoll.Success, 10)


class StubPeerBackend(PeerThreadBackend):
    """A thread-per-peer backend with no data path of its own (``connect`` adds a peer): a test gives it
    ``_send``, or ``pipelined`` and ``_post``/``_check``."""

    name = "stub"

    def register(self, regions: Any) -> None:
        pass

    def endpoint(self) -> bytes:
        return b""

    def connect(self, endpoint: bytes = b"") -> int:
        return self._add_peer(SenderPeer(label="peer"))


class Waker:
    """A KV manager listener that waits the way the scheduler does: on notifications only, no polling.

    ``until(predicate)`` re-checks only when the listener fired since its last check, so a state change
    that is not notified makes it time out (the scheduler would sleep through it)."""

    def __init__(self) -> None:
        self._fired = threading.Event()
        self.num_calls = 0

    def __call__(self) -> None:
        self.num_calls += 1
        self._fired.set()

    def until(self, predicate: Callable[[], bool], timeout_s: float = 10.0) -> bool:
        deadline = time.monotonic() + timeout_s
        while True:
            self._fired.clear()
            if predicate():
                return True
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not self._fired.wait(remaining):
                return False  # even if it holds by now: nothing said so


class StallingTcp(TcpBackend):
    """tcp whose sends, once ``stall`` is set, move nothing until the connection is cut (``_interrupt``): a data
    path that stalls (black-holed packets, a wedged receiver) while the control connection lives."""

    def __init__(self) -> None:
        super().__init__()
        self.stall = threading.Event()
        self.cut = threading.Event()
        self.num_connects = 0

    def connect(self, endpoint: bytes) -> int:
        self.num_connects += 1
        self.cut.clear()
        return super().connect(endpoint)

    def _send(self, peer: SenderPeer, blocks: list, fence: Any) -> TransferError | None:
        if self.stall.is_set():
            self.cut.wait(60)
            return TransferError(TransferErrorKind.PEER_GONE, "tcp: connection cut")
        return super()._send(peer, blocks, fence)

    def _interrupt(self, peer: SenderPeer) -> None:
        self.cut.set()
        super()._interrupt(peer)


REPO = Path(__file__).resolve().parents[2]


def run_mooncake_child(child: str, *, setup: str = "", tools: tuple[str, ...] = (), timeout_s: float = 120.0) -> None:
    """Run the Python source ``child`` (real Mooncake engines) in a network namespace of its own: loopback up, then
    the shell commands ``setup`` (a veth, an ``iptables`` rule: root), so that nothing else's network is touched.
    Skips where Mooncake is not installed, a tool in ``tools`` is missing, or the child printed ``SKIP: why``;
    else the child must end printing ``ok``."""
    from transfer.mooncake import MooncakeBackend

    unavailable = MooncakeBackend.unavailable_reason()
    if unavailable is not None and "not installed" in str(unavailable):
        pytest.skip(str(unavailable))
    missing = [tool for tool in ("unshare", *tools) if shutil.which(tool) is None]
    if missing:
        pytest.skip(f"needs {', '.join(missing)}")
    script = " && ".join(["ip link set lo up", *([setup] if setup else []), 'exec "$0" -c "$1"'])
    env = {"PYTHONPATH": str(REPO), "MC_LOG_LEVEL": "ERROR", "PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}
    run = subprocess.run(["unshare", "--net", "--", "sh", "-c", script, sys.executable, child], cwd=REPO,
                         capture_output=True, text=True, timeout=timeout_s, env=env)
    if run.stdout.startswith("SKIP"):
        pytest.skip(run.stdout.strip())
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), (run.stdout + run.stderr)[-3000:]


def late_bytes_child(*, deadline_s: float = 90.0, before: str = "", after_connect: str = "", cleanup: str = "") -> str:
    """A ``run_mooncake_child`` script: a prefill writes 2048 small blocks (one engine call, which Mooncake fails
    quickly) to a decode frozen with SIGSTOP for 2.5 s (a child process whose KV memory this one shares); the write
    must end within ``deadline_s`` and no byte of it land after it ended (the decode, which does not fence Mooncake's
    writes, gives the pages out again once the room's writes ended). ``before`` runs first (it may print ``SKIP:
    why`` and exit), ``after_connect`` once the prefill is connected, ``cleanup`` in the ``finally`` after the decode
    is reaped (each top-level Python; ``pid`` is the decode's)."""
    def block(code: str, indent: str) -> str:
        return textwrap.indent(textwrap.dedent(code).strip("\n"), indent) + "\n" if code.strip() else ""

    return (textwrap.dedent("""\
        import ctypes, mmap, os, signal, time
        from transfer import WriteState
        """) + block(before, "") + textwrap.dedent("""\
        N, BLOCK = 2048, 2048  # small KV blocks (page_size 1): one 4 MiB turn is one engine call of 2048 entries
        SIZE = N * BLOCK
        shared = mmap.mmap(-1, SIZE)  # the decode's KV memory, seen by this process too
        ready_r, ready_w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the decode
            from transfer.mooncake import MooncakeBackend
            decode = MooncakeBackend()
            decode.register([(ctypes.addressof((ctypes.c_ubyte * SIZE).from_buffer(shared)), SIZE)])
            endpoint = decode.endpoint()
            os.write(ready_w, len(endpoint).to_bytes(4, "big") + endpoint)
            while True:
                time.sleep(1)
        from transfer.mooncake import MooncakeBackend
        size = int.from_bytes(os.read(ready_r, 4), "big")
        endpoint = b""
        while len(endpoint) < size:
            endpoint += os.read(ready_r, size - len(endpoint))
        dst = (ctypes.c_ubyte * SIZE).from_buffer(shared)
        src = (ctypes.c_ubyte * SIZE)()
        ctypes.memset(src, 0x5A, SIZE)
        prefill = MooncakeBackend(options={"max_batch_blocks": "2048"})
        try:
            prefill.register([(ctypes.addressof(src), SIZE)])
            peer = prefill.connect(endpoint)
        """) + block(after_connect, "    ") + textwrap.dedent(f"""\
            os.kill(pid, signal.SIGSTOP)  # the decode stalls (a starved host) for 2.5 s
            started = time.monotonic()
            handle = prefill.write(peer, [(ctypes.addressof(src) + i * BLOCK, ctypes.addressof(dst) + i * BLOCK, BLOCK)
                                          for i in range(N)])
            ended, resumed = None, False
            while ended is None and time.monotonic() - started < {deadline_s!r}:
                if not resumed and time.monotonic() - started > 2.5:
                    os.kill(pid, signal.SIGCONT)
                    resumed = True
                if prefill.poll(handle) != WriteState.PENDING:
                    ended = time.monotonic()
                time.sleep(0.01)
            assert ended is not None, "the write never ended"
            ctypes.memset(ctypes.addressof(dst), 0, SIZE)  # its room quiesced: the decode gives the pages out again
            while time.monotonic() < max(started + 10.0, ended + 5.0):
                if not resumed and time.monotonic() - started > 2.5:
                    os.kill(pid, signal.SIGCONT)
                    resumed = True
                landed = sum(1 for i in range(N) if dst[i * BLOCK])
                assert not landed, (f"{{landed}} blocks landed {{time.monotonic() - ended:.1f}}s after the write ended "
                                    f"{{prefill.poll(handle).name}} ({{ended - started:.1f}}s after it began: "
                                    f"{{prefill.error(handle)}})")
                time.sleep(0.05)
            print("ok")
        finally:
            os.kill(pid, signal.SIGCONT)
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        """) + block(cleanup, "    ") + "    prefill.close()\n")
