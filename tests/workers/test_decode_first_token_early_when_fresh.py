"""A fresh decode (no forward timed yet) sends the first token of the first request it imports before its first
forward too: that forward is the one most likely to be slow (a model's first kernels load lazily), and
``EARLY_FLUSH_MIN_S`` only spares a zero-cost engine's hand-off, which one step more does not matter to."""

from __future__ import annotations

import time
from typing import Any

from test_decode_first_token_before_step import serve
from test_scheduler import _pd_pair


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
        serve(p, d, pkv, dsink, 1)
        assert seen_before_forward and seen_before_forward[0] == 1, seen_before_forward
    finally:
        pkv.close()
        dkv.close()
