"""A tokenizer directory saved before transformers 4.34 (``tokenizer_config.json`` without ``added_tokens_decoder``)
names its special tokens in ``special_tokens_map.json`` (which a worker sends a gateway with its tokenizer, too):
transformers reads them there, so the template's ``bos_token``/``eos_token`` and the EOS id are those."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from gateway.hf_tokenizer import HFTokenizer

TEMPLATE = "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{{ eos_token }}{% endfor %}"
MESSAGES = [{"role": "user", "content": "Paris?"}]


def _legacy_dir(tiny_tokenizer_dir: str, tmp_path: Path, config: dict[str, object]) -> str:
    shutil.copy(Path(tiny_tokenizer_dir) / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": TEMPLATE, **config}))
    (tmp_path / "special_tokens_map.json").write_text(json.dumps(
        {"bos_token": "<|im_start|>", "eos_token": {"content": "<|im_end|>", "lstrip": False, "normalized": False,
                                                    "rstrip": False, "single_word": False}}))
    return str(tmp_path)


@pytest.mark.parametrize("config", [{}, {"bos_token": "<|endoftext|>"}])
def test_a_legacy_special_tokens_map_names_the_special_tokens(tiny_tokenizer_dir, tmp_path, config) -> None:
    path = _legacy_dir(tiny_tokenizer_dir, tmp_path, config)
    tok = HFTokenizer.from_dir(path)
    assert tok.render_chat(MESSAGES, False) == "<|im_start|>[user] Paris?<|im_end|>"
    assert tok.eos_token_ids == (tok._tok.token_to_id("<|im_end|>"),)
    transformers = pytest.importorskip("transformers")
    ref = transformers.AutoTokenizer.from_pretrained(path)
    assert tok.render_chat(MESSAGES, False) == ref.apply_chat_template(MESSAGES, tokenize=False)
    assert tok.eos_token_ids == (ref.eos_token_id,)


def test_a_worker_stops_at_a_legacy_maps_eos_too(tiny_model, tiny_tokenizer_dir, tmp_path) -> None:
    """The worker's engine reads the same EOS (else it ran on past it until the gateway aborted the request)."""
    from workers.engines.llama.config import load_config

    model_dir = tmp_path / "model"
    shutil.copytree(tiny_model("qwen2").path, model_dir)
    _legacy_dir(tiny_tokenizer_dir, model_dir, {"eos_token": "<|endoftext|>"})
    tok = HFTokenizer.from_dir(str(model_dir))
    assert tok.eos_token_ids == (tok._tok.token_to_id("<|im_end|>"),)
    assert load_config(str(model_dir)).eos_token_ids == tok.eos_token_ids


def test_a_config_with_added_tokens_decoder_keeps_its_own(tiny_tokenizer_dir, tmp_path) -> None:
    """(As transformers: the map is read only for a legacy config.)"""
    path = _legacy_dir(tiny_tokenizer_dir, tmp_path, {"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>",
                                                      "added_tokens_decoder": {}})
    tok = HFTokenizer.from_dir(path)
    assert tok.render_chat(MESSAGES, False) == "<|endoftext|>[user] Paris?<|endoftext|>"
    transformers = pytest.importorskip("transformers")
    ref = transformers.AutoTokenizer.from_pretrained(path)
    assert tok.render_chat(MESSAGES, False) == ref.apply_chat_template(MESSAGES, tokenize=False)
