"""Review of 3b2bc2b (``HFIncrementalDecoder``: the cut past a held run only for a run ending in U+FFFD)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from gateway.hf_tokenizer import HFTokenizer, _unicode_to_byte

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_hf_tokenizer import _llama_style_tokenizer  # type: ignore[import-not-found]


def _tokenizer(family: str, request: pytest.FixtureRequest) -> HFTokenizer:
    if family == "smollm2":
        return HFTokenizer.from_dir(request.getfixturevalue("smollm2_dir"))
    return _llama_style_tokenizer()


@pytest.mark.parametrize("family", ["llama-style", "smollm2"])
def test_a_long_run_of_skipped_special_tokens_streams_in_linear_time(family: str, request: pytest.FixtureRequest,
                                                                     ) -> None:
    """A run of skipped special tokens (EOS under ``ignore_eos``: a model that keeps answering EOS) is held now,
    never cut: each push past ``MAX_HELD_IDS`` decodes the whole run again (``self._decode(ids[self._read:])``,
    and the DecodeStream's own window grows): 8,000 EOS took 2.8 s on one stream (25 ms at 50920a2), on the
    gateway's event loop and the worker's stop-string watch. Such ids add no text and change no neighbour's (HF
    drops skipped specials before its decoder runs): leaving them out of the window keeps the text and the cost."""
    tok = _tokenizer(family, request)
    eos = tok.eos_token_ids[0]
    a = tok._tok.encode(" hello", add_special_tokens=False).ids
    n = 8000
    ids = a + [eos] * n + a
    decoder = tok.decoder([])
    decoded = [0]
    inner = decoder._decode

    def counting(window: list[int]) -> str:
        decoded[0] += len(window)
        return inner(window)

    decoder._decode = counting  # type: ignore[method-assign]
    out = "".join(decoder.push([i]) for i in ids) + decoder.flush()
    assert out == tok.decode(ids)
    assert decoded[0] < 50 * len(ids), f"{decoded[0]} ids decoded for {len(ids)} pushed: quadratic"


@pytest.mark.parametrize("family", ["llama-style", "smollm2"])
def test_a_character_split_by_a_long_run_of_skipped_specials_streams_as_decoded_whole(
        family: str, request: pytest.FixtureRequest) -> None:
    """(Pre-existing: fails at 50920a2 too.) The first byte of 東, more than ``MAX_HELD_IDS`` skipped EOS, its last
    two bytes: the whole decode says 東 (specials dropped before the decoder), the stream cuts past the held run
    and says U+FFFD (20 EOS: three of them) for it."""
    tok = _tokenizer(family, request)
    inv = {b: c for c, b in _unicode_to_byte().items()}

    def byte(b: int) -> int:
        token = f"<0x{b:02X}>" if family == "llama-style" else inv[b]
        found = tok._tok.token_to_id(token)
        assert found is not None
        return found

    eos = tok.eos_token_ids[0]
    a = tok._tok.encode(" hello", add_special_tokens=False).ids
    for run in (9, 20):
        ids = a + [byte(0xE6)] + [eos] * run + [byte(0x9D), byte(0xB1)] + a
        decoder = tok.decoder([])
        out = "".join(decoder.push([i]) for i in ids) + decoder.flush()
        assert out == tok.decode(ids), (run, out, tok.decode(ids))
