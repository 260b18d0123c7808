"""HFTokenizer: tokenizer.json + chat template via tokenizers/jinja2, checked against transformers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gateway.hf_tokenizer import HFTokenizer, TokenizerLoadError
from gateway.tokenizer import load_tokenizer

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "東京は日本の首都です。北京是中国的首都。",
    "未見の漢字とハングル 한국어 텍스트",
    "Emoji: 😀 👍🏽 🎉 and flags 🇫🇷 — mixed with ünïcödé",
    "tabs\tand\n\nnewlines  and   spaces ",
    "",
]


def _stream(tok: HFTokenizer, ids: list[int], chunk: int) -> list[str]:
    dec = tok.decoder()
    pieces = [dec.push(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
    pieces.append(dec.flush())
    return pieces


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("chunk", [1, 2, 3])
def test_incremental_decoder_never_splits_characters(tiny_tokenizer_dir, text, chunk) -> None:
    tok = HFTokenizer.from_dir(tiny_tokenizer_dir)
    ids = tok.encode(text)
    if any(ord(c) > 0xFFFF for c in text) or "한" in text:
        # The test is only worth its name if some token boundary falls inside a character.
        assert any("\ufffd" in tok.decode([i]) for i in ids)
    pieces = _stream(tok, ids, chunk)
    assert "".join(pieces) == tok.decode(ids) == text
    assert not any("\ufffd" in p for p in pieces)


def test_decoder_holds_back_an_unfinished_character(tiny_tokenizer_dir) -> None:
    tok = HFTokenizer.from_dir(tiny_tokenizer_dir)
    ids = tok.encode("😀")
    assert len(ids) > 1  # four UTF-8 bytes, not one token in a 400-entry vocabulary
    dec = tok.decoder()
    assert [dec.push([i]) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert dec.push(ids[-1:]) == "😀"
    assert dec.flush() == ""


def test_flush_emits_a_dangling_partial_character(tiny_tokenizer_dir) -> None:
    tok = HFTokenizer.from_dir(tiny_tokenizer_dir)
    ids = tok.encode("ab😀")
    dec = tok.decoder()
    streamed = dec.push(ids[:-1])
    assert "\ufffd" not in streamed
    assert streamed + dec.flush() == tok.decode(ids[:-1])


def test_matches_transformers(tiny_tokenizer_dir) -> None:
    transformers = pytest.importorskip("transformers")
    ref = transformers.AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    tok = HFTokenizer.from_dir(tiny_tokenizer_dir)
    for text in TEXTS:
        assert tok.encode(text) == ref.encode(text)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is the capital of France? 🇫🇷"},
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "東京は?"},
    ]
    expected = ref.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if not isinstance(expected, list):
        expected = expected["input_ids"]
    assert tok.apply_chat_template(messages) == expected
    assert tok.render_chat(messages).endswith("<|im_start|>assistant\n")
    assert tok.render_chat(messages).startswith("<|endoftext|><|im_start|>system")


def test_special_tokens_and_eos_ids(tiny_tokenizer_dir) -> None:
    tok = HFTokenizer.from_dir(tiny_tokenizer_dir)
    im_end = tok.token_to_id("<|im_end|>")
    assert tok.eos_token_ids[0] == im_end  # eos_token first, then generation_config's ids
    assert set(tok.eos_token_ids) == {im_end, 0}
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == tok.token_to_id("<|im_start|>")
    assert tok.decode(ids) == "user\nhi"  # specials are skipped in output text


def test_content_parts_and_load_tokenizer(tiny_tokenizer_dir) -> None:
    tok = load_tokenizer(tiny_tokenizer_dir)
    parts = [{"role": "user", "content": [{"type": "text", "text": "Paris"}, {"type": "image_url"}]}]
    plain = [{"role": "user", "content": "Paris"}]
    assert tok.apply_chat_template(parts) == tok.apply_chat_template(plain)


def test_template_is_sandboxed(tmp_path, tiny_tokenizer_dir) -> None:
    (tmp_path / "tokenizer.json").write_bytes((Path(tiny_tokenizer_dir) / "tokenizer.json").read_bytes())
    evil = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    (tmp_path / "chat_template.jinja").write_text(evil)
    tok = HFTokenizer.from_dir(str(tmp_path))
    from jinja2.exceptions import SecurityError

    with pytest.raises(SecurityError):
        tok.apply_chat_template([{"role": "user", "content": "x"}])


def test_raise_exception_in_template(tmp_path, tiny_tokenizer_dir) -> None:
    (tmp_path / "tokenizer.json").write_bytes((Path(tiny_tokenizer_dir) / "tokenizer.json").read_bytes())
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": [{"name": "default", "template": "{{ raise_exception('no system role') }}"}]})
    )
    tok = HFTokenizer.from_dir(str(tmp_path))
    from jinja2 import TemplateError

    with pytest.raises(TemplateError, match="no system role"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])


def test_bad_directories(tmp_path) -> None:
    with pytest.raises(TokenizerLoadError, match=r"no tokenizer\.json"):
        HFTokenizer.from_dir(str(tmp_path))
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerLoadError, match=r"tokenizer\.json"):
        HFTokenizer.from_dir(str(tmp_path))


def test_missing_chat_template_is_a_clear_error(tmp_path, tiny_tokenizer_dir) -> None:
    (tmp_path / "tokenizer.json").write_bytes((Path(tiny_tokenizer_dir) / "tokenizer.json").read_bytes())
    tok = HFTokenizer.from_dir(str(tmp_path))
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])
