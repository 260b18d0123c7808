"""A grammar the library compiles but whose matcher fails at its first mask is refused at its compile.

Two kinds pass the gateway's tokenizer-less check and compile on the worker, then fail only when the
first token mask is computed: a grammar that accepts nothing (a GBNF rule that only recurses into itself,
a JSON Schema ``$ref`` cycle) and a regex past the lexer's limits (``a{1000000000}``, whose first mask
costs about a second of the step's thread on SmolLM2's vocabulary before the lexer gives up). The compile
thread now computes that first mask, so such a request ends with a 400 naming its field while it waits in
stage "grammar": no page taken, no prompt computed, and no scheduler step spent on its mask.
"""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from workers.grammar import GrammarError
from workers.protocol import Error, Grammar, Outputs, SamplingParams, Submit

pytest.importorskip("llguidance")

DEAD = [
    Grammar("ebnf", 'root ::= root "a"', param="sampling_params.ebnf"),
    Grammar("json_schema", json.dumps({"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/b"},
                                                                      "b": {"$ref": "#/$defs/a"}}}),
            param="response_format.json_schema.schema"),
    Grammar("regex", "[^\\s\\S]", param="regex"),
]
# Past the lexer's limits at the first mask with SmolLM2's vocabulary (the tiny one's meets them a token later)
HUGE_REPEAT = Grammar("regex", "a{1000000000}", param="guided_regex")


@pytest.fixture(scope="module")
def model_dir(tiny_llama_with_tokenizer: str) -> str:
    return tiny_llama_with_tokenizer


@pytest.mark.parametrize("grammar", DEAD, ids=lambda g: g.kind + ":" + g.source[:12])
def test_the_compile_refuses_a_grammar_its_first_mask_fails(make_engine: Any, model_dir: str,
                                                            grammar: Grammar) -> None:
    e = make_engine(model_dir)
    with pytest.raises(GrammarError) as err:
        e.engine.prepare(grammar).result(timeout=60)
    assert err.value.param == grammar.param
    assert "\n" not in str(err.value)  # (the library's first line, not its state dump)


def test_the_scheduler_fails_it_in_stage_grammar_without_a_step(make_engine: Any, model_dir: str,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    from workers.scheduler import Scheduler, SchedulerConfig

    e = make_engine(model_dir)
    stepped: list[int] = []
    forward = e.engine.forward

    def recording(batch: list[Any]) -> Any:
        stepped.extend(seq.rid for seq in batch)
        return forward(batch)

    monkeypatch.setattr(e.engine, "forward", recording)
    sink: list[tuple[int, Any]] = []
    sched = Scheduler(SchedulerConfig("both", chunk_size=16), e.engine, e.pool, sink.extend)
    for rid, grammar in enumerate(DEAD, start=1):
        sched.submit(0, Submit(rid, [5, 6, 7], SamplingParams(temperature=0.0, max_new_tokens=8, grammar=grammar)))
    sched.submit(0, Submit(99, [8, 9], SamplingParams(temperature=0.0, max_new_tokens=4)))
    deadline = time.monotonic() + 120
    sched.step()
    while sched.reqs:
        assert time.monotonic() < deadline, "requests did not finish"
        if not sched.step():
            time.sleep(0.005)
    errors = {m.rid: m for _, m in sink if isinstance(m, Error)}
    assert sorted(errors) == list(range(1, len(DEAD) + 1))
    for rid, grammar in enumerate(DEAD, start=1):
        assert errors[rid].code == "bad_request" and errors[rid].param == grammar.param, errors[rid]
    seq_ids = set(stepped)
    assert len(seq_ids) == 1, f"a refused grammar's request reached the engine: {sorted(seq_ids)}"
    assert len([t for _, m in sink if isinstance(m, Outputs) for i in m.items if i.rid == 99
                for t in i.token_ids]) == 4
    assert sched.cache.num_available == e.pool.num_pages


def test_a_regex_past_the_lexers_limits_is_refused_off_the_step_thread() -> None:
    """On SmolLM2's tokenizer ``a{1000000000}``'s first mask ran ~1 s on the scheduler's thread (every other
    sequence of the step waited) and then failed the request; now its compile refuses it."""
    import os

    import torch

    from workers.engines.llama.constrained import Constraints
    from workers.engines.llama.gguf_convert import default_model_dir

    try:
        tokenizer_dir = str(default_model_dir())
    except Exception as exc:  # (no cached SmolLM2 here)
        pytest.skip(f"SmolLM2 is not available: {exc}")
    if not os.path.isfile(os.path.join(tokenizer_dir, "tokenizer.json")):
        pytest.skip("SmolLM2's tokenizer.json is not available")
    constraints = Constraints(tokenizer_dir, vocab_size=49152, eos_token_ids=(2,))
    try:
        with pytest.raises(GrammarError) as err:
            constraints.prepare(HUGE_REPEAT).result(timeout=120)
        assert err.value.param == "guided_regex" and "too many expressions" in str(err.value)
        # a grammar that compiles and masks: its first step is quick (the lexer state built at its compile)
        from workers.engines.base import SeqInput

        good = Grammar("regex", "(ab|cd)[0-9]{2}", param="regex")
        constraints.prepare(good).result(timeout=120)
        seq = SeqInput(1, [0], 0, [5], True, SamplingParams(grammar=good), 0, [5])
        started = time.perf_counter()
        out, failures = constraints.mask([seq], torch.zeros(1, 49152))
        assert time.perf_counter() - started < 0.5 and not failures
        assert int(torch.isfinite(out[0]).sum()) > 0
    finally:
        constraints.close()
