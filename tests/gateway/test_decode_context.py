"""A SentencePiece-style tokenizer (Metaspace: "▁" for a space, dropped at a sequence's start) made at
test time: an answer's text is decoded as following its prompt, so its first word keeps its space,
streamed or whole, in the gateway and in the worker's stop-string watch alike."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gateway.hf_tokenizer import HFTokenizer
from gateway.text import ChoiceState
from workers.protocol import StepOutput
from workers.stop_strings import StopWatch

tokenizers = pytest.importorskip("tokenizers")
WORDS = ["▁The", "▁capital", "▁of", "▁France", "▁is", "▁Paris", ".", "▁Lyon", "▁"]


@pytest.fixture(scope="module")
def spm(tmp_path_factory: pytest.TempPathFactory) -> HFTokenizer:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{word: 3 + i for i, word in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    path = tmp_path_factory.mktemp("spm")
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>", "bos_token": "<s>"}))
    return HFTokenizer.from_dir(str(Path(path)))


def test_the_answers_first_word_keeps_its_space(spm: HFTokenizer) -> None:
    prompt = spm.encode("The capital of France is")
    answer = [spm._tok.token_to_id("▁Paris"), spm._tok.token_to_id(".")]
    assert spm.decode(prompt + answer) == "The capital of France is Paris."
    for steps in ([answer[:1], answer[1:]], [answer]):  # streamed, or whole
        state = ChoiceState(0, spm, [], False, prompt[-4:])
        text = ""
        for i, ids in enumerate(steps):
            text += state.accept(StepOutput(1, ids, finish_reason="stop" if i == len(steps) - 1 else None))[0]
        assert text == " Paris.", steps
        assert spm.decode(prompt) + text == spm.decode(prompt + answer), "echo reads as the whole text"
    assert ChoiceState(0, spm, [], False).accept(StepOutput(1, answer, finish_reason="stop"))[0] == "Paris."


def test_the_workers_stop_watch_sees_the_same_text(spm: HFTokenizer) -> None:
    prompt = spm.encode("The capital of France is")
    paris = spm._tok.token_to_id("▁Paris")
    assert StopWatch(spm, [" Paris"], context=prompt[-4:]).push(paris), "the gateway's text has ' Paris' here"
    assert not StopWatch(spm, [" Paris"]).push(paris)  # (without the prompt: "Paris")
