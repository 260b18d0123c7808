"""``/flush_cache`` gives up waiting for the scheduler after a while and cancels its future: the scheduler, when it
gets to the flush, still clears the cache, and setting the cancelled future's result no longer raises
(``InvalidStateError`` in the loop: the load report was not marked changed after the clear)."""

from __future__ import annotations

import time

from tests.workers.test_scheduler import make, run_until_idle
from workers.protocol import LoadReport, SamplingParams, Submit


def test_a_flush_whose_caller_gave_up_still_clears_the_cache() -> None:
    sched, sink, pool = make(chunk_size=64)
    sched.connect(0)
    sched.submit(0, Submit(1, list(range(10, 30)), SamplingParams(max_new_tokens=2, ignore_eos=True)))
    run_until_idle(sched)
    assert pool.num_free_pages < pool.num_pages  # (its pages are cached)
    future = sched.flush_cache()
    assert future.cancel()  # (the caller's timeout)
    sched._load_dirty = False
    sink.items.clear()
    sched.step()
    assert pool.num_free_pages == pool.num_pages
    # The clear is reported: in this step's report, or (a report went out less than the minimum interval before)
    # in the next one, which the changed load makes due then.
    if sched._load_dirty:
        sched._maybe_report_load(time.monotonic() + 1.0)
        sched._flush()
    reports = [m for _, m in sink.items if isinstance(m, LoadReport)]
    assert reports, "the clear is reported"
    assert reports[-1].num_free_pages == pool.num_pages
