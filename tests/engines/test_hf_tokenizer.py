"""HFTokenizer: tokenizer.json + chat template via tokenizers/jinja2, checked against transformers."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from gateway.hf_tokenizer import HFTokenizer, PieceEncoder, TokenizerLoadError
from gateway.tokenizer import DECODE_CONTEXT_TOKENS, load_tokenizer

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


def test_a_template_refusing_the_messages_is_the_clients_400(tmp_path, tiny_tokenizer_dir) -> None:
    """A template that refuses what it is given (Gemma's "System role not supported", Mistral's "roles must
    alternate") answers the client 400 naming ``messages``, not a 500."""
    import msgspec

    from gateway.api import Frontend
    from gateway.api_models import ChatCompletionRequest
    from gateway.errors import BadRequest

    (tmp_path / "tokenizer.json").write_bytes((Path(tiny_tokenizer_dir) / "tokenizer.json").read_bytes())
    template = ("{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
                "{% endif %}{% for m in messages %}{{ m['content'] }}{% endfor %}")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    frontend = Frontend(None, HFTokenizer.from_dir(str(tmp_path)), "m", 8192)  # type: ignore[arg-type]
    request = msgspec.convert({"messages": [{"role": "system", "content": "Be brief."},
                                            {"role": "user", "content": "hi"}]}, ChatCompletionRequest)
    with pytest.raises(BadRequest, match="System role not supported") as info:
        frontend.prepare_chat(request)
    assert info.value.status == 400 and info.value.param == "messages"
    user_only = msgspec.convert({"messages": [{"role": "user", "content": "hi"}]}, ChatCompletionRequest)
    assert frontend.prepare_chat(user_only).input_ids


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


def _llama_style_tokenizer() -> HFTokenizer:
    """A SentencePiece-style tokenizer (the Llama family's decoder pipeline): ``▁`` for spaces, byte
    fallback for characters outside its small vocabulary, and a decoder that strips the leading space
    of whatever it decodes, so that a window decodes differently from the same ids in context."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for byte in range(256):
        vocab[f"<0x{byte:02X}>"] = len(vocab)
    for ch in "▁abcdefghijklmnopqrstuvwxyzT.,!?":
        vocab.setdefault(ch, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens(["<s>", "</s>"])
    return HFTokenizer(tok, name="llama-style", chat_template=None, special_tokens={}, eos_token_ids=(2,))


@pytest.mark.parametrize("prompt, answer", [("東東", " é"), ("é東", " ab"), ("x東", " é"), ("東", " a")])
def test_a_context_window_cut_mid_character_keeps_the_answers_leading_space(prompt: str, answer: str) -> None:
    """The prompt's last ids begin inside a byte-fallback character (its bytes decode to U+FFFD run-wide),
    yet the prompt ends whole: the answer's first space stays, as in the whole decode (the worker's stop
    strings read the same decoder)."""
    tok = _llama_style_tokenizer()
    prompt_ids, answer_ids = tok.encode(prompt), tok._tok.encode(answer, add_special_tokens=False).ids
    want = tok.decode(prompt_ids + answer_ids)[len(tok.decode(prompt_ids)):]
    assert want.startswith(" ")
    decoder = tok.decoder(prompt_ids[-DECODE_CONTEXT_TOKENS:])
    assert decoder.push(answer_ids) + decoder.flush() == want


def test_a_prompt_ending_mid_character_still_drops_its_context() -> None:
    tok = _llama_style_tokenizer()
    ids = tok.encode("ab東")[:-1]  # the last byte of 東 missing
    decoder = tok.decoder(ids[-DECODE_CONTEXT_TOKENS:])
    answer = tok._tok.encode(" a", add_special_tokens=False).ids
    assert decoder.push(answer) + decoder.flush() == tok.decode(answer)


def _pieces(tok: HFTokenizer, ids: list[int], splits: list[int], *, python_only: bool = False,
            stream: object = None) -> list[str]:
    dec = tok.decoder()
    if python_only:
        dec._stream = None  # type: ignore[attr-defined]
    elif stream is not None:
        dec._stream = stream  # type: ignore[attr-defined]
    pieces, i = [], 0
    for size in splits:
        pieces.append(dec.push(ids[i:i + size]))
        i += size
    return [*pieces, dec.flush()]


def _random_splits(rng: random.Random, n: int) -> list[int]:
    splits = []
    while sum(splits) < n:
        splits.append(rng.choice([1, 1, 1, 2, 3, 5]))
    return splits


@pytest.mark.parametrize("family", ["byte-level", "llama-style"])
def test_incremental_decoder_over_any_split_equals_the_python_window_and_the_whole_decode(
        tiny_tokenizer_dir, family) -> None:
    """The decoder (``tokenizers``' ``DecodeStream``) emits the same pieces at the same pushes as the
    Python window algorithm, over any split of the ids into pushes, and together with the flush the
    whole decode's text: characters split across tokens, a character cut off at the end (U+FFFD, as
    the whole decode), special tokens skipped, and a decoder that strips a window's leading space."""
    tok = HFTokenizer.from_dir(tiny_tokenizer_dir) if family == "byte-level" else _llama_style_tokenizer()
    rng = random.Random(11)
    texts = [*TEXTS, "a b  c. Tomorrow, ünïcödé and 東京 🎉 again!", " leading space", "trailing é"]
    checked_cut = False
    for text in texts:
        full = tok.encode(text)
        special = tok.encode("<|im_end|>" if family == "byte-level" else "</s>")
        cut = full[:-1]
        for ids in (full, cut, [*full[:3], *special, *full[3:]]):
            for _ in range(20):
                splits = _random_splits(rng, len(ids))
                pieces = _pieces(tok, ids, splits)
                assert pieces == _pieces(tok, ids, splits, python_only=True)
                if ids is cut and family == "llama-style" and "\ufffd" in tok.decode(ids):
                    # Byte fallback decodes a run of byte tokens that is not valid UTF-8 as one U+FFFD
                    # per byte, complete characters of the run included, where the pushes emitted
                    # those characters as they completed: what was pushed is the text's start.
                    assert tok.decode(full).startswith("".join(pieces[:-1]))
                    checked_cut = True
                else:
                    assert "".join(pieces) == tok.decode(ids)
                    checked_cut |= "\ufffd" in pieces[-1]
    assert checked_cut  # (some cut-off id list ended inside a character)


def test_a_push_the_stream_refuses_carries_on_in_python(tiny_tokenizer_dir) -> None:
    """A ``DecodeStream`` that raises on a push (its prefix check) hands the stream to the Python
    algorithm from the same boundary: the pieces are those of a decoder that never used it."""
    from tokenizers.decoders import DecodeStream

    class Refusing:
        def __init__(self, fail_at: int) -> None:
            self.stream, self.calls, self.fail_at = DecodeStream(skip_special_tokens=True), 0, fail_at

        def step(self, tokenizer: object, ids: object) -> str | None:
            self.calls += 1
            if self.calls == self.fail_at:
                raise Exception("Invalid prefix encountered")
            return self.stream.step(tokenizer, ids)  # type: ignore[arg-type]

    tok = HFTokenizer.from_dir(tiny_tokenizer_dir)
    ids = tok.encode("Emoji: 😀 👍🏽 🎉 and flags 🇫🇷 — mixed with ünïcödé")
    splits = _random_splits(random.Random(3), len(ids))
    expected = _pieces(tok, ids, splits, python_only=True)
    for fail_at in range(1, len(splits) + 1):
        refusing = Refusing(fail_at)
        assert _pieces(tok, ids, splits, stream=refusing) == expected
        assert refusing.calls == fail_at  # (not asked again after it refused)


def _metaspace_first_tokenizer() -> HFTokenizer:
    """A tokenizer whose text after an added token encodes differently from the same text alone (its
    pre-tokenizer marks only the very start of the input with ``▁``)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    llama = _llama_style_tokenizer()._tok
    tok = Tokenizer(models.BPE(vocab=llama.get_vocab(), merges=[], unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    tok.add_special_tokens(["<s>", "</s>"])
    return HFTokenizer(tok, name="metaspace-first", chat_template=None, special_tokens={}, eos_token_ids=(2,))


def _chat_texts(tok: HFTokenizer, rng: random.Random) -> list[str]:
    """Texts as a chat template renders them: added tokens between pieces of text, pieces repeated."""
    added = list(tok._tok.get_added_tokens_decoder().values())
    words = ["system", "user\n", "You are helpful.", " ", "\n\n", "ünïcödé 東京 🎉", "12 345", "x", "  y  ", ""]
    texts = []
    for _ in range(60):
        parts = [rng.choice(words) + rng.choice(words) if rng.random() < 0.7 else rng.choice(added).content
                 for _ in range(rng.randint(1, 9))]
        texts.append("".join(parts))
    return texts


@pytest.mark.parametrize("family", ["byte-level", "llama-style", "smollm2"])
def test_chats_encoded_by_pieces_equal_the_whole_encode(tiny_tokenizer_dir, request, family) -> None:
    """``apply_chat_template`` through ``PieceEncoder`` (the text between added tokens encoded, and
    kept, piece by piece) gives the ids of encoding the rendered text whole, on first sight and from
    the kept pieces, for a byte-level BPE, a SentencePiece-style tokenizer with a normalizer, and
    SmolLM2's; a caller changing the ids it got changes nothing kept."""
    if family == "smollm2":
        tok = HFTokenizer.from_dir(request.getfixturevalue("smollm2_dir"))
    else:
        tok = HFTokenizer.from_dir(tiny_tokenizer_dir) if family == "byte-level" else _llama_style_tokenizer()
    pieces = tok._pieces
    assert pieces is not None
    for text in _chat_texts(tok, random.Random(5)):
        whole = tok._tok.encode(text, add_special_tokens=False).ids
        first = pieces.encode(text)
        assert first == whole
        first.append(-1)
        assert pieces.encode(text) == whole  # (from the kept pieces now)
    if tok.chat_template is not None:
        messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "東京は? 🇫🇷"},
                    {"role": "assistant", "content": "Tokyo is 東京."}, {"role": "user", "content": "And 2+2?"}]
        for _ in range(2):
            assert tok.apply_chat_template(messages) == tok._tok.encode(tok.render_chat(messages),
                                                                        add_special_tokens=False).ids


def test_a_tokenizer_whose_pieces_encode_differently_is_encoded_whole() -> None:
    """Where the text after an added token encodes differently on its own (found by the probes at
    load), or an added token is not matched as itself (``rstrip``), chats are encoded whole."""
    from tokenizers import AddedToken

    tok = _metaspace_first_tokenizer()
    assert tok._tok.encode("a</s>b", add_special_tokens=False).ids != \
        tok._tok.encode("a</s>", add_special_tokens=False).ids + tok._tok.encode("b", add_special_tokens=False).ids
    assert tok._pieces is None
    stripping = _llama_style_tokenizer()._tok
    stripping.add_special_tokens([AddedToken("<sep>", rstrip=True)])
    assert PieceEncoder.of(stripping) is None
    assert PieceEncoder.of(_llama_style_tokenizer()._tok) is not None


def test_kept_pieces_are_bounded_and_the_least_recently_used_leave_first(tiny_tokenizer_dir) -> None:
    tok = HFTokenizer.from_dir(tiny_tokenizer_dir)
    pieces = tok._pieces
    assert pieces is not None
    hot = "You are a helpful assistant."
    size = len(tok._tok.encode(hot, add_special_tokens=False).ids)
    size += 2 * len(tok._tok.encode("user question 10 with some words", add_special_tokens=False).ids)
    pieces.max_tokens = size + 2  # the hot piece and two questions
    for i in range(30):
        text = f"<|im_start|>{hot}<|im_end|><|im_start|>user question {i} with some words<|im_end|>"
        assert pieces.encode(text) == tok._tok.encode(text, add_special_tokens=False).ids
        assert pieces.size <= pieces.max_tokens
        assert hot in pieces._cache  # used by every request: never the least recently used
    assert "user question 29 with some words" in pieces._cache
    assert "user question 27 with some words" not in pieces._cache
    too_long = "word " * pieces.max_tokens
    assert pieces.encode(too_long) == tok._tok.encode(too_long, add_special_tokens=False).ids
    assert too_long not in pieces._cache and pieces.size <= pieces.max_tokens


def test_one_token_decodes_as_itself_first_and_from_the_kept_text(tiny_tokenizer_dir) -> None:
    tok = HFTokenizer.from_dir(tiny_tokenizer_dir)
    ids = [*tok.encode("Emoji: 😀 and ünïcödé"), *tok.encode("<|im_end|>")]
    expected = [tok._tok.decode([i], skip_special_tokens=True) for i in ids]
    assert [tok.decode([i]) for i in ids] == expected == [tok.decode([i]) for i in ids]
    assert expected[-1] == "" and "\ufffd" in "".join(expected)  # (a special token; a piece of a character)
    assert tok.decode(ids) == "Emoji: 😀 and ünïcödé"


def test_tokenizer_digest_follows_the_tokenizer_file(tmp_path, tiny_tokenizer_dir) -> None:
    """``tokenizer_digest``: equal for a byte-identical copy elsewhere (another host's copy of the model),
    different once ``tokenizer.json`` differs; "" when there is none to read."""
    import shutil

    from gateway.tokenizer import tokenizer_digest

    assert tokenizer_digest("byte") == "byte"
    copy, edited = tmp_path / "copy", tmp_path / "edited"
    shutil.copytree(tiny_tokenizer_dir, copy)
    shutil.copytree(tiny_tokenizer_dir, edited)
    data = json.loads((edited / "tokenizer.json").read_text())
    (edited / "tokenizer.json").write_text(json.dumps(data, indent=3))
    digest = tokenizer_digest(str(tiny_tokenizer_dir))
    assert len(digest) == 32 and tokenizer_digest(str(copy)) == digest
    assert tokenizer_digest(str(edited)) not in (digest, "")
    assert tokenizer_digest(str(tmp_path / "nowhere")) == ""


def test_template_options_match_transformers(tiny_tokenizer_dir, tmp_path) -> None:
    """``add_generation_prompt``, ``continue_final_message`` and template variables (a request's
    ``chat_template_kwargs``) render as transformers renders them."""
    import shutil

    transformers = pytest.importorskip("transformers")
    shutil.copytree(tiny_tokenizer_dir, tmp_path, dirs_exist_ok=True)
    (tmp_path / "chat_template.jinja").write_text(
        "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
        "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}{% endif %}")
    ref = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    tok = HFTokenizer.from_dir(str(tmp_path))
    messages = [{"role": "user", "content": "Name a capital."}, {"role": "assistant", "content": "The capital of "}]

    def expected(**kwargs: object) -> list[int]:
        ids = ref.apply_chat_template(messages, tokenize=True, **kwargs)
        return list(ids if isinstance(ids, list) else ids["input_ids"])

    cases = [({"add_generation_prompt": False}, {"add_generation_prompt": False}),
             ({"add_generation_prompt": True, "template_kwargs": {"enable_thinking": False}},
              {"add_generation_prompt": True, "enable_thinking": False}),
             ({"add_generation_prompt": False, "continue_final_message": True},
              {"add_generation_prompt": False, "continue_final_message": True})]
    for ours, theirs in cases:
        assert tok.apply_chat_template(messages, **ours) == expected(**theirs), ours
    assert tok.decode(tok.apply_chat_template(messages, add_generation_prompt=False, continue_final_message=True)
                      ).endswith("assistant\nThe capital of ")
    # A final content that the template's own markup also contains ("d" ends "<|im_end|>"), or none at all:
    # cut where the message's content ends, not at a later occurrence.
    for content in ("d", "<", ""):
        final = [*messages[:1], {"role": "assistant", "content": content}]
        ours = tok.apply_chat_template(final, add_generation_prompt=False, continue_final_message=True)
        assert tok.decode_literally(ours).endswith(f"<|im_start|>assistant\n{content}"), (content, ours)
    with pytest.raises(ValueError, match="final message"):
        tok.apply_chat_template([], add_generation_prompt=False, continue_final_message=True)


@pytest.mark.parametrize("content", ["The capital of ", "The capital of\n", "ok"])
@pytest.mark.parametrize("shown", ["message['content'] | trim", "message['content'].strip()", "message['content']"])
def test_continue_final_message_as_transformers_with_trimming_templates(tiny_tokenizer_dir, tmp_path, content,
                                                                        shown) -> None:
    """A template that trims the content (Llama 3's, Gemma's) drops the final message's trailing whitespace
    from the continued prompt too; one that shows it as it is keeps it."""
    import shutil

    transformers = pytest.importorskip("transformers")
    shutil.copytree(tiny_tokenizer_dir, tmp_path, dirs_exist_ok=True)
    (tmp_path / "chat_template.jinja").write_text(
        "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ " + shown + " }}<|im_end|>\n{% endfor %}")
    ref = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    tok = HFTokenizer.from_dir(str(tmp_path))
    messages = [{"role": "user", "content": "Name a capital."}, {"role": "assistant", "content": content}]
    theirs = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=False, continue_final_message=True)
    ours = tok.apply_chat_template(messages, add_generation_prompt=False, continue_final_message=True)
    assert tok.decode_literally(ours) == theirs


def test_skip_special_tokens_false_writes_special_tokens_out(tiny_tokenizer_dir) -> None:
    """vLLM's ``skip_special_tokens: false`` (tool parsers that read the model's markers from the text): the
    special tokens' text is in the answer, over any split, the Python window included; the token that stops the
    choice (EOS) stays out unless ``include_stop_str_in_output``, as vLLM answers."""
    from gateway.text import ChoiceState
    from workers.protocol import StepOutput

    tok = HFTokenizer.from_dir(tiny_tokenizer_dir)
    start, end = tok._tok.token_to_id("<|im_start|>"), tok._tok.token_to_id("<|im_end|>")
    ids = [*tok.encode("Hello "), start, *tok.encode("tool ünï 🎉"), end, *tok.encode(" x")]
    literal = tok.decode_literally(ids)
    assert "<|im_start|>" in literal and literal != tok.decode(ids)
    rng = random.Random(5)
    for _ in range(30):
        splits = _random_splits(rng, len(ids))
        for python_only in (False, True):
            dec = tok.decoder(skip_special_tokens=False)
            if python_only:
                dec._stream = None  # type: ignore[attr-defined]
            pieces, i = [], 0
            for size in splits:
                pieces.append(dec.push(ids[i:i + size]))
                i += size
            assert "".join(pieces) + dec.flush() == literal
    answer = [*tok.encode("Hi "), start, *tok.encode("call"), end]
    for keep, skip, want in ((False, True, "Hi call"), (False, False, "Hi <|im_start|>call"),
                             (True, False, "Hi <|im_start|>call<|im_end|>")):
        state = ChoiceState(0, tok, [], False, keep_stop=keep, stop_tokens=(tok.eos_token_ids,), skip_special=skip)
        state.accept(StepOutput(1, answer[:3]))
        state.accept(StepOutput(1, answer[3:], finish_reason="stop"))
        assert state.text == want, (keep, skip, state.text)
