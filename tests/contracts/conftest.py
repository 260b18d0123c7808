"""Fixtures of the transfer contract suite: which backends run here, peers in child processes, and
in-process managers. Every peer process is reaped at teardown, whatever the test did."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

import pytest
from kvpeer import BACKENDS, FAST, SHAPE, PeerProcess, Shape, in_private_netns, shared_pool, skip_reason

from transfer import KVArgs, KVManager, KVTimeouts, create_backend
from workers.kv_pool import KVPool

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
os.environ["UCX_TLS"] = "tcp"  # the network-like path (parity with cross-host); see docs/transfer.md
if not in_private_netns():
    os.environ.setdefault("UCX_NET_DEVICES", "lo")


@pytest.fixture(params=BACKENDS)
def backend_name(request: pytest.FixtureRequest) -> str:
    reason = skip_reason(request.param)
    if reason:
        pytest.skip(reason)
    return str(request.param)


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
        self.pool: KVPool = shape.pool(shared=shared_pool(role, backend))
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
        local.pool.close()
