"""``HFTokenizer``: a model directory's ``tokenizer.json`` + chat template behind our ``Tokenizer`` protocol.

Runtime deps are ``tokenizers`` and ``jinja2`` only (no transformers). The directory holds:
- ``tokenizer.json`` (required): the fast tokenizer, including its post-processor (BOS, if any).
- ``tokenizer_config.json`` (optional): ``bos_token``/``eos_token``/``pad_token``/``unk_token``,
  ``chat_template`` (a string, or a list of ``{name, template}`` where ``default`` is used).
- ``special_tokens_map.json`` (optional): the special tokens of a config without ``added_tokens_decoder`` (one
  saved before transformers 4.34), which it overrides, as transformers reads them.
- ``chat_template.jinja`` (optional): the template as a file; preferred when present.
- ``generation_config.json`` / ``config.json`` (optional): more EOS ids.

Templates render in jinja2's immutable sandbox with ``messages``, ``add_generation_prompt`` (True unless
the request says otherwise), the special tokens (``bos_token``, ``eos_token``, ...), the request's
``chat_template_kwargs``, ``tools`` where given, ``raise_exception`` and ``strftime_now``;
the rendered text is encoded without adding special tokens again (the template wrote them).
"""

from __future__ import annotations

import codecs
import functools
import json
import logging
import os
import re
import threading
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from tokenizers.decoders import DecodeStream

from gateway.tokenizer import IncrementalDecoder, content_text, render_continuing

REPLACEMENT_CHAR = "\ufffd"
# Ids an incremental decoder holds back while their text ends mid-character: a UTF-8 character is at most
# 4 bytes, so at most 3 tokens of one can be waiting for the next. A longer held run that still ends in U+FFFD
# is bytes that never make a character (garbled output, lone bytes a logit_bias forced): its text goes out
# (as U+FFFD), all but the last ``HELD_TAIL`` ids, rather than the whole growing run being decoded per token.
MAX_HELD_IDS = 8
HELD_TAIL = 4
_utf8_decode = codecs.utf_8_decode
log = logging.getLogger(__name__)


class TokenizerLoadError(ValueError):
    """A tokenizer directory that cannot be used (missing or malformed files)."""


class HFTokenizer:
    """A Hugging Face fast tokenizer plus its chat template."""

    def __init__(
        self,
        tokenizer: Any,
        *,
        name: str,
        chat_template: str | None,
        special_tokens: dict[str, str | None],
        eos_token_ids: tuple[int, ...],
    ) -> None:
        self._tok = tokenizer
        self.name = name
        self.chat_template = chat_template
        self.special_tokens = special_tokens
        self.eos_token_ids = eos_token_ids
        self.vocab_size: int = tokenizer.get_vocab_size(with_added_tokens=True)
        self._template: Any = None
        self._token_texts: dict[int, str] = {}  # id -> token_text(id) (at most the vocabulary)
        self._pieces = PieceEncoder.of(tokenizer)  # (None: this tokenizer's chats are encoded whole)
        # Byte fallback (SentencePiece's ``<0x00>``..``<0xFF>`` pieces): only those pieces are parts of characters
        self.byte_fallback = all(tokenizer.token_to_id(f"<0x{b:02X}>") is not None for b in (0x00, 0x80, 0xFF))
        # The special tokens a decode that skips them leaves out (before its decoder runs: the same text); asked of
        # the decode itself (a "normalized" special token behind a prepending normalizer is written out all the
        # same): one missed is only decoded, as it was before
        self.skipped_ids = frozenset(i for i, t in tokenizer.get_added_tokens_decoder().items()
                                     if t.special and tokenizer.decode([i], skip_special_tokens=True) == "")

    @classmethod
    def from_dir(cls, path: str) -> HFTokenizer:
        from tokenizers import Tokenizer

        tok_file = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(tok_file):
            raise TokenizerLoadError(f"{path!r} has no tokenizer.json")
        try:
            tokenizer = Tokenizer.from_file(tok_file)
        except Exception as exc:
            raise TokenizerLoadError(f"cannot load {tok_file}: {exc}") from exc
        config = _read_json(os.path.join(path, "tokenizer_config.json"))
        special = {key: _token_text(config.get(key)) for key in ("bos_token", "eos_token", "pad_token", "unk_token")}
        if "added_tokens_decoder" not in config:  # a config saved before transformers 4.34: as transformers loads
            # it, ``special_tokens_map.json`` says the special tokens (the template's ``bos_token``, the EOS id)
            for key, value in _read_json(os.path.join(path, "special_tokens_map.json")).items():
                if key in special and _token_text(value) is not None:
                    special[key] = _token_text(value)
        template = _chat_template(path, config)
        eos_ids: list[int] = []
        eos_text = special["eos_token"]
        if eos_text is not None:
            eos_id = tokenizer.token_to_id(eos_text)
            if eos_id is not None:
                eos_ids.append(eos_id)
        for extra in ("generation_config.json", "config.json"):
            value = _read_json(os.path.join(path, extra)).get("eos_token_id")
            for item in value if isinstance(value, list) else [value]:
                if isinstance(item, int) and not isinstance(item, bool) and item not in eos_ids:
                    eos_ids.append(item)
        return cls(
            tokenizer,
            name=os.path.abspath(path),
            chat_template=template,
            special_tokens=special,
            eos_token_ids=tuple(eos_ids),
        )

    # -- Tokenizer protocol -------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        return encode_ids(self._tok, text, True)

    def apply_chat_template(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None, *,
                            add_generation_prompt: bool = True, continue_final_message: bool = False,
                            template_kwargs: dict[str, Any] | None = None) -> list[int]:
        if continue_final_message:
            text = render_continuing(lambda marked: self.render_chat(marked, False, tools, template_kwargs), messages)
        else:
            text = self.render_chat(messages, add_generation_prompt, tools, template_kwargs)
        if self._pieces is not None:
            return self._pieces.encode(text)
        return encode_ids(self._tok, text, False)

    def decode(self, token_ids: Sequence[int]) -> str:
        """The text of ``token_ids`` as an answer shows it: special tokens (EOS, chat markers) left out."""
        text: str = self._tok.decode(list(token_ids), skip_special_tokens=True)
        return text

    def decode_literally(self, token_ids: Sequence[int]) -> str:
        """The text of ``token_ids`` with their special tokens written out (an echoed prompt of token ids)."""
        text: str = self._tok.decode(list(token_ids), skip_special_tokens=False)
        return text

    def token_text(self, token_id: int) -> str:
        """One token's own text (logprob entries: every token, every alternative), a special one's written
        out (``<|im_end|>``, as vLLM shows it; left out it was an empty string)."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._tok.decode([token_id], skip_special_tokens=False)
            piece = self._tok.id_to_token(token_id)
            if piece is not None and piece.startswith("\u2581") and not text.startswith(" "):
                # A SentencePiece word's space ("▁Paris"), which a Metaspace decoder drops from the first
                # token of what it decodes: the entries' tokens join to the answer's text, as vLLM's do.
                text = " " + text
            self._token_texts[token_id] = text
        return text

    def token_bytes(self, token_id: int) -> bytes | None:
        """The bytes a token stands for, where the vocabulary tells them: a byte-level BPE piece (GPT-2's
        printable stand-ins for bytes) or a byte-fallback piece (``<0x9F>``); else None."""
        piece = self._tok.id_to_token(token_id)
        if piece is None:
            return None
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            try:
                return bytes([int(piece[3:5], 16)])
            except ValueError:
                return None
        table = _unicode_to_byte()
        if all(c in table for c in piece):
            return bytes(table[c] for c in piece)
        return None

    def decoder(self, context: Sequence[int] = (), *, skip_special_tokens: bool = True) -> IncrementalDecoder:
        return HFIncrementalDecoder(self, context, skip_special_tokens)

    # -- helpers ------------------------------------------------------------------------------
    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    tools: list[dict[str, Any]] | None = None, variables: dict[str, Any] | None = None) -> str:
        """The chat template's text for ``messages`` (content parts flattened to their text); ``variables``:
        more template variables (a request's ``chat_template_kwargs``; they may replace the special tokens')."""
        if self.chat_template is None:
            raise ValueError(f"tokenizer {self.name!r} has no chat template")
        if self._template is None:
            self._template = _compile_template(self.chat_template)
        normalized = []
        for message in messages:
            if not isinstance(message, dict):
                raise ValueError("each chat message must be an object")
            item = dict(message)
            item["content"] = content_text(message.get("content"))
            normalized.append(item)
        specials = {k: (v if v is not None else "") for k, v in self.special_tokens.items()}
        context: dict[str, Any] = dict(specials)
        if variables:
            context.update(variables)
        if tools is not None:  # (templates that know tools; gateway/tool_calls.py)
            context["tools"] = tools
        return str(self._template.render(messages=normalized, add_generation_prompt=add_generation_prompt, **context))

    def token_to_id(self, token: str) -> int | None:
        result: int | None = self._tok.token_to_id(token)
        return result


LONG_TEXT = 1 << 14  # characters


def encode_ids(tokenizer: Any, text: str, add_special_tokens: bool) -> list[int]:
    """``tokenizer.encode(text).ids``; a long text through ``encode_batch``, which lets other threads run while it
    works: ``encode`` can hold the interpreter's lock for the whole text (measured: a 2 MB prompt, prepared on a
    thread, stopped the event loop for 7 s, every stream and probe with it)."""
    if len(text) > LONG_TEXT:
        batch: list[int] = tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        return batch
    ids: list[int] = tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
    return ids


class PieceEncoder:
    """``encode(text, add_special_tokens=False)`` as its pieces between added tokens, each piece's ids
    kept for the next request that has it.

    A chat's rendered prompt repeats most of its text from one request to the next: the system
    prompt, the template's markup and, in a conversation, every earlier turn; encoding it whole costs
    about 0.8 µs per token on the event loop (36 µs for SmolLM2's 40-token one-line chat). A tokenizer
    splits its input at added tokens (``<|im_start|>``...) before anything else and encodes the text
    between them on its own, so that text's ids can be kept, and a request encodes only what is new
    (the last message). Used only for a tokenizer whose added tokens split exactly that way (matched
    in the raw text, longest first; no ``lstrip``/``rstrip``/``single_word``; not normalized, or no
    normalizer), and whose pieces' ids equal the whole encode on probe texts at load (``of``).

    Bounded: at most ``max_tokens`` ids are kept, the least recently used pieces leave first, and a
    piece longer than that is encoded but not kept. Thread-safe: the event loop and the threads that
    prepare long prompts (``gateway.responder``) share it.
    """

    __slots__ = ("_added", "_cache", "_encode", "_lock", "_split", "max_tokens", "size")

    def __init__(self, tokenizer: Any, added: dict[str, int], max_tokens: int = 1 << 18) -> None:
        self._encode = functools.partial(encode_ids, tokenizer)
        self._added = added
        alternatives = "|".join(re.escape(token) for token in sorted(added, key=len, reverse=True))
        self._split = re.compile(f"({alternatives})").split  # text, token, text, ..., text
        self._cache: dict[str, list[int]] = {}  # piece -> its ids, least recently used first
        self._lock = threading.Lock()  # (a long prompt is prepared on a thread: ``gateway.responder``)
        self.max_tokens = max_tokens
        self.size = 0  # ids kept

    @classmethod
    def of(cls, tokenizer: Any) -> PieceEncoder | None:
        """A ``PieceEncoder`` for ``tokenizer`` (a ``tokenizers.Tokenizer``), or None where its pieces
        might not encode as the whole text does."""
        added: dict[str, int] = {}
        for token_id, token in tokenizer.get_added_tokens_decoder().items():
            if token.lstrip or token.rstrip or token.single_word or (token.normalized and tokenizer.normalizer):
                log.info("tokenizer: added token %r is not matched as itself; chats are encoded whole",
                         token.content)
                return None
            added[token.content] = token_id
        if not added:
            return None  # (one piece: nothing to split, nothing shared to keep)
        encoder = cls(tokenizer, added)
        samples = list(added)[:8]
        probes = ["", " leading space", "Hello, world! 123 4567 ünïcödé 東京 🎉\n\n  x"]
        probes += [f"{a}text {b}\n{a}{b}  y{a}" for a, b in zip(samples, [*samples[1:], samples[0]], strict=True)]
        probes.append("say: " + "".join(samples) + " done")
        for probe in probes:
            whole = tokenizer.encode(probe, add_special_tokens=False).ids
            if encoder.encode(probe) != whole:
                log.warning("tokenizer: its text between added tokens does not encode on its own as in the "
                            "whole (probe %r); chats are encoded whole", probe)
                return None
        encoder.clear()
        return encoder

    def encode(self, text: str) -> list[int]:
        parts = self._split(text)
        ids: list[int] = []
        cache, added, lock = self._cache, self._added, self._lock
        for i, part in enumerate(parts):
            if i & 1:  # an added token
                ids.append(added[part])
            elif part:
                with lock:
                    piece = cache.pop(part, None)
                    if piece is not None:
                        cache[part] = piece  # (put back last: the most recently used)
                if piece is None:  # (encoded outside the lock: a long piece lets other threads run meanwhile)
                    piece = self._encode(part, False)
                    self._keep(part, piece)
                ids += piece
        return ids

    def _keep(self, part: str, piece: list[int]) -> None:
        if len(piece) > self.max_tokens:
            return
        cache = self._cache
        with self._lock:
            if part in cache:  # (kept meanwhile by another thread)
                return
            self.size += len(piece)
            while self.size > self.max_tokens:
                self.size -= len(cache.pop(next(iter(cache))))
            cache[part] = piece

    def clear(self) -> None:
        with self._lock:
            self._cache.clear()
            self.size = 0


def _whole_characters(tokenizer: HFTokenizer, context: list[int]) -> list[int]:
    """The longest suffix of ``context`` whose text is whole characters; [] for a prompt ending mid-character
    (every suffix then decodes to a trailing U+FFFD). The window itself may begin mid-character: byte
    fallback decodes a run with a cut character as U+FFFD throughout, though the prompt ends whole."""
    if not context or not tokenizer.decode(context).endswith(REPLACEMENT_CHAR):
        return context
    for start in range(1, len(context)):
        if REPLACEMENT_CHAR not in tokenizer.decode(context[start:]):
            return context[start:]
    return []


class HFIncrementalDecoder:
    """Streams text for growing token ids, holding back bytes of an unfinished UTF-8 character.

    Byte-level tokens can split one character across tokens; decoding such a prefix yields U+FFFD.
    The text since the last emitted boundary is decoded again with the new ids, and only text that
    no longer ends in U+FFFD is emitted; ``flush()`` emits whatever remains (as the whole decode
    does, an unfinished character as U+FFFD).

    ``tokenizers``' own ``DecodeStream`` (Rust) runs that algorithm in one call per push: a streamed
    token costs about a third of decoding the window twice from Python (0.6 against 1.9 µs with
    SmolLM2's tokenizer). The window is kept here too, for ``flush`` and as the fallback: after a
    push the stream refuses (its check that the window's new text extends what it emitted failed)
    the Python algorithm carries on from the same boundary, so the text is the same either way.
    """

    __slots__ = ("_decode", "_ids", "_piece", "_prefix", "_raw", "_read", "_skipped", "_stream")

    def __init__(self, tokenizer: HFTokenizer, context: Sequence[int] = (), skip_special_tokens: bool = True) -> None:
        # (``skip_special_tokens=False``: special tokens' text written out, as ``decode_literally`` writes it)
        self._decode = tokenizer.decode if skip_special_tokens else tokenizer.decode_literally
        # Skipped special tokens never enter the window (their text is none): a run of them (EOS after EOS under
        # ignore_eos) would otherwise be decoded again with every push
        self._skipped = tokenizer.skipped_ids if skip_special_tokens and tokenizer.skipped_ids else None
        self._raw = tokenizer._tok  # (``tokenizers.Tokenizer``, what ``DecodeStream.step`` takes)
        # (``_past_held``: a byte-fallback tokenizer's pieces, whole characters but for ``<0x9F>``...; else None)
        self._piece = tokenizer._tok.id_to_token if tokenizer.byte_fallback else None
        ids = _whole_characters(tokenizer, list(context))  # (``gateway.tokenizer``: the text before, never emitted)
        self._stream: DecodeStream | None = DecodeStream(ids=ids or None, skip_special_tokens=skip_special_tokens)
        self._ids = ids
        self._prefix = 0  # window start: ids before it are fully emitted
        self._read = len(ids)  # ids up to here are reflected in emitted text

    def push(self, token_ids: Sequence[int]) -> str:
        skipped = self._skipped
        if skipped is not None and not skipped.isdisjoint(token_ids):
            token_ids = [t for t in token_ids if t not in skipped]
            if not token_ids:
                return ""
        ids = self._ids
        ids.extend(token_ids)
        stream = self._stream
        if stream is not None:
            try:  # (one id as an int: a one-item list takes its slower path)
                text = stream.step(self._raw, token_ids[0] if len(token_ids) == 1 else list(token_ids))
            except Exception as exc:  # (its DecodeStreamError and kin: not worth failing a stream over)
                log.debug("DecodeStream refused a push (%s); decoding this stream in Python", exc)
                self._stream = None
            else:
                if text is not None:
                    self._prefix, self._read = self._read, len(ids)
                    return text
                if len(ids) - self._read <= MAX_HELD_IDS:
                    return ""
                self._stream = None  # (a run that is no character: its own window would go on growing)
        prefix_text = self._decode(ids[self._prefix : self._read])
        full_text = self._decode(ids[self._prefix :])
        if len(full_text) > len(prefix_text) and not full_text.endswith(REPLACEMENT_CHAR):
            new = full_text[len(prefix_text) :]
            self._prefix = self._read
            self._read = len(ids)
            return new
        if len(ids) - self._read > MAX_HELD_IDS and full_text.endswith(REPLACEMENT_CHAR):
            return self._past_held(prefix_text, full_text)
        return ""

    def _past_held(self, prefix_text: str, full_text: str) -> str:
        """A held run longer than ``MAX_HELD_IDS`` (``full_text``, its window's text, ends in U+FFFD): the text up
        to where its unfinished character begins (among the last ``HELD_TAIL - 1`` ids) goes out, the window
        moving past it; only those ids stay held. The cut: the last one whose text ends in a whole character (a
        push of several ids that ends inside one); else the last whose text the window's extends (byte-level
        tokens: a character is never split); else, ``HELD_TAIL`` ids from the end (bytes that make nothing)."""
        ids, start, end = self._ids, self._prefix, len(self._ids)
        candidates = [(cut, self._decode(ids[start:cut])) for cut in range(end - 1, end - HELD_TAIL, -1)]
        found = next(((cut, text) for cut, text in candidates
                      if len(text) > len(prefix_text) and not text.endswith(REPLACEMENT_CHAR)), None)
        if found is None:  # (a text ending in U+FFFD as a character of its own: the model wrote "\ufffd")
            found = next(((cut, text) for cut, text in candidates
                          if len(text) > len(prefix_text) and self._ends_whole_bytes(start, cut)), None)
        if found is None:
            found = next(((cut, text) for cut, text in candidates
                          if len(prefix_text) < len(text) < len(full_text) and full_text.startswith(text)), None)
        if found is None:
            found = end - HELD_TAIL, self._decode(ids[start : end - HELD_TAIL])
        cut, text = found
        self._prefix, self._read = self._read, cut
        return text[len(prefix_text) :]

    def _ends_whole_bytes(self, start: int, cut: int) -> bool:
        """Whether ``ids[start:cut]`` ends on a character boundary, a byte-fallback tokenizer's (False for others):
        after a piece of its own (a literal U+FFFD among them), or after a run of byte pieces (``<0xE6>``...) that
        is whole UTF-8 characters. Byte fallback decodes a run that is not as U+FFFD byte for byte, its whole
        characters too: a window cut inside a character says U+FFFD for the characters before it in the run, so
        that the cut cannot be told by the text (a text ending in U+FFFD: a character the model wrote, too)."""
        piece_of = self._piece
        if piece_of is None:
            return False
        data = bytearray()
        for token_id in reversed(self._ids[start:cut]):
            piece = piece_of(token_id)
            if piece is None or len(piece) != 6 or not piece.startswith("<0x") or not piece.endswith(">"):
                break
            try:
                data.insert(0, int(piece[3:5], 16))
            except ValueError:
                break
        return _utf8_decode(bytes(data), "replace", False)[1] == len(data)

    def flush(self) -> str:
        ids = self._ids
        if self._read == len(ids):
            return ""
        prefix_text = self._decode(ids[self._prefix : self._read])
        full_text = self._decode(ids[self._prefix :])
        self._prefix = self._read = len(ids)
        self._stream = None  # (nothing is pushed after a flush)
        return full_text[len(prefix_text) :]


@functools.cache
def _unicode_to_byte() -> dict[str, int]:
    """Byte-level BPE's alphabet (GPT-2's ``bytes_to_unicode``), inverted: a printable character per byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {chr(b): b for b in printable}
    extra = 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + extra)] = b
            extra += 1
    return table


def _compile_template(source: str) -> Any:
    from jinja2 import TemplateError, nodes
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationBlock(Extension):
        """``{% generation %}...{% endgeneration %}`` (transformers' assistant-mask marker, which fine-tunes'
        templates carry): its body, as transformers renders it when no mask is asked for."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.Scope(body).set_lineno(lineno)

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
               sort_keys: bool = False) -> str:  # (transformers' filter: templates pass these, e.g. GLM's, Kimi's)
        if isinstance(separators, list):
            separators = tuple(separators)
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols", GenerationBlock])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(source)


def _chat_template(path: str, config: dict[str, Any]) -> str | None:
    jinja_file = os.path.join(path, "chat_template.jinja")
    if os.path.isfile(jinja_file):
        with open(jinja_file, encoding="utf-8") as f:
            return f.read()
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):  # serialized AddedToken
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: str) -> dict[str, Any]:
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as exc:
        raise TokenizerLoadError(f"cannot read {path}: {exc}") from exc
    return data if isinstance(data, dict) else {}
