"""locust users for the gateway's OpenAI API: chat and completions, streaming and not, shared-prefix and
random prompts; TTFT and inter-token latency reported as their own locust entries.

Run headless against a local sim cluster (``pd-cluster --engine sim --port 8000`` in another shell):

    .venv/bin/locust -f loadtests/locustfile.py --headless -u 32 -r 8 -t 30s --host http://127.0.0.1:8000

Entries in locust's table (``Type`` column / ``Name`` column):
- ``POST`` / ``chat stream [shared]`` etc.: the whole request, to the last byte (for streams too:
  locust alone would stop the clock at the response headers).
- ``TTFT`` / same name: request sent -> first SSE event carrying output text.
- ``ITL`` / same name: the gap between two successive SSE events carrying output text (one entry per
  gap; the gateway sends one event per decode step that produced text, so normally per token).
- ``tokens`` / same name: "response time" is the number of output tokens of one request (a way to
  see the per-request token count in locust's table; with the byte tokenizer, one character = one
  token).

Settings (environment variables; tasks also carry tags: ``chat``, ``completions``, ``stream``,
``nostream``, so ``--tags stream`` or ``--exclude-tags completions`` narrow the mix):
- ``LOAD_W_CHAT_STREAM`` (4), ``LOAD_W_CHAT`` (2), ``LOAD_W_COMPLETION_STREAM`` (1),
  ``LOAD_W_COMPLETION`` (1): task weights (0 switches a task off).
- ``LOAD_SHARED_PREFIX`` (0.5): the share of requests whose prompt starts with the same
  ``LOAD_PREFIX_CHARS`` (512) characters (a cache-aware policy can route those to a warm prefill);
  the others are random text of the same length.
- ``LOAD_MAX_TOKENS`` (64): ``max_tokens`` of every request; ``LOAD_MODEL``: the model name
  (default: the first one ``/v1/models`` lists).

Why ``FastHttpUser``: its geventhttpclient costs several times less CPU per request than
``HttpUser``'s requests stack (and far less than the ``openai`` package's httpx), so one locust
process can drive the gateway harder before it becomes the bottleneck. Streams are read one SSE
event at a time from the underlying geventhttpclient response (``readline(b"\\n\\n")``): locust's
own ``iter_content`` reads fixed-size blocks and would hold early events back.
"""

from __future__ import annotations

import json
import os
import random
import string
import time
from typing import Any

from locust import FastHttpUser, between, tag, task

MAX_TOKENS = int(os.environ.get("LOAD_MAX_TOKENS", "64"))
SHARED_SHARE = float(os.environ.get("LOAD_SHARED_PREFIX", "0.5"))
PREFIX_CHARS = int(os.environ.get("LOAD_PREFIX_CHARS", "512"))
SHARED_PREFIX = ("You are a careful assistant serving a load test. Answer briefly and precisely. " * 64)[:PREFIX_CHARS]
_WORDS = ["".join(random.Random(i).choices(string.ascii_lowercase, k=1 + i % 9)) for i in range(512)]


def _weight(name: str, default: int) -> int:
    return int(os.environ.get(name, str(default)))


def _random_text(rng: random.Random, num_chars: int) -> str:
    words: list[str] = []
    size = 0
    while size < num_chars:
        word = rng.choice(_WORDS)
        words.append(word)
        size += len(word) + 1
    return " ".join(words)[:num_chars]


class OpenAIUser(FastHttpUser):
    """One client of the OpenAI API; each task is one request of one kind."""

    wait_time = between(0.0, 0.05)
    model = os.environ.get("LOAD_MODEL", "")

    def on_start(self) -> None:
        self.rng = random.Random()
        if not self.model:
            with self.client.get("/v1/models", name="/v1/models", catch_response=True) as resp:
                try:
                    type(self).model = resp.json()["data"][0]["id"]
                except Exception as exc:  # any failure: reported as this entry's failure
                    resp.failure(f"cannot read the model name: {exc}")
                    type(self).model = "sim"

    # -- prompts ------------------------------------------------------------------------------------
    def _prompt(self) -> tuple[str, str]:
        """(prompt text, "shared" | "random")."""
        suffix = _random_text(self.rng, 48)
        if self.rng.random() < SHARED_SHARE:
            return f"{SHARED_PREFIX}\n{suffix}", "shared"
        return f"{_random_text(self.rng, PREFIX_CHARS)}\n{suffix}", "random"

    def _chat_body(self, stream: bool) -> tuple[dict[str, Any], str]:
        text, kind = self._prompt()
        return {"model": self.model, "messages": [{"role": "user", "content": text}], "max_tokens": MAX_TOKENS,
                "temperature": 0, "stream": stream}, kind

    def _completion_body(self, stream: bool) -> tuple[dict[str, Any], str]:
        text, kind = self._prompt()
        return {"model": self.model, "prompt": text, "max_tokens": MAX_TOKENS, "temperature": 0,
                "stream": stream}, kind

    # -- tasks --------------------------------------------------------------------------------------
    @tag("chat", "stream")
    @task(_weight("LOAD_W_CHAT_STREAM", 4))
    def chat_stream(self) -> None:
        body, kind = self._chat_body(True)
        self._stream("/v1/chat/completions", body, f"chat stream [{kind}]")

    @tag("chat", "nostream")
    @task(_weight("LOAD_W_CHAT", 2))
    def chat(self) -> None:
        body, kind = self._chat_body(False)
        self._whole("/v1/chat/completions", body, f"chat [{kind}]")

    @tag("completions", "stream")
    @task(_weight("LOAD_W_COMPLETION_STREAM", 1))
    def completion_stream(self) -> None:
        body, kind = self._completion_body(True)
        self._stream("/v1/completions", body, f"completions stream [{kind}]")

    @tag("completions", "nostream")
    @task(_weight("LOAD_W_COMPLETION", 1))
    def completion(self) -> None:
        body, kind = self._completion_body(False)
        self._whole("/v1/completions", body, f"completions [{kind}]")

    # -- requests -----------------------------------------------------------------------------------
    def _whole(self, path: str, body: dict[str, Any], name: str) -> None:
        with self.client.post(path, json=body, name=name, catch_response=True) as resp:
            if resp.status_code != 200:
                resp.failure(f"HTTP {resp.status_code}: {(resp.text or '')[:200]}")
                return
            try:
                num_tokens = int(resp.json()["usage"]["completion_tokens"])
            except Exception as exc:  # any failure: reported as this entry's failure
                resp.failure(f"bad response body: {exc}")
                return
            self._report("tokens", name, num_tokens)

    def _stream(self, path: str, body: dict[str, Any], name: str) -> None:
        t0 = time.perf_counter()
        with self.client.post(path, json=body, name=name, stream=True, catch_response=True) as resp:
            if resp.status_code != 200:
                resp.failure(f"HTTP {resp.status_code}: {(resp.read() or b'')[:200]!r}")
                return
            raw = resp._response  # geventhttpclient's response: readline returns each event as it arrives
            t_last: float | None = None
            num_tokens = 0
            done = False
            error: str | None = None
            while True:
                event = raw.readline(b"\n\n")
                if not event:
                    break
                if not event.startswith(b"data: "):
                    continue
                data = event[6:].strip()
                if data == b"[DONE]":
                    done = True
                    continue
                chunk = json.loads(data)
                if "error" in chunk:
                    error = str(chunk["error"].get("message", chunk["error"]))
                    continue
                text = "".join((c.get("delta") or {}).get("content") or c.get("text") or ""
                               for c in chunk.get("choices", []))
                if not text:
                    continue
                now = time.perf_counter()
                if t_last is None:
                    self._report("TTFT", name, (now - t0) * 1000)
                else:
                    self._report("ITL", name, (now - t_last) * 1000)
                t_last = now
                num_tokens += len(text)
            resp.request_meta["response_time"] = (time.perf_counter() - t0) * 1000  # the whole stream
            if error is not None:
                resp.failure(f"error event: {error}")
            elif not done:
                resp.failure("stream ended without data: [DONE]")
            else:
                self._report("tokens", name, num_tokens)

    def _report(self, kind: str, name: str, value: float) -> None:
        self.environment.events.request.fire(request_type=kind, name=name, response_time=value,
                                             response_length=0, exception=None, context={})
