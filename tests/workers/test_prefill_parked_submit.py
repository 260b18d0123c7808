"""A prefill's submit waits, parked, for its room's page list instead of waking the scheduler loop for nothing to run:
the page list's arrival (or the decode's abort of the room) is the wake-up that takes it in, a page list that came
first wakes the loop at the submit, and whatever reaches the scheduler after a parked submit (its abort, its
connection's end) is applied after it. Real KV managers over the tcp backend; the schedulers are stepped by the test
unless a test starts one."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from transfer import KVArgs, KVManager, KVPoll, create_backend
from workers.engines.sim import SimEngine
from workers.kv_pool import KVPool
from workers.protocol import BootstrapTarget, Error, Outputs, SamplingParams, Submit
from workers.scheduler import Scheduler, SchedulerConfig


class _Sink:
    def __init__(self) -> None:
        self.items: list[tuple[int, object]] = []

    def __call__(self, messages: list[tuple[int, object]]) -> None:
        self.items.extend(messages)

    def answers(self, rid: int) -> list[object]:
        return [m for _, m in self.items if (isinstance(m, Error) and m.rid == rid)
                or (isinstance(m, Outputs) and any(i.rid == rid for i in m.items))]


class _Prefill:
    def __init__(self) -> None:
        engine = SimEngine()
        info = engine.info
        self.pool = KVPool(num_layers=info.num_layers, num_pages=32, page_size=4, num_kv_heads=info.num_kv_heads,
                           head_dim=info.head_dim)
        engine.bind(self.pool)
        self.kv = KVManager("prefill", KVArgs.from_pool(self.pool), create_backend("tcp"))
        self.sink = _Sink()
        self.sched = Scheduler(SchedulerConfig("prefill"), engine, self.pool, self.sink, self.kv)
        self.sched.connect(1)
        self.decode_pool = KVPool(num_layers=info.num_layers, num_pages=32, page_size=4,
                                  num_kv_heads=info.num_kv_heads, head_dim=info.head_dim)
        self.decode = KVManager("decode", KVArgs.from_pool(self.decode_pool), create_backend("tcp"))

    def submit(self, rid: int, room: int) -> None:
        target = BootstrapTarget(*self.kv.control_address, room)
        self.sched.submit(1, Submit(rid, [rid * 10 + i for i in range(6)], SamplingParams(max_new_tokens=4),
                                    target, timeout_s=30))

    def page_list(self, room: int) -> Any:
        """The decode's side of ``room``: its receiver, its page list sent."""
        receiver = self.decode.create_receiver(room, *self.kv.control_address)
        _until(lambda: receiver.poll() != KVPoll.Bootstrapping, "the decode's connection to the prefill")
        receiver.send_metadata([0, 1], 0)
        return receiver

    def woken(self) -> bool:
        """Whether anything waits in the scheduler's inbox (what its loop's sleep ends on)."""
        return not self.sched._inbox.empty()

    def close(self) -> None:
        self.sched.stop()
        self.decode.close()
        self.kv.close()


@pytest.fixture
def prefill() -> Iterator[_Prefill]:
    side = _Prefill()
    while side.woken():  # (the connect: what the test's submits do to the inbox is what is looked at)
        side.sched.step()
    try:
        yield side
    finally:
        side.close()


def _until(check: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


def test_a_submit_before_its_page_list_waits_for_the_list_s_wake_up(prefill: _Prefill) -> None:
    prefill.submit(1, 101)
    assert not prefill.woken(), "the submit woke the loop with nothing for it to run"
    receiver = prefill.page_list(101)
    _until(prefill.woken, "the page list's wake-up")
    for _ in range(20):
        prefill.sched.step()
        if receiver.poll() == KVPoll.Success:
            break
        time.sleep(0.01)
    assert receiver.poll() == KVPoll.Success
    handover = [m for m in prefill.sink.answers(1) if isinstance(m, Outputs)]
    assert handover and handover[-1].items[-1].finish_reason == "transferred"


def test_a_page_list_that_came_first_is_woken_for_at_the_submit(prefill: _Prefill) -> None:
    prefill.page_list(102)
    _until(lambda: prefill.kv.room_requested(102), "the page list at the prefill")
    while prefill.woken():  # (its own wake-up, taken: the submit must bring one of its own)
        prefill.sched.step()
    prefill.submit(2, 102)
    assert prefill.woken(), "a submit whose page list is here waits for the loop's idle wake-up"


def test_the_decode_s_abort_of_the_room_wakes_a_parked_submit_and_ends_it(prefill: _Prefill) -> None:
    prefill.submit(3, 103)
    assert not prefill.woken()
    prefill.decode.decline_room(103, *prefill.kv.control_address, None, "refused by the decode")
    _until(prefill.woken, "the abort's wake-up")
    for _ in range(20):
        prefill.sched.step()
        if prefill.sink.answers(3):
            break
        time.sleep(0.01)
    (answer,) = prefill.sink.answers(3)
    assert isinstance(answer, Error) and "refused by the decode" in answer.message


def test_an_abort_after_a_parked_submit_ends_that_request(prefill: _Prefill) -> None:
    prefill.submit(4, 104)
    prefill.sched.abort(1, 4, "client gone")
    prefill.sched.step()
    (answer,) = prefill.sink.answers(4)
    assert isinstance(answer, Error) and answer.code == "aborted"
    assert not prefill.sched.reqs
    assert prefill.sched.cache.num_available == prefill.pool.num_pages


def test_a_dropped_connection_after_a_parked_submit_releases_it(prefill: _Prefill) -> None:
    prefill.submit(5, 105)
    prefill.sched.drop_connection(1)
    prefill.sched.step()
    assert not prefill.sched.reqs
    assert prefill.sched.cache.num_available == prefill.pool.num_pages


def test_a_parked_submit_is_taken_in_by_an_idle_wake_up_and_times_out_with_no_page_list(prefill: _Prefill) -> None:
    """No page list ever comes (its decode died before sending it): the loop's idle wake-up takes the submit in,
    and the bootstrap timeout ends it as before."""
    prefill.sched.start()
    target = BootstrapTarget(*prefill.kv.control_address, 106)
    prefill.sched.submit(1, Submit(6, [1, 2, 3], SamplingParams(), target, timeout_s=0.5))
    _until(lambda: bool(prefill.sink.answers(6)), "the request's end")
    (answer,) = prefill.sink.answers(6)
    assert isinstance(answer, Error) and "timed out" in answer.message


def test_a_parked_submit_reaching_a_stopped_scheduler_is_answered(prefill: _Prefill) -> None:
    prefill.sched.start()
    prefill.sched.stop()
    prefill.submit(7, 107)
    (answer,) = prefill.sink.answers(7)
    assert isinstance(answer, Error) and answer.code == "shutting_down"
