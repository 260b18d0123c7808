"""A repetition_penalty the API accepts (``gateway.api_models.RepetitionPenalty``: > 0, and the worker's
``check_sampling``: any positive finite number) must not leave its row with no token to sample.

In float32, a seen token's positive logit divided by a tiny penalty (1e-40) is +inf, and a zero logit
times a huge one (1e39 is inf in float32) is NaN: the row's scores are then not finite and the request
failed as the worker's own "internal" error (a 500, held against the worker's circuit breaker) for a
value the client was allowed to send. The limit of the formula is what must be sampled: a tiny penalty
strongly prefers the seen tokens with positive logits.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from workers.engines.base import SeqInput, check_sampling
from workers.protocol import SamplingParams


@pytest.mark.parametrize("temperature", [0.0, 0.7, 1e-4])
@pytest.mark.parametrize("penalty", [1e-40, 1e-35, 1e39])
def test_an_extreme_repetition_penalty_still_samples(make_engine: Any, tiny_model: Callable[[str], Any],
                                                     penalty: float, temperature: float) -> None:
    e = make_engine(tiny_model("llama").path)
    prompt = [5, 6, 7, 8, 9]
    plain = SamplingParams(temperature=0.0)
    pages = e.pool.alloc(2)
    e.engine.forward([SeqInput(1, pages, 0, prompt, True, plain, 0, prompt)])
    raw = e.engine.last_logits[0]
    e.engine.forget(1)
    params = SamplingParams(temperature=temperature, seed=1, repetition_penalty=penalty)
    assert check_sampling(params, e.engine) is None  # (a value the worker accepts)
    out = e.engine.forward([SeqInput(2, pages, 0, prompt, True, params, 0, prompt)])[0]
    assert out.error is None
    assert out.token_id is not None, f"repetition_penalty={penalty} left no token to sample"
    if penalty < 1:  # the seen tokens with a positive logit are the only ones left at the top
        assert max(float(raw[t]) for t in prompt) > 0  # (the case this test is about)
        assert out.token_id in prompt and float(raw[out.token_id]) > 0
