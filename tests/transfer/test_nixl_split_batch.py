"""A NIXL batch that mixes memory types (a KV pool on a GPU and the host aux slot) is one NIXL transfer per
type pair (``xfer_groups``). When one part fails while another is still moving, the batch must not end yet:
a failed write counts as over for the prefill, which then tells the decode its room is quiesced, and the
decode gives the pages out again while the moving part's bytes still land in them. Unit test over a stand-in
agent (the split needs device memory, which this machine has not)."""

from __future__ import annotations

import threading
from typing import Any

from transfer.base import Fence, WriteState
from transfer.nixl import NixlBackend, _NixlPeer


class _Agent:
    """Answers ``transfer`` and ``check_xfer_state`` from the scripts it is given, per transfer."""

    def __init__(self, transfer: list[str]) -> None:
        self.transfer_states = list(transfer)
        self.states: dict[int, str] = {}
        self.released: list[int] = []

    def get_xfer_descs(self, descs: list[tuple[int, int, int]], kind: str) -> tuple[str, list[Any]]:
        return kind, descs

    def initialize_xfer(self, op: str, local: Any, remote: Any, name: str, notif: bytes) -> int:
        return len(self.states)

    def transfer(self, xfer: int) -> str:
        self.states[xfer] = self.transfer_states.pop(0)
        return self.states[xfer]

    def check_xfer_state(self, xfer: int) -> str:
        return self.states[xfer]

    def release_xfer_handle(self, xfer: int) -> None:
        self.released.append(xfer)


def _backend(agent: _Agent) -> tuple[NixlBackend, _NixlPeer]:
    backend = NixlBackend.__new__(NixlBackend)  # (no NIXL agent: only the batch's bookkeeping is under test)
    backend._agent_lock = threading.Lock()
    backend._agent = agent
    backend._vram = [(1000, 4096, 0)]  # our KV pages on device 0; the aux slot at 50000 is host memory
    return backend, _NixlPeer(label="decode", name="decode-agent", vram=[(9000, 4096, 0)])


BLOCKS = [(1000, 9000, 512), (50000, 70000, 64)]  # a KV page (VRAM to VRAM), the aux record (DRAM to DRAM)


def test_a_part_that_fails_while_another_moves_ends_the_batch_only_once_none_moves() -> None:
    agent = _Agent(transfer=["PROC", "ERR"])
    backend, peer = _backend(agent)
    token, error, done = backend._post(peer, BLOCKS, Fence(1, 1))
    assert (error, done) == (None, False), "failed while its first part was still moving"
    assert backend._check(peer, token) == (WriteState.PENDING, None)
    agent.states[0] = "DONE"
    state, error = backend._check(peer, token)
    assert state == WriteState.FAILED and error is not None
    backend._forget(peer, token)
    assert sorted(agent.released) == [0, 1]


def test_a_part_that_errs_later_while_another_moves_keeps_the_batch_pending() -> None:
    agent = _Agent(transfer=["PROC", "PROC"])
    backend, peer = _backend(agent)
    token, error, done = backend._post(peer, BLOCKS, Fence(1, 1))
    assert (error, done) == (None, False)
    agent.states[1] = "ERR"
    assert backend._check(peer, token) == (WriteState.PENDING, None)
    agent.states[0] = "DONE"
    assert backend._check(peer, token)[0] == WriteState.FAILED


def test_a_first_part_that_fails_at_once_fails_the_batch_at_once() -> None:
    agent = _Agent(transfer=["ERR"])
    backend, peer = _backend(agent)
    token, error, done = backend._post(peer, BLOCKS, Fence(1, 1))
    assert error is not None and not done  # (nothing of it moves: the second part was never started)
    backend._forget(peer, token)
    assert agent.released == [0]


def test_a_batch_whose_parts_all_complete_is_done() -> None:
    agent = _Agent(transfer=["PROC", "DONE"])
    backend, peer = _backend(agent)
    token, error, done = backend._post(peer, BLOCKS, Fence(1, 1))
    assert (error, done) == (None, False)
    assert backend._check(peer, token) == (WriteState.PENDING, None)
    agent.states[0] = "DONE"
    assert backend._check(peer, token) == (WriteState.DONE, None)
