"""A decode sends an imported request's first token (sampled by the prefill, arrived with the KV) before it
runs its next forward step, not after: a stream's time to first token does not include a decode step of
the whole batch (when its forwards take a model's time: ``EARLY_FLUSH_MIN_S``)."""

from __future__ import annotations

import time
from typing import Any

from test_scheduler import _pd_pair, _submit_pd

from workers.protocol import SamplingParams


def serve(p: Any, d: Any, pkv: Any, dsink: Any, rid: int) -> None:
    """Request ``rid`` (4 tokens) through the pair, both stepped until it is done; all 4 tokens came."""
    _submit_pd(d, p, pkv, rid, SamplingParams(max_new_tokens=4))
    p.step()
    d.step()  # (both admit it: their inboxes hold the submits)
    deadline = time.monotonic() + 30
    while d.reqs or p.reqs:
        assert time.monotonic() < deadline, {k: r.stage for k, r in d.reqs.items()}
        p.step()
        d.step()
        time.sleep(0.001)
    assert sum(len(o.token_ids) for o in dsink.outputs(rid)) == 4, (dsink.errors(rid), dsink.items[:5])


def test_an_imported_requests_first_token_goes_out_before_the_decode_step() -> None:
    """A decode whose forward takes a model's time (here 5 ms a step): the first token of a request it imports
    goes out before the step's forward (one request first, so that its forwards were timed)."""
    (p, _, pkv), (d, dsink, dkv) = _pd_pair(256, 256)
    seen_before_forward: list[int] = []  # per decode forward with rid 2 in it: its tokens sent by then
    forward = d.engine.forward

    def slow_recording_forward(batch: list[Any]) -> Any:
        req = d.reqs.get((1, 2))  # (connection 1, rid 2; the engine knows it by its seq_id)
        if req is not None and any(seq.rid == req.seq_id for seq in batch):
            seen_before_forward.append(sum(len(o.token_ids) for o in dsink.outputs(2)))
        time.sleep(0.005)
        return forward(batch)

    d.engine.forward = slow_recording_forward  # type: ignore[method-assign]
    try:
        for rid in (1, 2):
            serve(p, d, pkv, dsink, rid)
        # the first decode step for it (its second token) ran after its first token had gone out
        assert seen_before_forward and seen_before_forward[0] == 1, seen_before_forward
    finally:
        pkv.close()
        dkv.close()
