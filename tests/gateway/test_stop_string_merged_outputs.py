"""A stop string found in an output of several tokens: the tokens after the one whose text completed it are not the
answer's. The gateway merges outputs queued behind one another (``EventSink.merge_ready``), and a decode that does
not stop at the strings itself (``skip_special_tokens: false``, whose strings the gateway alone watches; a decode
with another tokenizer) runs on past them: those tokens were counted in ``usage.completion_tokens`` and given
logprob entries, though their text is cut, and how many depended on how the outputs happened to be grouped."""

from __future__ import annotations

import random

from gateway.text import ChoiceState
from gateway.tokenizer import ByteTokenizer
from workers.protocol import StepOutput


def test_tokens_after_the_stop_string_in_one_output_are_not_counted() -> None:
    state = ChoiceState(0, ByteTokenizer(), ["!"], want_logprobs=True)
    ids = list(b"ab!cd")
    text, entries = state.accept(StepOutput(1, ids, logprobs=[-0.5] * len(ids)))
    assert text == "ab" and state.finish_reason == "stop"
    assert state.token_ids == list(b"ab!")
    assert [e["token"] for e in entries] == ["a", "b", "!"] and state.logprobs == entries


def test_kept_stop_string_and_min_tokens_cut_at_the_same_token() -> None:
    kept = ChoiceState(0, ByteTokenizer(), ["c!"], want_logprobs=False, keep_stop=True)
    kept.accept(StepOutput(1, list(b"abc!xyz")))
    assert kept.text == "abc!" and kept.token_ids == list(b"abc!")
    late = ChoiceState(0, ByteTokenizer(), ["a"], want_logprobs=False, min_tokens=1)
    late.accept(StepOutput(1, list(b"aab"), finish_reason=None))  # (the first 'a' is within min_tokens)
    assert late.text == "a" and late.token_ids == list(b"aa")
    final = ChoiceState(0, ByteTokenizer(), ["b"], want_logprobs=False, stop_tokens=((ByteTokenizer.EOS,),))
    final.accept(StepOutput(1, [*b"abcd", ByteTokenizer.EOS], finish_reason="stop"))
    assert final.text == "a" and final.token_ids == list(b"ab")


def test_any_grouping_of_a_real_tokenizers_outputs_counts_up_to_the_stop() -> None:
    from gateway.hf_tokenizer import HFTokenizer
    from workers.engines.llama.gguf_convert import default_model_dir
    from workers.stop_strings import StopWatch

    tok = HFTokenizer.from_dir(default_model_dir())
    ids = tok.encode("Hello \U0001f355\U0001f355 world. The end, and more words after it.")
    for stops in (["e"], ["wor"], ["\U0001f355 w"], ["end,"]):
        watch = StopWatch(tok, stops)
        at = next(i + 1 for i, t in enumerate(ids) if watch.push(t))
        for seed in range(20):
            rng, state, i = random.Random(seed), ChoiceState(0, tok, stops, True), 0
            while state.finish_reason is None:  # (the outputs go on past ``at``: a decode that does not stop there)
                end = min(i + rng.randint(1, 6), len(ids))
                state.accept(StepOutput(1, ids[i:end], logprobs=[-1.0] * (end - i),
                                        finish_reason="length" if end == len(ids) else None))
                i = end
            assert len(state.token_ids) == at == len(state.logprobs), (stops, seed, len(state.token_ids), at)
            assert state.token_ids == ids[:at]
