"""Faults inside the torch engine under the scheduler: non-finite logits, a grammar backend that raises."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from workers.engines.base import SeqInput
from workers.protocol import Error, Grammar, Outputs, SamplingParams, Submit


def test_non_finite_logits_never_become_a_token(make_engine: Any, tiny_model: Callable[[str], Any]) -> None:
    """KV the model turns into NaN (a corrupt transfer, an fp16 overflow): a sampled row gets no token (its request
    fails, "could not sample"); a greedy row must not get one either (argmax of NaN is an arbitrary id)."""
    import torch

    e = make_engine(tiny_model("llama").path)
    pages = e.pool.alloc(2)
    prompt = [5, 6, 7, 8, 9]
    out = e.engine.forward([SeqInput(1, pages, 0, prompt, True, SamplingParams(temperature=0.0), 0, prompt)])[0]
    for buf in e.pool.kv_buffers():  # the prompt's KV turns to NaN (e.g. bytes a faulty transfer wrote)
        buf[pages[0]] = float("nan")
    results = {}
    for name, params in (("greedy", SamplingParams(temperature=0.0, logprobs=True)),
                         ("sampled", SamplingParams(temperature=0.7, logprobs=True))):
        seq = SeqInput(1, pages, len(prompt), [out.token_id], True, params, 1)
        o = e.engine.forward([seq])[0]
        results[name] = (o.token_id, o.logprob, bool(torch.isfinite(e.engine.last_logits[0]).all()))
    assert results["sampled"][0] is None
    assert results["greedy"][0] is None, f"greedy sampled token {results['greedy'][0]} from NaN logits"


def test_a_grammar_matcher_raising_in_accept_fails_its_row_not_the_batch(
        make_engine: Any, tiny_model: Callable[[str], Any], tiny_tokenizer_dir: str, tmp_path: Any,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The docs: "a matcher failure ends that sequence without failing the batch". One raising while it
    consumes the sampled token (``Constraints.accept``) fails the whole step: every co-scheduled request."""
    pytest.importorskip("llguidance")
    import shutil

    from workers.engines.llama.constrained import Constraints
    from workers.scheduler import Scheduler, SchedulerConfig

    shutil.copytree(tiny_model("llama").path, tmp_path, dirs_exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{tiny_tokenizer_dir}/{name}", tmp_path / name)
    e = make_engine(str(tmp_path))
    calls = {"n": 0}

    class Panic(BaseException):  # (as pyo3's PanicException, which a panic of llguidance's Rust code raises)
        pass

    class Panicky:
        """The matcher, whose third ``consume_token`` panics."""

        def __init__(self, inner: Any) -> None:
            self.inner = inner

        def __getattr__(self, name: str) -> Any:
            return getattr(self.inner, name)

        def consume_token(self, token: int) -> Any:
            calls["n"] += 1
            if calls["n"] == 3:
                raise Panic("llguidance: consume_token panicked (injected)")
            return self.inner.consume_token(token)

    real_catch_up = Constraints._catch_up

    def catch_up(self: Any, seq: Any) -> Any:
        state = real_catch_up(self, seq)
        if not isinstance(state.matcher, Panicky):
            state.matcher = Panicky(state.matcher)
        return state

    monkeypatch.setattr(Constraints, "_catch_up", catch_up)
    sink: list[tuple[int, Any]] = []
    sched = Scheduler(SchedulerConfig("both", chunk_size=64), e.engine, e.pool, sink.extend)
    sched.submit(0, Submit(1, [5, 6, 7], SamplingParams(temperature=0.0, max_new_tokens=12,
                                                        grammar=Grammar("regex", "[a-z ]{1,40}"))))
    sched.submit(0, Submit(2, [8, 9, 10], SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)))
    import time
    deadline = time.monotonic() + 60
    sched.step()
    while sched.reqs:
        assert time.monotonic() < deadline
        if not sched.step():
            time.sleep(0.005)
    errors = {m.rid: m for _, m in sink if isinstance(m, Error)}
    done2 = [i for _, m in sink if isinstance(m, Outputs) for i in m.items if i.rid == 2 and i.finish_reason]
    assert sched.cache.num_available == e.pool.num_pages
    assert 1 in errors
    assert 2 not in errors and done2, "the unconstrained request failed with its constrained neighbour's grammar"


def test_a_grammar_compile_that_crashes_is_not_the_clients_bad_request(
        make_engine: Any, tiny_model: Callable[[str], Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """The compile thread raising something other than ``GrammarError`` (the library's panic, a missing
    tokenizer file, MemoryError) is the worker's failure: ``internal``, not a 400 blaming the client's field."""
    pytest.importorskip("llguidance")
    import time

    from workers.engines.llama.constrained import Constraints
    from workers.scheduler import Scheduler, SchedulerConfig

    e = make_engine(tiny_model("llama").path)

    def crash(self: Any, grammar: Any) -> Any:
        raise MemoryError("compile (injected)")

    monkeypatch.setattr(Constraints, "_compile", crash)
    sink: list[tuple[int, Any]] = []
    sched = Scheduler(SchedulerConfig("both"), e.engine, e.pool, sink.extend)
    sched.submit(0, Submit(1, [5, 6], SamplingParams(max_new_tokens=4,
                                                     grammar=Grammar("regex", "a+", param="regex"))))
    deadline = time.monotonic() + 30
    while sched.reqs or not sink:
        assert time.monotonic() < deadline
        sched.step()
        time.sleep(0.005)
    (err,) = [m for _, m in sink if isinstance(m, Error)]
    assert err.code == "internal", f"{err.code}: {err.message} (param {err.param})"
