"""Client request bodies (OpenAI and SGLang ``/generate``), decoded and type-checked by msgspec.

Unknown fields are ignored (clients send many optional ones); known fields with the wrong type
are a 400 naming the field. Semantic checks live in ``gateway.api``.
"""

from __future__ import annotations

from typing import Any

import msgspec


class StreamOptions(msgspec.Struct):
    include_usage: bool = False


class ChatMessage(msgspec.Struct):
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None


class _Sampling(msgspec.Struct):
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    timeout_s: float | None = None  # ours: per-request deadline


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = []
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None


class CompletionRequest(_Sampling):
    prompt: str | list[Any] | None = None  # str, token ids, or a one-element batch of either
    logprobs: int | None = None
    echo: bool = False


class GenerateRequest(msgspec.Struct):
    """SGLang's native ``/generate`` body (single request)."""

    text: str | None = None
    input_ids: list[int] | None = None
    sampling_params: dict[str, Any] = {}
    stream: bool = False
    return_logprob: bool = False
    rid: str | None = None
    bootstrap_host: Any = None  # accepted and ignored: the gateway assigns rooms itself
    bootstrap_port: Any = None
    bootstrap_room: Any = None


class GenerateSampling(msgspec.Struct):
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    seed: int | None = msgspec.field(default=None, name="sampling_seed")
