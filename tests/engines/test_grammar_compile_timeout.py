"""A grammar's compile on the torch engine is bounded: a slow one neither holds its request without limit nor
the other clients' grammars, and a compile that failed through the worker's fault is not kept.

The scheduler holds a constrained request in stage "grammar" while the engine compiles its grammar. A compile
cannot be stopped (llguidance has no cancel; a thread cannot be killed), so:
- the request gives up after ``grammar_timeout_s`` (``--grammar-timeout-s``) with a bad_request naming its field,
  leaving its stage and holding no page;
- compiles run on up to ``COMPILE_THREADS`` threads: one slow compile leaves the others free, and at most that
  many threads are ever held by compiles whose requests gave up;
- a queued compile that no request waits for any more is dropped unstarted;
- only the library's refusal (``GrammarError``, the client's grammar) is cached: a missing tokenizer.json (the
  worker's fault) fails that request, and the grammar compiles once the file is there.

Slow compiles are made with an event that holds ``_compile`` (no clock in the asserts); the last test uses a
real slow grammar (a JSON Schema of 12,000 required properties: seconds of compile on this tiny vocabulary).
"""

from __future__ import annotations

import json
import re
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from workers.grammar import GrammarError
from workers.protocol import Error, Grammar, Outputs, SamplingParams, Submit

pytest.importorskip("llguidance")

HANG_GUARD_S = 60.0  # only ever reached when the code under test hangs


@pytest.fixture(scope="module")
def model_dir(tiny_llama_with_tokenizer: str) -> str:
    return tiny_llama_with_tokenizer


class HeldCompiles:
    """Wraps an engine's ``_compile``: the grammars in ``hold`` wait for ``release`` (a compile that takes as long
    as the test wants); every compile started is recorded (``started``, in order)."""

    def __init__(self, constraints: Any, hold: set[Grammar]) -> None:
        self.hold = hold
        self.release = threading.Event()
        self.started: list[Grammar] = []
        self.num_running = 0
        self.changed = threading.Condition()
        self._compile = constraints._compile

    def __call__(self, grammar: Grammar) -> Any:
        with self.changed:
            self.started.append(grammar)
            self.num_running += 1
            self.changed.notify_all()
        try:
            if grammar in self.hold:
                assert self.release.wait(HANG_GUARD_S), "never released"
            return self._compile(grammar)
        finally:
            with self.changed:
                self.num_running -= 1
                self.changed.notify_all()

    def wait_for(self, predicate: Callable[[], bool]) -> None:
        with self.changed:
            assert self.changed.wait_for(predicate, HANG_GUARD_S), "compiles did not get there"


@pytest.fixture
def held(make_engine: Any, model_dir: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., Any]]:
    """``held(*grammars)``: (engine under test, its ``HeldCompiles``); the held grammars are released at the end."""
    made: list[HeldCompiles] = []

    def build(*grammars: Grammar) -> tuple[Any, HeldCompiles]:
        e = make_engine(model_dir)
        compiles = HeldCompiles(e.engine.constraints, set(grammars))
        monkeypatch.setattr(e.engine.constraints, "_compile", compiles)
        made.append(compiles)
        return e, compiles

    yield build
    for compiles in made:
        compiles.release.set()


def scheduler(e: Any, timeout_s: float) -> tuple[Any, list[tuple[int, Any]]]:
    from workers.scheduler import Scheduler, SchedulerConfig

    sink: list[tuple[int, Any]] = []
    sched = Scheduler(SchedulerConfig("both", chunk_size=16, grammar_timeout_s=timeout_s), e.engine, e.pool,
                      sink.extend)
    return sched, sink


def run_until(sched: Any, done: Callable[[], bool]) -> None:
    """Step a threadless scheduler until ``done()`` (a compile's end wakes no loop here: it polls)."""
    deadline = time.monotonic() + HANG_GUARD_S
    sched.step()
    while not done():
        assert time.monotonic() < deadline, f"stuck: {[(r.key, r.stage) for r in sched.reqs.values()]}"
        if not sched.step():
            time.sleep(0.005)


def errors_of(sink: list[tuple[int, Any]]) -> dict[int, Error]:
    return {m.rid: m for _, m in sink if isinstance(m, Error)}


def text_of(model_dir: str, sink: list[tuple[int, Any]], rid: int, ended: bool = True) -> str:
    """``rid``'s output text; ``ended``: the grammar's end (EOS, last) was reached."""
    from tokenizers import Tokenizer

    tokens = [t for _, m in sink if isinstance(m, Outputs) for i in m.items if i.rid == rid for t in i.token_ids]
    return Tokenizer.from_file(f"{model_dir}/tokenizer.json").decode(tokens[:-1] if ended else tokens)


def constrained(grammar: Grammar) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_new_tokens=24, grammar=grammar)


def assert_clean(sched: Any, e: Any) -> None:
    """Nothing left held: no request, none in stage grammar, every page free."""
    assert not sched.reqs and sched.grammar_wait is not None and len(sched.grammar_wait) == 0
    assert sched.grammar_wait.next_deadline() is None
    assert sched.cache.num_available == e.pool.num_pages


def test_a_slow_compile_times_out_its_request_and_holds_up_no_other_grammar(held: Any, model_dir: str) -> None:
    slow = Grammar("regex", "slow[a-z]{3}", param="sampling_params.regex")
    e, compiles = held(slow)
    sched, sink = scheduler(e, timeout_s=1.0)
    sched.submit(0, Submit(1, [5, 6, 7], constrained(slow)))
    sched.step()
    compiles.wait_for(lambda: compiles.started == [slow])
    # Distinct grammars of other clients, admitted while the slow one compiles: served, not queued behind it.
    fast = {2: "(ab|cd)[0-9]{2}", 3: "x[a-z]{4}"}
    for rid, regex in fast.items():
        sched.submit(0, Submit(rid, [8, 9], constrained(Grammar("regex", regex))))
    sched.submit(0, Submit(4, [8, 9], SamplingParams(temperature=0.0, max_new_tokens=3)))  # unconstrained
    run_until(sched, lambda: not sched.reqs)

    errors = errors_of(sink)
    assert list(errors) == [1], errors
    assert errors[1].code == "bad_request" and errors[1].param == "sampling_params.regex"
    assert "took too long to compile" in errors[1].message and "--grammar-timeout-s" in errors[1].message
    for rid, regex in fast.items():
        assert re.fullmatch(regex, text_of(model_dir, sink, rid))
    assert sched.grammar_wait.num_timed_out == 1
    assert_clean(sched, e)
    assert compiles.num_running == 1  # (the slow compile: it cannot be stopped, it goes on)

    # It ends later and is kept as any compile is: the client's retry is served without a second compile.
    compiles.release.set()
    compiles.wait_for(lambda: compiles.num_running == 0)
    sink.clear()
    sched.submit(0, Submit(5, [5, 6, 7], constrained(slow)))
    run_until(sched, lambda: not sched.reqs)
    assert not errors_of(sink) and re.fullmatch("slow[a-z]{3}", text_of(model_dir, sink, 5))
    assert compiles.started.count(slow) == 1
    assert_clean(sched, e)


def test_a_queued_compile_whose_requests_gave_up_is_never_started(held: Any, monkeypatch: pytest.MonkeyPatch,
                                                                 model_dir: str) -> None:
    """One compile thread, held by a slow grammar: the requests queued behind it time out, and their compiles
    are dropped: once the thread is free it goes on to the grammars someone still waits for."""
    import workers.engines.llama.constrained as constrained_module

    monkeypatch.setattr(constrained_module, "COMPILE_THREADS", 1)
    slow = Grammar("regex", "slow[a-z]{3}")
    abandoned = [Grammar("regex", f"gone{i}[a-z]") for i in range(3)]
    e, compiles = held(slow)
    sched, sink = scheduler(e, timeout_s=0.5)
    sched.submit(0, Submit(1, [5, 6], constrained(slow)))
    sched.step()
    compiles.wait_for(lambda: compiles.started == [slow])
    for rid, grammar in enumerate(abandoned, start=2):
        sched.submit(0, Submit(rid, [5, 6], constrained(grammar)))
    run_until(sched, lambda: not sched.reqs)
    assert sorted(errors_of(sink)) == [1, 2, 3, 4]
    errors = errors_of(sink)
    # the slow one ran past its limit: the client's grammar; the others never got a compile thread: the worker's
    # capacity, retryable on another worker, not blamed on their (simple) grammars
    assert errors[1].code == "bad_request"
    assert {errors[rid].code for rid in (2, 3, 4)} == {"overloaded"}
    assert all("compile threads are busy" in errors[rid].message for rid in (2, 3, 4))
    assert sched.grammar_wait.num_timed_out == 4
    assert_clean(sched, e)

    compiles.release.set()
    sink.clear()
    wanted = Grammar("regex", "kept[0-9]{2}")
    sched.grammar_wait.timeout_s = HANG_GUARD_S  # (the queue now moves: this one is served)
    sched.submit(0, Submit(9, [5, 6], constrained(wanted)))
    run_until(sched, lambda: not sched.reqs)
    assert not errors_of(sink) and re.fullmatch("kept[0-9]{2}", text_of(model_dir, sink, 9))
    assert compiles.started == [slow, wanted]  # the abandoned ones: dropped unstarted
    assert_clean(sched, e)


def test_at_most_compile_threads_compiles_run_and_the_rest_wait_their_turn(held: Any) -> None:
    """As many slow compiles at once as there are compile threads (the most that abandoned compiles can ever
    hold); more queue, and all are served once the threads are free."""
    from workers.engines.llama.constrained import COMPILE_THREADS

    grammars = [Grammar("regex", f"g{i}[a-z]{{2}}") for i in range(COMPILE_THREADS + 2)]
    e, compiles = held(*grammars)
    constraints = e.engine.constraints
    futures = [constraints.prepare(g) for g in grammars]
    compiles.wait_for(lambda: compiles.num_running == COMPILE_THREADS)
    assert set(compiles.started) == set(grammars[:COMPILE_THREADS])  # (every thread held: no other can start)
    assert len(constraints._threads) == COMPILE_THREADS
    assert not any(f.done() for f in futures)
    compiles.release.set()
    for future in futures:
        future.result(HANG_GUARD_S)
    assert len(compiles.started) == len(grammars) and set(compiles.started) == set(grammars)
    assert len(constraints._threads) == COMPILE_THREADS
    assert all(name.startswith("grammar-compile") for name in (t.name for t in constraints._threads))


def test_a_workers_fault_is_not_cached_a_rejected_grammar_is(make_engine: Any, model_dir: str, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: a compile that failed for want of tokenizer.json stayed cached, so that grammar failed on this
    worker for good (``internal``) after the file was restored."""
    model = tmp_path / "model"
    shutil.copytree(model_dir, model)
    tokenizer_json = (model / "tokenizer.json").read_bytes()
    (model / "tokenizer.json").unlink()
    e = make_engine(str(model))
    calls: list[Grammar] = []
    run_once = e.engine.constraints._run_one  # (a compile attempt: the tokenizer's load, then the grammar's)

    def counted(grammar: Grammar, future: Any) -> None:
        calls.append(grammar)
        run_once(grammar, future)

    monkeypatch.setattr(e.engine.constraints, "_run_one", counted)
    sched, sink = scheduler(e, timeout_s=HANG_GUARD_S)
    grammar = Grammar("regex", "(ab|cd)[0-9]{2}", param="regex")
    sched.submit(0, Submit(1, [5, 6], constrained(grammar)))
    run_until(sched, lambda: not sched.reqs)
    (error,) = errors_of(sink).values()
    assert error.code == "internal" and "tokenizer.json" in error.message
    assert_clean(sched, e)

    (model / "tokenizer.json").write_bytes(tokenizer_json)  # the deployment mended
    sink.clear()
    sched.submit(0, Submit(2, [5, 6], constrained(grammar)))
    run_until(sched, lambda: not sched.reqs)
    assert not errors_of(sink) and re.fullmatch("(ab|cd)[0-9]{2}", text_of(model_dir, sink, 2))
    assert calls == [grammar, grammar]

    # The library's refusal is the grammar's own: kept, never compiled again.
    bad = Grammar("regex", "(x", param="regex")
    for _ in range(2):
        with pytest.raises(GrammarError):
            e.engine.prepare(bad).result(HANG_GUARD_S)
    assert calls.count(bad) == 1
    assert_clean(sched, e)


def test_a_real_slow_schema_times_out_and_others_are_served(make_engine: Any, model_dir: str,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """End to end with the library: a legal JSON Schema of 12,000 required properties (~2 s to compile here,
    several times the limit set) fails in stage grammar; a simple grammar admitted after it is served; the
    client's retry while the compile still runs joins it (one compile) and is served once it ends."""
    slow = Grammar("json_schema", json.dumps({
        "type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(12000)},
        "required": [f"p{i}" for i in range(12000)]}), param="response_format.json_schema.schema")
    e = make_engine(model_dir)
    e.engine.prepare(Grammar("regex", "warm")).result(HANG_GUARD_S)  # (the llguidance tokenizer, built once)
    calls: list[Grammar] = []
    compile_once = e.engine.constraints._compile

    def counted(grammar: Grammar) -> Any:
        calls.append(grammar)
        return compile_once(grammar)

    monkeypatch.setattr(e.engine.constraints, "_compile", counted)
    sched, sink = scheduler(e, timeout_s=0.3)
    sched.submit(0, Submit(1, [5, 6, 7], constrained(slow)))
    sched.step()
    sched.submit(0, Submit(2, [8, 9], constrained(Grammar("regex", "(ab|cd)[0-9]{2}"))))
    run_until(sched, lambda: not sched.reqs)
    errors = errors_of(sink)
    assert list(errors) == [1], errors
    assert errors[1].code == "bad_request" and errors[1].param == "response_format.json_schema.schema"
    assert "took too long to compile" in errors[1].message
    assert re.fullmatch("(ab|cd)[0-9]{2}", text_of(model_dir, sink, 2))
    assert_clean(sched, e)

    running = e.engine.constraints._held.get(slow)
    assert running is not None and not running.done(), "the compile was expected to outlast the limit"
    sink.clear()
    sched.grammar_wait.timeout_s = HANG_GUARD_S
    sched.submit(0, Submit(3, [5, 6, 7], SamplingParams(temperature=0.0, max_new_tokens=8, grammar=slow)))
    run_until(sched, lambda: not sched.reqs)
    assert not errors_of(sink) and text_of(model_dir, sink, 3, ended=False).startswith('{"p0": ')
    assert calls.count(slow) == 1
    assert_clean(sched, e)


def test_a_grammar_waiting_for_the_tokenizers_first_load_is_not_blamed(make_engine: Any, model_dir: str,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The first compiles wait for the llguidance tokenizer's load (~1 s): a request that times out meanwhile is the
    worker's ``overloaded`` (its time was the worker's), not a 400 telling the client to simplify its grammar."""
    e = make_engine(model_dir)
    gate = threading.Event()
    load = e.engine.constraints._load_tokenizer

    def slow_load() -> None:
        gate.wait(HANG_GUARD_S)
        load()

    monkeypatch.setattr(e.engine.constraints, "_load_tokenizer", slow_load)
    sched, sink = scheduler(e, timeout_s=0.3)
    sched.submit(0, Submit(1, [5, 6], constrained(Grammar("regex", "(ab|cd)[0-9]{2}", param="regex"))))
    try:
        run_until(sched, lambda: not sched.reqs)
    finally:
        gate.set()
    (error,) = errors_of(sink).values()
    assert error.code == "overloaded", error
    assert_clean(sched, e)
