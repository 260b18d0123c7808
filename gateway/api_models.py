"""Client request bodies (OpenAI and SGLang ``/generate``), decoded and type-checked by msgspec.

Unknown fields are ignored (clients send many optional ones); known fields with the wrong type
are a 400 naming the field. Semantic checks live in ``gateway.api``.

Fields that would change what a request means but that the gateway does not implement (penalties,
logit bias, tools, structured output, non-text inputs...) are declared here only so that
``gateway.api.reject_unsupported`` can answer a 400 naming them instead of silently dropping them.
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
    # SGLang's PD fields, set by an SGLang router in front of our workers; the gateway assigns its
    # own rooms and ignores them (see ``gateway.api.ClientBootstrap``).
    bootstrap_host: Any = None
    bootstrap_port: Any = None
    bootstrap_room: Any = None
    # not supported: a 400 unless absent or at the neutral value (see gateway.api)
    logit_bias: dict[str, float] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    regex: Any = None
    ebnf: Any = None
    json_schema: Any = None


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = []
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    # not supported: a 400 unless absent or neutral
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None
    response_format: Any = None
    modalities: list[str] | None = None
    audio: Any = None


class CompletionRequest(_Sampling):
    prompt: str | list[Any] | None = None  # str, token ids, or a one-element batch of either
    logprobs: int | None = None
    echo: bool = False
    # not supported: a 400 unless absent or neutral
    suffix: str | None = None
    best_of: int | None = None


class GenerateRequest(msgspec.Struct):
    """SGLang's native ``/generate`` body (single request)."""

    text: str | None = None
    input_ids: list[int] | None = None
    sampling_params: dict[str, Any] = {}
    stream: bool = False
    return_logprob: bool = False
    rid: str | None = None
    bootstrap_host: Any = None  # SGLang's PD fields: see ``_Sampling``
    bootstrap_port: Any = None
    bootstrap_room: Any = None
    # not supported: a 400 when set
    image_data: Any = None
    audio_data: Any = None
    video_data: Any = None
    input_embeds: Any = None
    lora_path: Any = None
    custom_logit_processor: Any = None
    return_hidden_states: bool = False


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
    # not supported: a 400 unless absent or neutral
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_new_tokens: int = 0
    logit_bias: Any = None
    regex: Any = None
    json_schema: Any = None
    ebnf: Any = None
    structural_tag: Any = None
