"""A long prompt is prepared (parsed, templated, tokenized) on a thread, the rest on the event loop.

In process: a ``Responder`` over a stand-in host and exchange, with a real ``Frontend`` whose
tokenizer records the thread it runs on and whose dispatcher has no workers (so a request that got
through its preparation ends with a 503, one that did not with its 400).
"""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Any

from gateway.admission import Admission
from gateway.api import Frontend
from gateway.errors import NoWorkers
from gateway.metrics import GatewayMetrics
from gateway.responder import Responder
from gateway.shapes import ChatShape, CompletionShape
from gateway.tokenizer import ByteTokenizer


class _RecordingTokenizer(ByteTokenizer):
    def __init__(self) -> None:
        super().__init__()
        self.threads: list[int] = []

    def apply_chat_template(self, messages: list[dict[str, Any]], tools: Any = None) -> list[int]:
        self.threads.append(threading.get_ident())
        return super().apply_chat_template(messages)

    def encode(self, text: str) -> list[int]:
        self.threads.append(threading.get_ident())
        return super().encode(text)


class _NoWorkers:
    async def complete(self, *args: Any, **kwargs: Any) -> None:
        raise NoWorkers("no healthy decode worker", retry_after_s=1.0)


class _Host:
    max_body_bytes = 1 << 20
    body_timeout_s = 5.0

    def __init__(self, tokenizer: _RecordingTokenizer) -> None:
        self.metrics = GatewayMetrics()
        self.admission = Admission(0, 0, 1.0, self.metrics)
        self.frontend = Frontend(_NoWorkers(), tokenizer, "m", max_context=1 << 20)  # type: ignore[arg-type]

    def require_frontend(self) -> Frontend:
        return self.frontend


class _Exchange:
    def __init__(self, body: bytes) -> None:
        self.loop = asyncio.get_running_loop()
        self.body = body
        self.headers: list[tuple[bytes, bytes]] = []
        self.answers: list[tuple[int, dict[str, Any]]] = []

    def check_length(self, limit: int) -> None:
        pass

    async def read_body(self, limit: int, timeout_s: float) -> bytes:
        return self.body

    def watch_disconnect(self, gone: list[bool]) -> None:
        pass

    def stop_watching(self) -> None:
        pass

    async def send_json(self, body: bytes, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        self.answers.append((status, json.loads(body)))


def test_a_long_prompt_is_prepared_on_a_thread_and_the_request_goes_on() -> None:
    async def main() -> None:
        loop_thread = threading.get_ident()
        tokenizer = _RecordingTokenizer()
        host = _Host(tokenizer)
        chat = Responder(host, ChatShape(), prepare_thread_bytes=1000)  # type: ignore[arg-type]
        completions = Responder(host, CompletionShape(), prepare_thread_bytes=1000)  # type: ignore[arg-type]

        def body(content: str, role: str = "user") -> bytes:
            messages = [{"role": role, "content": content}]
            return json.dumps({"model": "m", "messages": messages, "max_tokens": 4}).encode()

        cases = [
            (chat, body("short"), 503, False),
            (chat, body("long " * 400), 503, True),
            (chat, body("long " * 400, role="nobody"), 400, None),  # refused on the thread: never tokenized
            (completions, json.dumps({"model": "m", "prompt": "x" * 2000, "max_tokens": 4}).encode(), 503, True),
            (completions, json.dumps({"model": "other", "prompt": "x" * 2000}).encode(), 404, None),
        ]
        for responder, data, status, on_thread in cases:
            tokenizer.threads.clear()
            exchange = _Exchange(data)
            await responder.serve(exchange)  # type: ignore[arg-type]
            assert [answer[0] for answer in exchange.answers] == [status], exchange.answers
            if on_thread is None:
                assert tokenizer.threads == []
            else:
                (thread,) = set(tokenizer.threads)
                assert (thread != loop_thread) == on_thread
        _, error = exchange.answers[0]
        assert error["error"]["code"] == "model_not_found"

    asyncio.run(main())


def test_a_zero_threshold_prepares_everything_on_the_loop() -> None:
    async def main() -> None:
        tokenizer = _RecordingTokenizer()
        responder = Responder(_Host(tokenizer), ChatShape(), prepare_thread_bytes=0)  # type: ignore[arg-type]
        exchange = _Exchange(json.dumps({"messages": [{"role": "user", "content": "y" * 50_000}]}).encode())
        await responder.serve(exchange)  # type: ignore[arg-type]
        assert [a[0] for a in exchange.answers] == [503] and set(tokenizer.threads) == {threading.get_ident()}

    asyncio.run(main())


def test_a_schema_nested_just_shallow_enough_to_decode_is_a_400() -> None:
    """msgspec decodes a schema nested ~950 deep; serializing or checking it then ran out of recursion and the
    catch-all answered 500 "internal error in the gateway" (on the loop and on the prepare thread alike)."""
    wraps = ['"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": %s}}',
             '"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", '
             '"properties": {"a": %s}}}}], "tool_choice": "required"']

    async def main() -> None:
        host = _Host(_RecordingTokenizer())
        for threshold in (0, 1000):
            responder = Responder(host, ChatShape(), prepare_thread_bytes=threshold)  # type: ignore[arg-type]
            for wrap in wraps:
                statuses = set()
                for depth in range(900, 1001, 3):
                    deep = '{"items": ' * depth + "{}" + "}" * depth
                    exchange = _Exchange(('{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, '
                                          + wrap % deep + "}").encode())
                    await responder.serve(exchange)  # type: ignore[arg-type]
                    statuses.update(answer[0] for answer in exchange.answers)
                assert statuses == {400}, (threshold, wrap[:20], statuses)

    asyncio.run(main())


def test_a_long_text_is_encoded_letting_other_threads_run() -> None:
    """SmolLM2's tokenizer encoding a chat of ~1 MB on a thread (where a long prompt is prepared) held the
    interpreter's lock for the whole run: the event loop stood still for seconds (7 s for 2 MB), every
    stream and health probe with it. Long texts are encoded through ``encode_batch``, which lets other
    threads run; the ids are the same. (Counted, not timed: the main thread wakes many times meanwhile.)"""
    import random
    import time

    from gateway.hf_tokenizer import LONG_TEXT, HFTokenizer
    from workers.engines.llama.gguf_convert import default_model_dir

    tokenizer = HFTokenizer.from_dir(default_model_dir())
    rng = random.Random(1)
    text = " ".join(rng.choice(("alpha", "beta", "gamma")) + str(rng.randint(0, 99999)) for _ in range(100_000))
    assert len(text) > LONG_TEXT
    messages = [{"role": "user", "content": text}]
    done = threading.Event()
    out: list[list[int]] = []

    def encode() -> None:
        try:
            out.append(tokenizer.apply_chat_template(messages))
        finally:
            done.set()

    worker = threading.Thread(target=encode)
    worker.start()
    wakes = 0
    while not done.is_set():
        time.sleep(0.001)
        wakes += 1
    worker.join()
    assert wakes >= 20, f"the main thread ran {wakes} times while a long text was encoded"
    rendered = tokenizer.render_chat(messages, True, None, None)
    assert out[0] == tokenizer._tok.encode(rendered, add_special_tokens=False).ids
    short = "Hello, world! " * 10
    assert tokenizer.encode(short) == tokenizer._tok.encode(short, add_special_tokens=True).ids
