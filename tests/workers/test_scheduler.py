"""The scheduler in-process with the sim engine (role both): batching, chunking, stops, aborts, release."""

from __future__ import annotations

import time
from typing import Any

import pytest

from gateway.tokenizer import ByteTokenizer
from workers.engines.sim import SimEngine
from workers.kv_pool import KVPool
from workers.protocol import Error, Fault, Outputs, SamplingParams, StepOutput, Submit
from workers.request import live
from workers.scheduler import Scheduler, SchedulerConfig


class Collector:
    def __init__(self) -> None:
        self.items: list[tuple[int, object]] = []

    def __call__(self, messages: list[tuple[int, object]]) -> None:
        self.items.extend(messages)

    def outputs(self, rid: int) -> list[StepOutput]:
        return [i for _, m in self.items if isinstance(m, Outputs) for i in m.items if i.rid == rid]

    def errors(self, rid: int) -> list[Error]:
        return [m for _, m in self.items if isinstance(m, Error) and m.rid == rid]


def make(chunk_size: int = 8, num_pages: int = 64, max_running: int = 8,
         stop_tokenizer: ByteTokenizer | None = None, engine: SimEngine | None = None,
         ) -> tuple[Scheduler, Collector, KVPool]:
    """A combined scheduler over ``engine`` (a ``SimEngine``, or a subclass with faults) and a pool of its own."""
    engine = engine or SimEngine()
    info = engine.info
    pool = KVPool(num_layers=info.num_layers, num_pages=num_pages, page_size=4, num_kv_heads=info.num_kv_heads,
                  head_dim=info.head_dim)
    engine.bind(pool)
    sink = Collector()
    sched = Scheduler(SchedulerConfig("both", chunk_size=chunk_size, max_running=max_running), engine, pool, sink,
                      stop_tokenizer=stop_tokenizer)
    return sched, sink, pool


def run_until_idle(sched: Scheduler, limit: int = 500) -> None:
    for _ in range(limit):
        sched.step()
        if not sched.reqs:
            sched.step()
            return
    raise AssertionError("scheduler did not drain")


def tokens_of(sink: Collector, rid: int) -> list[int]:
    return [t for o in sink.outputs(rid) for t in o.token_ids]


def test_batch_of_mixed_lengths_matches_one_by_one_and_frees_pages() -> None:
    prompts = [list(range(10, 10 + n)) for n in (3, 17, 9, 30)]
    sched, sink, pool = make()
    for rid, p in enumerate(prompts):
        sched.submit(0, Submit(rid, p, SamplingParams(max_new_tokens=6)))
    run_until_idle(sched)
    batched = [tokens_of(sink, rid) for rid in range(len(prompts))]
    assert all(len(t) == 6 for t in batched)
    assert sched.cache.num_available == pool.num_pages
    for rid, p in enumerate(prompts):
        solo, solo_sink, _ = make(chunk_size=1000)
        solo.submit(0, Submit(rid, p, SamplingParams(max_new_tokens=6)))
        run_until_idle(solo)
        assert tokens_of(solo_sink, rid) == batched[rid]
    finals = [o for o in sink.outputs(1) if o.finish_reason]
    assert len(finals) == 1 and finals[0].finish_reason == "length" and finals[0].prompt_tokens == 17


def test_stop_token_ends_early() -> None:
    sched, sink, _ = make()
    sched.submit(0, Submit(1, [5, 6, 7], SamplingParams(max_new_tokens=30)))
    run_until_idle(sched)
    full = tokens_of(sink, 1)
    stop_at = full[3]
    sched2, sink2, pool2 = make()
    sched2.submit(0, Submit(1, [5, 6, 7], SamplingParams(max_new_tokens=30, stop_token_ids=[stop_at])))
    run_until_idle(sched2)
    out = tokens_of(sink2, 1)
    assert out == full[: full.index(stop_at) + 1]
    assert sink2.outputs(1)[-1].finish_reason == "stop"
    assert sched2.cache.num_available == pool2.num_pages


def test_bad_requests_get_errors_not_crashes() -> None:
    sched, sink, pool = make(num_pages=8)
    sched.submit(0, Submit(1, [], SamplingParams()))
    sched.submit(0, Submit(2, [1, 2], SamplingParams(max_new_tokens=0)))
    sched.submit(0, Submit(3, [1, 2], SamplingParams(max_new_tokens=100)))  # 26 pages > 8
    sched.submit(0, Submit(4, [999999], SamplingParams()))
    sched.submit(0, Submit(5, [1], SamplingParams(max_new_tokens=100_000)))
    sched.submit(0, Submit(6, [1, 2, 3], SamplingParams(output_offset=50)))  # (past the prompt: a migration's
    sched.submit(0, Submit(7, [1, 2, 3], SamplingParams(output_offset=-1)))  # outputs are part of its prompt)
    sched.submit(0, Submit(8, [4, 5], SamplingParams(max_new_tokens=3)))  # a good one alongside
    run_until_idle(sched)
    assert len(tokens_of(sink, 8)) == 3
    for rid in range(1, 8):
        (err,) = sink.errors(rid)
        assert err.code == "bad_request" and err.message
    assert sched.cache.num_available == pool.num_pages


def test_abort_and_dropped_connection_release_pages() -> None:
    sched, sink, pool = make()
    sched.submit(0, Submit(1, list(range(40)), SamplingParams(max_new_tokens=200)))
    sched.submit(7, Submit(1, list(range(40)), SamplingParams(max_new_tokens=200)))
    for _ in range(10):
        sched.step()
    assert sched.cache.num_available < pool.num_pages
    sched.abort(0, 1, "client went away")
    sched.drop_connection(7)
    sched.step()
    assert not sched.reqs and sched.cache.num_available == pool.num_pages
    assert sink.errors(1)[0].code == "aborted"


def test_deadline_fails_request_and_frees() -> None:
    sched, sink, pool = make()
    sched.submit(0, Submit(1, [1, 2, 3], SamplingParams(max_new_tokens=200), timeout_s=0.05))
    deadline = time.monotonic() + 5
    while sched.reqs or not sink.errors(1):
        sched.step()
        assert time.monotonic() < deadline
    assert sink.errors(1)[0].code == "timeout"
    assert sched.cache.num_available == pool.num_pages


def test_pool_pressure_queues_instead_of_failing() -> None:
    sched, sink, pool = make(num_pages=12)  # each request needs 2 + 3 pages
    for rid in range(6):
        sched.submit(0, Submit(rid, list(range(8)), SamplingParams(max_new_tokens=12)))
    run_until_idle(sched, 2000)
    assert all(len(tokens_of(sink, rid)) == 12 for rid in range(6))
    assert sched.cache.num_available == pool.num_pages


def test_max_running_bounds_every_batch_of_a_combined_worker() -> None:
    """``max_running`` 2 and three short prompts that all fit the pool and one step's chunk budget: each
    admission re-checks the bound after the request it let in, so the third waits until a sequence ends
    and no forward step ever holds more than 2 sequences (an admission loop that let one past the bound
    would prefill all three in the first step). Recorded at the engine, the batch as the model sees it."""
    sched, sink, _ = make(chunk_size=64, max_running=2)
    sizes: list[int] = []
    forward = sched.engine.forward

    def recording(batch: list[Any]) -> list[Any]:
        sizes.append(len(batch))
        return forward(batch)

    sched.engine.forward = recording  # type: ignore[method-assign]
    for rid in range(3):
        sched.submit(0, Submit(rid, [10 * rid + i for i in range(3)], SamplingParams(max_new_tokens=4,
                                                                                     ignore_eos=True)))
    run_until_idle(sched)
    assert sizes and max(sizes) == 2, sizes
    for rid in range(3):
        assert len(tokens_of(sink, rid)) == 4 and sink.outputs(rid)[-1].finish_reason == "length"


def test_threaded_loop_serves_and_stops() -> None:
    sched, sink, pool = make()
    sched.start()
    try:
        sched.submit(0, Submit(1, [1, 2, 3], SamplingParams(max_new_tokens=4)))
        deadline = time.monotonic() + 5
        while not any(o.finish_reason for o in sink.outputs(1)):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert sched.is_alive
    finally:
        sched.stop()
    assert not sched.is_alive and sched.cache.num_available == pool.num_pages


def test_scheduler_tokens_equal_a_plain_engine_loop() -> None:
    """Reference computed without the scheduler: prefill whole prompt, then one token per step."""
    from workers.engines.base import SeqInput

    prompt = list(range(30, 51))
    sched, sink, _ = make(chunk_size=4)
    sched.submit(0, Submit(9, prompt, SamplingParams(max_new_tokens=7)))
    run_until_idle(sched)

    engine, pool = SimEngine(), None
    info = engine.info
    pool = KVPool(num_layers=info.num_layers, num_pages=16, page_size=4, num_kv_heads=info.num_kv_heads,
                  head_dim=info.head_dim)
    engine.bind(pool)
    pages = pool.alloc(8)
    assert pages
    seq = list(prompt)
    (out,) = engine.forward([SeqInput(0, pages, 0, prompt, True, SamplingParams())])
    expected = [out.token_id]
    while len(expected) < 7:
        seq.append(expected[-1])  # type: ignore[arg-type]
        (out,) = engine.forward([SeqInput(0, pages, len(seq) - 1, [seq[-1]], True, SamplingParams())])
        expected.append(out.token_id)
    assert tokens_of(sink, 9) == expected


def test_prefix_cache_hit_skips_compute_and_keeps_output() -> None:
    sched, sink, pool = make(chunk_size=64)
    prompt = list(range(100, 130))  # 30 tokens: 7 full pages of 4 may be shared
    sched.submit(0, Submit(1, prompt, SamplingParams(max_new_tokens=5)))
    run_until_idle(sched)
    sched.submit(0, Submit(2, prompt, SamplingParams(max_new_tokens=5)))
    run_until_idle(sched)
    assert tokens_of(sink, 2) == tokens_of(sink, 1)
    first = next(o for o in sink.outputs(1) if o.finish_reason)
    second = next(o for o in sink.outputs(2) if o.finish_reason)
    assert first.cached_tokens == 0 and second.cached_tokens == 28
    assert sched.cache.num_available == pool.num_pages


def test_a_prefix_being_computed_is_waited_for_not_computed_twice() -> None:
    """A and B share 6 full pages, arrive together, and a step computes 2 pages: B waits for A's pages
    (computing only its own suffix) while C, sharing nothing, goes ahead; outputs are unchanged."""
    shared = list(range(100, 124))
    prompts = {1: [*shared, 7, 8, 9, 10, 11], 2: [*shared, 20, 21, 22, 23, 24], 3: list(range(50, 62))}
    sched, sink, pool = make(chunk_size=8)
    for rid, prompt in prompts.items():
        sched.submit(0, Submit(rid, prompt, SamplingParams(max_new_tokens=4)))
    sched.step()
    assert [sched.reqs[(0, rid)].stage for rid in prompts] == ["prefill", "waiting", "prefill"]
    # the load report counts the shared pages once: B's estimate has them as cached (A computes them)
    assert [sched.reqs[(0, rid)].num_cached_estimate for rid in prompts] == [0, 24, 0]
    assert sched.load_report().num_prefill_tokens == 29 + 5 + 12 - 8  # less the step's chunk of 8
    run_until_idle(sched)
    assert not sched._queued_pages  # every prefill ended: nothing left indexed
    finals = {rid: next(o for o in sink.outputs(rid) if o.finish_reason) for rid in prompts}
    assert finals[1].cached_tokens == 0 and finals[3].cached_tokens == 0
    assert finals[2].cached_tokens == 24  # all six pages, computed once, by A
    assert sched.stats()["num_prefix_waits"] == 1
    for rid, prompt in prompts.items():
        solo, solo_sink, _ = make(chunk_size=1000)
        solo.submit(0, Submit(rid, prompt, SamplingParams(max_new_tokens=4)))
        run_until_idle(solo)
        assert tokens_of(sink, rid) == tokens_of(solo_sink, rid)
    assert sched.cache.num_available == pool.num_pages


def test_a_request_waiting_for_a_prefix_goes_when_its_computer_is_aborted() -> None:
    shared = list(range(100, 124))
    sched, sink, pool = make(chunk_size=8)
    sched.submit(0, Submit(1, [*shared, 7, 8], SamplingParams(max_new_tokens=4)))
    sched.submit(0, Submit(2, [*shared, 20, 21], SamplingParams(max_new_tokens=4)))
    sched.step()
    sched.step()  # A has computed 4 of the 6 shared pages (2 per step); B waits
    assert sched.reqs[(0, 2)].stage == "waiting"
    sched.abort(0, 1, "client left")
    run_until_idle(sched)
    assert not sched._queued_pages
    final = next(o for o in sink.outputs(2) if o.finish_reason)
    assert final.finish_reason == "length" and final.cached_tokens == 16  # A's published pages, then its own
    solo, solo_sink, _ = make(chunk_size=1000)
    solo.submit(0, Submit(2, [*shared, 20, 21], SamplingParams(max_new_tokens=4)))
    run_until_idle(solo)
    assert tokens_of(sink, 2) == tokens_of(solo_sink, 2)
    assert sched.cache.num_available == pool.num_pages


def test_a_request_for_prompt_logprobs_computes_its_whole_prompt() -> None:
    """Only positions a request computes have prompt logprobs: one that asks for them takes no cached
    prefix (it would get logprobs for its suffix alone, read by the gateway as the prompt's first
    positions) and waits for no other request's prefix; its own pages are still shared."""
    sched, sink, pool = make(chunk_size=8)
    prompt = list(range(100, 130))
    sched.submit(0, Submit(1, prompt, SamplingParams(max_new_tokens=2)))
    sched.submit(0, Submit(2, prompt, SamplingParams(max_new_tokens=2, prompt_logprobs=True)))
    sched.step()
    assert sched.reqs[(0, 2)].stage == "prefill"  # not waiting for request 1's pages
    run_until_idle(sched)
    sched.submit(0, Submit(3, prompt, SamplingParams(max_new_tokens=2, prompt_logprobs=True)))
    sched.submit(0, Submit(4, prompt, SamplingParams(max_new_tokens=2)))
    run_until_idle(sched)
    cached = {rid: next(o for o in sink.outputs(rid) if o.finish_reason).cached_tokens for rid in (1, 2, 3, 4)}
    assert cached == {1: 0, 2: 0, 3: 0, 4: 28}
    assert sched.stats()["num_prefix_waits"] == 0
    assert sched.cache.num_available == pool.num_pages and not sched._queued_pages


def _with_position_logprobs(sched: Scheduler) -> None:
    """The sim engine has no prompt logprobs: its chunks get value -i at prompt position i."""
    real = sched.engine.forward

    def forward(batch: list[Any]) -> list[Any]:
        outs = real(batch)
        for seq, out in zip(batch, outs, strict=True):
            if seq.params.prompt_logprobs and seq.num_generated == 0:
                out.prompt_logprobs = [-float(seq.num_cached + j) for j in range(len(seq.token_ids))]
        return outs

    sched.engine.forward = forward  # type: ignore[method-assign]


def test_prompt_logprobs_from_a_start_share_the_prefix_before_it() -> None:
    """SGLang's ``logprob_start_len`` (``prompt_logprobs_start``): only positions from the start on are sent,
    and the cached pages before it are shared (the start itself may be cached: the engine re-runs the row
    before it). A start of 0 still shares nothing; the request's own pages are cached for the next."""
    sched, sink, pool = make(chunk_size=8)
    _with_position_logprobs(sched)
    prompt = list(range(100, 130))  # 30 tokens: 7 full pages of 4
    sched.submit(0, Submit(1, prompt, SamplingParams(max_new_tokens=2)))
    run_until_idle(sched)
    for rid, start, cached in ((2, 20, 20), (3, 21, 20), (4, 0, 0), (5, 29, 28), (6, 3, 0)):
        sched.submit(0, Submit(rid, prompt, SamplingParams(max_new_tokens=2, prompt_logprobs=True,
                                                           prompt_logprobs_start=start)))
        run_until_idle(sched)
        outputs = sink.outputs(rid)
        assert outputs[-1].cached_tokens == cached, rid
        assert outputs[0].prompt_logprobs == [-float(j) for j in range(start, len(prompt))], rid
        assert all(o.prompt_logprobs is None for o in outputs[1:])
    assert sched.cache.num_available == pool.num_pages and not sched._queued_pages
    # a start past the prompt (the gateway refuses it): no prompt logprobs, the request still served
    sched.submit(0, Submit(7, prompt, SamplingParams(max_new_tokens=2, prompt_logprobs=True,
                                                     prompt_logprobs_start=40)))
    run_until_idle(sched)
    assert sink.outputs(7)[-1].finish_reason == "length" and sink.outputs(7)[0].prompt_logprobs is None
    # a negative start is refused
    sched.submit(0, Submit(8, prompt, SamplingParams(max_new_tokens=2, prompt_logprobs=True,
                                                     prompt_logprobs_start=-1)))
    run_until_idle(sched)
    assert [e.code for e in sink.errors(8)] == ["bad_request"] and not sink.outputs(8)


def test_preemption_by_recompute_when_pages_run_out() -> None:
    # 10 pages of 4 tokens; 3 requests of 8 + 20 tokens need 7 pages each at the end.
    prompts = [list(range(i * 10, i * 10 + 8)) for i in range(3)]
    sched, sink, pool = make(num_pages=10, chunk_size=64)
    for rid, p in enumerate(prompts):
        sched.submit(0, Submit(rid, p, SamplingParams(max_new_tokens=20)))
    run_until_idle(sched, 5000)
    assert sched.num_preemptions > 0
    assert not sched._queued_pages  # (a preempted request's recompute is not indexed again)
    for rid, p in enumerate(prompts):
        solo, solo_sink, _ = make(chunk_size=64)
        solo.submit(0, Submit(rid, p, SamplingParams(max_new_tokens=20)))
        run_until_idle(solo)
        assert tokens_of(sink, rid) == tokens_of(solo_sink, rid), "preemption must not change outputs"
    assert sched.cache.num_available == pool.num_pages


def test_a_preempted_request_keeps_the_pages_it_computed_in_the_prefix_cache() -> None:
    """A request that gives way publishes what it computed before releasing it, so its recompute takes
    those pages back from the prefix cache. The case where the publication at the end of its prefill was
    not enough: B repeats A's 8-token prompt (two whole pages) and shares only A's first page (a match leaves
    a token to compute), so it computes its own copy of the second, which is not published then (A's copy
    has that hash). By the time the pool runs dry A's cached copy has been evicted; B (the youngest) gives
    way, and its recompute must find both prompt pages cached, B's own second page included. (C, the
    older request whose growth preempts B, ends before it needs another page: nothing evicts B's cached
    pages before its recompute is admitted.)"""
    sched, sink, pool = make(num_pages=8, chunk_size=64, max_running=64)
    prompt = list(range(40, 48))
    params = {1: SamplingParams(max_new_tokens=12, ignore_eos=True), 2: SamplingParams(max_new_tokens=20,
                                                                                        ignore_eos=True)}
    sched.submit(0, Submit(0, prompt, SamplingParams(max_new_tokens=1)))  # A: leaves both pages cached
    run_until_idle(sched)
    sched.submit(0, Submit(1, list(range(60, 68)), params[1]))  # C: older than B, so B is the one to give way
    sched.submit(0, Submit(2, prompt, params[2]))  # B
    sched.step()
    b = sched.reqs[(0, 2)]
    assert b.stage == "running" and b.cached_tokens == 4, "B shares A's first page only"
    for _ in range(200):
        if sched.num_preemptions:
            break
        sched.step()
    assert sched.num_preemptions == 1 and b.stage == "waiting" and sched.cache.num_evictions >= 1
    hits = sched.cache.num_hit_tokens
    for _ in range(200):
        if b.stage != "waiting" or b.done:
            break
        sched.step()
    assert b.is_recompute and b.stage in ("prefill", "running")
    # (and the pages of its outputs: test_preemption_keeps_output_kv.py)
    assert sched.cache.num_hit_tokens - hits >= len(prompt), "the recompute found both prompt pages cached"
    run_until_idle(sched, 2000)
    for rid, p in ((1, list(range(60, 68))), (2, prompt)):
        solo, solo_sink, _ = make(chunk_size=64)
        solo.submit(0, Submit(rid, p, params[rid]))
        run_until_idle(solo)
        assert tokens_of(sink, rid) == tokens_of(solo_sink, rid)
        assert len(tokens_of(sink, rid)) == params[rid].max_new_tokens
    assert sched.cache.num_available == pool.num_pages


@pytest.mark.parametrize("num_pages, chunk, first, second", [
    (6, 3, (4, 8), (16, 4)),  # a decode next to a long chunked prefill
    (14, 64, (4, 8), (47, 4)),  # the same with one-chunk prefills
    (8, 4, (5, 12), (20, 6)),
    (9, 2, (3, 20), (25, 8)),
])
def test_two_requests_that_fit_only_one_at_a_time_both_finish(num_pages: int, chunk: int, first: tuple[int, int],
                                                              second: tuple[int, int]) -> None:
    """Combined role, pages for one of the two at a time: the younger gives way, decoding or still in
    its prefill. A victim chosen among decoding sequences only used to swap the two for ever (a
    sequence preempted itself next to the other's prefill, then took its pages back)."""
    sched, sink, pool = make(num_pages=num_pages, chunk_size=chunk, max_running=64)
    requests = [(rid, list(range(10 + 100 * rid, 10 + 100 * rid + n)), m) for rid, (n, m) in enumerate((first, second))]
    for rid, prompt, max_tokens in requests:
        sched.submit(0, Submit(rid, prompt, SamplingParams(max_new_tokens=max_tokens, ignore_eos=True)))
    run_until_idle(sched, 2000)
    for rid, prompt, max_tokens in requests:
        solo, solo_sink, _ = make(chunk_size=chunk)
        solo.submit(0, Submit(rid, prompt, SamplingParams(max_new_tokens=max_tokens, ignore_eos=True)))
        run_until_idle(solo)
        assert tokens_of(sink, rid) == tokens_of(solo_sink, rid) and len(tokens_of(sink, rid)) == max_tokens
    assert sched.num_prompt_tokens == first[0] + second[0], "a prefill sent back is not counted twice"
    assert sched.cache.num_available == pool.num_pages and not sched._queued_pages


def test_prompt_logprobs_survive_giving_way() -> None:
    """A request that gives way mid-prefill keeps (or computes again) its prompt logprobs: one that
    was recomputing after a preemption had them from its first prefill, and the engine does not make
    them twice. The sim engine has none: this wraps it to give position i of a prompt the value -i."""
    cases = [(6, 3, (4, 8), (16, 4)), (14, 64, (4, 8), (47, 4)), (8, 4, (5, 12), (20, 6)), (9, 2, (3, 20), (25, 8)),
             (8, 2, (9, 14), (20, 8)), (10, 4, (9, 6), (20, 8))]
    for num_pages, chunk, first, second in cases:
        sched, sink, _ = make(num_pages=num_pages, chunk_size=chunk, max_running=64)
        _with_position_logprobs(sched)
        prompts = {rid: list(range(10 + 100 * rid, 10 + 100 * rid + n)) for rid, (n, _) in enumerate((first, second))}
        for rid, (_, max_tokens) in enumerate((first, second)):
            sched.submit(0, Submit(rid, prompts[rid], SamplingParams(max_new_tokens=max_tokens, ignore_eos=True,
                                                                     prompt_logprobs=True)))
        run_until_idle(sched, 3000)
        for rid, prompt in prompts.items():  # (with the first output, once: a stream's first chunk shows them)
            outputs = sink.outputs(rid)
            carrying = [o for o in outputs if o.prompt_logprobs is not None]
            assert outputs and outputs[-1].finish_reason is not None and carrying == outputs[:1], \
                (num_pages, chunk, rid, [o.prompt_logprobs for o in outputs])
            assert carrying[0].prompt_logprobs == [-float(j) for j in range(len(prompt))], (num_pages, chunk, rid)


def fail_on_call(engine: Any, n: int, exc: Exception) -> None:
    """``engine.forward`` raising ``exc`` on its ``n``-th call (the others go through)."""
    real = engine.forward
    calls = {"n": 0}

    def flaky(batch):  # type: ignore[no-untyped-def]
        calls["n"] += 1
        if calls["n"] == n:
            raise exc
        return real(batch)

    engine.forward = flaky


def test_engine_failure_fails_the_batch_not_the_worker() -> None:
    sched, sink, pool = make()
    fail_on_call(sched.engine, 2, ValueError("boom"))
    sched.submit(0, Submit(1, [1, 2, 3], SamplingParams(max_new_tokens=5)))
    run_until_idle(sched)
    assert sink.errors(1)[0].code == "internal" and "boom" in sink.errors(1)[0].message
    sched.submit(0, Submit(2, [1, 2, 3], SamplingParams(max_new_tokens=5)))
    run_until_idle(sched)
    assert len(tokens_of(sink, 2)) == 5 and sched.cache.num_available == pool.num_pages


def test_a_row_the_engine_cannot_sample_fails_that_request_only() -> None:
    """An engine reports a row it could not sample (NaN scores) with no token: that request fails, the
    others of the step go on (an exception there failed them all), and every page comes back."""
    sched, sink, pool = make()
    real_forward = sched.engine.forward

    def one_row_unsampled(batch):  # type: ignore[no-untyped-def]
        outputs = real_forward(batch)
        for seq, out in zip(batch, outputs, strict=True):
            if seq.params.seed == 13 and seq.num_generated == 2:  # (rid 1's; seq ids are the scheduler's own)
                out.token_id = None
        return outputs

    sched.engine.forward = one_row_unsampled  # type: ignore[method-assign]
    sched.submit(0, Submit(1, [1, 2, 3], SamplingParams(max_new_tokens=6, seed=13)))
    sched.submit(0, Submit(2, [4, 5, 6], SamplingParams(max_new_tokens=6)))
    run_until_idle(sched)
    assert sink.errors(1)[0].code == "internal" and "could not sample" in sink.errors(1)[0].message
    assert len(tokens_of(sink, 1)) == 2 and len(tokens_of(sink, 2)) == 6 and not sink.errors(2)
    assert sched.cache.num_available == pool.num_pages


def test_nan_or_infinite_timeout_is_rejected() -> None:
    sched, sink, _ = make()
    sched.submit(0, Submit(1, [1, 2], SamplingParams(max_new_tokens=2), timeout_s=float("nan")))
    sched.submit(0, Submit(2, [1, 2], SamplingParams(max_new_tokens=2), timeout_s=float("inf")))
    run_until_idle(sched)
    assert sink.errors(1)[0].code == "bad_request" and sink.errors(2)[0].code == "bad_request"


def test_a_room_already_in_use_is_a_bad_request_not_a_dead_loop() -> None:
    from transfer import KVArgs, KVManager, create_backend
    from workers.protocol import BootstrapTarget

    engine = SimEngine()
    info = engine.info
    pool = KVPool(num_layers=info.num_layers, num_pages=32, page_size=4, num_kv_heads=info.num_kv_heads,
                  head_dim=info.head_dim)
    engine.bind(pool)
    args = KVArgs.from_pool(pool)
    kv = KVManager("prefill", args, create_backend("fake"))
    sink = Collector()
    sched = Scheduler(SchedulerConfig("prefill"), engine, pool, sink, kv)
    sched.start()
    try:
        target = BootstrapTarget("127.0.0.1", 1, 42)
        sched.submit(1, Submit(1, [1, 2, 3], SamplingParams(), target, timeout_s=5))
        sched.submit(2, Submit(1, [1, 2, 3], SamplingParams(), target, timeout_s=5))
        deadline = time.monotonic() + 5
        while not sink.errors(1):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        errors = [m for c, m in sink.items if isinstance(m, Error)]
        assert errors[0].code == "bad_request" and "42" in errors[0].message
        assert sched.is_alive
    finally:
        sched.stop()
        kv.close()


def test_a_prefill_needs_pages_for_the_prompt_only() -> None:
    """A prefill keeps the prompt's KV and none of the answer's: a pool too small for prompt +
    max_new_tokens (but not for the prompt) must not refuse a request its decode can hold."""
    from transfer import KVArgs, KVManager, KVPoll, create_backend
    from workers.protocol import BootstrapTarget

    engine = SimEngine()
    info = engine.info
    pool = KVPool(num_layers=info.num_layers, num_pages=8, page_size=4, num_kv_heads=info.num_kv_heads,
                  head_dim=info.head_dim)
    engine.bind(pool)
    kv = KVManager("prefill", KVArgs.from_pool(pool), create_backend("fake"))
    sink = Collector()
    sched = Scheduler(SchedulerConfig("prefill"), engine, pool, sink, kv)
    try:
        long_answer = SamplingParams(max_new_tokens=40)  # 5 + 40 tokens: 12 pages of 4
        sched.submit(0, Submit(1, list(range(5)), long_answer, BootstrapTarget("127.0.0.1", 1, 7), timeout_s=5))
        sched.submit(0, Submit(2, list(range(40)), SamplingParams(max_new_tokens=1), BootstrapTarget("127.0.0.1", 1, 8),
                               timeout_s=5))  # a prompt of 10 pages: refused
        for _ in range(3):
            sched.step()
        assert not sink.errors(1) and sched.reqs[(0, 1)].stage != "done"
        assert sink.errors(2) and "KV pages" in sink.errors(2)[0].message
        # The refused request's room is ended: its decode's page list fails at once, not after the
        # bootstrap timeout, so the decode does not hold its pages meanwhile.
        decode = KVManager("decode", KVArgs.from_pool(pool), create_backend("fake"))
        try:
            receiver = decode.create_receiver(8, *kv.control_address)
            deadline = time.monotonic() + 5
            while receiver.poll() not in (KVPoll.WaitingForInput, KVPoll.Failed):
                assert time.monotonic() < deadline
                time.sleep(0.01)
            if receiver.poll() == KVPoll.WaitingForInput:
                receiver.send_metadata([1, 2], 0)
            while receiver.poll() != KVPoll.Failed:
                assert time.monotonic() < deadline, "the decode waits for a room the prefill refused"
                time.sleep(0.01)
            assert "KV pages" in str(receiver.failure())
        finally:
            decode.close()
    finally:
        kv.close()


def test_kv_events_and_acknowledging_load_reports() -> None:
    from workers.page_cache import page_hashes
    from workers.protocol import KVEvents, LoadReport

    sched, sink, pool = make(num_pages=12)
    sched.connect(7)
    sched.step()
    snapshot = [m for c, m in sink.items if isinstance(m, KVEvents)]
    assert len(snapshot) == 1 and snapshot[0].reset and snapshot[0].stored == []
    assert any(c == 7 and isinstance(m, LoadReport) for c, m in sink.items)

    prompt = list(range(20, 37))  # 17 tokens, page size 4: 4 full pages
    sched.submit(7, Submit(5, prompt, SamplingParams(max_new_tokens=3)))
    run_until_idle(sched)
    stored = [h for _, m in sink.items if isinstance(m, KVEvents) for h in m.stored]
    assert stored and set(stored) <= set(page_hashes(prompt + [0] * 8, 4)) | set(page_hashes(
        prompt + tokens_of(sink, 5), 4)), "events carry the same chained hashes the gateway computes"
    assert set(page_hashes(prompt, 4)) <= set(stored)
    reports = [m for c, m in sink.items if c == 7 and isinstance(m, LoadReport)]
    assert reports[-1].last_rid == 5 and reports[-1].num_prefill_tokens == 0

    # A prompt the cache holds shows up in num_prefill_tokens without its cached part.
    sched.submit(7, Submit(6, prompt, SamplingParams(max_new_tokens=1)))
    sched._handle(sched._inbox.get_nowait())
    assert sched.load_report().num_prefill_tokens == len(prompt) - 16
    run_until_idle(sched)

    # Evictions are published as removals; a new connection gets the whole cache as a snapshot.
    sink.items.clear()
    other = [100 + i for i in range(40)]
    sched.submit(7, Submit(8, other, SamplingParams(max_new_tokens=1)))
    run_until_idle(sched)
    removed = {h for _, m in sink.items if isinstance(m, KVEvents) for h in m.removed}
    assert removed & set(page_hashes(prompt, 4)), "the old prompt's pages were evicted for the new one"
    sched.connect(9)
    sched.step()
    (snap,) = [m for c, m in sink.items if c == 9 and isinstance(m, KVEvents)]
    assert snap.reset and set(snap.stored) == set(sched.cache.cached_hashes())
    assert sched.cache.num_available == pool.num_pages


def test_idle_sleep_ends_when_a_report_or_a_deadline_is_due() -> None:
    from workers import scheduler as mod

    sched, _, _ = make()
    now = time.monotonic()
    assert sched._idle_wait_s(now) == mod.IDLE_WAIT_S  # no connection, no request: only the safety net
    sched.connect(1)
    sched.step()  # the new connection got its first report
    sched._load_dirty = True
    assert sched._idle_wait_s(sched._last_load) == mod.REPORT_MIN_INTERVAL_S
    sched._load_dirty, sched._load_moved = False, True  # an admission or a stage move: within MOVED_REPORT_S
    assert sched._idle_wait_s(sched._last_load) == mod.MOVED_REPORT_S < mod.IDLE_WAIT_S
    sched._load_moved = False
    assert sched._idle_wait_s(sched._last_load) == mod.IDLE_WAIT_S
    assert sched._idle_wait_s(sched._last_load + mod.IDLE_REPORT_S) == 0.0
    sched.submit(1, Submit(1, [1, 2, 3], SamplingParams(max_new_tokens=5), timeout_s=0.01))
    sched._handle(sched._inbox.get())
    req = next(iter(sched.reqs.values()))
    sched._load_dirty, sched._last_load = False, req.deadline - 0.004  # no report due for a while
    assert abs(sched._idle_wait_s(req.deadline - 0.004) - 0.004) < 1e-9  # wake for the deadline
    assert sched._idle_wait_s(req.deadline + 1) == 0.0


def test_an_admission_rides_on_the_next_report_and_the_end_s_report_goes_with_the_last_output(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """An admission (or a stage move) is not reported on its own within ``MOVED_REPORT_S`` (its gateway counts the
    request until a report covers its rid); a request's end is, at once past the minimum interval, in the same
    hand-over to the sink as its last output, and that report covers the admission too. Past ``MOVED_REPORT_S`` an
    admission is reported without an end. (``MOVED_REPORT_S`` is a minute while no report may go: a slow step on a
    busy machine cannot make one due.)"""
    from workers import scheduler as mod
    from workers.protocol import LoadReport

    moved_report_s = mod.MOVED_REPORT_S
    monkeypatch.setattr(mod, "MOVED_REPORT_S", 60.0)

    calls: list[list[tuple[int, object]]] = []
    sched, sink, _ = make()
    sched._sink = lambda messages: (calls.append(list(messages)), sink(messages))  # type: ignore[func-returns-value]
    sched.connect(1)
    sched.step()
    assert any(isinstance(m, LoadReport) for _, m in calls[-1])  # the new connection's first report

    sched.submit(1, Submit(5, [5, 6, 7], SamplingParams(max_new_tokens=4, ignore_eos=True)))
    sched._last_load = time.monotonic() - 2 * mod.REPORT_MIN_INTERVAL_S  # past the minimum, within MOVED_REPORT_S
    before = len(calls)
    sched.step()  # admitted, prefilled, its first token out
    assert sched.reqs and tokens_of(sink, 5)
    assert not [m for call in calls[before:] for _, m in call if isinstance(m, LoadReport)]
    sched._last_load = time.monotonic() - 2 * mod.REPORT_MIN_INTERVAL_S
    while sched.reqs:
        sched.step()
    (last,) = [call for call in calls if any(isinstance(m, Outputs) and m.items[-1].finish_reason for _, m in call)]
    reports = [m for _, m in last if isinstance(m, LoadReport)]
    assert len(reports) == 1 and reports[0].last_rid == 5 and reports[0].num_running == 0

    monkeypatch.setattr(mod, "MOVED_REPORT_S", moved_report_s)  # (below BUSY_REPORT_S: not the heartbeat's report)
    sched.submit(1, Submit(6, [5, 6, 7], SamplingParams(max_new_tokens=50, ignore_eos=True)))
    sched._last_load = time.monotonic() - mod.MOVED_REPORT_S  # an admission past MOVED_REPORT_S: reported alone
    before = len(calls)
    sched.step()
    reports = [m for call in calls[before:] for _, m in call if isinstance(m, LoadReport)]
    assert len(reports) == 1 and reports[0].last_rid == 6 and reports[0].num_running == 1


def test_a_gathered_request_sends_its_first_token_alone_then_the_rest_together() -> None:
    """``Submit.gather_s`` (a whole response): the first token goes out at once; later ones are held
    and go out as one output once ``gather_s`` has passed since the first held, or with the last. The
    tokens and logprobs equal an ungathered run's, and another request in the batch is not gathered."""
    params = SamplingParams(max_new_tokens=12, logprobs=True, top_logprobs=2, seed=7, temperature=0.8)
    plain, plain_sink, _ = make()
    plain.submit(0, Submit(1, [5, 6, 7], params))
    run_until_idle(plain)
    assert len(plain_sink.outputs(1)) == 12  # one per step

    sched, sink, pool = make()
    sched.submit(0, Submit(1, [5, 6, 7], params, gather_s=60.0))
    sched.submit(0, Submit(2, [8, 9], SamplingParams(max_new_tokens=5)))
    run_until_idle(sched)
    outs = sink.outputs(1)
    assert [len(o.token_ids) for o in outs] == [1, 11]
    assert outs[-1].finish_reason == "length" and outs[0].finish_reason is None
    assert tokens_of(sink, 1) == tokens_of(plain_sink, 1)
    gathered_lp = [lp for o in outs for lp in o.logprobs or []]
    assert gathered_lp == [lp for o in plain_sink.outputs(1) for lp in o.logprobs or []]
    assert [t for o in outs for t in o.top_logprobs or []] == [t for o in plain_sink.outputs(1)
                                                               for t in o.top_logprobs or []]
    assert len(sink.outputs(2)) == 5
    assert sched.cache.num_available == pool.num_pages

    # A short gather: the held tokens go out once it has passed, not only with the last.
    sched, sink, _ = make()
    sched.submit(0, Submit(1, [5, 6, 7], SamplingParams(max_new_tokens=12), gather_s=0.01))
    for _ in range(500):
        sched.step()
        if not sched.reqs:
            break
        time.sleep(0.003)
    sizes = [len(o.token_ids) for o in sink.outputs(1)]
    assert sum(sizes) == 12 and sizes[0] == 1 and 2 < len(sizes) < 12, sizes


def test_a_stop_string_ends_the_request_at_the_token_that_completes_it() -> None:
    """With its tokenizer, the scheduler ends a request ("stop") at the token whose text completes one
    of its stop strings, one that spans tokens too, gathered or not; the pages come back. Without a
    tokenizer (``HelloAck.stop_strings`` false) it generates on, for the gateway to stop."""
    plain, plain_sink, _ = make()
    plain.submit(0, Submit(1, [5, 6, 7], SamplingParams(max_new_tokens=30)))
    run_until_idle(plain)
    full = tokens_of(plain_sink, 1)
    text = bytes(full).decode()
    stop = text[9:12]  # three tokens' text: the request must end at the third
    end = text.index(stop) + len(stop)
    assert end < len(full) - 2
    for gather_s in (0.0, 60.0):
        sched, sink, pool = make(stop_tokenizer=ByteTokenizer())
        params = SamplingParams(max_new_tokens=30, stop=["never here", stop])
        sched.submit(0, Submit(1, [5, 6, 7], params, gather_s=gather_s))
        sched.submit(0, Submit(2, [5, 6, 7], SamplingParams(max_new_tokens=30)))  # no stop strings: runs on
        run_until_idle(sched)
        assert tokens_of(sink, 1) == full[:end], gather_s
        assert sink.outputs(1)[-1].finish_reason == "stop"
        assert tokens_of(sink, 2) == full
        assert sched.cache.num_available == pool.num_pages
    blind, blind_sink, _ = make()
    blind.submit(0, Submit(1, [5, 6, 7], SamplingParams(max_new_tokens=30, stop=[stop])))
    run_until_idle(blind)
    assert tokens_of(blind_sink, 1) == full and blind_sink.outputs(1)[-1].finish_reason == "length"


def test_a_stop_string_spanning_a_migration_ends_the_continuing_request() -> None:
    """A migrated stream's new decode gets the outputs so far at the end of its prompt
    (``output_offset`` of them): a stop string that starts in them and ends in its first token ends the
    request there; a string lying wholly in them (text the gateway's detokenizer would have stopped at,
    so it did not see it that way) does not end it at once."""
    prompt, before = [5, 6, 7], 12
    plain, plain_sink, _ = make()
    plain.submit(0, Submit(1, prompt, SamplingParams(max_new_tokens=before)))
    run_until_idle(plain)
    history = tokens_of(plain_sink, 1)
    plain.submit(0, Submit(2, prompt + history, SamplingParams(max_new_tokens=10, output_offset=before)))
    run_until_idle(plain)
    rest = tokens_of(plain_sink, 2)
    text = bytes(history + rest).decode()
    spanning = text[before - 2:before + 1]  # two characters of the earlier outputs, one of the new
    assert text.index(spanning) == before - 2, text
    inside = text[3:6]
    for stop, expected in (([spanning], rest[:1]), ([inside], rest)):
        sched, sink, pool = make(stop_tokenizer=ByteTokenizer())
        params = SamplingParams(max_new_tokens=10, output_offset=before, stop=stop)
        sched.submit(0, Submit(1, prompt + history, params))
        run_until_idle(sched)
        assert tokens_of(sink, 1) == expected, stop
        assert sink.outputs(1)[-1].finish_reason == ("stop" if expected != rest else "length"), stop
        assert sched.cache.num_available == pool.num_pages



def test_a_step_never_idles_while_a_finished_request_holds_batch_room() -> None:
    """Requests that finished in a step leave the batch lists only at the next one: until then they
    must not count against ``max_running`` (a step admitting nothing would run nothing, and the loop
    would sleep with requests waiting), nor twice in load reports (a combined worker's prefilled
    request is in both lists for a step)."""
    sched, sink, _ = make(chunk_size=64, max_running=2)
    sched.connect(1)
    for rid in range(1, 5):
        sched.submit(1, Submit(rid, list(range(rid * 10, rid * 10 + 9)), SamplingParams(max_new_tokens=3), timeout_s=5))
    for _ in range(40):
        ran = sched.step()
        if not sched.reqs:
            break
        assert ran, f"a step ran nothing with requests at {sorted(r.stage for r in sched.reqs.values())}"
    assert not sched.reqs and all(sink.outputs(rid)[-1].finish_reason for rid in range(1, 5))

    sched.submit(1, Submit(9, list(range(1, 10)), SamplingParams(max_new_tokens=20), timeout_s=5))
    sched.step()  # prefilled (one chunk) and its first token out: now decoding
    assert sched.reqs[(1, 9)].stage == "running"
    assert sched.load_report().num_running == 1
    run_until_idle(sched)


def _pd_pair(prefill_pages: int, decode_pages: int, num_aux_slots: int = 256, decode_max_running: int = 64,
             prefill_chunk_size: int = 64, backend: str = "tcp") -> list[tuple[Scheduler, Collector, Any]]:
    """A prefill and a decode scheduler moving KV over ``backend``, stepped by the test."""
    from transfer import KVArgs, KVManager, create_backend

    sides = []
    for role, num_pages in (("prefill", prefill_pages), ("decode", decode_pages)):
        engine = SimEngine()
        info = engine.info
        pool = KVPool(num_layers=info.num_layers, num_pages=num_pages, page_size=4, num_kv_heads=info.num_kv_heads,
                      head_dim=info.head_dim, num_aux_slots=num_aux_slots)
        engine.bind(pool)
        kv = KVManager(role, KVArgs.from_pool(pool), create_backend(backend))
        sink = Collector()
        max_running = decode_max_running if role == "decode" else 64
        chunk_size = prefill_chunk_size if role == "prefill" else 64
        sched = Scheduler(SchedulerConfig(role, chunk_size=chunk_size, max_running=max_running), engine, pool, sink, kv)
        sched.connect(1)
        sides.append((sched, sink, kv))
    return sides


def _submit_pd(d: Scheduler, p: Scheduler, pkv: Any, rid: int, params: SamplingParams,
               prompt: list[int] | None = None) -> None:
    """Request ``rid`` to both sides of a ``_pd_pair``: room 100 + rid at the prefill's control address, the
    prompt ``rid * 20, rid * 20 + 1, ...`` (9 tokens) unless one is given."""
    from workers.protocol import BootstrapTarget

    target = BootstrapTarget(*pkv.control_address, 100 + rid)
    prompt = prompt if prompt is not None else [rid * 20 + i for i in range(9)]
    for sched in (d, p):
        sched.submit(1, Submit(rid, prompt, params, target, timeout_s=60))


def _until_pool_full(sched: Scheduler) -> None:
    """Step ``sched`` until every page is back (an aborted request's may wait in quarantine for its transfer
    to quiesce), failing after 50 steps."""
    for _ in range(50):
        sched.step()
        if sched.cache.num_available == sched.pool.num_pages:
            return
        time.sleep(0.01)
    assert sched.cache.num_available == sched.pool.num_pages


@pytest.mark.parametrize("short_side", ["prefill", "decode"])
def test_pages_freed_in_a_step_are_taken_in_that_step(short_side: str) -> None:
    """A pool that holds one request at a time: the pages a finished transfer frees (prefill), or a
    request that ends at its import (decode, one token), go to the next waiting request in the same
    step, so a step that runs nothing leaves nothing waiting that could have gone (the loop would
    sleep, up to ``IDLE_WAIT_S``, with pages free)."""
    from transfer import KVPoll
    from workers.protocol import BootstrapTarget

    (p, _, pkv), (d, dsink, dkv) = _pd_pair(3 if short_side == "prefill" else 64, 3 if short_side == "decode" else 64)
    try:
        host, port = pkv.control_address
        num = 5
        for rid in range(1, num + 1):
            prompt, target = [rid * 20 + i for i in range(9)], BootstrapTarget(host, port, 100 + rid)
            params = SamplingParams(max_new_tokens=1 if short_side == "decode" else 2)  # 9 + 1 tokens: 3 pages
            d.submit(1, Submit(rid, prompt, params, target, timeout_s=30))
            p.submit(1, Submit(rid, prompt, params, target, timeout_s=30))
        deadline = time.monotonic() + 30

        def done() -> bool:
            return all(dsink.errors(rid) or any(o.finish_reason for o in dsink.outputs(rid))
                       for rid in range(1, num + 1))

        while not done() or p.reqs or d.reqs:
            assert time.monotonic() < deadline, "the pair did not finish its requests"
            # (decode: requests whose page list could go out before the step; their state does not go back)
            ready = [r for r in d.prealloc_queue if r.kv_receiver.poll() >= KVPoll.WaitingForInput]
            if not p.step() and p._waiting:
                first = p._waiting[0]
                assert p.pool.pages_for(len(first.input_ids)) > p.cache.num_available, "prefill idled with pages free"
            if not d.step():
                for req in ready:
                    if not req.done and req.stage == "prealloc":
                        needed = d.pool.pages_for(len(req.input_ids) + req.params.max_new_tokens)
                        assert needed > d.cache.num_available, "decode idled with pages free"
            time.sleep(0.001)
        for rid in range(1, num + 1):
            assert not dsink.errors(rid) and dsink.outputs(rid)[-1].finish_reason is not None
        assert p.cache.num_available == p.pool.num_pages and d.cache.num_available == d.pool.num_pages
    finally:
        pkv.close()
        dkv.close()


@pytest.mark.parametrize("order", ["decode_first", "prefill_first"])
def test_a_request_its_decode_refuses_ends_on_its_prefill_at_once(order: str) -> None:
    """A decode refusing a request (here: more pages than its pool) tells the prefill, which fails its
    side at once instead of holding the request until its bootstrap timeout (an SGLang router waits for
    both answers); the decode had no connection to that prefill yet (its abort waits for one)."""
    from workers.protocol import BootstrapTarget

    (p, psink, pkv), (d, dsink, dkv) = _pd_pair(64, 8)
    try:
        host, port = pkv.control_address
        prompt, target = list(range(9)), BootstrapTarget(host, port, 7)
        params = SamplingParams(max_new_tokens=60)  # 9 + 60 tokens: 18 pages of 4, the decode has 8
        sides = [(d, d), (p, p)] if order == "decode_first" else [(p, p), (d, d)]
        for sched, _ in sides:
            sched.submit(1, Submit(1, prompt, params, target, timeout_s=60))
        deadline = time.monotonic() + 20  # (the bootstrap timeout is 300 s)
        while not psink.errors(1):
            assert time.monotonic() < deadline, "the prefill still waits for the refused request's page list"
            for sched, _ in sides:
                sched.step()
            time.sleep(0.005)
        (refused,) = dsink.errors(1)
        assert refused.code == "bad_request" and "KV pages" in refused.message
        (ended,) = psink.errors(1)
        assert "KV pages" in ended.message, ended
        for _ in range(3):
            p.step()
        assert not p.reqs and p.cache.num_available == p.pool.num_pages
    finally:
        pkv.close()
        dkv.close()


def test_requests_whose_grammar_is_compiling_count_in_load_reports() -> None:
    """A report's ``last_rid`` covers a request from its admission, so the gateway stops counting it
    itself: while its grammar compiles it must count as waiting (and its prompt as prefill work), or a
    worker holding a burst of structured-output requests reports itself idle."""
    import concurrent.futures

    from workers.protocol import Grammar

    compiles: list[concurrent.futures.Future[None]] = []

    class CompilingSim(SimEngine):
        def prepare(self, grammar: Grammar) -> concurrent.futures.Future[None]:
            future: concurrent.futures.Future[None] = concurrent.futures.Future()
            compiles.append(future)
            return future

    engine = CompilingSim()
    info = engine.info
    pool = KVPool(num_layers=info.num_layers, num_pages=64, page_size=4, num_kv_heads=info.num_kv_heads,
                  head_dim=info.head_dim)
    engine.bind(pool)
    sched = Scheduler(SchedulerConfig("both"), engine, pool, Collector())
    sched.connect(1)
    params = SamplingParams(max_new_tokens=3, grammar=Grammar("json_object"))
    for rid in range(1, 6):
        sched.submit(1, Submit(rid, list(range(rid * 40, rid * 40 + 40)), params, timeout_s=60))  # (no shared pages)
    sched.step()
    report = sched.load_report()
    assert len(compiles) == 5 and {r.stage for r in sched.reqs.values()} == {"grammar"}
    assert report.num_waiting == 5 and report.num_prefill_tokens == 200
    for rid in range(1, 6):
        sched.abort(1, rid, "the client left")
    sched.step()
    report = sched.load_report()
    assert not sched.reqs and report.num_waiting == 0 and report.num_prefill_tokens == 0


def test_a_prefill_ends_a_waiting_request_its_decode_ended_without_waiting_its_turn() -> None:
    """A decode ends a room (its client left) while the prefill's request waits in line behind a long
    prefill: the prefill fails it as soon as its sender fails, not when it reaches the head of the
    line (its answer, its count in the load reports and its place in line were held until then)."""
    from workers.engines.base import EngineOptions

    (p, psink, pkv), (d, _, dkv) = _pd_pair(1024, 1024)
    try:
        # (the long prompt: ~12 s, so that on a loaded machine the short one's page list still comes while it waits
        # behind it: with ~4 s, under a full CI run it sometimes found the long one done, was never seen waiting,
        # and the loop timed out; the test ends once the short one is answered, not when the long one is)
        slow = SimEngine(EngineOptions(extra={"prefill_token_s": "5e-3"}))
        slow.bind(p.pool)
        p.engine = slow
        p.config = SchedulerConfig("prefill", chunk_size=64, max_running=1)
        # The long one first, and prefilling before the short one comes: submitted together, the short one's page
        # list sometimes reached the prefill first (a loaded CI machine), went first, and was never seen waiting.
        _submit_pd(d, p, pkv, 1, SamplingParams(max_new_tokens=4), [i % 250 for i in range(2400)])
        deadline = time.monotonic() + 30
        while not ((1, 1) in p.reqs and p.reqs[(1, 1)].stage == "prefill"):
            assert time.monotonic() < deadline, {k: r.stage for k, r in p.reqs.items()}
            d.step()
            p.step()
        _submit_pd(d, p, pkv, 2, SamplingParams(max_new_tokens=4), list(range(40)))
        while not ((1, 2) in p.reqs and p.reqs[(1, 2)].stage == "waiting"):  # (its decode's page list came)
            assert time.monotonic() < deadline, {k: r.stage for k, r in p.reqs.items()}
            d.step()
            p.step()
        d.abort(1, 2, "the client left")
        while not psink.errors(2):
            assert time.monotonic() < deadline, "no answer for the ended request"
            d.step()
            p.step()
        assert p.reqs[(1, 1)].stage == "prefill", "the ended request was answered only after the long prefill"
        assert (1, 2) not in p.reqs and p.load_report().num_waiting == 0
    finally:
        pkv.close()
        dkv.close()


def test_a_prefilling_request_its_decode_ended_is_failed_without_waiting_for_chunk_budget() -> None:
    """A prefill request already holding its pages (in the prefill stage) behind a long prefill that takes
    the whole chunk budget every step: its decode ending the room fails it at the next step, not once the
    budget reaches it (its pages and batch slot were held for the long prefill's whole length)."""
    from workers.engines.base import EngineOptions

    (p, psink, pkv), (d, _, dkv) = _pd_pair(512, 512)
    try:
        slow = SimEngine(EngineOptions(extra={"prefill_token_s": "4e-3"}))  # the long prompt: ~6.4 s of prefill
        slow.bind(p.pool)
        p.engine = slow
        p.config = SchedulerConfig("prefill", chunk_size=64, max_running=8)
        # The long one first, and prefilling before the short one comes: a short one whose page list reached the
        # prefill first (a loaded machine) was prefilled at once, and never seen waiting for the chunk budget.
        _submit_pd(d, p, pkv, 1, SamplingParams(max_new_tokens=4), [i % 250 for i in range(1600)])
        deadline = time.monotonic() + 20
        while not ((1, 1) in p.reqs and p.reqs[(1, 1)].stage == "prefill"):
            assert time.monotonic() < deadline, {k: r.stage for k, r in p.reqs.items()}
            d.step()
            p.step()
        _submit_pd(d, p, pkv, 2, SamplingParams(max_new_tokens=4), list(range(100, 140)))
        while not ((1, 2) in p.reqs and p.reqs[(1, 2)].stage == "prefill"):
            assert time.monotonic() < deadline, {k: r.stage for k, r in p.reqs.items()}
            d.step()
            p.step()
        assert p.reqs[(1, 2)].pages and p.reqs[(1, 2)].num_computed == 0
        d.abort(1, 2, "the client left")
        deadline = time.monotonic() + 30
        while not psink.errors(2):
            assert time.monotonic() < deadline, "no answer for the ended request"
            d.step()
            p.step()
        assert (1, 1) in p.reqs and p.reqs[(1, 1)].stage == "prefill", "answered only after the long prefill"
        assert [e.code for e in psink.errors(2)] == ["transfer_failed"]
    finally:
        pkv.close()
        dkv.close()


def test_an_engine_returning_too_few_outputs_fails_its_batch_not_the_loop() -> None:
    """An engine (a plugin's) that returns fewer outputs than sequences fails that batch's requests; the
    scheduler's loop goes on (it died on the mismatch, failing every request and the worker's health)."""

    class ShortEngine(SimEngine):
        calls = 0

        def forward(self, batch: Any) -> Any:
            out = super().forward(batch)
            ShortEngine.calls += 1
            return out[:-1] if ShortEngine.calls == 3 and len(out) > 1 else out

    sched, sink, pool = make(chunk_size=64, engine=ShortEngine())
    sched.start()
    try:
        for rid in (1, 2):
            sched.submit(0, Submit(rid, [rid, 2, 3], SamplingParams(max_new_tokens=20)))
        deadline = time.monotonic() + 10

        def ended(rid: int) -> bool:
            return bool(sink.errors(rid)) or any(o.finish_reason for o in sink.outputs(rid))

        while not (ended(1) and ended(2)) and sched.is_alive:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert sched.is_alive, f"the scheduler loop died: {sched.error!r}"
        assert ShortEngine.calls >= 3 and {e.code for rid in (1, 2) for e in sink.errors(rid)} == {"internal"}
        sched.submit(0, Submit(3, [3, 2, 1], SamplingParams(max_new_tokens=4)))
        while not ended(3):
            assert time.monotonic() < deadline and sched.is_alive
            time.sleep(0.01)
        assert not sink.errors(3)
        assert sched.cache.num_available == pool.num_pages  # (nothing held; its answer may stay cached)
    finally:
        sched.stop()


def test_prefix_hits_are_counted_once_for_a_request_that_waited_for_pages() -> None:
    """A request at the head of the line that cannot get its fresh pages matches its cached prefix again
    each step: its hits count once, when it gets its pages (``pd_worker_prefix_cache_hit_tokens`` grew per
    step it waited)."""
    sched, sink, _ = make(chunk_size=64, num_pages=8, max_running=8)  # page_size 4
    prefix = list(range(100, 116))  # 4 pages
    sched.submit(0, Submit(1, [*prefix, 1], SamplingParams(max_new_tokens=1)))
    run_until_idle(sched)  # publishes the prefix's pages
    base = sched.cache.num_hit_tokens
    sched.submit(0, Submit(2, list(range(200, 220)), SamplingParams(max_new_tokens=8)))  # holds most of the pool
    sched.step()
    sched.submit(0, Submit(3, [*prefix, *range(40, 52)], SamplingParams(max_new_tokens=1)))  # 4 cached + 3 fresh
    for _ in range(5):
        sched.step()
    run_until_idle(sched)
    (last,) = [o for o in sink.outputs(3) if o.finish_reason]
    assert last.cached_tokens > 0 and sched.cache.num_hit_tokens - base == last.cached_tokens


def test_a_decoding_request_gives_its_aux_slot_back_at_import() -> None:
    """The aux slot carries the prefill's first-token record, read at import: a decode that kept it to the
    request's end decoded at most as many requests at once as its pool has slots (256 in production),
    the rest waiting with pages free."""

    (p, _, pkv), (d, _, dkv) = _pd_pair(256, 2048, num_aux_slots=2)  # (pages for 4 of 1009 tokens)
    try:
        for rid in range(1, 5):
            _submit_pd(d, p, pkv, rid, SamplingParams(max_new_tokens=1000))
        most = 0
        deadline = time.monotonic() + 30
        while most < 4:
            assert time.monotonic() < deadline, (most, {k: r.stage for k, r in d.reqs.items()})
            p.step()
            d.step()
            most = max(most, sum(1 for r in d.reqs.values() if r.stage == "running"))
            # (paced: at zero model cost the first request's 1000 tokens would otherwise be done in ~50 ms, before
            # a transfer that a loaded machine delays has landed the last one; seen in a CI run)
            time.sleep(0.001)
        assert most == 4 and d.pool.num_free_aux_slots == 2
        for rid in range(1, 5):
            d.abort(1, rid, "done")
        for _ in range(50):
            p.step()
            d.step()
    finally:
        pkv.close()
        dkv.close()


def test_a_decode_batch_holds_at_most_max_running_sequences() -> None:
    """``--max-running`` bounds a decode's batch as it bounds a combined worker's: requests whose KV has
    arrived wait (pages held, counted as waiting in load reports; their first token not sent yet, or their
    streams would fall silent after it) and join oldest first as sequences end; an aborted one gives its
    pages back while it waits."""

    (p, _, pkv), (d, dsink, dkv) = _pd_pair(256, 256, decode_max_running=2)
    try:
        for rid in range(1, 7):
            _submit_pd(d, p, pkv, rid, SamplingParams(max_new_tokens=8))
        most, most_waiting, aborted = 0, 0, False
        deadline = time.monotonic() + 30
        d.step()
        while d.reqs or p.reqs:
            assert time.monotonic() < deadline, {k: r.stage for k, r in d.reqs.items()}
            p.step()
            d.step()
            most = max(most, len(live(d._running, "running")))
            imported = [r for r in d.reqs.values() if r.stage == "imported"]
            assert not any(dsink.outputs(r.rid) for r in imported), "a waiting request's first token went out"
            most_waiting = max(most_waiting, len(imported))
            if imported and not aborted:
                assert d.load_report().num_waiting >= len(imported)
                d.abort(1, imported[-1].rid, "client left")
                aborted = True
            time.sleep(0.001)
        assert most == 2 and most_waiting >= 2 and aborted
        finished = [rid for rid in range(1, 7) if any(o.finish_reason for o in dsink.outputs(rid))]
        assert len(finished) == 5
        for rid in finished:
            assert sum(len(o.token_ids) for o in dsink.outputs(rid)) == 8
        _until_pool_full(d)
    finally:
        pkv.close()
        dkv.close()


def test_a_prefill_chunk_ending_inside_a_page_sends_only_the_pages_it_completed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Prefill chunks of 6 tokens on pages of 4, a 20-token prompt: chunks end at 6, 12 and 18, inside a page.
    Each non-final send carries only pages whose every position is computed (the page a chunk ends in is
    the next chunk's to send): a page sent half-computed is never sent again, and the decode would hold
    whatever the rest of that page held before. Checked at each send, against the KV those positions must
    hold (the sim engine's rows are a function of token and position); at the end the decode holds the
    prompt's exact KV and answers as a combined worker does."""
    (p, _, pkv), (d, dsink, dkv) = _pd_pair(64, 64, prefill_chunk_size=6)
    engine = p.engine
    assert isinstance(engine, SimEngine)
    prompt = list(range(30, 50))
    sent: list[int] = []
    sends: list[tuple[list[int], bool, bool | None]] = []
    create_sender = pkv.create_sender

    def checked_sender(room: int) -> Any:
        sender = create_sender(room)
        send = sender.send

        def checked(page_ids: list[int], *, last: bool, aux: bytes | None = None) -> None:
            sent.extend(page_ids)  # (pages go in order: ``sent`` is the request's leading pages)
            sends.append((list(page_ids), last, None if last else engine.verify(sent, prompt[: len(sent) * 4])))
            send(page_ids, last=last, aux=aux)

        monkeypatch.setattr(sender, "send", checked)
        return sender

    monkeypatch.setattr(pkv, "create_sender", checked_sender)
    try:
        params = SamplingParams(max_new_tokens=6, ignore_eos=True)
        _submit_pd(d, p, pkv, 1, params, prompt)
        deadline = time.monotonic() + 30
        d.step()
        while d.reqs or p.reqs:
            assert time.monotonic() < deadline, {k: r.stage for k, r in d.reqs.items()}
            p.step()
            d.step()
            time.sleep(0.001)
        assert [(len(pages), last) for pages, last, _ in sends] == [(1, False), (2, False), (1, False), (1, True)]
        assert all(ok for _, last, ok in sends if not last), sends
        outputs = dsink.outputs(1)
        assert outputs and outputs[-1].finish_reason == "length" and outputs[-1].kv_verified is True
        solo, solo_sink, _ = make(chunk_size=64)
        solo.submit(0, Submit(1, prompt, params))
        run_until_idle(solo)
        assert tokens_of(dsink, 1) == tokens_of(solo_sink, 1) and len(tokens_of(dsink, 1)) == 6
    finally:
        pkv.close()
        dkv.close()


def test_a_first_token_outside_the_decodes_vocabulary_fails_only_its_request() -> None:
    """A prefill serving another model may hand over a first token this decode's model cannot embed: that
    request fails (transfer_failed, blamed on its peer) at import; the batch it would have joined goes on."""
    import dataclasses


    (p, _, pkv), (d, dsink, dkv) = _pd_pair(256, 256)
    try:

        def submit(rid: int, prompt: list[int], max_new_tokens: int) -> None:
            _submit_pd(d, p, pkv, rid, SamplingParams(max_new_tokens=max_new_tokens), prompt)

        def step_until(cond: Any) -> None:
            deadline = time.monotonic() + 30
            while not cond():
                assert time.monotonic() < deadline, {k: r.stage for k, r in d.reqs.items()}
                p.step()
                d.step()
                time.sleep(0.001)

        submit(1, [1] * 9, 200)
        step_until(lambda: dsink.outputs(1))
        first = dsink.outputs(1)[0].token_ids[0]
        assert first > 1  # (the sim's first token for this prompt: outside a vocabulary of 1)
        d.engine.info = dataclasses.replace(d.engine.info, vocab_size=1)  # (prompts of token 0 still valid)
        submit(2, [0] * 9, 200)
        step_until(lambda: dsink.errors(2))
        (error,) = dsink.errors(2)
        assert error.code == "transfer_failed" and "vocabulary" in error.message and error.fault == Fault.PEER
        assert (1, 1) in d.reqs and not dsink.errors(1)  # (the first one decodes on)
        d.abort(1, 1, "done")
        step_until(lambda: not d.reqs and not p.reqs)
    finally:
        pkv.close()
        dkv.close()


def test_a_room_that_brings_another_prompts_kv_fails_the_decode_request() -> None:
    """One room given to two requests (a client choosing rooms through the SGLang API can): the decode whose
    prompt is not the one the prefill computed fails (transfer_failed) instead of answering with the other
    prompt's KV and first token; its pages go back."""
    from workers.protocol import BootstrapTarget

    (p, _, pkv), (d, dsink, dkv) = _pd_pair(256, 256)
    try:
        host, port = pkv.control_address
        target = BootstrapTarget(host, port, 100)
        params = SamplingParams(max_new_tokens=4)
        d.submit(1, Submit(1, [7] * 9, params, target, timeout_s=30))
        p.submit(1, Submit(1, [8] * 9, params, target, timeout_s=30))  # (same length, another prompt)
        deadline = time.monotonic() + 30
        while not (dsink.errors(1) or dsink.outputs(1)) or d.reqs or p.reqs:
            assert time.monotonic() < deadline, ({k: r.stage for k, r in d.reqs.items()}, dsink.outputs(1))
            p.step()
            d.step()
            time.sleep(0.001)
        assert not dsink.outputs(1)
        (error,) = dsink.errors(1)
        assert error.code == "transfer_failed" and "another prompt" in error.message and error.fault == Fault.NONE
        _until_pool_full(d)
    finally:
        pkv.close()
        dkv.close()


def test_a_request_its_first_token_ends_needs_no_batch_slot() -> None:
    """With the decode's batch full, a request whose first token ends it (a stop token, EOS, a budget of one)
    is answered at once, not after a running sequence ends (it held its pages for a whole generation)."""

    (p, _, pkv), (d, dsink, dkv) = _pd_pair(256, 512, decode_max_running=1)
    try:
        long_one = SamplingParams(max_new_tokens=400)
        stops_at_once = SamplingParams(max_new_tokens=50, stop_token_ids=list(range(258)))  # (every token stops it)
        for rid, params in ((1, long_one), (2, stops_at_once)):
            _submit_pd(d, p, pkv, rid, params)
            if rid == 1:  # (the long one first: it holds the batch's one slot)
                deadline = time.monotonic() + 30
                while not dsink.outputs(1):
                    assert time.monotonic() < deadline
                    p.step()
                    d.step()
        deadline = time.monotonic() + 30
        while not any(o.finish_reason for o in dsink.outputs(2)):
            assert time.monotonic() < deadline, {k: r.stage for k, r in d.reqs.items()}
            p.step()
            d.step()
            time.sleep(0.001)
        assert (1, 1) in d.reqs and not any(o.finish_reason for o in dsink.outputs(1)), "it waited for the long one"
        d.abort(1, 1, "done")
        _until_pool_full(d)
    finally:
        pkv.close()
        dkv.close()


def test_finished_requests_leave_no_sim_engine_state() -> None:
    """The sim engine's per-sequence digests go with the request (``SequenceState.forget``), not only once
    ``_MAX_SEEN`` newer sequences pushed them out: a soak's workers kept 8192 of them (RSS creeping)."""
    engine = SimEngine()
    sched, sink, pool = make(engine=engine)
    sched.submit(0, Submit(99, list(range(10, 30)), SamplingParams(max_new_tokens=50)))
    for _ in range(6):
        sched.step()
    assert tokens_of(sink, 99) and engine._seen  # (sampled: its digest is kept while it runs)
    sched.abort(0, 99, "client went away")
    for rid in range(20):
        sched.submit(0, Submit(rid, list(range(10, 20 + rid)), SamplingParams(max_new_tokens=3)))
    run_until_idle(sched)
    assert all(len(tokens_of(sink, rid)) == 3 for rid in range(20))
    assert sched.cache.num_available == pool.num_pages
    assert engine._seen == {}
