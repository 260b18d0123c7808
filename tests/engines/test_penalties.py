"""logit_bias, repetition/presence/frequency penalties and min_new_tokens against transformers.

transformers' logits processors are the reference for ``repetition_penalty``
(``RepetitionPenaltyLogitsProcessor``), ``logit_bias`` (``SequenceBiasLogitsProcessor`` with
one-token sequences) and ``min_new_tokens`` (``MinNewTokensLengthLogitsProcessor``). transformers has
no processor for OpenAI's presence and frequency penalties, so ``OpenAIPenalties`` below is a plain
reference written from OpenAI's formula (``logit[j] -= c[j] * frequency + (c[j] > 0) * presence``,
``c[j]`` = occurrences of token j in the output so far), token by token, without vectors.
"""

from __future__ import annotations

import random

import pytest
import torch
from llama_harness import Request, run_requests
from transformers.generation.logits_process import (
    LogitsProcessor,
    LogitsProcessorList,
    MinNewTokensLengthLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
)

from workers.engines.base import SeqInput
from workers.engines.llama.penalties import LogitAdjuster
from workers.protocol import SamplingParams

VOCAB = 512
EOS = (2,)


class OpenAIPenalties(LogitsProcessor):
    """OpenAI's presence/frequency formula, one token at a time (the test's own reference)."""

    def __init__(self, prompt_len: int, presence: float, frequency: float) -> None:
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        scores = scores.clone()
        for b in range(scores.shape[0]):
            counts: dict[int, int] = {}
            for token in input_ids[b, self.prompt_len :].tolist():
                counts[token] = counts.get(token, 0) + 1
            for token, c in counts.items():
                scores[b, token] -= c * self.frequency + (1.0 if c > 0 else 0.0) * self.presence
        return scores


def hf_processors(params: SamplingParams, prompt_len: int) -> LogitsProcessorList:
    """transformers' processors (and the OpenAI reference) in the engine's documented order."""
    procs = LogitsProcessorList()
    if params.logit_bias:
        procs.append(SequenceBiasLogitsProcessor([[[t], b] for t, b in params.logit_bias.items()]))
    if params.repetition_penalty != 1.0:
        procs.append(RepetitionPenaltyLogitsProcessor(params.repetition_penalty))
    if params.presence_penalty or params.frequency_penalty:
        procs.append(OpenAIPenalties(prompt_len, params.presence_penalty, params.frequency_penalty))
    if params.min_new_tokens:  # stop_token_ids end a sequence like EOS does: banned as well
        stops = list(params.stop_token_ids) + ([] if params.ignore_eos else list(EOS))
        procs.append(MinNewTokensLengthLogitsProcessor(prompt_len, params.min_new_tokens, stops))
    return procs


def _tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(0, 40) for _ in range(n)]  # a small range: repeats are common


def _seq(rid: int, history: list[int], num_generated: int, params: SamplingParams, feed_all: bool = True) -> SeqInput:
    """A decode-style step: the last history token is fed, the next one is sampled."""
    return SeqInput(rid, [], len(history) - 1, history[-1:], True, params, num_generated,
                    history if feed_all else None)


PARAMS = [
    SamplingParams(repetition_penalty=1.7),
    SamplingParams(repetition_penalty=0.6),
    SamplingParams(presence_penalty=1.5),
    SamplingParams(frequency_penalty=0.7),
    SamplingParams(presence_penalty=-0.5, frequency_penalty=-1.2),
    SamplingParams(logit_bias={3: 100.0, 7: -100.0, 11: 2.5}),
    SamplingParams(min_new_tokens=5, stop_token_ids=[4, 9]),
    SamplingParams(min_new_tokens=5, stop_token_ids=[4], ignore_eos=True),
    SamplingParams(repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.3, logit_bias={5: 3.0},
                   min_new_tokens=3),
    SamplingParams(),
]


def test_a_mixed_batch_matches_the_processors_row_by_row() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(len(PARAMS), VOCAB, generator=gen) * 4
    seqs, histories = [], []
    for i, params in enumerate(PARAMS):
        prompt, outputs = _tokens(i, 12), _tokens(100 + i, i % 5 + 1)
        histories.append((prompt, outputs))
        seqs.append(_seq(i, prompt + outputs, len(outputs), params))
    adjusted = LogitAdjuster(VOCAB, EOS).adjust(logits, seqs)
    for i, params in enumerate(PARAMS):
        prompt, outputs = histories[i]
        reference = hf_processors(params, len(prompt))(torch.tensor([prompt + outputs]), logits[i : i + 1].clone())
        torch.testing.assert_close(adjusted[i], reference[0], rtol=0, atol=1e-6)
        if i < len(PARAMS) - 1:
            assert not torch.equal(adjusted[i], logits[i]), f"row {i}: the adjustment did something (can fail)"
    assert torch.equal(adjusted[-1], logits[-1])


def test_min_new_tokens_bans_eos_and_stop_ids_until_reached() -> None:
    adjuster = LogitAdjuster(VOCAB, EOS)
    params = SamplingParams(min_new_tokens=3, stop_token_ids=[9])
    logits = torch.zeros(1, VOCAB)
    for num_outputs, banned in ((0, True), (2, True), (3, False)):
        history = list(range(10, 20 + num_outputs))
        row = adjuster.adjust(logits, [_seq(1, history, num_outputs, params)])[0]
        assert bool(row[2] == float("-inf")) is banned and bool(row[9] == float("-inf")) is banned
    # A migrated stream's earlier outputs count (output_offset).
    migrated = SamplingParams(min_new_tokens=3, stop_token_ids=[9], output_offset=3)
    assert torch.isfinite(adjuster.adjust(logits, [_seq(2, list(range(10, 20)), 0, migrated)])).all()


def test_counts_kept_step_by_step_equal_counts_from_scratch() -> None:
    """The adjuster's records, extended by one fed token per step (no all_token_ids), equal a fresh count."""
    params = SamplingParams(repetition_penalty=1.4, presence_penalty=0.8, frequency_penalty=0.5)
    prompt = _tokens(7, 9)
    kept = LogitAdjuster(VOCAB, EOS)
    gen = torch.Generator().manual_seed(1)
    outputs: list[int] = []
    for step in range(12):
        logits = torch.randn(1, VOCAB, generator=gen)
        history = prompt + outputs
        if step == 0:  # the prefill's last chunk: the whole prompt
            seq = SeqInput(1, [], 0, prompt, True, params, 0, prompt)
        else:
            seq = _seq(1, history, len(outputs), params, feed_all=False)
        fresh = LogitAdjuster(VOCAB, EOS).adjust(logits, [_seq(9, history, len(outputs), params)])
        torch.testing.assert_close(kept.adjust(logits, [seq]), fresh, rtol=0, atol=0)
        outputs.append(_tokens(step, 1)[0])
    assert kept.num_records == 1
    kept.forget(1)
    assert kept.num_records == 0
    with pytest.raises(ValueError, match="all_token_ids"):
        kept.adjust(torch.zeros(1, VOCAB), [_seq(1, prompt + outputs, len(outputs), params, feed_all=False)])


def test_reused_and_evicted_slots_count_from_scratch(monkeypatch: pytest.MonkeyPatch) -> None:
    """A slot freed by ``forget`` (or by eviction past MAX_RECORDS) holds nothing of its old sequence."""
    import workers.engines.llama.penalties as penalties

    monkeypatch.setattr(penalties, "MAX_RECORDS", 2)
    params = SamplingParams(repetition_penalty=1.5, presence_penalty=1.0, frequency_penalty=0.5)
    adjuster = LogitAdjuster(VOCAB, EOS)
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(5))
    for rid in range(6):  # each new sequence evicts or reuses the slot of an older one
        history = _tokens(rid, 30 + rid)
        seq = _seq(rid, history, 10, params)
        fresh = LogitAdjuster(VOCAB, EOS).adjust(logits, [seq])
        torch.testing.assert_close(adjuster.adjust(logits, [seq]), fresh, rtol=0, atol=0)
        if rid % 2:
            adjuster.forget(rid)
    assert adjuster.num_records <= 2


def test_a_batch_larger_than_max_records_keeps_a_slot_per_sequence(monkeypatch: pytest.MonkeyPatch) -> None:
    """More penalised sequences in one batch than MAX_RECORDS: none is evicted while the batch uses it (two
    rows sharing a slot would be penalised for each other's tokens); each row is what it is alone."""
    import workers.engines.llama.penalties as penalties

    monkeypatch.setattr(penalties, "MAX_RECORDS", 2)
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5)
    seqs = [_seq(rid, _tokens(rid, 12 + rid), 4, params) for rid in range(5)]
    logits = torch.randn(len(seqs), VOCAB, generator=torch.Generator().manual_seed(3))
    adjuster = LogitAdjuster(VOCAB, EOS)
    for _ in range(2):  # (the second step: every record already there)
        got = adjuster.adjust(logits.clone(), seqs)
        for row, seq in enumerate(seqs):
            alone = LogitAdjuster(VOCAB, EOS).adjust(logits[row : row + 1].clone(), [seq])
            torch.testing.assert_close(got[row : row + 1], alone, rtol=0, atol=0)
    adjuster.adjust(logits[:1].clone(), [_seq(9, _tokens(9, 10), 4, params)])  # a later step: back to the bound
    assert adjuster.num_records <= 2


def _prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB) for _ in range(n)]


ENGINE_CASES = {
    "repetition": SamplingParams(temperature=0.0, repetition_penalty=1.5),
    "presence_frequency": SamplingParams(temperature=0.0, presence_penalty=1.2, frequency_penalty=0.8),
    "logit_bias": SamplingParams(temperature=0.0, logit_bias={17: 8.0, 300: 5.0, 41: -100.0}),
    # (stop ids the unconstrained greedy outputs of these prompts start with)
    "min_new_tokens": SamplingParams(temperature=0.0, min_new_tokens=12, stop_token_ids=[0, 249, 151, 466]),
    "all": SamplingParams(temperature=0.0, repetition_penalty=1.2, presence_penalty=0.5, frequency_penalty=0.5,
                          logit_bias={17: 3.0}, min_new_tokens=4),
}


def _reference(model, prompt: list[int], params: SamplingParams, n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.int64),
                             max_new_tokens=n, do_sample=False, logits_processor=hf_processors(params, len(prompt)))
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("case", list(ENGINE_CASES))
def test_engine_greedy_equals_transformers_generate_with_the_processors(tiny_model, make_engine, case: str) -> None:
    """Greedy tokens of the engine (batched with other requests) equal transformers' generate()."""
    model = tiny_model("llama")
    params = ENGINE_CASES[case]
    prompts = [_prompt(i, 10 + 3 * i) for i in range(3)]
    expected = [_reference(model.reference, p, params, 16) for p in prompts]
    plain = [_reference(model.reference, p, SamplingParams(temperature=0.0), 16) for p in prompts]
    assert expected != plain, "the settings change the greedy output (else this test could not fail)"
    under = make_engine(model.path)
    assert under.engine.info.eos_token_ids == EOS
    reqs = [Request(rid=i, prompt=p, max_new_tokens=16, params=params, chunks=[5, len(p) - 5])
            for i, p in enumerate(prompts)]
    reqs.append(Request(rid=9, prompt=_prompt(9, 7), max_new_tokens=16))  # an unpenalised neighbour
    run_requests(under.engine, under.pool, reqs)
    assert [r.outputs for r in reqs[:3]] == expected
    assert reqs[3].outputs == _reference(model.reference, reqs[3].prompt, SamplingParams(temperature=0.0), 16)


def test_a_pd_split_samples_what_one_engine_does(tiny_model, make_engine) -> None:
    """Output 0 on a prefill engine, 1.. on a decode engine that only has the prompt and the first token."""
    model = tiny_model("llama")
    params = ENGINE_CASES["all"]
    prompt = _prompt(21, 13)
    single = make_engine(model.path)
    alone = Request(rid=1, prompt=prompt, max_new_tokens=14, params=params)
    run_requests(single.engine, single.pool, [alone])
    assert alone.outputs == _reference(model.reference, prompt, params, 14)

    prefill, decode = make_engine(model.path), make_engine(model.path)
    p_req = Request(rid=4, prompt=prompt, max_new_tokens=1, params=params)
    run_requests(prefill.engine, prefill.pool, [p_req])
    assert p_req.page_ids is not None and p_req.outputs is not None
    d_pages = decode.pool.alloc(decode.pool.pages_for(len(prompt) + 14))
    assert d_pages is not None
    n = prefill.pool.pages_for(len(prompt))
    for src, dst in zip(prefill.pool.kv_buffers(), decode.pool.kv_buffers(), strict=True):
        dst[d_pages[:n]] = src[p_req.page_ids[:n]]
    d_req = Request(rid=7, prompt=prompt, max_new_tokens=14, params=params, page_ids=d_pages,
                    num_cached=len(prompt), chunks=[], outputs=list(p_req.outputs))
    run_requests(decode.engine, decode.pool, [d_req])
    assert d_req.outputs == alone.outputs


def test_penalties_and_logit_bias_leave_a_grammar_in_force(tiny_model, tiny_tokenizer_dir, make_engine,
                                                            tmp_path) -> None:
    """The grammar's mask comes after the adjustments: a +100 bias on tokens the regex forbids, strong
    penalties and min_new_tokens still give text in the regex's language (and the adjustments did act)."""
    import re
    import shutil

    pytest.importorskip("llguidance")
    from tokenizers import Tokenizer

    from workers.protocol import Grammar

    shutil.copytree(tiny_model("llama").path, tmp_path, dirs_exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{tiny_tokenizer_dir}/{name}", tmp_path / name)
    regex = r"(ab|cd)[0-9]{2}-[a-z]{3}"
    under = make_engine(str(tmp_path))
    engine, pool = under.engine, under.pool
    eos = engine.info.eos_token_ids

    def run(rid: int, params: SamplingParams) -> list[int]:
        prompt = [5, 6, 7]
        pages = pool.alloc(pool.pages_for(len(prompt) + 48))
        assert pages is not None
        engine.prepare(params.grammar).result()
        outputs = [engine.forward([SeqInput(rid, pages, 0, prompt, True, params, 0, prompt)])[0].token_id]
        while outputs[-1] not in eos and len(outputs) < 48:
            history = prompt + outputs  # as the scheduler passes it to a request that needs_history
            seq = SeqInput(rid, pages, len(history) - 1, [outputs[-1]], True, params, len(outputs), history)
            outputs.append(engine.forward([seq])[0].token_id)
        engine.forget(rid)
        return outputs

    tok = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    grammar = Grammar("regex", regex)
    plain = run(1, SamplingParams(temperature=0.0, grammar=grammar))
    banned_first = {plain[0]: -100.0}
    forced_elsewhere = {t: 100.0 for t in range(300, 320)}  # ids the regex's language has no use for here
    adjusted = run(2, SamplingParams(temperature=0.0, grammar=grammar, repetition_penalty=1.8, presence_penalty=2.0,
                                     frequency_penalty=2.0, min_new_tokens=3,
                                     logit_bias={**banned_first, **forced_elsewhere}))
    for tokens in (plain, adjusted):
        assert tokens[-1] in eos
        assert re.fullmatch(regex, tok.decode(tokens[:-1])), tok.decode(tokens[:-1])
    assert adjusted != plain, "the bias against the plain first token acted within the grammar"
