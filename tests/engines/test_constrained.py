"""Constrained decoding in the torch engine: a random tiny model's output follows the grammar.

A random model left alone emits garbage, so an output that matches the regex / parses and validates
against the schema is the mask at work. The split test runs the first token on one engine and the
rest on another (whose matcher is rebuilt and advanced by that token), as a P/D pair does.
"""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from workers.engines.base import SeqInput
from workers.grammar import GrammarError, check
from workers.protocol import Grammar, SamplingParams

pytest.importorskip("llguidance")
jsonschema_rs = pytest.importorskip("jsonschema_rs")

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Berlin"]},
        "population": {"type": "integer", "minimum": 0, "maximum": 99999},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 2},
    },
    "required": ["city", "population", "tags"],
    "additionalProperties": False,
}
REGEX = r"(ab|cd)[0-9]{2}-[a-z]{3}"


@pytest.fixture(scope="module")
def model_dir(tiny_llama_with_tokenizer: str) -> str:
    return tiny_llama_with_tokenizer


def generate(engine: Any, pool: Any, rid: int, prompt: list[int], params: SamplingParams,
             max_new_tokens: int = 48, split: bool = False) -> list[int]:
    """Greedy-ish generation until EOS; ``split``: after the first token the matcher is new (a decode; as the
    scheduler does, its first step has ``all_token_ids`` when the stream migrated, i.e. ``output_offset``)."""
    pages = pool.alloc(pool.pages_for(len(prompt) + max_new_tokens))
    assert pages is not None
    engine.prepare(params.grammar).result()
    out = engine.forward([SeqInput(rid, pages, 0, prompt, True, params, 0, prompt)])[0]
    outputs = [out.token_id]
    if split:
        engine.forget(rid)  # the decode worker's engine never saw this sequence
    eos = engine.info.eos_token_ids
    while outputs[-1] not in eos and len(outputs) < max_new_tokens:
        n = len(prompt) + len(outputs)
        history = prompt + outputs if split and len(outputs) == 1 and params.output_offset else None
        seq = SeqInput(rid, pages, n - 1, [outputs[-1]], True, params, len(outputs), history)
        outputs.append(engine.forward([seq])[0].token_id)
    engine.forget(rid)
    pool.free(pages)
    return outputs


def text_of(model_dir: str, tokens: list[int], eos: tuple[int, ...]) -> str:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(f"{model_dir}/tokenizer.json")
    assert tokens[-1] in eos, "the grammar's language ended: the only allowed token was EOS"
    return tok.decode(tokens[:-1])


def run_to_idle(sched: Any, timeout_s: float) -> None:
    """Step a threadless scheduler until its requests have ended (a grammar's compile wakes no loop here)."""
    import time

    deadline = time.monotonic() + timeout_s
    sched.step()
    while sched.reqs:
        assert time.monotonic() < deadline, "requests did not finish"
        if not sched.step():
            time.sleep(0.005)


def tokens_of(sink: list[tuple[int, Any]], rid: int) -> list[int]:
    from workers.protocol import Outputs

    return [t for _, m in sink if isinstance(m, Outputs) for i in m.items if i.rid == rid for t in i.token_ids]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_regex_and_schema_hold_on_a_random_model(make_engine: Any, model_dir: str, temperature: float) -> None:
    e = make_engine(model_dir)
    eos = e.engine.info.eos_token_ids
    regex = SamplingParams(temperature=temperature, seed=7, grammar=Grammar("regex", REGEX))
    text = text_of(model_dir, generate(e.engine, e.pool, 1, [5, 6, 7], regex), eos)
    assert re.fullmatch(REGEX, text), text
    schema = SamplingParams(temperature=temperature, seed=7, max_new_tokens=64,
                            grammar=Grammar("json_schema", json.dumps(SCHEMA)))
    text = text_of(model_dir, generate(e.engine, e.pool, 2, [8, 9], schema, max_new_tokens=120), eos)
    jsonschema_rs.validate(SCHEMA, json.loads(text))
    if temperature > 0:  # (greedy, this random model writes one endless string of an object's key)
        obj = SamplingParams(temperature=temperature, seed=7, grammar=Grammar("json_object"))
        text = text_of(model_dir, generate(e.engine, e.pool, 3, [10], obj, max_new_tokens=400), eos)
        assert isinstance(json.loads(text), dict)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_min_new_tokens_past_the_grammars_end_gives_way_to_it(make_engine: Any, model_dir: str,
                                                               temperature: float) -> None:
    """``min_new_tokens`` bans EOS, the ended grammar allows nothing else: the grammar wins (its EOS), where
    the row had no token left (a multinomial over NaN failed the whole batch's step; greedy took token 0)."""
    e = make_engine(model_dir)
    eos = e.engine.info.eos_token_ids
    params = SamplingParams(temperature=temperature, seed=3, min_new_tokens=40,
                            grammar=Grammar("ebnf", 'root ::= "yes" | "no"'))
    tokens = generate(e.engine, e.pool, 1, [5, 6, 7], params)
    assert text_of(model_dir, tokens, eos) in ("yes", "no"), tokens


def test_ebnf(make_engine: Any, model_dir: str) -> None:
    e = make_engine(model_dir)
    ebnf = 'root ::= "yes" | "no" | "maybe " [0-9]'
    params = SamplingParams(temperature=0.0, grammar=Grammar("ebnf", ebnf))
    text = text_of(model_dir, generate(e.engine, e.pool, 1, [11, 12], params), e.engine.info.eos_token_ids)
    assert re.fullmatch(r"yes|no|maybe [0-9]", text), text


@pytest.mark.parametrize(("ebnf", "expected"), [
    (r'root ::= "caf\u00e9 " [\u4e00-\u9fff] "\U0001F600"', "caf\u00e9 [\u4e00-\u9fff]\U0001F600"),
    (r'root ::= "a\\u00e9"', re.escape("a\\u00e9")),  # (an escaped backslash, then letters: no escape)
], ids=["escapes", "escaped-backslash"])
def test_ebnf_unicode_escapes(make_engine: Any, model_dir: str, ebnf: str, expected: str) -> None:
    """GBNF's \\u and \\U escapes (llama.cpp's grammars use them) in strings and in classes: llguidance's GBNF
    converter dropped their leading zeros (``"caf\\ue9"``), a 400 for a valid grammar."""
    check(Grammar("ebnf", ebnf))
    e = make_engine(model_dir)
    params = SamplingParams(temperature=0.0, max_new_tokens=40, grammar=Grammar("ebnf", ebnf))
    text = text_of(model_dir, generate(e.engine, e.pool, 1, [11, 12], params), e.engine.info.eos_token_ids)
    assert re.fullmatch(expected, text), text


def test_split_equals_one_engine_and_masks_stay_per_row(make_engine: Any, model_dir: str) -> None:
    e = make_engine(model_dir)
    params = SamplingParams(temperature=0.0, grammar=Grammar("json_schema", json.dumps(SCHEMA)))
    whole = generate(e.engine, e.pool, 1, [3, 4, 5], params, max_new_tokens=120)
    split = generate(e.engine, e.pool, 2, [3, 4, 5], params, max_new_tokens=120, split=True)
    assert split == whole
    # An unconstrained row batched with a constrained one samples what it samples alone.
    free = SamplingParams(temperature=0.0)
    pages = e.pool.alloc(8)
    rows = [SeqInput(10, pages[:4], 0, [3, 4, 5], True, params, 0, [3, 4, 5]),
            SeqInput(11, pages[4:], 0, [3, 4, 5], True, free, 0, [3, 4, 5])]
    both = e.engine.forward(rows)
    solo = e.engine.forward([SeqInput(12, pages[4:], 0, [3, 4, 5], True, free, 0, [3, 4, 5])])
    assert both[1].token_id == solo[0].token_id
    assert both[0].token_id == whole[0]


def test_rejected_grammars_name_the_field(make_engine: Any, model_dir: str) -> None:
    bad = [
        Grammar("regex", "(unclosed", param="sampling_params.regex"),
        Grammar("json_schema", "{not json", param="response_format.json_schema.schema"),
        Grammar("ebnf", "root ::= (", param="sampling_params.ebnf"),
        Grammar("json_schema", json.dumps({"type": "object", "properties": {"a": {"type": "wat"}}}),
                param="sampling_params.json_schema"),
    ]
    e = make_engine(model_dir)
    for grammar in bad:
        with pytest.raises(GrammarError) as gateway_side:
            check(grammar)
        assert gateway_side.value.param == grammar.param
        with pytest.raises(GrammarError) as worker_side:
            e.engine.prepare(grammar).result()
        assert worker_side.value.param == grammar.param


def test_after_the_grammar_ends_only_eos_follows(make_engine: Any, model_dir: str) -> None:
    """With ignore_eos a request goes on past the grammar's end: EOS again, no failed step."""
    e = make_engine(model_dir)
    params = SamplingParams(temperature=0.0, ignore_eos=True, grammar=Grammar("regex", "ab"))
    e.engine.prepare(params.grammar).result()
    prompt = [5, 6]
    pages = e.pool.alloc(e.pool.pages_for(len(prompt) + 8))
    outputs = [e.engine.forward([SeqInput(1, pages, 0, prompt, True, params, 0, prompt)])[0].token_id]
    free = SamplingParams(temperature=0.0)
    for _ in range(5):
        n = len(prompt) + len(outputs)
        steps = e.engine.forward([SeqInput(1, pages, n - 1, [outputs[-1]], True, params, len(outputs), None),
                                  SeqInput(2, pages, n - 1, [outputs[-1]], True, free, len(outputs), None)])
        outputs.append(steps[0].token_id)
    eos = e.engine.info.eos_token_ids
    assert outputs[-3:] == [eos[0]] * 3 and outputs.index(eos[0]) <= 3


def test_scheduler_waits_for_the_compile_and_refuses_what_the_library_rejects(make_engine: Any,
                                                                             model_dir: str) -> None:

    from workers.engines.sim import SimEngine
    from workers.kv_pool import KVPool
    from workers.protocol import Error, Submit
    from workers.scheduler import Scheduler, SchedulerConfig

    e = make_engine(model_dir)
    sink: list[tuple[int, Any]] = []
    sched = Scheduler(SchedulerConfig("both", chunk_size=16), e.engine, e.pool, sink.extend)
    sched.submit(0, Submit(1, [5, 6, 7], SamplingParams(temperature=0.0, max_new_tokens=24,
                                                        grammar=Grammar("regex", REGEX))))
    sched.submit(0, Submit(2, [5, 6], SamplingParams(max_new_tokens=4, grammar=Grammar(
        "regex", "(x", param="sampling_params.regex"))))
    sched.submit(0, Submit(3, [8, 9], SamplingParams(temperature=0.0, max_new_tokens=4)))
    run_to_idle(sched, 60)
    outputs = {rid: tokens_of(sink, rid) for rid in (1, 3)}
    errors = [m for _, m in sink if isinstance(m, Error)]
    assert [(m.rid, m.code, m.param) for m in errors] == [(2, "bad_request", "sampling_params.regex")]
    assert re.fullmatch(REGEX, text_of(model_dir, outputs[1], e.engine.info.eos_token_ids))
    assert len(outputs[3]) == 4
    assert sched.cache.num_available == e.pool.num_pages

    sim = SimEngine()
    pool = KVPool(num_layers=sim.info.num_layers, num_pages=16, page_size=4, num_kv_heads=sim.info.num_kv_heads,
                  head_dim=sim.info.head_dim)
    sim.bind(pool)
    sink.clear()
    sched = Scheduler(SchedulerConfig("both"), sim, pool, sink.extend)
    sched.submit(0, Submit(4, [1, 2], SamplingParams(grammar=Grammar("json_object", param="response_format"))))
    sched.step()
    (refusal,) = [m for _, m in sink if isinstance(m, Error)]
    assert refusal.rid == 4 and refusal.param == "response_format" and "sim engine" in refusal.message
    assert pool.num_free_pages == pool.num_pages


def test_a_migrated_stream_continues_its_grammar(make_engine: Any, model_dir: str) -> None:
    """A stream that moved pairs restarts with prompt + its outputs and ``output_offset``: the new engine's
    matcher consumes those outputs (from ``all_token_ids``) and samples what one engine would have."""
    import msgspec

    e = make_engine(model_dir)
    params = SamplingParams(temperature=0.0, grammar=Grammar("json_schema", json.dumps(SCHEMA)))
    whole = generate(e.engine, e.pool, 1, [3, 4, 5], params, max_new_tokens=120)
    for k in (1, 5, 11):
        moved = msgspec.structs.replace(params, output_offset=k)
        rest = generate(e.engine, e.pool, 2, [3, 4, 5, *whole[:k]], moved, max_new_tokens=120)
        assert rest == whole[k:], k
        rest = generate(e.engine, e.pool, 3, [3, 4, 5, *whole[:k]], moved, max_new_tokens=120, split=True)
        assert rest == whole[k:], ("moved and split", k)


def test_a_grammar_that_fails_at_its_first_mask_ends_its_row_not_the_batch() -> None:
    """E.g. evicted from the compile cache and failing to recompile: only that row is affected (named among
    ``mask``'s failures: its request fails with a reason rather than ending as if the grammar had been followed)."""
    import concurrent.futures

    import torch

    from workers.engines.llama.constrained import Constraints

    constraints = Constraints("/nonexistent", vocab_size=40, eos_token_ids=(2,))
    grammar = Grammar("regex", "a+", param="regex")
    failed: concurrent.futures.Future[Any] = concurrent.futures.Future()
    failed.set_exception(GrammarError("invalid regex: gone", "regex"))
    constraints._cache[grammar] = failed
    seqs = [SeqInput(1, [0], 0, [5], True, SamplingParams(grammar=grammar), 0, [5]),
            SeqInput(2, [1], 0, [5], True, SamplingParams(), 0, [5])]
    scores = torch.zeros(2, 40)
    try:
        out, failures = constraints.mask(seqs, scores)
    finally:
        constraints.close()
    assert torch.isfinite(out[0]).tolist() == [i == 2 for i in range(40)]  # (still a row that can be sampled)
    assert torch.equal(out[1], scores[1])  # the unconstrained row untouched
    assert list(failures) == [0] and failures[0].startswith("regex: ")
    assert "gone" in failures[0]


def test_a_grammar_the_matcher_gives_up_on_fails_its_request_not_its_batch(make_engine: Any, model_dir: str,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A grammar the library compiled but its matcher cannot follow (e.g. a regex past its lexer's limits,
    which a real tokenizer meets at the first token): that row samples nothing and says why, naming the
    field (the request ended as an empty answer, finish "stop"); the other request of the step is served."""
    e = make_engine(model_dir)
    engine = e.engine
    grammar = Grammar("regex", "(ab)+", param="regex")
    engine.prepare(grammar).result()
    catch_up = engine.constraints._catch_up

    def failing(seq: SeqInput) -> Any:
        if seq.rid == 1:
            raise RuntimeError("LexerTooComplex: too many expressions constructed")
        return catch_up(seq)

    monkeypatch.setattr(engine.constraints, "_catch_up", failing)
    a, b = e.pool.alloc(4), e.pool.alloc(4)
    constrained = SamplingParams(temperature=0.0, grammar=grammar)
    outs = engine.forward([SeqInput(1, a, 0, [10, 11, 12], True, constrained, 0, [10, 11, 12]),
                           SeqInput(2, b, 0, [13, 14, 15], True, constrained, 0, [13, 14, 15])])
    assert outs[0].token_id is None and outs[0].error is not None and outs[0].error.startswith("regex: ")
    assert "LexerTooComplex" in outs[0].error
    assert outs[1].token_id is not None and outs[1].error is None


def test_more_distinct_grammars_queued_than_cached_compile_once_each(make_engine: Any, model_dir: str,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Past the engine's grammar cache (4 here, 256 in production), requests queued with distinct grammars
    are compiled once each: a compile evicted from the cache while its request waits is found again, not
    compiled a second time on the scheduler's thread at the request's first step (every step stalled)."""
    import threading

    import workers.engines.llama.constrained as constrained
    from workers.protocol import Error, Submit
    from workers.scheduler import Scheduler, SchedulerConfig

    monkeypatch.setattr(constrained, "MAX_CACHED_GRAMMARS", 4)
    e = make_engine(model_dir)
    compile_threads: list[str] = []
    compile_once = e.engine.constraints._compile

    def counted(grammar: Grammar) -> Any:
        compile_threads.append(threading.current_thread().name)
        return compile_once(grammar)

    monkeypatch.setattr(e.engine.constraints, "_compile", counted)
    sink: list[tuple[int, Any]] = []
    sched = Scheduler(SchedulerConfig("both", chunk_size=16, max_running=2), e.engine, e.pool, sink.extend)
    regexes = {rid: f"x{rid}[a-z]{{4}}" for rid in range(1, 11)}
    for rid, regex in regexes.items():
        sched.submit(0, Submit(rid, [5, 6, 7], SamplingParams(temperature=0.0, max_new_tokens=12,
                                                              grammar=Grammar("regex", regex))))
    run_to_idle(sched, 120)
    assert not [m for _, m in sink if isinstance(m, Error)]
    assert len(compile_threads) == len(regexes)
    assert all(name.startswith("grammar-compile") for name in compile_threads)  # never the scheduler's thread
    for rid, regex in regexes.items():
        assert re.fullmatch(regex, text_of(model_dir, tokens_of(sink, rid), e.engine.info.eos_token_ids))
