"""A model whose vocabulary makes ``<tool_call>`` / ``</tool_call>`` special tokens (Hermes 2 Pro's does): under
``tool_choice: auto`` the gateway decoded the answer skipping special tokens, so the call's tags vanished and the call
came back as plain text (finish_reason stop, no tool_calls). The tags are now written out for such a request (as
vLLM's Hermes parser asks), and the call is read; a plain chat, or a client that says ``skip_special_tokens``, is
decoded as before. The tokenizer is SmolLM2's with the two tags added as special tokens, built here."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import msgspec
import pytest

from gateway.api import Frontend, decode_body
from gateway.api_models import ChatCompletionRequest
from gateway.hf_tokenizer import HFTokenizer
from gateway.tool_calls import ChoiceStream, shape_choices
from workers.protocol import StepOutput

TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools: {{ tools | tojson }}\nCall one as <tool_call>{\"name\": ..., "
    "\"arguments\": ...}</tool_call><|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> HFTokenizer:
    from tokenizers import AddedToken, Tokenizer

    from workers.engines.llama.gguf_convert import default_model_dir

    source = Path(default_model_dir())
    out = tmp_path_factory.mktemp("hermes-tok")
    tok = Tokenizer.from_file(str(source / "tokenizer.json"))
    tok.add_special_tokens([AddedToken("<tool_call>", special=True), AddedToken("</tool_call>", special=True)])
    tok.save(str(out / "tokenizer.json"))
    config = json.loads((source / "tokenizer_config.json").read_text())
    config["chat_template"] = TEMPLATE
    config.pop("added_tokens_decoder", None)
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    for name in ("special_tokens_map.json", "generation_config.json"):
        if os.path.isfile(source / name):
            shutil.copy(source / name, out / name)
    return HFTokenizer.from_dir(str(out))


def _prepared(tokenizer: HFTokenizer, **fields: object) -> object:
    body = {"model": "m", "messages": [{"role": "user", "content": "Weather in Paris?"}], **fields}
    return Frontend(None, tokenizer, "m", 8192).prepare_chat(  # type: ignore[arg-type]
        decode_body(msgspec.json.encode(body), ChatCompletionRequest))


def _answer(tokenizer: HFTokenizer) -> list[int]:
    ids = tokenizer.encode("Let me check. ")
    ids.append(tokenizer.token_to_id("<tool_call>"))  # type: ignore[arg-type]
    ids += tokenizer.encode(json.dumps({"name": "get_weather", "arguments": {"city": "Paris"}}))
    ids.append(tokenizer.token_to_id("</tool_call>"))  # type: ignore[arg-type]
    return [*ids, tokenizer.eos_token_ids[0]]


def test_an_auto_call_between_special_tags_is_read(tokenizer: HFTokenizer) -> None:
    assert tokenizer.token_to_id("<tool_call>") in tokenizer.skipped_ids  # (the case: a special token)
    for stream in (False, True):
        prep = _prepared(tokenizer, tools=[TOOL], stream=stream)
        assert prep.tools is not None and prep.tools.hermes  # type: ignore[attr-defined]
        frontend = Frontend(None, tokenizer, "m", 8192)  # type: ignore[arg-type]
        state = frontend._choice(prep)  # type: ignore[arg-type]
        answer = _answer(tokenizer)
        if not stream:
            state.accept(StepOutput(1, answer, finish_reason="stop"))
            result = {"choices": [{"index": 0, "message": {"role": "assistant", "content": state.text},
                                   "finish_reason": state.finish_reason}]}
            shape_choices(prep.tools, result)  # type: ignore[attr-defined]
            choice = result["choices"][0]
            assert choice["finish_reason"] == "tool_calls", choice
            [call] = choice["message"]["tool_calls"]  # type: ignore[index]
        else:
            chat = ChoiceStream(prep.tools)  # type: ignore[attr-defined]
            deltas = []
            for i, token in enumerate(answer):
                final = i == len(answer) - 1
                text, _ = state.accept(StepOutput(1, [token], finish_reason="stop" if final else None))
                deltas += chat.feed(text)
            finish_deltas, finish_reason = chat.finish("stop")
            deltas += finish_deltas
            assert finish_reason == "tool_calls", deltas
            calls = [c for d in deltas for c in d.get("tool_calls") or ()]
            call = {"function": {"name": calls[0]["function"]["name"],
                                 "arguments": "".join(c["function"].get("arguments") or "" for c in calls)}}
            assert "<tool_call>" not in "".join(d.get("content") or "" for d in deltas)
        assert call["function"]["name"] == "get_weather"
        assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}


def test_special_tokens_stay_skipped_otherwise(tokenizer: HFTokenizer) -> None:
    """A plain chat, tool_choice none, and a client's own skip_special_tokens: true keep skipping them."""
    for fields in ({}, {"tools": [TOOL], "tool_choice": "none"}, {"tools": [TOOL], "skip_special_tokens": True}):
        prep = _prepared(tokenizer, **fields)
        assert prep.skip_special, fields  # type: ignore[attr-defined]
    assert not _prepared(tokenizer, tools=[TOOL]).skip_special  # type: ignore[attr-defined]
