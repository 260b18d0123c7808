"""An answer that writes U+FFFD itself ("\\ufffd", as in text it copies), streamed by a byte-fallback tokenizer
(Llama 2's, Mistral's, Gemma's): the text of the characters after it is the whole decode's, not U+FFFD byte for
byte. Such a text ends in U+FFFD while whole, so more than ``MAX_HELD_IDS`` ids are held and the window is cut
(``_past_held``); a cut inside a byte-fallback character made its run decode as U+FFFD per byte."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from gateway.hf_tokenizer import HFTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_hf_tokenizer import _llama_style_tokenizer  # type: ignore[import-not-found]


def _with_replacement_piece() -> HFTokenizer:
    """The same, with U+FFFD a piece of its vocabulary."""
    from tokenizers import Tokenizer, models

    base = _llama_style_tokenizer()._tok
    vocab = dict(base.get_vocab())
    vocab["\ufffd"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tok.normalizer, tok.decoder = base.normalizer, base.decoder
    tok.add_special_tokens(["<s>", "</s>"])
    return HFTokenizer(tok, name="llama-style-fffd", chat_template=None, special_tokens={}, eos_token_ids=(2,))


TEXTS = ["x\ufffd\ufffd\ufffd\ufffd😀 ok", "😀\ufffd\ufffd\ufffd😀a",
         "ab \ufffd\ufffd\ufffd東\ufffd\ufffd\ufffd\ufffd東é", "\ufffd" * 12 + "😀😀"]


@pytest.mark.parametrize("family", ["byte-pieces", "replacement-piece"])
@pytest.mark.parametrize("size", [1, 2, 3])
@pytest.mark.parametrize("python_only", [False, True])
def test_a_literal_replacement_character_leaves_the_next_characters_whole(family: str, size: int,
                                                                        python_only: bool) -> None:
    tok = _llama_style_tokenizer() if family == "byte-pieces" else _with_replacement_piece()
    for text in TEXTS:
        ids = tok._tok.encode(text, add_special_tokens=False).ids
        assert tok.decode(ids) == text.lstrip(" ")
        decoder = tok.decoder()
        if python_only:
            decoder._stream = None  # type: ignore[attr-defined]
        pieces = [decoder.push(ids[i:i + size]) for i in range(0, len(ids), size)]
        assert "".join(pieces) + decoder.flush() == tok.decode(ids), (text, pieces)


@pytest.mark.parametrize("family", ["byte-pieces", "replacement-piece"])
def test_a_stop_string_after_literal_replacement_characters_is_found(family: str) -> None:
    """The worker's stop-string watch reads the same decoder: the string after the run ends the request."""
    from workers.stop_strings import StopWatch

    tok = _llama_style_tokenizer() if family == "byte-pieces" else _with_replacement_piece()
    ids = tok._tok.encode("x\ufffd\ufffd\ufffd\ufffd😀 ok and on", add_special_tokens=False).ids
    watch = StopWatch(tok, ["😀 ok"])
    hits = [watch.push(token) for token in ids]
    assert True in hits and hits.index(True) == len(tok._tok.encode("x\ufffd\ufffd\ufffd\ufffd😀 ok",
                                                                     add_special_tokens=False).ids) - 1
