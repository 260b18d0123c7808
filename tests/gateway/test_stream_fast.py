"""A chat stream's first and last chunks from the choice's template (``ChatShape.first``, ``ChatShape.events``):
byte for byte the chunks ``ChatShape._chunk`` encodes from their dicts."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from gateway.shapes import ChatShape, Run, Shape
from gateway.text import ChoiceState
from gateway.tokenizer import ByteTokenizer
from workers.protocol import StepOutput


def _run(include_usage: bool, model: str) -> Run:
    frontend: Any = SimpleNamespace(model_name=model)
    prep: Any = SimpleNamespace(include_usage=include_usage)
    return Run(frontend, prep, "chatcmpl-0123abcd")


def _dict_chunk(shape: ChatShape, run: Run, index: int, delta: dict[str, Any], finish: str | None) -> bytes:
    return shape._chunk(run, [{"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}])


TEXTS = ["", "hi", 'a "quote" \\ and null}', "finish_reason\":null", "\x00text\x00", "é 😀 \n"]


@pytest.mark.parametrize("include_usage", [False, True])
@pytest.mark.parametrize("index", [0, 3])
@pytest.mark.parametrize("model", ["m", 'odd "finish_reason":null model'])
@pytest.mark.parametrize("text", TEXTS)
def test_first_chunk_is_the_dicts(include_usage: bool, index: int, model: str, text: str) -> None:
    shape, run = ChatShape(), _run(include_usage, model)
    state: Any = SimpleNamespace(index=index)
    assert shape.first(run, state, text) == _dict_chunk(shape, run, index, {"content": text, "role": "assistant"},
                                                        None)


@pytest.mark.parametrize("include_usage", [False, True])
@pytest.mark.parametrize("model", ["m", 'odd "finish_reason":null model'])
@pytest.mark.parametrize("finish", ["stop", "length"])
@pytest.mark.parametrize("text", TEXTS)
def test_last_chunk_is_the_dicts(include_usage: bool, model: str, finish: str, text: str) -> None:
    shape = ChatShape()
    run = _run(include_usage, model)
    run.prep.tools, run.prep.want_logprobs = None, False
    opening: Any = SimpleNamespace(index=0, finish_reason=None)
    last: Any = SimpleNamespace(index=0, finish_reason=finish, token_ids=[1, 2], cached_tokens=0)

    async def run_choices(prep: Any, emitter: Any) -> Any:
        yield opening, "x", []
        yield last, text, []

    run.frontend.run_choices = run_choices
    run.prep.input_ids, run.prep.batch = [5], None

    async def collect() -> list[bytes]:
        return [chunk async for chunk in shape.events(run)]

    chunks = asyncio.run(collect())
    expected = _dict_chunk(shape, run, 0, {"content": text}, finish)
    assert chunks[1] == expected
    assert len(chunks) == (3 if include_usage else 2)


def test_middle_accepter_is_accept_middle() -> None:
    """``ChoiceState.middle_accepter``'s callable leaves the state as ``accept_middle`` does, output by output (a
    character split across outputs, cached tokens growing, prompt logprobs on one), and the final ``accept`` after
    it sees the same state."""
    tok = ByteTokenizer()
    euro = list("€".encode())
    outputs = [StepOutput(1, [ord("a"), euro[0]], cached_tokens=3, prompt_logprobs=[-0.5]),
               StepOutput(1, [euro[1]], cached_tokens=2), StepOutput(1, [euro[2], ord("b")], cached_tokens=7),
               StepOutput(1, [])]
    plain, bound = ChoiceState(0, tok, [], False), ChoiceState(0, tok, [], False)
    accept = bound.middle_accepter()
    for output in outputs:
        assert accept(output) == plain.accept_middle(output)
        assert (bound.token_ids, bound.text, bound.cached_tokens, bound.prompt_logprobs) == \
            (plain.token_ids, plain.text, plain.cached_tokens, plain.prompt_logprobs)
    last = StepOutput(1, [ord("c")], finish_reason="length")
    assert bound.accept(last) == plain.accept(last)
    assert (bound.token_ids, bound.text, bound.finish_reason) == (plain.token_ids, plain.text, plain.finish_reason)
    assert bound.text == "a€bc"


@pytest.mark.parametrize("include_usage", [False, True])
@pytest.mark.parametrize("index", [0, 2])
@pytest.mark.parametrize("model", ["m", "100% %d %b %s model", '"id":"\x00id\x00" "created":987654321987654321',
                                   "\x00id\x00"])
def test_chat_template_from_its_form(include_usage: bool, index: int, model: str) -> None:
    """``ChatShape._template`` (a form per model, usage option and choice, formatted per request) makes what
    ``Shape._template`` makes from the request's own chunk, request after request (ids, times)."""
    shape = ChatShape()
    for rid, created in [("chatcmpl-0123abcd", 1_700_000_000), ("chatcmpl-ffff", 0), ('odd "id" %s', 5)]:
        run, plain = _run(include_usage, model), _run(include_usage, model)
        run.rid = plain.rid = rid
        run.created = plain.created = created
        template = shape._template(run, index)
        assert template == Shape._template(shape, plain, index)
        assert run.templates[index] == template
