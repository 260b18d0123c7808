"""Fixtures of the transfer contract suite: which backends run here, peers in child processes, and
in-process managers. Every peer process is reaped at teardown, whatever the test did."""

from __future__ import annotations

import importlib.util
import os
import socket
from collections.abc import Callable, Iterator

import pytest
from kvpeer import PeerProcess, Shape

from transfer import KVArgs, KVManager, KVTimeouts, create_backend
from workers.kv_pool import KVPool

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
os.environ["UCX_TLS"] = "tcp"  # the network-like path (parity with cross-host); see docs/transfer.md


def in_private_netns() -> bool:
    """True inside a network namespace holding only loopback (``unshare --net``)."""
    try:
        return [name for _, name in socket.if_nameindex()] == ["lo"]
    except OSError:
        return False


if not in_private_netns():
    os.environ.setdefault("UCX_NET_DEVICES", "lo")


def _skip_reason(name: str) -> str | None:
    if importlib.util.find_spec(f"transfer.{name}") is None:
        return f"transfer.{name} is not written yet"
    if name == "mooncake":
        if importlib.util.find_spec("mooncake") is None:
            return "mooncake-transfer-engine is not installed"
        if not in_private_netns():
            return (
                "Mooncake binds 0.0.0.0: its tests run only inside a private network namespace "
                "(unshare --net -- sh -c 'ip link set lo up && exec python -m pytest ...')"
            )
    if name == "nixl" and importlib.util.find_spec("nixl_cu12") is None and importlib.util.find_spec("nixl") is None:
        return "nixl is not installed"
    return None


BACKENDS = ["tcp", "mooncake", "nixl"]


@pytest.fixture(params=BACKENDS)
def backend_name(request: pytest.FixtureRequest) -> str:
    reason = _skip_reason(request.param)
    if reason:
        pytest.skip(reason)
    return str(request.param)


# Short timeouts so that failure tests end fast; heartbeats still tolerate a loaded 2-core machine.
FAST = KVTimeouts(bootstrap_s=20.0, waiting_s=20.0, transfer_s=10.0, heartbeat_interval_s=0.25,
                  heartbeat_timeout_s=2.0)
SHAPE = Shape()


@pytest.fixture
def spawn_peer() -> Iterator[Callable[..., PeerProcess]]:
    peers: list[PeerProcess] = []

    def spawn(role: str, backend: str, *, shape: Shape = SHAPE, timeouts: KVTimeouts = FAST,
              seed: int = 0) -> PeerProcess:
        peer = PeerProcess(role, backend, shape, timeouts, seed=seed)
        peers.append(peer)
        return peer

    yield spawn
    for peer in peers:
        peer.kill()


class Local:
    """An in-process manager with its pool."""

    def __init__(self, role: str, backend: str, shape: Shape, timeouts: KVTimeouts) -> None:
        self.pool: KVPool = shape.pool()
        self.args = KVArgs.from_pool(self.pool)
        self.manager = KVManager(role, self.args, create_backend(backend), timeouts=timeouts)  # type: ignore[arg-type]


@pytest.fixture
def local_manager() -> Iterator[Callable[..., Local]]:
    made: list[Local] = []

    def make(role: str, backend: str, *, shape: Shape = SHAPE, timeouts: KVTimeouts = FAST) -> Local:
        local = Local(role, backend, shape, timeouts)
        made.append(local)
        return local

    yield make
    for local in made:
        local.manager.close()
