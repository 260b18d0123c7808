"""A combined worker caches a finished request's answer with its prompt (every whole page of KV it wrote): a chat's
next turn, whose prompt is the last one's prompt and answer and more, then shares those pages instead of computing
the whole conversation again (SGLang and vLLM keep them so too). Its KV is the same as a cold computation's."""

from __future__ import annotations

from tests.workers.test_scheduler import make, run_until_idle, tokens_of
from workers.protocol import SamplingParams, Submit


def test_the_next_turn_shares_the_pages_of_the_last_answer() -> None:
    sched, sink, pool = make(chunk_size=64)
    first = list(range(10, 19))  # 9 tokens, and 15 outputs: 24 positions, of which 23 have KV (5 whole pages)
    sched.submit(0, Submit(1, first, SamplingParams(max_new_tokens=15, ignore_eos=True)))
    run_until_idle(sched)
    answer = tokens_of(sink, 1)
    assert len(answer) == 15
    second = [*first, *answer, 70, 71, 72]  # the next turn: the conversation so far, and the user's next words
    hits = sched.cache.num_hit_tokens
    sched.submit(0, Submit(2, second, SamplingParams(max_new_tokens=6, ignore_eos=True)))
    run_until_idle(sched)
    assert sched.cache.num_hit_tokens - hits == 20, "the answer's whole pages were shared (5 pages of 4)"
    cold, cold_sink, _ = make(chunk_size=64)  # (the same outputs as on a worker that never saw the first turn)
    cold.submit(0, Submit(2, second, SamplingParams(max_new_tokens=6, ignore_eos=True)))
    run_until_idle(cold)
    assert tokens_of(sink, 2) == tokens_of(cold_sink, 2)
    assert sched.cache.num_available == pool.num_pages and not sched._queued_pages
