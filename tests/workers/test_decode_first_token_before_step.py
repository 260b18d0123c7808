"""A decode sends an imported request's first token (sampled by the prefill, arrived with the KV) before it
runs its next forward step, not after: a stream's time to first token does not include a decode step of
the whole batch."""

from __future__ import annotations

import time
from typing import Any

from test_scheduler import _pd_pair, _submit_pd

from workers.protocol import SamplingParams


def test_an_imported_requests_first_token_goes_out_before_the_decode_step() -> None:
    (p, _, pkv), (d, dsink, dkv) = _pd_pair(256, 256)
    seen_before_forward: list[int] = []  # per decode forward with rid 1 in it: its tokens sent by then
    forward = d.engine.forward

    def recording_forward(batch: list[Any]) -> Any:
        req = d.reqs.get((1, 1))  # (connection 1, rid 1; the engine knows it by its seq_id)
        if req is not None and any(seq.rid == req.seq_id for seq in batch):
            seen_before_forward.append(sum(len(o.token_ids) for o in dsink.outputs(1)))
        return forward(batch)

    d.engine.forward = recording_forward  # type: ignore[method-assign]
    try:
        _submit_pd(d, p, pkv, 1, SamplingParams(max_new_tokens=4))
        p.step()
        d.step()  # (both admit it: their inboxes hold the submits)
        deadline = time.monotonic() + 30
        while d.reqs or p.reqs:
            assert time.monotonic() < deadline, {k: r.stage for k, r in d.reqs.items()}
            p.step()
            d.step()
            time.sleep(0.001)
        assert sum(len(o.token_ids) for o in dsink.outputs(1)) == 4, (dsink.errors(1), dsink.items[:5])
        # the first decode step for it (its second token) ran after its first token had gone out
        assert seen_before_forward and seen_before_forward[0] == 1, seen_before_forward
    finally:
        pkv.close()
        dkv.close()
