"""``/metrics`` shows ``--grammar-timeout-s`` failures by outcome and the grammar compile threads' load.

A constrained request whose grammar compiles past ``--grammar-timeout-s`` fails ``bad_request`` (the grammar was
slow) or ``overloaded`` (it waited behind busy compile threads): ``pd_worker_grammar_timeouts_total{outcome}``
counts each; ``pd_worker_grammar_compile_threads_busy`` and ``pd_worker_grammar_compiles_queued`` are read from the
engine's ``Constraints`` at scrape time. One compile thread, held by a slow grammar (an event, no clock in the
asserts), with requests queued behind it, as in ``test_grammar_compile_timeout.py``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from workers.metrics import create_registry
from workers.protocol import Error, Grammar, SamplingParams, Submit

pytest.importorskip("llguidance")

HANG_GUARD_S = 60.0  # only ever reached when the code under test hangs


def scrape(sched: Any) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    view = SimpleNamespace(worker_id="w", scheduler=sched, kv=None, http_connections=None, server=None,
                           config=SimpleNamespace(role="both", engine="torch", transfer="tcp"))
    text = generate_latest(create_registry(view)).decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def wait(predicate: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + HANG_GUARD_S
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.005)


def test_grammar_timeouts_by_outcome_and_compile_load_show_in_metrics(
        make_engine: Any, tiny_llama_with_tokenizer: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import workers.engines.llama.constrained as constrained_module
    from workers.scheduler import Scheduler, SchedulerConfig

    monkeypatch.setattr(constrained_module, "COMPILE_THREADS", 1)
    e = make_engine(tiny_llama_with_tokenizer)
    constraints = e.engine.constraints
    release, started = threading.Event(), threading.Event()
    compile_ = constraints._compile
    slow = Grammar("regex", "slow[a-z]{3}", param="sampling_params.regex")

    def held(grammar: Grammar) -> Any:
        if grammar == slow:
            started.set()
            assert release.wait(HANG_GUARD_S), "never released"
        return compile_(grammar)

    monkeypatch.setattr(constraints, "_compile", held)
    sink: list[tuple[int, Any]] = []
    sched = Scheduler(SchedulerConfig("both", chunk_size=16, grammar_timeout_s=0.5), e.engine, e.pool, sink.extend)
    try:
        before = scrape(sched)
        for outcome in ("bad_request", "overloaded"):
            assert before[("pd_worker_grammar_timeouts_total", frozenset({("role", "both"), ("outcome", outcome)}))] \
                == 0
        assert before[("pd_worker_grammar_compile_threads_busy", frozenset({("role", "both")}))] == 0
        assert before[("pd_worker_grammar_compiles_queued", frozenset({("role", "both")}))] == 0

        def params(grammar: Grammar) -> SamplingParams:
            return SamplingParams(temperature=0.0, max_new_tokens=8, grammar=grammar)

        sched.submit(0, Submit(1, [5, 6], params(slow)))
        sched.step()
        assert started.wait(HANG_GUARD_S)
        for rid in (2, 3):
            sched.submit(0, Submit(rid, [5, 6], params(Grammar("regex", f"queued{rid}[a-z]"))))
        sched.step()
        mid = scrape(sched)
        assert mid[("pd_worker_grammar_compile_threads_busy", frozenset({("role", "both")}))] == 1
        assert mid[("pd_worker_grammar_compiles_queued", frozenset({("role", "both")}))] == 2

        def ended() -> bool:
            sched.step()
            return not sched.reqs

        wait(ended, "the requests did not time out")
        errors = {m.rid: m.code for _, m in sink if isinstance(m, Error)}
        assert errors == {1: "bad_request", 2: "overloaded", 3: "overloaded"}
        after = scrape(sched)
        assert after[("pd_worker_grammar_timeouts_total", frozenset({("role", "both"), ("outcome", "bad_request")}))] \
            == 1
        assert after[("pd_worker_grammar_timeouts_total", frozenset({("role", "both"), ("outcome", "overloaded")}))] \
            == 2
        assert after[("pd_worker_grammar_compile_threads_busy", frozenset({("role", "both")}))] == 1  # (goes on)
        assert after[("pd_worker_grammar_compiles_queued", frozenset({("role", "both")}))] == 0  # (abandoned)
        release.set()
        wait(lambda: scrape(sched)[("pd_worker_grammar_compile_threads_busy", frozenset({("role", "both")}))] == 0,
             "the compile thread stayed busy")
    finally:
        release.set()
