"""Tokenizers the gateway uses to turn prompts into token ids and token ids back into text.

A worker names its tokenizer in its handshake (``HelloAck.tokenizer``): ``"byte"`` for the sim
engine's built-in byte tokenizer, or a model directory holding ``tokenizer.json`` (and a chat
template), loaded by ``gateway.hf_tokenizer``. ``load_tokenizer`` picks the implementation.

Detokenization is incremental: ``decoder(context)`` returns a stateful object whose ``push(token_ids)``
returns only complete text (never half a UTF-8 character), and ``flush()`` the remainder. ``context``
is the end of the prompt (``DECODE_CONTEXT_TOKENS`` ids): their text is not emitted, but the first
output is decoded as following it, as the whole sequence would be. That matters to SentencePiece
tokenizers (Llama 2's, Mistral's...), which drop the space of a sequence's first word: without the
context, an answer's "▁Paris" would read "Paris" where the model wrote " Paris".
"""

from __future__ import annotations

import codecs
import hashlib
import os
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

DECODE_CONTEXT_TOKENS = 4


class IncrementalDecoder(Protocol):
    def push(self, token_ids: Sequence[int]) -> str: ...

    def flush(self) -> str: ...


class Tokenizer(Protocol):
    name: str
    eos_token_ids: tuple[int, ...]

    def encode(self, text: str) -> list[int]:
        """Plain text to ids (adds BOS only where the model's tokenizer does)."""
        ...

    def apply_chat_template(self, messages: list[dict[str, Any]]) -> list[int]:
        """Chat messages to the prompt ids, with the generation prompt appended. Tokenizers with a template
        also take ``tools=`` and the keywords of ``TemplateOptions.keywords`` (``HFTokenizer``, ``ByteTokenizer``)."""
        ...

    def decode(self, token_ids: Sequence[int]) -> str: ...

    def decoder(self, context: Sequence[int] = (), *, skip_special_tokens: bool = True) -> IncrementalDecoder:
        """``skip_special_tokens=False``: the text of special tokens (chat markers, EOS) is written out."""
        ...


def token_text_of(tokenizer: Tokenizer) -> Callable[[int], str]:
    """How ``tokenizer`` names one token in logprob entries: its ``token_text`` (special tokens written out)
    where it has one, else the token's decoded text."""
    own: Callable[[int], str] | None = getattr(tokenizer, "token_text", None)
    return own if own is not None else lambda token_id: tokenizer.decode([token_id])


def literal_text(tokenizer: Tokenizer, token_ids: Sequence[int]) -> str:
    """``token_ids`` as text with their special tokens written out, where ``tokenizer`` can (``decode_literally``)."""
    literally: Callable[[Sequence[int]], str] | None = getattr(tokenizer, "decode_literally", None)
    return literally(token_ids) if literally is not None else tokenizer.decode(token_ids)


@dataclass(frozen=True)
class TemplateOptions:
    """A chat request's say in how its template renders (vLLM's and SGLang's request fields)."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False  # the prompt ends inside the final message (the model continues it)
    variables: dict[str, Any] | None = None  # ``chat_template_kwargs``: more template variables

    def keywords(self) -> dict[str, Any]:
        return {"add_generation_prompt": self.add_generation_prompt,
                "continue_final_message": self.continue_final_message, "template_kwargs": self.variables}


def render_continuing(render: Callable[[list[dict[str, Any]]], str], messages: list[dict[str, Any]]) -> str:
    """``continue_final_message``: the template's text (``render(messages)``) cut where the final message's
    content ends, found by a mark rendered right after it (the content itself may also occur later in the
    text, in the template's own markup); ValueError when the template does not show it."""
    if not messages:
        raise ValueError("continue_final_message: there is no final message")
    mark = f"\u2063{secrets.token_hex(8)}\u2063"  # (invisible separators around random hex: in no template)
    content = content_text(messages[-1].get("content"))
    core = content.rstrip()
    tail = content[len(core) :]  # (after the mark: a template that trims the content drops it, as it would)
    text = render([*messages[:-1], {**messages[-1], "content": core + mark + tail}])
    at = text.rfind(mark)
    if at < 0:
        raise ValueError("continue_final_message: the chat template does not show the final message's content")
    return text[:at] + (tail if text.startswith(tail, at + len(mark)) else "")


class ByteTokenizer:
    """Token i < 256 is byte i; a few specials above. Used by the sim engine."""

    name = "byte"
    BOS = 256
    EOS = 257
    vocab_size = 258
    eos_token_ids: tuple[int, ...] = (EOS,)

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def apply_chat_template(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True,
                            continue_final_message: bool = False, template_kwargs: dict[str, Any] | None = None,
                            ) -> list[int]:
        """(A fixed template: ``template_kwargs`` has no variable to set in it.)"""
        if continue_final_message:
            return [self.BOS, *self.encode(render_continuing(self._render, messages))]
        return [self.BOS, *self.encode(self._render(messages) + ("<|assistant|>\n" if add_generation_prompt else ""))]

    @staticmethod
    def _render(messages: list[dict[str, Any]]) -> str:
        # (content: a string, most often, as ``content_text`` would give it, without its call)
        return "".join([f"<|{m.get('role', 'user')}|>\n{c if type(c := m.get('content')) is str else content_text(c)}\n"
                        for m in messages])

    def decode(self, token_ids: Sequence[int]) -> str:
        return bytes(t for t in token_ids if 0 <= t < 256).decode("utf-8", errors="replace")

    def token_bytes(self, token_id: int) -> bytes | None:
        """The byte a token stands for (logprob entries' ``bytes``: one byte of a multi-byte character)."""
        return bytes((token_id,)) if 0 <= token_id < 256 else None

    def decoder(self, context: Sequence[int] = (), *, skip_special_tokens: bool = True) -> IncrementalDecoder:
        return _ByteDecoder()  # (a byte's text does not depend on what came before it; BOS and EOS have none)


class _ByteDecoder:
    """UTF-8 over the byte ids, keeping an incomplete character's bytes for the next push (what
    ``codecs``' incremental decoder does, without its Python layer: this runs once per streamed token)."""

    __slots__ = ("_pending",)

    def __init__(self) -> None:
        self._pending = b""

    def push(self, token_ids: Sequence[int]) -> str:
        try:
            data = bytes(token_ids)  # every id a byte: the common case, without a Python loop
        except ValueError:
            data = bytes(t for t in token_ids if 0 <= t < 256)
        if self._pending:
            data = self._pending + data
        elif data.isascii():  # (ASCII alone, nothing held: whole characters, nothing to hold back)
            return data.decode()
        text, used = _utf8_decode(data, "replace", False)
        self._pending = data[used:] if used < len(data) else b""
        return text

    def flush(self) -> str:
        if not self._pending:  # (what decoding nothing gives)
            return ""
        text = _utf8_decode(self._pending, "replace", True)[0]
        self._pending = b""
        return text


_utf8_decode = codecs.utf_8_decode


def content_text(content: object) -> str:
    """OpenAI message content: a string, or a list of parts of which text parts are kept."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if isinstance(part, dict) and part.get("type") == "text":
                texts.append(str(part.get("text", "")))
        return "".join(texts)
    raise ValueError("message content must be a string or a list of content parts")


def tokenizer_digest(spec: str) -> str:
    """A short digest of what decides the text a ``load_tokenizer(spec)`` tokenizer makes of token ids
    (``"byte"``, or a hash of the directory's ``tokenizer.json``: its vocabulary, added tokens and
    decoder); "" if it cannot be read. A gateway and a decode whose digests differ may see different
    text for the same output, so the gateway does not let such a decode stop at stop strings
    (``HelloAck.tokenizer_digest``)."""
    if spec == "byte":
        return "byte"
    try:
        with open(os.path.join(spec, "tokenizer.json"), "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()[:32]
    except OSError:
        return ""


def load_tokenizer(spec: str) -> Tokenizer:
    if spec == "byte":
        return ByteTokenizer()
    from gateway.hf_tokenizer import HFTokenizer  # heavy import, only for real models

    return HFTokenizer.from_dir(spec)
