"""A room the prefill aborted before the decode's page list came is refused with a ``RoomStatus`` of kind
``aborted`` when the list arrives: the decode's counters must count it ``aborted`` (ended on purpose), like an
``Abort`` message, not ``failed`` (``pd_worker_kv_transfer_rooms_total{outcome}``). Real loopback sockets."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
from kvunit import make_args, wait_for

from transfer import KVManager, KVPoll, KVTimeouts, TransferErrorKind
from transfer.fake import FakeBackend

QUICK = KVTimeouts(bootstrap_s=5.0, waiting_s=5.0, transfer_s=5.0, heartbeat_interval_s=0.1,
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
