"""A worker bounds what a ``Submit`` asks of every step, as the gateway bounds a client's request
(``gateway.api_models``): it does not trust its peer (a buggy or hostile gateway, any native client).

Unbounded, one request with a few MB of ``stop_token_ids`` or stop strings was scanned on every one
of its tokens inside the scheduler's step: every other sequence of the worker's batch waited for it
(measured with the sim engine: a 100-token request that took 0.08 s alone took 2.8 s next to one
request with 2M ``stop_token_ids``, 3.0 s next to one with 50k stop strings). ``top_logprobs`` asked a
model engine for the whole vocabulary's logprobs per token (and per prompt position), ``gather_s`` NaN
or negative was silently read as 0. Each is now refused with a ``bad_request`` naming the field.
(In-process sim workers over their real native socket.)
"""

from __future__ import annotations

import asyncio
import math
import time

import pytest
from test_submit_while_stopping import _connect, _enc, _next

from gateway.api_models import (
    MAX_LOGIT_BIAS,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    MAX_STOP_TOTAL_CHARS,
    MAX_TOP_LOGPROBS,
)
from workers.config import WorkerConfig
from workers.protocol import Error, Outputs, SamplingParams, Submit
from workers.worker import Worker

_PROMPT = [1, 2, 3, 4]


def _params(**fields: object) -> SamplingParams:
    return SamplingParams(**{"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True, **fields})  # type: ignore[arg-type]


async def _answers(port: int, submits: list[Submit], timeout_s: float = 10.0) -> dict[int, object]:
    """Each submit's end: its ``Error``, or its tokens (a list) when it finished."""
    reader, writer = await _connect(port)
    for submit in submits:
        writer.write(_enc.encode(submit))
    ends: dict[int, object] = {}
    tokens: dict[int, list[int]] = {}
    deadline = time.monotonic() + timeout_s
    while len(ends) < len(submits):
        msg = await _next(reader, (Outputs, Error), timeout_s=deadline - time.monotonic())
        if isinstance(msg, Error):
            ends[msg.rid] = msg
            continue
        assert isinstance(msg, Outputs)
        for item in msg.items:
            tokens.setdefault(item.rid, []).extend(item.token_ids)
            if item.finish_reason is not None:
                ends[item.rid] = tokens[item.rid]
    writer.close()
    return ends


def _run(submits: list[Submit], timeout_s: float = 10.0) -> dict[int, object]:
    async def main() -> dict[int, object]:
        worker = Worker(WorkerConfig(role="both", engine="sim", num_pages=64, http_port=0))
        await worker.start()
        try:
            ends = await _answers(worker.native_port, submits, timeout_s)
            assert worker.scheduler is not None
            for _ in range(100):  # (every request ended: none holds pages)
                if not worker.scheduler.reqs:
                    break
                await asyncio.sleep(0.02)
            assert not worker.scheduler.reqs
            return ends
        finally:
            await worker.aclose()

    return asyncio.run(main())


@pytest.mark.parametrize(("fields", "named"), [
    ({"stop_token_ids": [7] * (MAX_STOP_TOKEN_IDS + 1)}, "stop_token_ids"),
    ({"stop_token_ids": [7] * 200_000}, "stop_token_ids"),
    ({"stop": [f"s{i}" for i in range(MAX_STOP_STRINGS + 1)]}, "stop"),
    ({"stop": ["x" * (MAX_STOP_CHARS + 1)]}, "stop"),
    ({"stop": ["y" * MAX_STOP_CHARS] * 8 + ["z"]}, "stop"),  # (9 strings, 8193 characters)
    ({"stop": [f"zz{i:08d}qq" for i in range(50_000)]}, "stop"),
    ({"logit_bias": {i: 1.0 for i in range(MAX_LOGIT_BIAS + 1)}}, "logit_bias"),
    ({"top_logprobs": MAX_TOP_LOGPROBS + 1, "logprobs": True}, "top_logprobs"),
    ({"top_logprobs": 10**9, "logprobs": True, "prompt_logprobs": True}, "top_logprobs"),
    ({"top_logprobs": -1}, "top_logprobs"),
])
def test_an_oversized_sampling_field_is_refused_naming_it(fields: dict[str, object], named: str) -> None:
    assert sum(len(s) for s in ["y" * MAX_STOP_CHARS] * 8 + ["z"]) > MAX_STOP_TOTAL_CHARS
    ends = _run([Submit(1, _PROMPT, _params(**fields)), Submit(2, _PROMPT, _params())])
    err = ends[1]
    assert isinstance(err, Error), f"the worker served a request with {named} past the gateway's own bound"
    assert err.code == "bad_request" and err.param == named, err
    assert "at most" in err.message or "must be in" in err.message, err  # (the bound, not another refusal)
    assert isinstance(ends[2], list) and len(ends[2]) == 8, ends[2]  # (the worker serves on)


def test_the_gateways_largest_requests_are_served() -> None:
    """What the gateway lets through stays served (the bounds are the gateway's, not tighter)."""
    stops = ["q" * MAX_STOP_CHARS] * 8
    ends = _run([
        Submit(1, _PROMPT, _params(stop_token_ids=[300 % 258] * MAX_STOP_TOKEN_IDS)),
        Submit(2, _PROMPT, _params(stop=stops)),
        Submit(3, _PROMPT, _params(stop=["\x01" * 16] * MAX_STOP_STRINGS)),
        Submit(4, _PROMPT, _params(top_logprobs=MAX_TOP_LOGPROBS, logprobs=True)),
    ])
    for rid in (1, 2, 3, 4):
        assert isinstance(ends[rid], list), ends[rid]


@pytest.mark.parametrize("gather_s", [math.nan, -1.0, math.inf, -math.inf])
def test_a_gather_s_that_is_not_a_duration_is_refused(gather_s: float) -> None:
    """``Submit.gather_s`` NaN or negative was served as 0 (silently), inf held every output to the end."""
    ends = _run([Submit(1, _PROMPT, _params(), gather_s=gather_s), Submit(2, _PROMPT, _params(), gather_s=0.05)])
    err = ends[1]
    assert isinstance(err, Error) and err.code == "bad_request" and "gather_s" in err.message, err
    assert isinstance(ends[2], list) and len(ends[2]) == 8, ends[2]


def test_a_long_gather_ends_at_the_request_timeout_with_its_pages() -> None:
    """A gather longer than the request's timeout holds its outputs until the end, not past it: the request
    still ends at ``timeout_s`` (an ``Error``), and its pages go back (``_run`` checks none is held)."""
    async def main() -> None:
        worker = Worker(WorkerConfig(role="both", engine="sim", num_pages=64, http_port=0,
                                     engine_options={"decode_step_s": "0.05"}))
        await worker.start()
        try:
            assert worker.scheduler is not None
            sched = worker.scheduler
            started = time.monotonic()
            ends = await _answers(worker.native_port, [
                Submit(1, _PROMPT, _params(max_new_tokens=200), timeout_s=0.5, gather_s=1e9)], timeout_s=10.0)
            err = ends[1]
            assert isinstance(err, Error) and err.code == "timeout", err
            assert time.monotonic() - started < 5.0
            for _ in range(100):  # (its pages free, or evictable in the prefix cache)
                if not sched.reqs and sched.cache.num_available == sched.pool.num_pages:
                    break
                await asyncio.sleep(0.02)
            assert not sched.reqs and sched.cache.num_available == sched.pool.num_pages
        finally:
            await worker.aclose()

    asyncio.run(main())
