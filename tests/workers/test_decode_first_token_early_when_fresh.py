"""A fresh decode (no forward timed yet) sends the first token of the first request it imports before its first
forward too: that forward is the one most likely to be slow (a model's first kernels load lazily), and
``EARLY_FLUSH_MIN_S`` only spares a zero-cost engine's hand-off, which one step more does not matter to."""

from __future__ import annotations

import time
from typing import Any

from test_scheduler import _pd_pair, _submit_pd

from workers.protocol import SamplingParams


def test_the_first_imported_request_of_a_fresh_decode_gets_its_first_token_before_the_first_forward() -> None:
    (p, _, pkv), (d, dsink, dkv) = _pd_pair(256, 256)
    seen_before_forward: list[int] = []  # per decode forward: rid 1's tokens sent by then
    forward = d.engine.forward

    def slow_first_forward(batch: list[Any]) -> Any:
        seen_before_forward.append(sum(len(o.token_ids) for o in dsink.outputs(1)))
        time.sleep(0.05)  # (a model's first forward: lazy kernel loading, allocator warm-up)
        return forward(batch)

    d.engine.forward = slow_first_forward  # type: ignore[method-assign]
    try:
        _submit_pd(d, p, pkv, 1, SamplingParams(max_new_tokens=4))
        p.step()
        d.step()
        deadline = time.monotonic() + 30
        while d.reqs or p.reqs:
            assert time.monotonic() < deadline, {k: r.stage for k, r in d.reqs.items()}
            p.step()
            d.step()
            time.sleep(0.001)
        assert sum(len(o.token_ids) for o in dsink.outputs(1)) == 4, (dsink.errors(1), dsink.items[:5])
        assert seen_before_forward and seen_before_forward[0] == 1, seen_before_forward
    finally:
        pkv.close()
        dkv.close()
