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
