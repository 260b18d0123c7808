"""Chat logprob entries' ``bytes`` are the token's own bytes: joined, they rebuild characters that
byte-level tokens split (each piece of an emoji decodes to U+FFFD on its own)."""

from __future__ import annotations

import pytest

from gateway.hf_tokenizer import HFTokenizer
from gateway.text import ChoiceState
from workers.protocol import StepOutput, TokenLogprob


@pytest.fixture(scope="module")
def smollm2() -> HFTokenizer:
    pytest.importorskip("gguf")
    from workers.engines.llama.gguf_convert import default_model_dir

    return HFTokenizer.from_dir(default_model_dir())


def test_bytes_rebuild_characters_split_across_tokens(smollm2: HFTokenizer) -> None:
    text = "Pizza: 🍕🍕, café ü"
    ids = smollm2.encode(text)
    assert any("\ufffd" in smollm2.decode([i]) for i in ids), "the emoji is split across byte-level tokens"
    state = ChoiceState(0, smollm2, [], True)
    tops = [[TokenLogprob(i, -0.5)] for i in ids]
    state.accept(StepOutput(1, ids, finish_reason="stop", logprobs=[-0.5] * len(ids), top_logprobs=tops))
    assert bytes(b for entry in state.logprobs for b in entry["bytes"]).decode("utf-8") == text
    assert bytes(b for entry in state.logprobs for b in entry["top_logprobs"][0]["bytes"]).decode("utf-8") == text
    whole = [e for e in state.logprobs if "\ufffd" not in e["token"]]
    assert all(bytes(e["bytes"]) == e["token"].encode() for e in whole), "whole characters: their text's bytes"


def test_special_tokens_are_written_out_in_logprobs_and_echo(smollm2: HFTokenizer) -> None:
    """A logprob entry of the end-of-turn token names it (as vLLM: it was "" with bytes []); ``echo`` repeats
    a text prompt as sent (its chat markers were dropped) and ids with their special tokens written out."""
    import msgspec

    from gateway.api import Frontend
    from gateway.api_models import CompletionRequest
    from gateway.shapes import CompletionShape, Run

    eos = smollm2.eos_token_ids[0]
    state = ChoiceState(0, smollm2, [], True)
    hi = smollm2.encode("Hi")
    state.accept(StepOutput(1, [*hi, eos], finish_reason="stop", logprobs=[-0.1] * (len(hi) + 1),
                            top_logprobs=[[TokenLogprob(eos, -0.2)]] * (len(hi) + 1)))
    assert state.text == "Hi" and state.logprobs[-1]["token"] == "<|im_end|>" == smollm2.token_text(eos)
    assert bytes(state.logprobs[-1]["bytes"]) == b"<|im_end|>"
    assert state.logprobs[0]["top_logprobs"][0]["token"] == "<|im_end|>"

    frontend = Frontend(None, smollm2, "m", 2048)  # type: ignore[arg-type]
    chat = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    for prompt, echoed in [(chat, chat), (smollm2.encode(chat), chat), ([chat, "plain"], chat)]:
        body = msgspec.json.encode({"prompt": prompt, "max_tokens": 2, "echo": True})
        prep = frontend.prepare_completion(msgspec.json.decode(body, type=CompletionRequest))
        assert CompletionShape._prompt_text(Run(frontend, prep, "r"), 0) == echoed, prompt


def test_sentencepiece_tokens_keep_their_word_space(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A Metaspace decoder drops the space of the first token it decodes: each entry's token decoded alone read
    "Paris" for "▁Paris", so the tokens no longer joined to the text, /v1/completions' ``text_offset`` drifted
    a character per word, and legacy ``top_logprobs`` merged "▁true" and "true" into one key."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from gateway.shapes import legacy_logprobs

    words = ["▁The", "▁capital", "▁of", "▁France", "▁is", "▁Paris", ".", "▁Lyon", "▁"]
    tok = Tokenizer(models.WordLevel({"<unk>": 0, "<s>": 1, "</s>": 2, **{w: 3 + i for i, w in enumerate(words)}},
                                     unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>", "bos_token": "<s>"}))
    spm = HFTokenizer.from_dir(str(tmp_path))

    prompt = spm.encode("The capital of France is")
    answer = [tok.token_to_id(w) for w in ("▁Paris", ".", "▁Lyon", "▁")]
    state = ChoiceState(0, spm, [], True, prompt[-4:])
    state.accept(StepOutput(1, answer, finish_reason="length", logprobs=[-0.1, -0.2, -0.3, -0.4],
                            top_logprobs=[[TokenLogprob(answer[0], -0.1), TokenLogprob(tok.token_to_id("."), -3.0)],
                                          [], [], []]))
    assert state.text == " Paris. Lyon "
    tokens = [entry["token"] for entry in state.logprobs]
    assert tokens == [" Paris", ".", " Lyon", " "] and "".join(tokens) == state.text
    assert [entry["bytes"] for entry in state.logprobs] == [list(t.encode()) for t in tokens]
    legacy = legacy_logprobs(state.logprobs, 0)
    assert [state.text[o:o + len(t)] for o, t in zip(legacy["text_offset"], tokens, strict=True)] == tokens
    assert legacy["top_logprobs"][0] == {" Paris": -0.1, ".": -3.0}
