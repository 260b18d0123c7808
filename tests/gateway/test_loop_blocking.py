"""Work one valid request can put on the gateway's event loop, every stream waiting behind it.

Counted or located (which thread), never timed. Each test names the stall it stands for (measured on a
2-core machine with a sim cluster and a probe stream: the worst gap between the probe's chunks).
"""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Any

import pytest

from gateway import structured_output
from gateway.api import Frontend, Prepared
from gateway.responder import PREPARE_THREAD_BYTES, Responder
from gateway.shapes import ChatShape, GenerateShape, Run
from gateway.text import ChoiceState
from gateway.tokenizer import ByteTokenizer
from tests.gateway.test_prepare_thread import _Exchange
from tests.gateway.test_prepare_thread import _Host as _PreparingHost
from workers import grammar as grammars
from workers.protocol import SamplingParams, StepOutput, TokenLogprob


class _Host(_PreparingHost):
    """A responder's host whose dispatcher has no workers (a 503 once a request is prepared)."""

    def __init__(self) -> None:
        super().__init__(ByteTokenizer())  # type: ignore[arg-type]


def _gbnf(rules: int) -> str:
    return "root ::= " + " ".join(f"r{i}" for i in range(rules)) + "\n" + "\n".join(
        f'r{i} ::= "x" r{i + 1}?' if i + 1 < rules else f'r{i} ::= "x"' for i in range(rules))


def test_a_small_body_with_an_ebnf_grammar_is_not_compiled_on_the_event_loop(monkeypatch: Any) -> None:
    """``grammar_for`` -> ``checked`` -> ``workers.grammar.check`` -> llguidance's ``gbnf_to_lark``, which is
    pure Python and quadratic in the number of rules: a 7.9 KB chat body (300 rules, under
    ``--prepare-thread-bytes``' 8192, so prepared on the loop) held the gateway's loop for 156 ms (a probe
    stream's worst gap; 3 ms without it), and it is a valid grammar (200 on a worker with constrained decoding).
    A grammar is cheap to send and dear to check: its check belongs off the loop whatever the body's size."""
    threads: list[int] = []

    def check(grammar: Any) -> None:
        threads.append(threading.get_ident())

    monkeypatch.setattr(grammars, "is_available", lambda: True)
    monkeypatch.setattr(grammars, "check", check)
    structured_output._library_says.cache_clear()

    async def main() -> None:
        responder = Responder(_Host(), ChatShape())
        body = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                           "ebnf": _gbnf(300)}).encode()
        assert len(body) < PREPARE_THREAD_BYTES
        exchange = _Exchange(body)
        await responder.serve(exchange)  # type: ignore[arg-type]
        assert [answer[0] for answer in exchange.answers] == [503], exchange.answers
        assert threads and threading.get_ident() not in threads, "the grammar was checked on the event loop"

    try:
        asyncio.run(main())
    finally:
        structured_output._library_says.cache_clear()


class _CountingTokenizer(ByteTokenizer):
    def __init__(self) -> None:
        super().__init__()
        self.named = 0

    def token_text(self, token_id: int) -> str:
        self.named += 1
        return self.decode([token_id])


def test_a_generate_stream_does_not_rebuild_its_prompt_logprobs_for_every_chunk() -> None:
    """``GenerateShape._payload`` (every chunk of a ``/generate`` stream, from the task or the worker
    connection's callback: ``middle``) rebuilds ``meta_info`` whole: ``input_token_logprobs`` (one entry, and
    with ``return_text_in_logprobs`` one ``token_text`` call, per prompt position from ``logprob_start_len``),
    ``output_token_logprobs``, ``output_ids`` and ``text`` from the first token, for every chunk: quadratic in
    the output, and prompt x output in the prompt. Measured with the sim engine (no prompt logprobs): a 1 KB
    request streaming 4,000 tokens with ``return_logprob`` cost the gateway's loop 3.0 s of CPU (0.7 s without
    logprobs) and sent 155 MB. The prompt's entries never change after the first chunk; naming each prompt
    token once (and each output token once) is linear."""
    tokenizer = _CountingTokenizer()
    frontend = Frontend(None, tokenizer, "m", max_context=1 << 20)  # type: ignore[arg-type]
    prompt_len, chunks = 200, 100
    prompt = [ord("a") + i % 26 for i in range(prompt_len)]
    params = SamplingParams(max_new_tokens=chunks, logprobs=True)
    prep = Prepared(prompt, params, 1, [], True, False, True, logprob_text=True, logprob_starts=[0])
    run, shape = Run(frontend, prep, "rid"), GenerateShape()
    state = ChoiceState(0, tokenizer, [], True, prompt[-4:])
    for i in range(chunks):
        state.accept(StepOutput(0, [ord("x")], "length" if i == chunks - 1 else None, logprobs=[-0.5],
                                prompt_logprobs=[-1.0] * prompt_len if i == 0 else None))
        assert shape.middle(run, state, "x")
    named = tokenizer.named
    assert named <= 2 * (prompt_len + chunks), (
        f"{named} token_text calls for a {prompt_len}-token prompt streamed over {chunks} chunks")


def test_the_incremental_decoder_does_not_redecode_an_ever_growing_window() -> None:
    """``HFIncrementalDecoder.push`` decodes the window since the last emitted text again for each new token
    and emits nothing while it ends in U+FFFD: a run of tokens that never completes a character (byte-level
    tokens of lone UTF-8 continuation bytes, which a request's ``logit_bias`` can ask for, as can any garbled
    output) keeps the window growing, and each push decodes all of it. Measured with SmolLM2's tokenizer
    (its ``DecodeStream`` path, the Python one the same): 8,000 such tokens cost 5.4 s of the loop, up to
    2.4 ms a push (0.5 s for 2,000: quadratic); the worker's ``StopWatch`` runs the same decoder on its
    scheduler's step. A UTF-8 character is at most 4 bytes: a window longer than that which still ends in
    U+FFFD never will end otherwise, and its text can be emitted."""
    from gateway.hf_tokenizer import HFTokenizer
    from workers.engines.llama.gguf_convert import default_model_dir

    tokenizer = HFTokenizer.from_dir(default_model_dir())
    lone = 111  # (SmolLM2: a lone byte of a multi-byte character)
    assert tokenizer.decode([lone]) == "\ufffd"
    decoder = tokenizer.decoder([1, 2, 3, 4])  # (below: its Python path, whose work can be counted)
    decoder._stream = None  # type: ignore[attr-defined]
    decoded = [0]
    inner = decoder._decode  # type: ignore[attr-defined]

    def counting(ids: Any) -> str:
        decoded[0] += len(ids)
        return inner(ids)

    decoder._decode = counting  # type: ignore[attr-defined]
    pushes = 1000
    for _ in range(pushes):
        decoder.push([lone])
    assert decoded[0] <= 40 * pushes, f"{decoded[0]} token ids decoded for {pushes} pushes of one token"


class _ManyLogprobs:
    """A dispatcher whose one choice ends with ``tokens`` tokens, each with 20 top logprobs."""

    def __init__(self, tokens: int) -> None:
        self.tokens = tokens

    async def complete(self, input_ids: list[int], params: SamplingParams, state: ChoiceState, **_: Any) -> None:
        top = [TokenLogprob(ord("a") + k, -1.0 - k) for k in range(20)]
        for start in range(0, self.tokens, 64):
            count = min(64, self.tokens - start)
            state.accept(StepOutput(0, [ord("x")] * count, "length" if start + count >= self.tokens else None,
                                    logprobs=[-0.5] * count, top_logprobs=[top] * count))
            await asyncio.sleep(0)


class _RecordingChatShape(ChatShape):
    def __init__(self) -> None:
        self.threads: list[int] = []

    def whole(self, run: Run, choices: list[ChoiceState]) -> dict[str, Any]:
        self.threads.append(threading.get_ident())
        return super().whole(run, choices)


def test_a_large_whole_answer_is_not_shaped_and_encoded_on_the_event_loop() -> None:
    """A whole (non-streamed) answer is built (``Shape.whole``) and JSON-encoded in one step of the loop
    (``Responder.serve``), however large: with the sim engine, chat ``n: 64, max_tokens: 1000, logprobs`` (a
    136-byte body) stalled a probe stream for 269 ms, and completions ``echo`` + ``logprobs`` over a batch of
    64 x 2,000-token prompts for 249 ms. With a model's top logprobs (``top_logprobs: 20``), building and
    encoding alone took 0.15 s (n 1 x 8,000 tokens, 12 MB), 0.9 s (n 16 x 2,000, 48 MB) and, for completions'
    echo with ``logprobs: 5`` over 64 x 2,000 prompt tokens, 1.5 s. A large answer's JSON belongs on a thread
    (or streamed out in parts), as a long prompt's preparation is."""
    async def main() -> None:
        host = _Host()
        host.frontend = Frontend(_ManyLogprobs(4000), ByteTokenizer(), "m", max_context=1 << 20)  # type: ignore[arg-type]
        shape = _RecordingChatShape()
        responder = Responder(host, shape)
        exchange = _Exchange(json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4000,
                                         "logprobs": True, "top_logprobs": 20}).encode())
        await responder.serve(exchange)  # type: ignore[arg-type]
        ((status, answer),) = exchange.answers
        assert status == 200 and len(answer["choices"][0]["logprobs"]["content"]) == 4000
        assert shape.threads and threading.get_ident() not in shape.threads, \
            "a 4,000-token answer with 20 top logprobs each was shaped on the event loop"

    asyncio.run(main())


def test_a_generate_streams_chunks_are_what_they_were_before_the_lists_were_kept_encoded(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The encoded-once lists (``_Cumulative``) give each chunk the very JSON the whole build gives, logprobs (with
    their text) and prompt logprobs included, however many tokens each output brings."""
    monkeypatch.setattr("gateway.shapes._monotonic", lambda: 5.0)  # (the same ``e2e_latency`` in both)
    tokenizer = ByteTokenizer()
    frontend = Frontend(None, tokenizer, "m", max_context=1 << 20)  # type: ignore[arg-type]
    prompt = [ord(c) for c in "the prompt"]
    for want_logprobs, text in ((True, True), (True, False), (False, False)):
        params = SamplingParams(max_new_tokens=40, logprobs=want_logprobs)
        prep = Prepared(prompt, params, 1, [], True, False, want_logprobs, logprob_text=text, logprob_starts=[3])
        run, shape = Run(frontend, prep, "rid"), GenerateShape()
        state = ChoiceState(0, tokenizer, [], want_logprobs, prompt[-4:])
        sizes = [1, 3, 1, 7, 2, 1, 25]
        for i, size in enumerate(sizes):
            last = i == len(sizes) - 1
            state.accept(StepOutput(0, [ord("a") + (i + k) % 26 for k in range(size)], "length" if last else None,
                                    logprobs=[-0.25 * (k + 1) for k in range(size)] if want_logprobs else None,
                                    prompt_logprobs=[-1.5] * len(prompt) if i == 0 and want_logprobs else None))
            chunk = shape.middle(run, state, "")
            assert chunk is not None
            assert json.loads(chunk[len(b"data: "):]) == shape.whole(run, [state]), (want_logprobs, text, i)


def test_an_ebnf_grammar_of_too_many_rules_is_refused() -> None:
    from gateway.errors import BadRequest
    from workers.protocol import Grammar

    with_rules = Grammar("ebnf", _gbnf(structured_output.MAX_EBNF_RULES + 1), param="ebnf")
    try:
        structured_output.checked(with_rules)
    except BadRequest as exc:
        assert exc.param == "ebnf" and "rules" in exc.message
    else:
        raise AssertionError("accepted")


def test_the_incremental_decoder_streams_what_the_whole_decode_gives_around_lone_bytes() -> None:
    """Runs of tokens that never make a character (the held window cut past them) between whole characters
    split over tokens: pushed in groups of any size, the text is the whole decode's."""
    import random

    from gateway.hf_tokenizer import HFTokenizer
    from workers.engines.llama.gguf_convert import default_model_dir

    tokenizer = HFTokenizer.from_dir(default_model_dir())
    lone = [i for i in range(2000) if tokenizer.decode([i]) == "\ufffd"]
    assert len(lone) > 50
    rng = random.Random(7)
    for _ in range(150):
        ids = [rng.choice(lone) if rng.random() < 0.8 else rng.randrange(40000) for _ in range(rng.randint(1, 120))]
        if rng.random() < 0.5:
            ids += tokenizer.encode("中文😀é" * rng.randint(1, 4)) + ids[: rng.randint(0, 12)]
        decoder = tokenizer.decoder([])
        out, i = [], 0
        while i < len(ids):
            size = rng.choice([1, 1, 1, 2, 5, 20])
            out.append(decoder.push(ids[i:i + size]))
            i += size
        out.append(decoder.flush())
        assert "".join(out) == tokenizer.decode(ids), ids
