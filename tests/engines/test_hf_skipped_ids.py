"""Review of a2af4c0: ``HFTokenizer.skipped_ids`` must be exactly what ``decode(skip_special_tokens=True)`` drops."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_hf_tokenizer import _llama_style_tokenizer  # type: ignore[import-not-found]

from gateway.hf_tokenizer import HFTokenizer


def test_a_normalized_special_token_that_decode_keeps_is_kept_by_the_stream_too() -> None:
    """A special added token with ``normalized: true`` under a ``Prepend`` normalizer (legacy Llama/Mistral
    tokenizer.json): tokenizers' decode does not skip it, yet ``skipped_ids`` (``special`` flag only) drops it
    from the stream, so the streamed text differs from the whole decode."""
    from tokenizers import AddedToken

    raw = _llama_style_tokenizer()._tok
    raw.add_special_tokens([AddedToken("<sp_norm>", special=True, normalized=True)])
    tok = HFTokenizer(raw, name="x", chat_template=None, special_tokens={}, eos_token_ids=(2,))
    sp = raw.token_to_id("<sp_norm>")
    ids = [*raw.encode(" ab", add_special_tokens=False).ids, sp, *raw.encode(" cd", add_special_tokens=False).ids]
    decoder = tok.decoder([])
    streamed = "".join(decoder.push([i]) for i in ids) + decoder.flush()
    assert streamed == tok.decode(ids)
