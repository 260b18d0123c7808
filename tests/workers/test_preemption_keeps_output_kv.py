"""A decoding request that gives way (combined role, pool out of pages) leaves the KV of its outputs cached too,
not only its prompt's: its recompute then shares those pages instead of computing every output again."""

from __future__ import annotations

from typing import Any

from tests.workers.test_scheduler import make, run_until_idle, tokens_of
from workers.protocol import SamplingParams, Submit


def test_a_preempted_decoding_request_recomputes_only_what_its_cached_outputs_do_not_cover() -> None:
    """8 pages of 4: A (4 + 14 tokens) and B (4 + 20) decode side by side, 4 pages each, until A needs a fifth
    for position 16 at its last step; B, the younger, gives way with 16 positions of KV (its prompt and 12
    outputs, 4 whole pages). A ends at once and nothing evicts B's pages before its recompute: it must
    share 3 pages (a match leaves at least one token to compute) and compute 4 positions, not 12."""
    sched, sink, pool = make(num_pages=8, chunk_size=64, max_running=64)
    real = sched.engine.forward
    recomputed: list[tuple[int, int]] = []  # (first position, positions) of each recompute chunk

    def forward(batch: list[Any]) -> list[Any]:
        recomputed.extend((seq.num_cached, len(seq.token_ids)) for seq in batch
                          if seq.num_generated > 0 and not seq.sample)
        return real(batch)

    sched.engine.forward = forward  # type: ignore[method-assign]
    params = {1: SamplingParams(max_new_tokens=14, ignore_eos=True), 2: SamplingParams(max_new_tokens=20,
                                                                                        ignore_eos=True)}
    prompts = {1: [1, 2, 3, 4], 2: [5, 6, 7, 8]}
    for rid in (1, 2):
        sched.submit(0, Submit(rid, prompts[rid], params[rid]))
    run_until_idle(sched, 2000)
    assert sched.num_preemptions == 1
    assert recomputed == [(12, 4)], "the recompute shares the pages of the outputs it had computed"
    for rid in (1, 2):  # (outputs unchanged: the sim's tokens are a function of the KV the worker holds)
        solo, solo_sink, _ = make(chunk_size=64)
        solo.submit(0, Submit(rid, prompts[rid], params[rid]))
        run_until_idle(solo)
        assert tokens_of(sink, rid) == tokens_of(solo_sink, rid)
    assert sched.cache.num_available == pool.num_pages and not sched._queued_pages
