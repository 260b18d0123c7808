"""A decode reserves the KV pages its request will write, no more: the prompt's positions and those of every
output but the last (the last sampled token is never fed back, so its KV is never written). Reserving
``prompt + max_new_tokens`` positions took one page too many whenever that sum was one past a page boundary: a
request that fits the pool was refused, and two requests that fit side by side were served one after the other."""

from __future__ import annotations

import time
from typing import Any

from test_scheduler import _pd_pair, _submit_pd

from workers.protocol import SamplingParams


def _run(p: Any, d: Any, limit_s: float = 30.0) -> None:
    p.step()
    d.step()  # (both admit what their inboxes hold)
    deadline = time.monotonic() + limit_s
    while d.reqs or p.reqs:
        assert time.monotonic() < deadline, {k: r.stage for k, r in d.reqs.items()}
        p.step()
        d.step()
        time.sleep(0.001)


def test_a_request_that_fits_the_decode_pool_exactly_is_served() -> None:
    """9 prompt tokens + 4 outputs on pages of 4: positions 0..11 are written (12 = 3 pages); a 3-page decode."""
    (p, _, pkv), (d, dsink, dkv) = _pd_pair(64, 3)
    try:
        _submit_pd(d, p, pkv, 1, SamplingParams(max_new_tokens=4))
        _run(p, d)
        assert not dsink.errors(1), dsink.errors(1)
        assert sum(len(o.token_ids) for o in dsink.outputs(1)) == 4
        assert dsink.outputs(1)[-1].finish_reason == "length"
        assert d.cache.num_available == d.pool.num_pages and p.cache.num_available == p.pool.num_pages
    finally:
        pkv.close()
        dkv.close()


def test_two_requests_that_fit_side_by_side_are_reserved_together() -> None:
    """Two such requests on a 6-page decode: both hold their pages at once (3 each), and both finish."""
    (p, _, pkv), (d, dsink, dkv) = _pd_pair(64, 6)
    try:
        for rid in (1, 2):
            _submit_pd(d, p, pkv, rid, SamplingParams(max_new_tokens=4))
        most = 0
        p.step()
        d.step()
        deadline = time.monotonic() + 30
        while d.reqs or p.reqs:
            assert time.monotonic() < deadline, {k: r.stage for k, r in d.reqs.items()}
            p.step()
            d.step()
            most = max(most, sum(1 for r in d.reqs.values() if r.pages))
            time.sleep(0.001)
        assert most == 2
        for rid in (1, 2):
            assert not dsink.errors(rid), dsink.errors(rid)
            assert sum(len(o.token_ids) for o in dsink.outputs(rid)) == 4
        assert d.cache.num_available == d.pool.num_pages
    finally:
        pkv.close()
        dkv.close()


def test_the_load_report_counts_the_pages_a_queued_request_will_take() -> None:
    """A request waiting in the decode's prealloc queue is reported with the pages it will reserve (3, not 4)."""
    (p, _, pkv), (d, _, dkv) = _pd_pair(64, 64)
    try:
        _submit_pd(d, p, pkv, 1, SamplingParams(max_new_tokens=4))
        d.step()  # admitted: in prealloc until its prefill connects
        assert d.reqs[(1, 1)].stage == "prealloc"
        assert d.load_report().num_queued_pages == 3
        _run(p, d)
    finally:
        pkv.close()
        dkv.close()


def test_a_combined_worker_serves_a_request_that_fits_its_pool_exactly() -> None:
    """The same bound on a combined worker: 9 + 4 tokens on a pool of 3 pages of 4 (it never writes the last)."""
    from test_scheduler import make, run_until_idle, tokens_of

    from workers.protocol import Submit

    sched, sink, pool = make(num_pages=3)
    sched.submit(0, Submit(1, list(range(1, 10)), SamplingParams(max_new_tokens=4)))
    run_until_idle(sched)
    assert not sink.errors(1), sink.errors(1)
    assert len(tokens_of(sink, 1)) == 4 and sink.outputs(1)[-1].finish_reason == "length"
    assert sched.cache.num_available == pool.num_pages
