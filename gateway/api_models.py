"""Client request bodies (OpenAI and SGLang ``/generate``), decoded and type-checked by msgspec.

Unknown fields are ignored (clients send many optional ones); known fields with the wrong type
or out of range are a 400 naming the field. ``null`` means the default for every optional
field, as in OpenAI's schema (clients send ``"logprobs": null`` for an unset argument), on ``/generate`` too:
such fields are declared ``T | None`` and read through ``gateway.api`` with their default. These structs are also
what ``GET /openapi.json`` publishes (``gateway/openapi.py``), so a constraint lives here once:
enforced by msgspec where it can be (``Meta`` bounds), otherwise stated in ``extra_json_schema`` and
checked in ``gateway.api`` (a chat role, text-only content parts, the shapes of ``prompt``). Checks that need
the model (its name, the context length, the vocabulary) live in ``gateway.api`` only.

Fields that would change what a request means but that the gateway does not implement (legacy
``functions``, ``structural_tag``, non-text inputs...) are declared here only so that
``gateway.request_checks.reject_unsupported`` can answer a 400 naming them instead of silently dropping them.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
from msgspec import Meta

MAX_BATCH_CHOICES = 64  # a batched completion's prompts x n
MAX_N = MAX_BATCH_CHOICES  # choices per request (OpenAI's own limit is 128)
GENERATE_MAX_NEW_TOKENS = 128  # /generate's default budget (SGLang's)
MAX_STOP_STRINGS = 64  # (vLLM and SGLang take any number; Continue's autocomplete sends 12 to 17)
# Bounds on what every choice carries to both of its workers (a request's n choices each send their own copy:
# unbounded, one request of a few MB made frames of over 100 MB, past the connection's unread limit, and every
# request open on those workers failed with it)
MAX_STOP_CHARS = 1024  # characters per stop string
# ... and in all (each token is searched for every stop string, on the worker's step and the gateway's loop):
# as much as 8 strings of the longest, whatever their number
MAX_STOP_TOTAL_CHARS = 8 * MAX_STOP_CHARS
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS = 1024  # entries (OpenAI's own limit is 300)
MAX_TOOLS = 128  # OpenAI's limit
MAX_TOP_LOGPROBS = 20
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")

Count = Annotated[int, Meta(ge=1)]
MAX_TOKEN_ID = 2**31 - 1  # beyond any vocabulary; larger ints do not fit the workers' wire format
TokenId = Annotated[int, Meta(ge=0, le=MAX_TOKEN_ID)]


def is_token_ids(value: object) -> bool:
    """A list of token ids (``TokenId``s), checked by hand where a union leaves the type to ``Any``."""
    return isinstance(value, list) and all(type(t) is int and 0 <= t <= MAX_TOKEN_ID for t in value)

Temperature = Annotated[float, Meta(ge=0.0, le=2.0)]
TopP = Annotated[float, Meta(ge=0.0, le=1.0, description="0: only the most probable token")]
TopK = Annotated[int, Meta(ge=-1, le=MAX_TOKEN_ID, description="-1 or 0 (off), or positive")]
Seed = Annotated[int, Meta(ge=-(2**63), le=2**63 - 1)]  # (choice i of n uses seed + i)
MinP = Annotated[float, Meta(ge=0.0, le=1.0)]
NumChoices = Annotated[int, Meta(ge=1, le=MAX_N)]
NumLogprobs = Annotated[int, Meta(ge=0, le=MAX_TOP_LOGPROBS)]
StopString = Annotated[str, Meta(min_length=1, max_length=MAX_STOP_CHARS)]
StopTokenIds = Annotated[list[TokenId], Meta(max_length=MAX_STOP_TOKEN_IDS)]
ModelName = Annotated[str, Meta(description="the served model (GET /v1/models) or 'default'; another is a 404")]
IgnoredTimeout = Annotated[float, Meta(description="accepted and not used: --request-timeout-s bounds every request")]
Stop = StopString | Annotated[list[StopString], Meta(max_length=MAX_STOP_STRINGS)] | None
# OpenAI's ranges; token ids as strings (JSON keys), checked against the vocabulary by the workers
LogitBias = Annotated[dict[Annotated[str, Meta(pattern=r"^[0-9]{1,10}$", description="a token id")],
                           Annotated[float, Meta(ge=-100.0, le=100.0)]], Meta(max_length=MAX_LOGIT_BIAS)]
Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)]
RepetitionPenalty = Annotated[float, Meta(gt=0.0, le=1e6, description="1 is off; > 1 discourages repeats")]
MinTokens = Annotated[int, Meta(ge=0, le=MAX_TOKEN_ID)]
_TEXT_PART = {"type": "object", "required": ["type", "text"],
              "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}
# Text parts only (``gateway.request_checks.reject_non_text_content``).
ContentParts = Annotated[list[dict[str, Any]], Meta(extra_json_schema={"allOf": [{"items": _TEXT_PART}]})]
_TOKEN_ID = {"type": "integer", "minimum": 0, "maximum": MAX_TOKEN_ID}
_TOKEN_IDS = {"type": "array", "minItems": 1, "items": _TOKEN_ID}
# A prompt is text, token ids, or a batch of either (each prompt run ``n`` times); msgspec allows one
# array type per union, so ``list[Any]`` whose items ``gateway.api.Frontend.prepare_completion`` checks.
PromptList = Annotated[list[Any], Meta(min_length=1, extra_json_schema={"anyOf": [
    {"items": _TOKEN_ID},
    {"maxItems": MAX_BATCH_CHOICES, "items": {"anyOf": [{"type": "string", "minLength": 1}, _TOKEN_IDS]}}]})]


class StreamOptions(msgspec.Struct):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False  # (vLLM's usage in every chunk: not implemented, a 400 when true)


class ChatMessage(msgspec.Struct):
    role: Annotated[str, Meta(extra_json_schema={"enum": list(CHAT_ROLES)})]  # checked in gateway.api
    content: str | ContentParts | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # assistant: the calls it made (gateway/tool_calls.py)
    tool_call_id: str | None = None  # tool: the call this message answers


class _Sampling(msgspec.Struct):
    model: ModelName | None = None
    max_tokens: Count | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    min_p: MinP | None = None
    seed: Seed | None = None
    stop: Stop = None
    stop_token_ids: StopTokenIds | None = None
    ignore_eos: bool | None = False
    n: NumChoices | None = 1
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    timeout_s: IgnoredTimeout | None = None
    # SGLang's PD fields, set by an SGLang router in front of our workers; the gateway assigns its
    # own rooms and ignores them (see ``gateway.api.ClientBootstrap``).
    bootstrap_host: Any = None
    bootstrap_port: Any = None
    bootstrap_room: Any = None
    logit_bias: LogitBias | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: RepetitionPenalty | None = None  # SGLang/vLLM extension
    min_tokens: MinTokens | None = None  # vLLM/SGLang extension: EOS and stop_token_ids banned before
    # SGLang's structured output (gateway/structured_output.py): at most one, with response_format
    regex: str | None = None
    ebnf: str | None = None  # GBNF
    json_schema: str | dict[str, Any] | None = None  # a JSON Schema, as text or an object
    # vLLM's structured output, the same three (and a list of choices), older and newer spellings
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_grammar: str | None = None  # GBNF, as vLLM's xgrammar backend takes it
    guided_choice: list[str] | None = None
    # {"json" | "regex" | "grammar" | "choice": ..., or "json_object": true}
    structured_outputs: dict[str, Any] | None = None
    guided_decoding_backend: str | None = None  # accepted, not used (one grammar library here)
    guided_whitespace_pattern: str | None = None  # not supported: a 400 when set
    include_stop_str_in_output: bool | None = False  # vLLM: the stop string that ended the text is kept
    # vLLM's detokenizing options: only their defaults (a 400 otherwise)
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    # vLLM's sampling options not implemented: read only to refuse them (a 400 unless neutral), so that a
    # request is never answered as if they had been honoured (a ``bad_words`` answer with the banned word)
    allowed_token_ids: Any = None
    bad_words: Any = None
    prompt_logprobs: Any = None
    truncate_prompt_tokens: Any = None
    use_beam_search: Any = None
    length_penalty: Any = None
    add_special_tokens: Any = None  # (the route's own default only: chat false, completions true)
    return_tokens_as_token_ids: Any = None


class ChatCompletionRequest(_Sampling):
    messages: Annotated[list[ChatMessage], Meta(min_length=1)] = []
    max_completion_tokens: Count | None = None
    logprobs: bool | None = False
    top_logprobs: NumLogprobs | None = None
    # {"type": "text" | "json_object" | "json_schema", "json_schema": {"name", "schema", "strict"}}
    response_format: dict[str, Any] | None = None
    # function tools: "none" | "auto" | "required" | {"type": "function", "function": {"name"}}
    tools: Annotated[list[dict[str, Any]], Meta(max_length=MAX_TOOLS)] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None  # false: at most one call (the answer's first)
    # the template (vLLM's and SGLang's fields): more variables, the generation prompt, an open final message
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    # not supported: a 400 unless absent or neutral
    chat_template: Any = None  # (vLLM: a template of the request's own)
    echo: Any = None  # (vLLM: the last message repeated in front of the answer)
    functions: list[Any] | None = None
    function_call: Any = None
    modalities: list[str] | None = None
    audio: Any = None
    web_search_options: Any = None  # (OpenAI's search models: no search here, a 400 when set)


class CompletionRequest(_Sampling):
    prompt: Annotated[str, Meta(min_length=1)] | PromptList | None = None
    logprobs: NumLogprobs | None = None
    echo: bool | None = False
    response_format: dict[str, Any] | None = None  # as chat's
    # not supported: a 400 unless absent or neutral
    suffix: str | None = None
    best_of: int | None = None


class GenerateSampling(msgspec.Struct):
    """SGLang's ``sampling_params``; ``null`` means the default here too (SGLang's router sends its
    unset optional fields as ``null``)."""

    # (SGLang's default budget, GENERATE_MAX_NEW_TOKENS, cut to what fits; 0: the prompt alone, as SGLang)
    max_new_tokens: Annotated[int, Meta(ge=0)] | None = None
    temperature: Temperature | None = 1.0
    top_p: TopP | None = 1.0
    top_k: TopK | None = -1
    min_p: MinP | None = 0.0
    stop: Stop = None
    stop_token_ids: StopTokenIds | None = None
    ignore_eos: bool | None = False
    seed: Seed | None = msgspec.field(default=None, name="sampling_seed")
    presence_penalty: Penalty | None = 0.0
    frequency_penalty: Penalty | None = 0.0
    repetition_penalty: RepetitionPenalty | None = 1.0
    min_new_tokens: MinTokens | None = 0
    logit_bias: LogitBias | None = None
    regex: str | None = None  # structured output (gateway/structured_output.py): at most one of three
    json_schema: str | dict[str, Any] | None = None
    ebnf: str | None = None
    no_stop_trim: bool | None = False  # the stop string that ended the text is kept
    n: NumChoices | None = 1  # samples of each prompt (SGLang's parallel sampling): a batch of prompts x n items
    # not supported: a 400 unless absent or neutral
    structural_tag: Any = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    stop_regex: Any = None


class GenerateRequest(msgspec.Struct):
    """SGLang's native ``/generate`` body: one prompt, or a batch (a list of texts, or of token id lists;
    SGLang's routers send both, with a list of bootstrap fields, one per item)."""

    text: str | Annotated[list[str], Meta(min_length=1, max_length=MAX_BATCH_CHOICES)] | None = None
    # token ids, or a batch of token id lists (``gateway.api.Frontend.prepare_generate`` checks the items:
    # msgspec allows one array type per union)
    input_ids: Annotated[list[Any], Meta(min_length=1, extra_json_schema={"anyOf": [
        {"items": _TOKEN_ID}, {"maxItems": MAX_BATCH_CHOICES, "items": _TOKEN_IDS}]})] | None = None
    sampling_params: GenerateSampling | None = msgspec.field(default_factory=GenerateSampling)
    stream: bool | None = False
    return_logprob: bool | None = False
    # the first prompt position of ``input_token_logprobs``: -1 (the default) the last; a batch may give one per item
    logprob_start_len: int | Annotated[list[int], Meta(min_length=1, max_length=MAX_BATCH_CHOICES)] | None = None
    # the request's id in ``meta_info.id``; a batch may give one per item (SGLang's routers pass the client's on)
    rid: str | Annotated[list[str], Meta(min_length=1, max_length=MAX_BATCH_CHOICES)] | None = None
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
    return_hidden_states: bool | None = False
    top_logprobs_num: int | None = None
    return_text_in_logprobs: Any = None
    token_ids_logprob: Any = None

