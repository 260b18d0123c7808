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
