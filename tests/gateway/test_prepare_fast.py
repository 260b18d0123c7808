"""The plain-request shortcuts of preparing and answering a chat request give what the whole way gives.

``Frontend.prepare_chat`` prepares a plain chat without the checks it would pass (``_PLAIN_CHAT_FIELDS``),
``Prepared.plain`` leaves the defaults on the class, ``ChoiceState`` watches no stop strings with ``_NoStops``,
``_ByteDecoder`` decodes ASCII directly, and ``usage`` counts one choice directly: each is checked here against
the general code it stands in for.
"""

from __future__ import annotations

import codecs
import dataclasses
import random
from typing import Any

import msgspec
import pytest

from gateway import api
from gateway.api import Frontend, Prepared, decode_body
from gateway.api_models import ChatCompletionRequest, ChatMessage
from gateway.errors import APIError
from gateway.shapes import usage
from gateway.text import ChoiceState, StopMatcher, _NoStops
from gateway.tokenizer import ByteTokenizer
from workers.protocol import SamplingParams, StepOutput

# The fields the plain path reads (or ignores, as the whole way does); every other one must send a request
# that sets it the whole way.
READ_BY_PLAIN = {"model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "min_p",
                 "seed", "ignore_eos", "n", "stream", "logprobs", "include_stop_str_in_output",
                 "user", "timeout_s", "parallel_tool_calls", "guided_decoding_backend"}


class _Pools:
    def decode_capacity(self) -> int:
        return 300

    def prefill_context(self, _prompt: int) -> int:
        return 280


def _frontend(pools: bool = False) -> Frontend:
    return Frontend(_Pools() if pools else None, ByteTokenizer(), "sim", 512 if pools else 4096,  # type: ignore[arg-type]
                    default_max_tokens=100)


def _outcome(prepare: Any, body: dict[str, Any] | ChatCompletionRequest) -> Any:
    req = body if isinstance(body, ChatCompletionRequest) else decode_body(msgspec.json.encode(body),
                                                                           ChatCompletionRequest)
    try:
        prep = prepare(req)
    except APIError as exc:
        return type(exc), exc.message, exc.param, exc.code
    return ({f.name: getattr(prep, f.name) for f in dataclasses.fields(prep) if f.name != "params"},
            msgspec.json.encode(prep.params))  # (the worker's bytes: the same defaults omitted)


def test_every_field_beyond_the_plain_ones_is_read_by_the_shortcut() -> None:
    assert set(ChatCompletionRequest.__struct_fields__) - set(api._PLAIN_CHAT_NAMES) == READ_BY_PLAIN


def test_prepared_plain_is_the_prepared_of_its_fields() -> None:
    for f in dataclasses.fields(Prepared):  # (the defaults it leaves on the class are the dataclass's)
        # (a field made per instance, or set up after __init__, would be missing from ``plain``'s objects)
        assert f.default_factory is dataclasses.MISSING, f"{f.name}: Prepared.plain would not make it"
        if f.default is not dataclasses.MISSING:
            assert getattr(Prepared, f.name) == f.default, f.name
    assert not hasattr(Prepared, "__post_init__"), "Prepared.plain would skip it"
    params = SamplingParams(max_new_tokens=5)
    plain = Prepared.plain([1, 2], params, 2, True, True, True, "max_completion_tokens")
    assert plain == Prepared([1, 2], params, 2, [], True, False, True, keep_stop=True,
                             max_tokens_param="max_completion_tokens", prompt_param="messages")
    assert plain.stops == [] and plain.stops is not Prepared.plain([1], params, 1, False, False, False, "x").stops


PLAIN_MESSAGES = [
    [{"role": "user", "content": "Hello there"}],
    [{"role": "system", "content": "S"}, {"role": "user", "content": "Hi"}, {"role": "assistant", "content": ""},
     {"role": "user", "content": "h\u00e9llo \u2603"}],
    [{"role": "user", "content": "x" * 600}],  # (past the context)
    [{"role": "user", "content": "x" * 270}],  # (past what the pools hold, with the default budget)
]
VARIANTS: list[dict[str, Any]] = [
    {}, {"model": None}, {"model": "default"}, {"model": "other"}, {"max_tokens": None}, {"max_tokens": 5000},
    {"max_tokens": None, "max_completion_tokens": 7}, {"max_completion_tokens": 9}, {"stream": True},
    {"stream": None}, {"logprobs": True}, {"logprobs": None}, {"temperature": 0}, {"temperature": 0.5, "top_p": 0},
    {"top_p": 0.9, "top_k": 0}, {"top_k": 5, "min_p": 0.1}, {"seed": 3}, {"ignore_eos": True}, {"ignore_eos": None},
    {"n": 3}, {"n": None}, {"include_stop_str_in_output": True}, {"include_stop_str_in_output": None},
    {"user": "u", "parallel_tool_calls": False}, {"guided_decoding_backend": "xgrammar"},
]


@pytest.mark.parametrize("pools", [False, True])
def test_a_plain_chat_is_prepared_as_the_whole_way_prepares_it(pools: bool) -> None:
    frontend = _frontend(pools)
    for messages in PLAIN_MESSAGES:
        for variant in VARIANTS:
            body = {"model": "sim", "messages": messages, "max_tokens": 16, **variant}
            assert _outcome(frontend.prepare_chat, body) == _outcome(frontend._prepare_chat, body), body


def test_a_chat_built_in_python_is_prepared_as_the_whole_way_prepares_it() -> None:
    frontend = _frontend()  # (as ``/v1/responses`` builds one: nothing checked by a decoder)
    for budget in (-1, 0, 1):
        req = ChatCompletionRequest(model="sim", messages=[ChatMessage("user", "Hi")], max_completion_tokens=budget)
        assert _outcome(frontend.prepare_chat, req) == _outcome(frontend._prepare_chat, req), budget


def test_a_chat_beyond_plain_is_prepared_the_whole_way(monkeypatch: pytest.MonkeyPatch) -> None:
    frontend = _frontend()
    whole: list[Any] = []
    prepare_chat = frontend._prepare_chat

    def counted(req: ChatCompletionRequest) -> Prepared:
        whole.append(req)
        return prepare_chat(req)

    monkeypatch.setattr(frontend, "_prepare_chat", counted)
    beyond: list[dict[str, Any]] = [
        {"stop": "x"}, {"stop": []}, {"top_logprobs": 2}, {"stream": True, "stream_options": {}},
        {"min_tokens": 0}, {"presence_penalty": 0}, {"logit_bias": {}}, {"stop_token_ids": []},
        {"response_format": {"type": "text"}}, {"tools": []}, {"tool_choice": "none"}, {"echo": False},
        {"chat_template_kwargs": {}}, {"skip_special_tokens": True}, {"bootstrap_room": 1},
        {"messages": [{"role": "developer", "content": "D"}]}, {"messages": [{"role": "user", "name": "a"}]},
        {"messages": [{"role": "user", "content": None}]}, {"messages": None},
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}]}]}]
    for variant in beyond:
        whole.clear()
        body = {"model": "sim", "messages": [{"role": "user", "content": "Hi"}], **variant}
        if body["messages"] is None:  # (no messages: the struct's default, an empty list)
            del body["messages"]
        _outcome(frontend.prepare_chat, body)
        assert len(whole) == 1, variant


def test_no_stops_passes_text_as_a_matcher_without_strings_does() -> None:
    rng = random.Random(7)
    for _ in range(200):
        general, plain = StopMatcher([""], keep=True), _NoStops(keep=True)
        for _ in range(rng.randrange(1, 6)):
            text = "".join(rng.choice("ab\u00e9 ") for _ in range(rng.randrange(0, 4)))
            final, exempt = rng.random() < 0.3, rng.random() < 0.3
            assert plain.push(text, final=final, exempt=exempt) == general.push(text, final=final, exempt=exempt)
            assert plain.matched is general.matched is None
    state = ChoiceState(0, ByteTokenizer(), [], False)
    assert isinstance(state.stop, _NoStops) and state.stop.stops == [] and state.stop.keep is False
    assert type(ChoiceState(0, ByteTokenizer(), ["x"], False).stop) is StopMatcher


def test_the_byte_decoder_decodes_as_utf8_incrementally() -> None:
    rng = random.Random(11)
    alphabet = [*range(32, 127), 0xC3, 0xA9, 0xE2, 0x98, 0x83, 0xF0, 0x9F, 0x98, 0x80, 0xFF, 257]
    for _ in range(300):
        ids = [rng.choice(alphabet) for _ in range(rng.randrange(0, 12))]
        reference = codecs.getincrementaldecoder("utf-8")("replace")
        decoder = ByteTokenizer().decoder()
        cuts = sorted(rng.sample(range(len(ids) + 1), min(len(ids) + 1, 3)))
        got, want = [], []
        for start, end in zip([0, *cuts], [*cuts, len(ids)], strict=True):
            got.append(decoder.push(ids[start:end]))
            want.append(reference.decode(bytes(t for t in ids[start:end] if t < 256)))
        got.append(decoder.flush())
        want.append(reference.decode(b"", final=True))
        assert got == want, ids


def test_usage_of_one_choice_is_the_general_count() -> None:
    prep = Prepared([1, 2, 3], SamplingParams(), 1, [], False, False, False)
    one = ChoiceState(0, ByteTokenizer(), [], False)
    one.accept(StepOutput(1, [104, 105], "length", 3, 2))
    empty = ChoiceState(1, ByteTokenizer(), [], False)
    assert usage(prep, [one]) == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5,
                                  "prompt_tokens_details": {"cached_tokens": 2}}
    # (the general count over two choices, one of which adds nothing)
    assert usage(prep, [one, empty]) == usage(prep, [one])
