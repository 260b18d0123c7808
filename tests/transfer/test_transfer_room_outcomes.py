"""The KV manager's room counters (``pd_worker_kv_transfer_rooms_total{outcome}``): a room ended on purpose (either
side's abort, a release before its end, a manager closing) counts ``aborted``, a transfer failure ``failed``, on
both roles; so does a room the prefill aborted before the decode's page list came (refused with a ``RoomStatus``
of kind ``aborted`` when the list arrives). In one process over real loopback sockets (the fake backend: no
bytes)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
from kvunit import make_args, wait_for

from gateway.cluster import free_port
from transfer import KVManager, KVPoll, KVTimeouts, TransferErrorKind
from transfer.fake import FakeBackend

QUICK = KVTimeouts(bootstrap_s=0.5, waiting_s=5.0, transfer_s=5.0, heartbeat_interval_s=0.1,
                   heartbeat_timeout_s=2.0)


@pytest.fixture
def managers() -> Iterator[Callable[[str], KVManager]]:
    made: list[KVManager] = []

    def make(role: str) -> KVManager:
        manager = KVManager(role, make_args(), FakeBackend(), timeouts=QUICK)
        made.append(manager)
        return manager

    yield make
    for manager in made:
        manager.close()


def outcomes(manager: KVManager) -> tuple[int, int, int]:
    c = manager.counters
    return c.num_rooms_completed, c.num_rooms_failed, c.num_rooms_aborted


@pytest.mark.parametrize("who", ["decode_aborts", "prefill_aborts", "prefill_releases", "decode_releases"])
def test_an_abort_or_early_release_counts_aborted_on_both_sides(managers: Callable[[str], KVManager],
                                                                who: str) -> None:
    prefill, decode = managers("prefill"), managers("decode")
    sender = prefill.create_sender(1)
    receiver = decode.create_receiver(1, *prefill.control_address)
    assert wait_for(lambda: receiver.poll() == KVPoll.WaitingForInput)
    receiver.send_metadata([3, 4], 1)
    assert wait_for(lambda: sender.poll() == KVPoll.WaitingForInput)
    match who:
        case "decode_aborts":
            receiver.abort("the client left")
        case "prefill_aborts":
            sender.abort("the client left")
        case "prefill_releases":
            sender.release()
        case "decode_releases":
            receiver.release()
    assert wait_for(lambda: sender.poll() == KVPoll.Failed and receiver.poll() == KVPoll.Failed)
    assert outcomes(prefill) == outcomes(decode) == (0, 0, 1), (outcomes(prefill), outcomes(decode))


def test_a_prefill_abort_before_the_page_list_counts_aborted_on_the_decode(
        managers: Callable[[str], KVManager]) -> None:
    prefill, decode = managers("prefill"), managers("decode")
    sender = prefill.create_sender(1)
    receiver = decode.create_receiver(1, *prefill.control_address)
    assert wait_for(lambda: receiver.poll() == KVPoll.WaitingForInput)
    sender.abort("the client left")  # before the decode's page list: the prefill has no request to tell
    assert wait_for(lambda: sender.poll() == KVPoll.Failed)
    receiver.send_metadata([3, 4], 1)
    assert wait_for(lambda: receiver.poll() == KVPoll.Failed)
    assert receiver.failure().kind == TransferErrorKind.ABORTED  # type: ignore[union-attr]
    assert outcomes(prefill) == outcomes(decode) == (0, 0, 1), (outcomes(prefill), outcomes(decode))


def test_a_transfer_failure_counts_failed(managers: Callable[[str], KVManager]) -> None:
    prefill, decode = managers("prefill"), managers("decode")
    sender = prefill.create_sender(1)  # no decode ever sends its page list: the bootstrap timeout
    receiver = decode.create_receiver(2, "127.0.0.1", free_port())  # nobody listens there
    assert wait_for(lambda: sender.poll() == KVPoll.Failed and receiver.poll() == KVPoll.Failed)
    assert sender.failure().kind == TransferErrorKind.BOOTSTRAP  # type: ignore[union-attr]
    assert receiver.failure().kind == TransferErrorKind.PEER_UNREACHABLE  # type: ignore[union-attr]
    assert outcomes(prefill) == outcomes(decode) == (0, 1, 0), (outcomes(prefill), outcomes(decode))
