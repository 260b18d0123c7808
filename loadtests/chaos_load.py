"""The chaos runner's load: closed-loop clients over aiohttp, each request judged by what the client saw.

Lifecycle (``Load``, owned by one ``loadtests/chaos.py`` run; event loop only):
1. ``Load(base_url, reference, ...)``; ``start(concurrency)`` launches that many named client tasks.
   Each loops until ``stop()``: draw a request kind (seeded), send it, judge it, record an ``Outcome``.
   Kinds: ``stream`` (SSE, read to ``[DONE]``), ``whole`` (one JSON body), ``disconnect`` (a stream
   the client closes after a few chunks) and ``hangup`` (a whole request the client gives up on
   after a fraction of a second). ``burst(n)`` sends ``n`` extra disconnecting requests at once.
2. Every request runs under its own deadline (``request_timeout_s``): past it the client gives up
   and the request counts as ``hung``. ``inflight`` holds each open request's deadline, so a
   monitor can see a hung client while it hangs, not only at its deadline.
3. ``await stop()`` ends the loops after their current request; ``outcomes`` is the record.

Judging (``Result``): a completed request must carry exactly the text a correct P->D run of the sim
engine produces for its prompt (``Reference``), one response id and usage counted once. A failure
is *clear* when it is OpenAI-shaped (``{"error": {"message", "type", ...}}``) with a status the
gateway gives for a failure before the first token (429, 502, 503, 504); a stream that had started
(status 200, text under way) and then got an error event is ``stream_failed``; a reset connection,
a cut stream, a 500 or a body that is not OpenAI-shaped is ``unclear``.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import aiohttp

from workers.engines.base import EngineOptions, SeqInput
from workers.engines.sim import SimEngine
from workers.kv_pool import KVPool
from workers.protocol import SamplingParams

CLEAR_STATUSES = frozenset({429, 502, 503, 504})  # what the gateway answers for a failure before the first token
PROMPT_LENGTHS = (8, 24, 60, 120, 200)
ALPHABET = b"abcdefghijklmnopqrstuvwxyz "
KINDS = ("stream", "whole", "disconnect", "hangup")
KIND_WEIGHTS = (0.55, 0.25, 0.12, 0.08)
MAX_TOKENS = {"stream": (16, 32, 64), "whole": (8, 24), "disconnect": (96,), "hangup": (96,)}
HANGUP_AFTER_S = (0.05, 0.3)


class Result(StrEnum):
    OK = "ok"
    WRONG = "wrong"  # completed, but the text, the id or the usage is not what it must be
    CLEAR_ERROR = "clear_error"  # failed before it started, with a clear OpenAI-shaped error
    STREAM_FAILED = "stream_failed"  # a stream that had started ended with an error event
    UNCLEAR = "unclear"  # reset, cut, 500, not OpenAI-shaped
    HUNG = "hung"  # no end within its deadline
    DISCONNECTED = "disconnected"  # the client left on purpose


@dataclass
class Outcome:
    kind: str
    prompt: int
    max_tokens: int
    t_start: float
    t_end: float
    result: Result
    tokens: int = 0
    status: int | None = None
    detail: str = ""


class Reference:
    """What the sim engine must answer: prefill then decode on the same KV (greedy, deterministic)."""

    def __init__(self, prompts: list[list[int]], max_tokens: int, page_size: int) -> None:
        zero = {"prefill_token_s": "0", "decode_step_s": "0", "decode_seq_s": "0"}
        prefill, decode = SimEngine(EngineOptions(extra=zero)), SimEngine(EngineOptions(extra=zero))
        info = decode.info
        self.texts: list[str] = []
        for seq_id, prompt in enumerate(prompts):  # one id per prompt: the engine keeps a running digest per id
            pool = KVPool(num_layers=info.num_layers, num_pages=(len(prompt) + max_tokens) // page_size + 2,
                          page_size=page_size, num_kv_heads=info.num_kv_heads, head_dim=info.head_dim)
            prefill.bind(pool)
            decode.bind(pool)
            pages = pool.alloc(pool.pages_for(len(prompt) + max_tokens))
            assert pages is not None
            (out,) = prefill.forward([SeqInput(seq_id, pages, 0, prompt, True, SamplingParams())])
            seq, tokens = list(prompt), [out.token_id]
            while len(tokens) < max_tokens:
                seq.append(tokens[-1])
                (out,) = decode.forward([SeqInput(seq_id, pages, len(seq) - 1, [seq[-1]], True, SamplingParams())])
                tokens.append(out.token_id)
            self.texts.append(bytes(t for t in tokens if t is not None).decode())

    def text(self, prompt: int, max_tokens: int) -> str:
        return self.texts[prompt][:max_tokens]


def make_prompts(rng: random.Random, count: int) -> list[list[int]]:
    return [[rng.choice(ALPHABET) for _ in range(PROMPT_LENGTHS[i % len(PROMPT_LENGTHS)])] for i in range(count)]


def _error_of(body: Any) -> dict[str, Any] | None:
    """The ``error`` object of an OpenAI-shaped error body, or None if it is not one."""
    err = body.get("error") if isinstance(body, dict) else None
    if isinstance(err, dict) and isinstance(err.get("message"), str) and err["message"] and isinstance(
            err.get("type"), str):
        return err
    return None


@dataclass
class Load:
    base_url: str
    reference: Reference
    prompts: list[list[int]]
    rng: random.Random
    request_timeout_s: float = 60.0
    outcomes: list[Outcome] = field(default_factory=list)
    inflight: dict[int, tuple[float, str]] = field(default_factory=dict)  # request no. -> (deadline, kind)
    on_outcome: Callable[[Outcome], None] | None = None
    num_sent: int = 0
    _stopping: bool = False
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)
    _session: aiohttp.ClientSession | None = None

    def start(self, concurrency: int) -> None:
        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                              timeout=aiohttp.ClientTimeout(total=None))
        for i in range(concurrency):
            self._tasks.append(asyncio.create_task(self._client(random.Random(self.rng.random())),
                                                   name=f"chaos-client-{i}"))

    async def stop(self) -> None:
        self._stopping = True
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def burst(self, count: int) -> None:
        """``count`` requests at once that the client abandons part-way (half streams, half whole)."""
        rng = random.Random(self.rng.random())
        await asyncio.gather(*(self.one(rng, "disconnect" if i % 2 else "hangup") for i in range(count)))

    async def _client(self, rng: random.Random) -> None:
        while not self._stopping:
            await self.one(rng, rng.choices(KINDS, KIND_WEIGHTS)[0])

    async def one(self, rng: random.Random, kind: str) -> Outcome:
        prompt = rng.randrange(len(self.prompts))
        max_tokens = rng.choice(MAX_TOKENS[kind])
        number = self.num_sent
        self.num_sent += 1
        t0 = time.monotonic()
        self.inflight[number] = (t0 + self.request_timeout_s, kind)
        outcome = Outcome(kind, prompt, max_tokens, t0, t0, Result.UNCLEAR)
        try:
            async with asyncio.timeout(self.request_timeout_s):
                if kind in ("stream", "disconnect"):
                    await self._stream(outcome, rng.randint(2, 6) if kind == "disconnect" else None)
                else:
                    await self._whole(outcome, rng.uniform(*HANGUP_AFTER_S) if kind == "hangup" else None)
        except TimeoutError:
            outcome.result, outcome.detail = Result.HUNG, f"no end within {self.request_timeout_s:g}s"
        except (aiohttp.ClientError, ConnectionError, ValueError) as exc:
            outcome.result, outcome.detail = Result.UNCLEAR, f"{type(exc).__name__}: {exc}"
        except (AttributeError, TypeError, KeyError, IndexError) as exc:  # JSON not shaped as a completion
            # (raised on, it would end this client's loop unseen: stop() gathers with return_exceptions)
            outcome.result, outcome.detail = Result.UNCLEAR, f"reply not shaped as a completion: {exc!r}"
        finally:
            outcome.t_end = time.monotonic()
            self.inflight.pop(number, None)
        self.outcomes.append(outcome)
        if self.on_outcome is not None:
            self.on_outcome(outcome)
        return outcome

    def _body(self, outcome: Outcome, stream: bool) -> dict[str, Any]:
        body: dict[str, Any] = {"model": "sim", "prompt": self.prompts[outcome.prompt],
                                "max_tokens": outcome.max_tokens, "stream": stream}
        if stream:
            body["stream_options"] = {"include_usage": True}
        return body

    def _judge_failure(self, outcome: Outcome, status: int, raw: bytes) -> None:
        try:
            err = _error_of(json.loads(raw))
        except ValueError:
            err = None
        clear = err is not None and status in CLEAR_STATUSES
        outcome.result = Result.CLEAR_ERROR if clear else Result.UNCLEAR
        outcome.detail = f"{status} {err['type']}: {err['message']}" if err else f"{status}: {raw[:200]!r}"

    def _judge_text(self, outcome: Outcome, text: str, ids: set[str], usage: Any, complete: bool) -> None:
        want = self.reference.text(outcome.prompt, outcome.max_tokens)
        outcome.tokens = len(text)
        if len(ids) > 1:
            outcome.result, outcome.detail = Result.WRONG, f"{len(ids)} response ids in one stream"
        elif not want.startswith(text) or (complete and text != want):
            outcome.result, outcome.detail = Result.WRONG, f"text {text!r} is not {want!r}"
        elif complete and usage is not None and (usage.get("completion_tokens") != outcome.max_tokens or
                                                 usage.get("prompt_tokens") != len(self.prompts[outcome.prompt])):
            outcome.result, outcome.detail = Result.WRONG, f"usage {usage}"
        elif complete and usage is None:
            outcome.result, outcome.detail = Result.WRONG, "no usage"
        else:
            outcome.result = Result.OK if complete else Result.DISCONNECTED

    async def _whole(self, outcome: Outcome, hangup_s: float | None) -> None:
        assert self._session is not None
        try:
            async with asyncio.timeout(hangup_s), self._session.post(
                    f"{self.base_url}/v1/completions", json=self._body(outcome, False)) as resp:
                outcome.status = resp.status
                raw = await resp.read()
        except TimeoutError:
            if hangup_s is None:
                raise
            outcome.result = Result.DISCONNECTED
            return
        if resp.status != 200:
            self._judge_failure(outcome, resp.status, raw)
            return
        body = json.loads(raw)
        choices = body.get("choices") or [{}]
        self._judge_text(outcome, choices[0].get("text", ""), {body.get("id", "")}, body.get("usage"), True)

    async def _stream(self, outcome: Outcome, leave_after: int | None) -> None:
        assert self._session is not None
        async with self._session.post(f"{self.base_url}/v1/completions", json=self._body(outcome, True)) as resp:
            outcome.status = resp.status
            if resp.status != 200:
                self._judge_failure(outcome, resp.status, await resp.read())
                return
            text, ids, usage, chunks = "", set(), None, 0
            error: dict[str, Any] | None = None
            done = False
            while True:
                line = await resp.content.readline()
                if not line:
                    break  # the connection ended
                if not line.startswith(b"data: "):
                    continue
                data = line[6:].strip()
                if data == b"[DONE]":
                    done = True
                    break
                event = json.loads(data)
                if "error" in event:
                    error = _error_of(event) or {"type": "?", "message": repr(event)[:200]}
                    continue
                ids.add(event.get("id", ""))
                usage = event.get("usage") or usage
                for choice in event.get("choices", ()):
                    text += choice.get("text", "")
                    chunks += 1
                if leave_after is not None and chunks >= leave_after and len(text) < outcome.max_tokens:
                    resp.close()  # the client leaves mid-stream
                    self._judge_text(outcome, text, ids, usage, False)
                    return
            if error is not None:
                outcome.tokens = len(text)
                clear = _error_of({"error": error}) is not None
                outcome.result = Result.STREAM_FAILED if clear and done else Result.UNCLEAR
                outcome.detail = f"after {len(text)} chars: {error['type']}: {error['message']}"
                return
            if not done:
                outcome.tokens = len(text)
                outcome.result, outcome.detail = Result.UNCLEAR, f"stream cut after {len(text)} chars, no [DONE]"
                return
            self._judge_text(outcome, text, ids, usage, True)


def hung_now(load: Load, now: float, grace_s: float = 1.0) -> list[str]:
    """Requests open past their deadline right now (each one's own timeout will also record it)."""
    return [f"request {n} ({kind})" for n, (deadline, kind) in list(load.inflight.items()) if now > deadline + grace_s]

