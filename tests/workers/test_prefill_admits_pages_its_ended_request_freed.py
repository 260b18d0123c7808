"""A prefill request whose decode ended its room while it was being prefilled is failed in the step that sees it,
and the pages it held go to the request waiting for them in that same step.

The check used to run inside the batch (after admission): with no other request prefilling, the step then found
nothing to run, returned "no work", and the loop slept (up to ``IDLE_WAIT_S``) while the request at the head of
the line could have taken the freed pages; nothing woke it (the room's change had been read already)."""

from __future__ import annotations

import time

from test_scheduler import _pd_pair, _submit_pd

from transfer import KVPoll
from workers.engines.base import EngineOptions
from workers.engines.sim import SimEngine
from workers.protocol import SamplingParams
from workers.scheduler import SchedulerConfig


def test_pages_of_a_prefilling_request_its_decode_ended_go_to_the_waiting_one_in_that_step() -> None:
    (p, psink, pkv), (d, _, dkv) = _pd_pair(10, 64)  # prefill: 10 pages of 4 tokens, one 40-token prompt at a time
    try:
        slow = SimEngine(EngineOptions(extra={"prefill_token_s": "2e-3"}))
        slow.bind(p.pool)
        p.engine = slow
        p.config = SchedulerConfig("prefill", chunk_size=4, max_running=8)  # 10 steps for the long prompt
        _submit_pd(d, p, pkv, 1, SamplingParams(max_new_tokens=4), list(range(40)))  # every page
        deadline = time.monotonic() + 20
        while not ((1, 1) in p.reqs and p.reqs[(1, 1)].stage == "prefill"):
            assert time.monotonic() < deadline, {k: r.stage for k, r in p.reqs.items()}
            d.step()
            p.step()
        _submit_pd(d, p, pkv, 2, SamplingParams(max_new_tokens=4), list(range(100, 109)))  # 3 pages: waits
        while not ((1, 2) in p.reqs and p.reqs[(1, 2)].stage == "waiting"):
            assert time.monotonic() < deadline, {k: r.stage for k, r in p.reqs.items()}
            d.step()
            p.step()
        long_one = p.reqs[(1, 1)]
        assert long_one.stage == "prefill" and long_one.num_computed < 40
        d.abort(1, 1, "the client left")  # the decode ends the room; the prefill's sender fails
        while long_one.kv_sender.poll() != KVPoll.Failed:
            assert time.monotonic() < deadline, "the prefill never learnt that the room ended"
            d.step()
            time.sleep(0.005)
        ran = p.step()  # sees the ended room: fails the long one, frees its 10 pages
        assert [e.code for e in psink.errors(1)] == ["transfer_failed"]
        short_one = p.reqs[(1, 2)]
        assert short_one.stage != "waiting", (
            f"the step freed every page but left the waiting request waiting (step ran a batch: {ran}); "
            "the loop sleeps on its inbox now")
        assert ran
    finally:
        pkv.close()
        dkv.close()
