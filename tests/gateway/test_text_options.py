"""Text options: the stop string kept in the output (vLLM's ``include_stop_str_in_output``, SGLang's
``no_stop_trim``), a final output without tokens still ending the text, byte tokens' logprob ``bytes``, and
detokenizing options the gateway does not implement refused (a 400 naming them, not silently ignored)."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from gateway.api import Frontend
from gateway.api_models import ChatCompletionRequest, CompletionRequest, GenerateRequest
from gateway.errors import BadRequest
from gateway.text import ChoiceState, StopMatcher
from gateway.tokenizer import ByteTokenizer
from workers.protocol import StepOutput


def _feed(matcher: StopMatcher, pieces: list[str]) -> str:
    out = "".join(matcher.push(p) for p in pieces[:-1])
    return out + matcher.push(pieces[-1], final=True)


@pytest.mark.parametrize("keep", [False, True])
def test_the_stop_string_is_kept_or_trimmed(keep: bool) -> None:
    text = _feed(StopMatcher(["END", "ZZ"], keep=keep), ["abc E", "N", "Dxyz ZZ", "more"])
    assert text == ("abc END" if keep else "abc ")


def test_a_final_output_without_tokens_ends_the_text() -> None:
    """An incomplete character held back by the decoder comes out (as U+FFFD) at a tokenless final output."""
    state = ChoiceState(0, ByteTokenizer(), [], False)
    parts = [state.accept(StepOutput(1, [ord("x"), 0xE2, 0x82]))[0], state.accept(StepOutput(1, [], "length"))[0]]
    assert parts == ["x", "\ufffd"] and state.text == ByteTokenizer().decode([ord("x"), 0xE2, 0x82])


def test_byte_tokens_logprob_bytes_are_their_own_byte() -> None:
    state = ChoiceState(0, ByteTokenizer(), [], True)
    _, entries = state.accept(StepOutput(1, [0xC3, 0xA9], "length", logprobs=[-0.1, -0.2]))
    assert [e["bytes"] for e in entries] == [[0xC3], [0xA9]]
    assert bytes(b for e in entries for b in e["bytes"]).decode() == "é"


class _NoDispatch:
    pass


def _frontend() -> Frontend:
    return Frontend(_NoDispatch(), ByteTokenizer(), "m", 4096)  # type: ignore[arg-type]


def _chat(**fields: Any) -> ChatCompletionRequest:
    return msgspec.convert({"messages": [{"role": "user", "content": "hi"}], **fields}, ChatCompletionRequest)


def test_keep_stop_reaches_every_route() -> None:
    front = _frontend()
    assert front.prepare_chat(_chat(stop=["x"], include_stop_str_in_output=True)).keep_stop
    assert not front.prepare_chat(_chat(stop=["x"])).keep_stop
    completion = msgspec.convert({"prompt": "hi", "stop": "x", "include_stop_str_in_output": True}, CompletionRequest)
    assert front.prepare_completion(completion).keep_stop
    generate = msgspec.convert({"text": "hi", "sampling_params": {"stop": "x", "no_stop_trim": True}}, GenerateRequest)
    assert front.prepare_generate(generate)[0].keep_stop


@pytest.mark.parametrize("field, value, neutral", [
    ("spaces_between_special_tokens", False, True),
    # vLLM's sampling options this gateway does not implement (they were read as unknown fields and dropped:
    # a ``bad_words`` answer could hold the banned word)
    ("allowed_token_ids", [65, 66], None), ("bad_words", ["Paris"], []), ("prompt_logprobs", 1, None),
    ("truncate_prompt_tokens", 2, None), ("use_beam_search", True, False), ("length_penalty", 0.5, 1.0),
    ("return_tokens_as_token_ids", True, False),
])
def test_options_not_implemented_are_refused(field: str, value: Any, neutral: Any) -> None:
    with pytest.raises(BadRequest) as err:
        _frontend().prepare_chat(_chat(**{field: value}))
    assert err.value.param == field
    completion = msgspec.convert({"prompt": "hi", field: value}, CompletionRequest)
    with pytest.raises(BadRequest) as err:
        _frontend().prepare_completion(completion)
    assert err.value.param == field
    _frontend().prepare_chat(_chat(**{field: neutral}))  # (the default, spelled out: fine)


@pytest.mark.parametrize("route, field, value, neutral", [
    ("chat", "chat_template", "{{ messages }}", None), ("chat", "echo", True, False),
    ("chat", "add_special_tokens", True, False), ("completions", "add_special_tokens", False, True),
    ("generate", "token_ids_logprob", [1, 2], None),
    ("generate", "sampling_params.stop_regex", "a+", None),
])
def test_route_options_not_implemented_are_refused(route: str, field: str, value: Any, neutral: Any) -> None:
    front = _frontend()

    def prepare(value: Any) -> None:
        if route == "chat":
            front.prepare_chat(_chat(**{field: value}))
        elif route == "completions":
            front.prepare_completion(msgspec.convert({"prompt": "hi", field: value}, CompletionRequest))
        else:
            name = field.removeprefix("sampling_params.")
            body: dict[str, Any] = {"text": "hi", "return_logprob": True}
            if name != field:
                body["sampling_params"] = {name: value}
            else:
                body[name] = value
            front.prepare_generate(msgspec.convert(body, GenerateRequest))

    with pytest.raises(BadRequest) as err:
        prepare(value)
    assert err.value.param == field
    prepare(neutral)  # (the route's own default, spelled out: fine)


def test_the_template_options_shape_the_prompt() -> None:
    """``add_generation_prompt: false`` leaves the assistant's turn unopened; ``continue_final_message`` ends
    the prompt inside the final message (the model continues it); spelled-out defaults change nothing."""
    front, tok = _frontend(), ByteTokenizer()
    messages = [{"role": "user", "content": "Name a capital."}, {"role": "assistant", "content": "The capital of"}]

    def prompt(**fields: Any) -> str:
        return tok.decode(front.prepare_chat(_chat(messages=messages, **fields)).input_ids)

    plain = prompt()
    assert plain.endswith("<|assistant|>\nThe capital of\n<|assistant|>\n")
    assert prompt(add_generation_prompt=True, continue_final_message=False, chat_template_kwargs={}) == plain
    assert prompt(add_generation_prompt=False) == plain.removesuffix("<|assistant|>\n")
    assert prompt(add_generation_prompt=False, continue_final_message=True).endswith("<|assistant|>\nThe capital of")
    assert prompt(chat_template_kwargs={"enable_thinking": False}) == plain  # (this template has no variables)


@pytest.mark.parametrize("fields, param", [
    ({"continue_final_message": True}, "continue_final_message"),  # (with the generation prompt: vLLM's 400 too)
    ({"continue_final_message": True, "add_generation_prompt": True}, "continue_final_message"),
    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs"),
])
def test_template_options_that_cannot_render_are_a_400(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(BadRequest) as err:
        _frontend().prepare_chat(_chat(**fields))
    assert err.value.param == param


def test_generate_options_not_implemented_are_refused() -> None:
    front = _frontend()
    for body, param in (({"sampling_params": {"spaces_between_special_tokens": False}},
                         "sampling_params.spaces_between_special_tokens"),
                        ({"top_logprobs_num": 3, "return_logprob": True}, "top_logprobs_num")):
        with pytest.raises(BadRequest) as err:
            front.prepare_generate(msgspec.convert({"text": "hi", **body}, GenerateRequest))
        assert err.value.param == param


def test_skip_special_tokens_reaches_every_route() -> None:
    """... and with it false the workers are not given the stop strings (they watch text without special
    tokens, where one could match across a marker the answer holds): the gateway alone watches them."""
    front = _frontend()
    assert front.prepare_chat(_chat()).skip_special and front.prepare_chat(_chat(skip_special_tokens=True)).skip_special
    assert not front.prepare_chat(_chat(skip_special_tokens=False)).skip_special
    literal = front.prepare_chat(_chat(skip_special_tokens=False, stop=["ab"]))
    assert literal.stops == ["ab"] and literal.params.stop == []
    assert front.prepare_chat(_chat(stop=["ab"])).params.stop == ["ab"]
    completion = msgspec.convert({"prompt": "hi", "skip_special_tokens": False}, CompletionRequest)
    assert not front.prepare_completion(completion).skip_special
    generate = msgspec.convert({"text": "hi", "sampling_params": {"skip_special_tokens": False}}, GenerateRequest)
    assert not front.prepare_generate(generate)[0].skip_special


def test_generate_logprob_entries_name_their_tokens_when_asked() -> None:
    """SGLang's ``return_text_in_logprobs`` (its docs' and RL clients' habit): each ``[logprob, id, text]``
    entry names its token; it was a 400, and before that the text was always null."""
    from gateway.shapes import GenerateShape, Run
    from gateway.text import ChoiceState
    from workers.protocol import StepOutput

    front = _frontend()
    for asked in (True, False):
        body = {"text": "hi", "return_logprob": True, "return_text_in_logprobs": asked, "logprob_start_len": 0}
        prep = front.prepare_generate(msgspec.convert(body, GenerateRequest))[0]
        state = ChoiceState(0, front.tokenizer, [], True)
        state.prompt_logprobs = [float("nan"), -0.5]
        state.accept(StepOutput(1, [ord("o"), ord("k")], "length", logprobs=[-0.1, -0.2]))
        meta = GenerateShape._payload(Run(front, prep, "r"), state)["meta_info"]
        out, prompt = meta["output_token_logprobs"], meta["input_token_logprobs"]
        assert [entry[2] for entry in out] == (["o", "k"] if asked else [None, None])
        assert [entry[2] for entry in prompt] == (["h", "i"] if asked else [None, None])
        assert [entry[:2] for entry in out] == [[-0.1, ord("o")], [-0.2, ord("k")]]
    # token_ids_logprob is only looked at with return_logprob (as SGLang): without it, not refused
    front.prepare_generate(msgspec.convert({"text": "hi", "token_ids_logprob": [1]}, GenerateRequest))


def test_logprob_start_len_picks_the_prompt_positions() -> None:
    """SGLang's ``logprob_start_len``: -1 (the default) gives the prompt's last position alone, k the positions
    from k on (position 0 has no logprob: null), sent to the workers as ``prompt_logprobs_start`` so that they
    score only those; a batch may give one per item; a start outside the prompt is a 400 naming it."""
    from gateway.shapes import GenerateShape, Run

    front = _frontend()

    def prepare(**fields: Any) -> Any:
        return front.prepare_generate(msgspec.convert({"return_logprob": True, **fields}, GenerateRequest))[0]

    def entries(prep: Any, index: int, values: list[float]) -> list[Any]:
        state = ChoiceState(index, front.tokenizer, [], True)
        state.prompt_logprobs = values
        state.accept(StepOutput(1, [ord("k")], "length", logprobs=[-0.1]))
        return GenerateShape._payload(Run(front, prep, "r"), state)["meta_info"]["input_token_logprobs"]

    prep = prepare(text="abcd")
    assert prep.params.prompt_logprobs_start == 3
    assert entries(prep, 0, [-0.4]) == [[-0.4, ord("d"), None]]
    prep = prepare(text="abcd", logprob_start_len=0)
    assert prep.params.prompt_logprobs_start == 0
    assert entries(prep, 0, [float("nan"), -0.2, -0.3, -0.4]) == [
        [None, ord("a"), None], [-0.2, ord("b"), None], [-0.3, ord("c"), None], [-0.4, ord("d"), None]]
    prep = prepare(text="abcd", logprob_start_len=2)
    assert entries(prep, 0, [-0.3, -0.4]) == [[-0.3, ord("c"), None], [-0.4, ord("d"), None]]
    batch = prepare(text=["abcd", "xyz"], logprob_start_len=[1, -1])
    assert batch.logprob_starts == [1, 2] and batch.params.prompt_logprobs_start == 1
    assert entries(batch, 1, [-0.9]) == [[-0.9, ord("z"), None]]
    assert prepare(text=["abcd", "xyz"]).logprob_starts == [3, 2]
    # without return_logprob it is not looked at (as SGLang)
    assert front.prepare_generate(msgspec.convert({"text": "ab", "logprob_start_len": 9}, GenerateRequest))[0]
    for fields, param in (({"text": "abcd", "logprob_start_len": 4}, "logprob_start_len"),
                          ({"text": "abcd", "logprob_start_len": -2}, "logprob_start_len"),
                          ({"text": "abcd", "logprob_start_len": [0]}, "logprob_start_len"),
                          ({"text": ["ab", "cd"], "logprob_start_len": [0]}, "logprob_start_len"),
                          ({"text": ["ab", "cd"], "logprob_start_len": [0, 2]}, "logprob_start_len[1]")):
        with pytest.raises(BadRequest) as err:
            prepare(**fields)
        assert err.value.param == param, fields


def test_max_new_tokens_0_answers_the_prompt_alone() -> None:
    """SGLang's ``max_new_tokens: 0`` (scoring a prompt: its logprobs, no output) was a 400: it runs for one token,
    which the answer leaves out (no text, ids or output logprobs; finish ``length`` 0)."""
    from gateway.shapes import GenerateShape, Run

    front = _frontend()
    body = {"text": "abcd", "return_logprob": True, "logprob_start_len": 0, "sampling_params": {"max_new_tokens": 0}}
    prep = front.prepare_generate(msgspec.convert(body, GenerateRequest))[0]
    assert prep.no_output and prep.params.max_new_tokens == 1
    state = ChoiceState(0, front.tokenizer, [], True)
    state.prompt_logprobs = [float("nan"), -0.2, -0.3, -0.4]
    state.accept(StepOutput(1, [ord("k")], "length", logprobs=[-0.1]))
    payload = GenerateShape._payload(Run(front, prep, "r"), state)
    meta = payload["meta_info"]
    assert payload["text"] == "" and payload["output_ids"] == [] and meta["completion_tokens"] == 0
    assert meta["finish_reason"] == {"type": "length", "length": 0} and meta["output_token_logprobs"] == []
    assert [entry[0] for entry in meta["input_token_logprobs"]] == [None, -0.2, -0.3, -0.4]
    assert state.text == "k"  # (the choice's own state is left as it was)
    unfinished = ChoiceState(0, front.tokenizer, [], True)
    assert GenerateShape._payload(Run(front, prep, "r"), unfinished)["meta_info"]["finish_reason"] is None
    with pytest.raises(BadRequest) as err:  # a minimum above the budget
        front.prepare_generate(msgspec.convert({"text": "ab", "sampling_params": {"max_new_tokens": 0,
                                                                                   "min_new_tokens": 1}},
                                               GenerateRequest))
    assert err.value.param == "sampling_params.min_new_tokens"
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"text": "ab", "sampling_params": {"max_new_tokens": -1}}, GenerateRequest)
