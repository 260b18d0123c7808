from gateway.worker_state import MAX_UNACKED, WorkerState
from workers.protocol import HelloAck, LoadReport


def make() -> tuple[WorkerState, list[float]]:
    now = [10.0]
    state = WorkerState("pd://w:1", "decode", stale_after_s=1.0, clock=lambda: now[0])
    state.connected(HelloAck(2, "w", "decode", "sim", "m", "byte", page_size=16, max_context=4096, num_pages=100))
    return state, now


def test_before_any_report_the_gateway_counts_its_own() -> None:
    state, _ = make()
    assert not state.is_load_fresh and state.num_free_pages == 100
    state.dispatched(1, 500, 10)
    figures = (state.num_active, state.num_prefill_tokens, state.num_free_pages, state.num_reserved_pages)
    assert figures == (1, 500, 90, 10)
    state.ended(1)
    state.ended(1)  # idempotent
    assert (state.num_active, state.num_prefill_tokens, state.num_free_pages) == (0, 0, 100)


def test_reports_ack_dispatches_by_rid() -> None:
    state, now = make()
    state.dispatched(1, 100, 5)
    state.dispatched(2, 200, 7)
    # The worker had admitted rid 1 when it measured: its figures include rid 1, not rid 2.
    state.reported(LoadReport(num_running=1, num_waiting=0, num_free_pages=95, num_total_pages=100,
                              num_prefill_tokens=100, last_rid=1, busy_fraction=0.5), now[0])
    assert state.is_load_fresh
    assert state.num_prefill_tokens == 300 and state.num_free_pages == 88 and state.num_reserved_pages == 7
    assert state.num_waiting_seqs == 1 and state.busy_fraction == 0.5
    state.reported(LoadReport(num_running=2, num_waiting=0, num_free_pages=80, num_total_pages=100,
                              num_queued_pages=3, num_prefill_tokens=250, last_rid=2), now[0])
    assert state.num_prefill_tokens == 250 and state.num_free_pages == 77 and state.num_reserved_pages == 0


def test_a_stale_report_falls_back_to_own_counts() -> None:
    state, now = make()
    state.reported(LoadReport(num_running=9, num_waiting=4, num_free_pages=3, num_total_pages=100,
                              num_prefill_tokens=9000, last_rid=0), now[0])
    state.dispatched(1, 40, 2)
    assert state.num_prefill_tokens == 9040
    now[0] += 1.5
    assert state.is_load_fresh, "until the periodic refresh notices"
    state.refresh()
    assert not state.is_load_fresh
    assert (state.num_prefill_tokens, state.num_running_seqs, state.num_free_pages) == (40, 1, 98)
    # a worker whose reports stopped keeps no growing list of dispatches waiting for one
    for rid in range(2, 5002):
        state.dispatched(rid, 1, 0)
        state.ended(rid)
    assert len(state._unacked) == MAX_UNACKED and state._unacked_tokens == MAX_UNACKED
    assert state.num_active == 1 and state.num_prefill_tokens == 40
    state.reported(LoadReport(num_running=1, num_waiting=0, num_free_pages=98, num_total_pages=100,
                              num_prefill_tokens=40, last_rid=5001), now[0])
    assert state.num_waiting_seqs == 0 and not state._unacked and state._unacked_tokens == 0


def test_sglang_workers_loads_turn_stale_too() -> None:
    """SGLang workers' loads are polled after each probe: stale past ``--load-stale-s`` (at least a poll
    interval), refreshed with the native workers'; a silent ``/v1/loads`` does not count for ever."""
    from gateway.health import HealthConfig
    from gateway.runtime import Gateway, GatewayConfig

    gw = Gateway(GatewayConfig(prefill=("http://127.0.0.1:1",), prefill_bootstrap_ports=(None,),
                               decode=("http://127.0.0.1:2",), load_stale_s=5.0,
                               health=HealthConfig(probe_interval_s=2.0, probe_timeout_s=1.0)))
    assert gw.fleet is not None
    # (at least a poll cycle: the interval, a /health of up to 5 s, SGLang's floor for it, and a loads poll)
    assert [w.state.stale_after_s for w in gw.fleet.workers] == [8.0, 8.0]
    short = Gateway(GatewayConfig(prefill=("http://127.0.0.1:1",), prefill_bootstrap_ports=(None,),
                                  decode=("http://127.0.0.1:2",), load_stale_s=0.5,
                                  health=HealthConfig(probe_interval_s=2.0, probe_timeout_s=1.0)))
    assert short.fleet is not None and short.fleet.workers[0].state.stale_after_s == 8.0
    longer = Gateway(GatewayConfig(prefill=("http://127.0.0.1:1",), prefill_bootstrap_ports=(None,),
                                   decode=("http://127.0.0.1:2",), load_stale_s=12.0,
                                   health=HealthConfig(probe_interval_s=2.0, probe_timeout_s=1.0)))
    assert longer.fleet is not None and longer.fleet.workers[0].state.stale_after_s == 12.0


def test_reconnect_forgets_unacknowledged_dispatches() -> None:
    state, now = make()
    state.dispatched(5, 100, 10)
    state.reported(LoadReport(0, 0, 100, 100, last_rid=0), now[0])
    assert state.num_reserved_pages == 10
    state.connected(HelloAck(2, "w", "decode", "sim", "m", "byte", 16, 4096, 100))
    state.reported(LoadReport(0, 0, 100, 100, last_rid=0), now[0])
    assert state.num_reserved_pages == 0


VIEW = ("is_load_fresh", "num_prefill_tokens", "prefill_tokens_per_s", "busy_fraction", "num_running_seqs",
        "num_waiting_seqs", "max_running_seqs", "num_reserved_pages", "num_free_pages")


def test_the_view_after_any_updates_equals_one_computed_afresh() -> None:
    """However dispatches, ends, reports and the clock interleave, the view the updates leave (some skip
    work that cannot change it) is the one a full recomputation gives."""
    import random

    rng = random.Random(7)
    for _ in range(50):
        state, now = make()
        rid, open_rids = 0, []
        for _ in range(60):
            op = rng.random()
            if op < 0.4:
                rid += 1
                open_rids.append(rid)
                state.dispatched(rid, rng.randint(0, 500), rng.randint(0, 9))
            elif op < 0.7 and open_rids:
                state.ended(open_rids.pop(rng.randrange(len(open_rids))))
            elif op < 0.85:
                state.reported(LoadReport(num_running=rng.randint(0, 9), num_waiting=rng.randint(0, 9),
                                          num_free_pages=rng.randint(0, 100), num_total_pages=100,
                                          num_prefill_tokens=rng.randint(0, 900), last_rid=rng.randint(0, rid),
                                          busy_fraction=rng.random(), max_running=8), now[0])
            else:
                now[0] += rng.choice([0.1, 0.6, 1.5])
                state.refresh()
            seen = [getattr(state, name) for name in VIEW]
            state._recompute()
            assert seen == [getattr(state, name) for name in VIEW]


def test_a_combined_workers_prompt_stops_counting_as_queued_prefill_at_its_first_token() -> None:
    """Through the dispatcher: a combined worker's request counts its prompt as queued prefill until its first
    token (then it is decoding; a disaggregated prefill's part ends at its hand-over), its pages until it ends;
    the gateway's own counts are what policies read while the worker's reports are stale."""
    import asyncio

    from test_hot_path import _connected_workers, _sent

    from gateway.dispatch import Dispatcher
    from gateway.policies.simple import RoundRobinPolicy
    from gateway.router import Router
    from workers.protocol import Outputs, SamplingParams, StepOutput, Submit

    async def main() -> None:
        (worker,), (transport,) = _connected_workers(asyncio.get_running_loop(), "both", 1)
        policy = RoundRobinPolicy()
        dispatcher = Dispatcher([], [worker], Router(policy, policy), combined=True)
        seen: list[int] = []

        async def consume() -> None:
            async for item in dispatcher.generate(list(range(1000)), SamplingParams(max_new_tokens=100)):
                seen.extend(item.token_ids)

        task = asyncio.create_task(consume())
        for _ in range(20):
            await asyncio.sleep(0)
        (submit,) = _sent(transport, Submit)
        state = worker.state
        assert not state.is_load_fresh and state.num_prefill_tokens == 1000 and state.num_reserved_pages > 0
        worker._dispatch(Outputs([StepOutput(submit.rid, [5])]))
        worker._dispatch(Outputs([StepOutput(submit.rid, [6])]))
        for _ in range(5):
            await asyncio.sleep(0)
        assert seen == [5, 6]
        assert (state.num_prefill_tokens, state.num_running_seqs) == (0, 1) and state.num_reserved_pages > 0
        worker._dispatch(Outputs([StepOutput(submit.rid, [7], finish_reason="length")]))
        await task
        assert (state.num_prefill_tokens, state.num_running_seqs, state.num_reserved_pages) == (0, 0, 0)

    asyncio.run(main())


def test_prefill_done_is_idempotent_and_ignores_unknown_rids() -> None:
    state, _ = make()
    state.dispatched(1, 500, 10)
    state.prefill_done(1)
    state.prefill_done(1)
    state.prefill_done(9)
    assert (state.num_active, state.num_prefill_tokens, state.num_reserved_pages) == (1, 0, 10)
    state.ended(1)
    assert (state.num_active, state.own_prefill_tokens, state.num_free_pages) == (0, 0, 100)
