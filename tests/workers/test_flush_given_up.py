"""``/flush_cache`` gives up waiting for the scheduler after a while and cancels its future: the scheduler, when it
gets to the flush, still clears the cache, and setting the cancelled future's result no longer raises
(``InvalidStateError`` in the loop: the load report was not marked changed after the clear)."""

from __future__ import annotations

from tests.workers.test_scheduler import make, run_until_idle
from workers.protocol import SamplingParams, Submit


def test_a_flush_whose_caller_gave_up_still_clears_the_cache() -> None:
    sched, _, pool = make(chunk_size=64)
    sched.submit(0, Submit(1, list(range(10, 30)), SamplingParams(max_new_tokens=2, ignore_eos=True)))
    run_until_idle(sched)
    assert pool.num_free_pages < pool.num_pages  # (its pages are cached)
    future = sched.flush_cache()
    assert future.cancel()  # (the caller's timeout)
    sched._load_dirty = False
    sched.step()
    assert pool.num_free_pages == pool.num_pages
    assert sched._load_dirty, "the clear is reported"
