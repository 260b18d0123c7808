"""The gateway's side of the sampling surface: request fields -> SamplingParams, and a worker's refusal renamed
to the client's field on each route. (Unit tests: a dispatcher that refuses like a worker does.)"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from typing import Any

import msgspec
import pytest

from gateway.api import Frontend, decode_body
from gateway.api_models import ChatCompletionRequest, CompletionRequest, GenerateRequest
from gateway.errors import BadRequest, from_worker_error
from gateway.tokenizer import ByteTokenizer
from workers.protocol import StepOutput


class RefusingDispatcher:
    """Answers every choice as a worker whose engine refuses ``field`` (``check_sampling``) would."""

    def __init__(self, field: str) -> None:
        self.field = field

    async def generate(self, input_ids: list[int], params: Any, **_: Any) -> AsyncGenerator[StepOutput, None]:
        raise from_worker_error("bad_request", f"{self.field} is not supported by the plugin engine", "decode",
                                self.field)
        yield StepOutput(0, [])  # pragma: no cover - makes this an async generator


def frontend(field: str = "logit_bias") -> Frontend:
    return Frontend(RefusingDispatcher(field), ByteTokenizer(), "sim", 4096)  # type: ignore[arg-type]


def chat(**fields: Any) -> ChatCompletionRequest:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, **fields}
    return decode_body(msgspec.json.encode(body), ChatCompletionRequest)  # type: ignore[no-any-return]


def generate(**sampling: Any) -> GenerateRequest:
    body = {"text": "hi", "sampling_params": {"max_new_tokens": 8, **sampling}}
    return decode_body(msgspec.json.encode(body), GenerateRequest)  # type: ignore[no-any-return]


def test_fields_reach_sampling_params_on_every_route() -> None:
    fe = frontend()
    p = fe.prepare_chat(chat(logit_bias={"65": 5, "7": -100}, presence_penalty=0.5, frequency_penalty=-1,
                             repetition_penalty=1.3, min_tokens=4)).params
    assert (p.logit_bias, p.presence_penalty, p.frequency_penalty, p.repetition_penalty, p.min_new_tokens) == \
        ({65: 5.0, 7: -100.0}, 0.5, -1.0, 1.3, 4)
    body = {"prompt": "hi", "max_tokens": 8, "presence_penalty": 2, "min_tokens": 8}
    p = fe.prepare_completion(decode_body(msgspec.json.encode(body), CompletionRequest)).params
    assert (p.presence_penalty, p.min_new_tokens, p.repetition_penalty, p.logit_bias) == (2.0, 8, 1.0, {})
    p = fe.prepare_generate(generate(repetition_penalty=0.7, min_new_tokens=3, logit_bias={"1": 1.5},
                                     frequency_penalty=0.25))[0].params
    assert (p.repetition_penalty, p.min_new_tokens, p.logit_bias, p.frequency_penalty) == (0.7, 3, {1: 1.5}, 0.25)
    assert fe.prepare_chat(chat()).params == fe.prepare_chat(chat(presence_penalty=0, logit_bias={},
                                                                  repetition_penalty=1, min_tokens=0)).params


def test_min_tokens_above_max_tokens_is_a_400_naming_it() -> None:
    with pytest.raises(BadRequest) as info:
        frontend().prepare_chat(chat(min_tokens=9))
    assert info.value.param == "min_tokens"
    with pytest.raises(BadRequest) as info:
        frontend().prepare_generate(generate(min_new_tokens=9))
    assert info.value.param == "sampling_params.min_new_tokens"


@pytest.mark.parametrize(("field", "chat_name"), [
    ("logit_bias", "logit_bias"), ("presence_penalty", "presence_penalty"), ("min_new_tokens", "min_tokens")])
@pytest.mark.parametrize("n", [1, 3])
def test_a_worker_refusal_names_the_clients_field(field: str, chat_name: str, n: int) -> None:
    fe = frontend(field)

    async def run(prep: Any) -> None:
        async for _ in fe.run_choices(prep):
            pass

    with pytest.raises(BadRequest) as info:
        asyncio.run(run(fe.prepare_chat(chat(n=n))))
    assert info.value.param == chat_name
    with pytest.raises(BadRequest) as info:
        asyncio.run(run(fe.prepare_generate(generate())[0]))
    assert info.value.param == f"sampling_params.{field}"


def test_min_tokens_without_max_tokens_raises_the_default_budget() -> None:
    """A client that sets only ``min_tokens`` gets at least that many tokens' budget, not a 400 against the
    gateway's default ``max_tokens`` it never asked for; past the context it is a 400 naming the field."""
    fe = Frontend(RefusingDispatcher("x"), ByteTokenizer(), "sim", 4096, default_max_tokens=16)  # type: ignore[arg-type]
    body = {"messages": [{"role": "user", "content": "hi"}], "min_tokens": 40}
    p = fe.prepare_chat(decode_body(msgspec.json.encode(body), ChatCompletionRequest)).params
    assert (p.min_new_tokens, p.max_new_tokens) == (40, 40)
    with pytest.raises(BadRequest) as info:
        fe.prepare_chat(decode_body(msgspec.json.encode({**body, "min_tokens": 5000}), ChatCompletionRequest))
    assert info.value.param == "min_tokens" and info.value.code == "context_length_exceeded"


def test_null_sampling_params_on_generate_mean_their_defaults() -> None:
    """SGLang's router sends a ``/generate`` body's unset optional fields as ``null``: each is its default."""
    fe = frontend()
    fields = ("max_new_tokens", "temperature", "top_p", "top_k", "min_p", "stop", "stop_token_ids", "ignore_eos",
              "sampling_seed", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_new_tokens",
              "logit_bias", "regex", "json_schema", "ebnf", "n", "structural_tag")
    nulls = decode_body(msgspec.json.encode({"text": "hi", "sampling_params": dict.fromkeys(fields)}), GenerateRequest)
    absent = decode_body(b'{"text": "hi", "sampling_params": {}}', GenerateRequest)
    no_params = decode_body(b'{"text": "hi", "sampling_params": null, "stream": null, "return_logprob": null}',
                            GenerateRequest)
    default = fe.prepare_generate(absent)[0].params
    assert default.max_new_tokens == 128 and default.temperature == 1.0
    assert fe.prepare_generate(nulls)[0].params == default
    assert fe.prepare_generate(no_params)[0].params == default


def test_generate_without_max_new_tokens_near_the_context_gets_what_fits() -> None:
    """/generate's default budget (SGLang's 128) is cut to what fits the context, as SGLang's scheduler does
    and as the OpenAI routes' default is; only an explicit max_new_tokens past the context is a 400."""
    fe = frontend()
    near = {"text": "a" * 4000}
    params = fe.prepare_generate(decode_body(msgspec.json.encode(near), GenerateRequest))[0].params
    assert params.max_new_tokens == 4096 - 4000
    explicit = {**near, "sampling_params": {"max_new_tokens": 128}}
    with pytest.raises(BadRequest) as info:
        fe.prepare_generate(decode_body(msgspec.json.encode(explicit), GenerateRequest))
    assert info.value.param == "sampling_params.max_new_tokens" and info.value.code == "context_length_exceeded"
    with_min = {**near, "sampling_params": {"min_new_tokens": 90}}
    prep = fe.prepare_generate(decode_body(msgspec.json.encode(with_min), GenerateRequest))[0]
    assert prep.params.max_new_tokens == 96


@pytest.mark.parametrize("field, value, param", [
    ("stop", ["s" * 1025], "stop[0]"), ("stop_token_ids", [1] * 1025, "stop_token_ids"),
    ("logit_bias", {str(i): 1 for i in range(1025)}, "logit_bias"), ("tools", [{}] * 129, "tools")])
def test_what_each_choice_carries_to_its_workers_is_bounded(field: str, value: Any, param: str) -> None:
    """A request's n choices each carry their own stop strings, stop token ids and logit bias to both of their
    workers: unbounded, a request of a few MB made over 100 MB of frames, past a worker connection's unread
    limit, and the gateway dropped the connection with every request open on it. Past the bounds: a 400
    naming the field (the bound itself is accepted); the /generate route's sampling fields alike."""
    from gateway.api_models import MAX_LOGIT_BIAS, MAX_STOP_CHARS, MAX_STOP_TOKEN_IDS, MAX_TOOLS

    assert (MAX_STOP_CHARS, MAX_STOP_TOKEN_IDS, MAX_LOGIT_BIAS, MAX_TOOLS) == (1024, 1024, 1024, 128)
    with pytest.raises(BadRequest) as exc:
        chat(**{field: value})
    assert exc.value.status == 400 and exc.value.param == param, exc.value.message
    chat(**{field: value[:-1] if isinstance(value, list) and field != "stop" else
            dict(list(value.items())[:-1]) if isinstance(value, dict) else ["s" * 1024]})
    if field != "tools":
        with pytest.raises(BadRequest) as exc:
            generate(**{field: value})
        assert exc.value.param == f"sampling_params.{param}", exc.value.message
