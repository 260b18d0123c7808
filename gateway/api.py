"""Client-facing request handling: validation, prompt building, n choices, and response shapes.

``Frontend`` turns a decoded body into token ids and ``SamplingParams``, runs its choices through
the ``Dispatcher`` and shapes OpenAI chat/completions and SGLang ``/generate`` responses, streamed
(SSE ``data: {...}\\n\\n`` ... ``data: [DONE]``) or whole.
"""

from __future__ import annotations

import asyncio
import contextlib
import operator
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import msgspec
from jinja2 import TemplateError

from gateway.api_models import (
    CHAT_ROLES,
    GENERATE_MAX_NEW_TOKENS,
    MAX_BATCH_CHOICES,
    MAX_STOP_TOTAL_CHARS,
    MAX_TOKEN_ID,
    ChatCompletionRequest,
    CompletionRequest,
    GenerateRequest,
    GenerateSampling,
    is_token_ids,
)
from gateway.context import random_hex
from gateway.errors import APIError, BadRequest, NotFound
from gateway.request_checks import (
    CHAT_RULES,
    COMPLETION_RULES,
    GENERATE_RULES,
    GENERATE_SAMPLING_RULES,
    check_batch_choices,
    reject_non_text_content,
    reject_unsupported,
)
from gateway.structured_output import grammar_for
from gateway.text import ChoiceState
from gateway.tokenizer import DECODE_CONTEXT_TOKENS, TemplateOptions, Tokenizer
from gateway.tool_calls import ToolPlan, plan_tools, render_prompt, skips_call_tags
from workers.protocol import SamplingParams, StepOutput

if TYPE_CHECKING:
    from gateway.dispatch import DirectConsumer

_json = msgspec.json.Encoder()


@dataclass(frozen=True)
class ClientBootstrap:
    """SGLang's PD fields as the client (an SGLang router) sent them: scalars, or one per item.

    Our gateway assigns rooms itself and ignores them; a worker serving SGLang's HTTP protocol
    (``workers/sglang_api.py``) takes its room and its prefill's address from them.
    """

    host: Any = None
    port: Any = None
    room: Any = None

    @classmethod
    def of(cls, req: Any) -> ClientBootstrap | None:
        if req.bootstrap_host is None and req.bootstrap_port is None and req.bootstrap_room is None:
            return None
        return cls(req.bootstrap_host, req.bootstrap_port, req.bootstrap_room)


@dataclass
class Prepared:
    input_ids: list[int]
    params: SamplingParams
    n: int
    stops: list[str]
    stream: bool
    include_usage: bool
    want_logprobs: bool
    echo: bool = False  # /v1/completions: the prompt is repeated before the completion
    bootstrap: ClientBootstrap | None = None
    param_prefix: str = ""  # where the route's sampling fields live ("sampling_params." on /generate)
    tools: ToolPlan | None = None  # chat with tools (gateway/tool_calls.py)
    # A batched completion's prompts (``input_ids`` is the first): ``n`` counts the choices of all of
    # them, each prompt's in a row (choice ``i`` answers prompt ``i // (n / len(batch))``).
    batch: list[list[int]] | None = None
    prompt_texts: list[str | None] | None = None  # (``echo``) each prompt as the client sent it, None for ids
    keep_stop: bool = False  # the stop string that ended a choice's text stays in it (vLLM, SGLang options)
    item_ids: list[str] | None = None  # /generate: a batch's ``rid`` list, item i's id at i
    skip_special: bool = True  # special tokens have no text (``skip_special_tokens``: false writes them out)
    logprob_text: bool = False  # /generate's ``return_text_in_logprobs``: each logprob entry names its token
    # /generate with ``return_logprob``: each prompt's first position with a prompt logprob (``logprob_start_len``)
    logprob_starts: list[int] | None = None
    # /generate's ``max_new_tokens: 0`` (the prompt alone: its logprobs, SGLang's scoring): run for one token,
    # answered without it
    no_output: bool = False
    max_tokens_param: str = "max_tokens"  # what the client called the budget (chat: or ``max_completion_tokens``)
    prompt_param: str = "prompt"  # what the client called the prompt (a worker's refusal of its token ids)
    echo_fields: dict[str, Any] | None = None  # /v1/responses: the request's fields its response repeats

    @classmethod
    def plain(cls, input_ids: list[int], params: SamplingParams, n: int, stream: bool, want_logprobs: bool,
              keep_stop: bool, max_tokens_param: str) -> Prepared:
        """A plain chat request's (``Frontend.prepare_chat``): no stop strings, usage, tools..., the prompt called
        "messages"; every other field its default, which the dataclass keeps on the class (its ``__init__`` would
        store each of them again, per request)."""
        prep = cls.__new__(cls)
        prep.input_ids, prep.params, prep.n, prep.stops, prep.stream = input_ids, params, n, [], stream
        prep.include_usage, prep.want_logprobs, prep.keep_stop = False, want_logprobs, keep_stop
        prep.max_tokens_param, prep.prompt_param = max_tokens_param, "messages"
        return prep

    def logprob_start_of(self, choice: int) -> int:
        return self.logprob_starts[choice // self.per_prompt] if self.logprob_starts else 0

    def prompt_text_of(self, choice: int) -> str | None:
        return self.prompt_texts[choice // self.per_prompt] if self.prompt_texts else None

    def decode_context(self, choice: int = 0) -> list[int]:
        """The end of ``choice``'s prompt, which the answer's text follows (``gateway.tokenizer``)."""
        return self.prompt_of(choice)[-DECODE_CONTEXT_TOKENS:]

    @property
    def per_prompt(self) -> int:
        """Choices per prompt (the request's ``n``)."""
        return self.n // len(self.batch) if self.batch else self.n

    def prompt_of(self, choice: int) -> list[int]:
        return self.batch[choice // self.per_prompt] if self.batch else self.input_ids

    @property
    def prompt_tokens(self) -> int:
        """The prompt tokens of the request's usage (each prompt of a batch once)."""
        return sum(len(ids) for ids in self.batch) if self.batch else len(self.input_ids)

    def name_for_client(self, exc: BaseException) -> None:
        """A worker's 400 names a ``SamplingParams`` field it refused (``check_sampling``): the client's
        name for it on this route instead."""
        if isinstance(exc, BadRequest) and exc.param == "input_ids":
            exc.param = self.prompt_param
        elif isinstance(exc, BadRequest) and exc.param in _CLIENT_NAMES:
            if self.param_prefix:
                exc.param = self.param_prefix + exc.param
            else:
                exc.param = self.max_tokens_param if exc.param == "max_new_tokens" else _CLIENT_NAMES[exc.param]


# ``SamplingParams`` fields a worker may refuse -> the OpenAI routes' names for them
_CLIENT_NAMES = {"max_new_tokens": "max_tokens", "logit_bias": "logit_bias", "presence_penalty": "presence_penalty",
                 "frequency_penalty": "frequency_penalty", "repetition_penalty": "repetition_penalty",
                 "min_new_tokens": "min_tokens", "stop_token_ids": "stop_token_ids"}


class ChoiceDispatcher(Protocol):
    """What runs one completion choice for ``Frontend``: the gateway's ``Dispatcher`` (a pair of its
    workers, a fresh room), or a worker's own relay to its scheduler (``workers/sglang_api.py``)."""

    def generate(self, input_ids: list[int], params: SamplingParams, *, choice: int = 0,
                 bootstrap: ClientBootstrap | None = None, direct: DirectConsumer | None = None,
                 counts_prompt: bool = True, served: Callable[[], bool] | None = None, counts_output: bool = True,
                 ) -> AsyncGenerator[StepOutput, None]:
        """The choice's ``StepOutput`` events until the final one; errors as ``APIError``. A dispatcher
        may hand non-final outputs to ``direct`` instead of yielding them (``gateway.dispatch``), or ignore it.
        ``counts_prompt``: the first choice of its prompt (a prompt's tokens are counted once, as in usage).
        ``served``: a choice stopped early counts as served only if this says so (``Dispatcher.generate``).
        ``counts_output``: its tokens count as generated ones in the figures (not for ``max_new_tokens: 0``)."""
        ...


class TextEmitter(Protocol):
    """Where a stream's text goes when it skips the generator layers (``run_choices``'s ``emitter``)."""

    def direct(self, state: ChoiceState) -> DirectConsumer:
        """The consumer of ``state``'s choice's non-final outputs, from the worker connection's callback
        (``Dispatcher.generate``'s ``direct``): it detokenizes each into ``state`` and writes its chunk."""
        ...


def _logprob_starts(value: int | list[int] | None, prompts: list[list[int]], batched: bool) -> list[int]:
    """SGLang's ``logprob_start_len`` as each prompt's first position with a prompt logprob: -1 (the default)
    its last position (SGLang's: only the output's logprobs are wanted), else the position given, which must be
    inside the prompt. A list gives one per item of a batch."""
    if isinstance(value, list):
        if not batched:
            raise BadRequest("logprob_start_len is a list only for a batch of prompts", param="logprob_start_len")
        if len(value) != len(prompts):
            raise BadRequest(f"logprob_start_len has {len(value)} items for a batch of {len(prompts)} prompts",
                             param="logprob_start_len")
        values = value
    else:
        values = [-1 if value is None else value] * len(prompts)
    starts = []
    for i, (given, prompt) in enumerate(zip(values, prompts, strict=True)):
        param = f"logprob_start_len[{i}]" if isinstance(value, list) else "logprob_start_len"
        if given < -1:
            raise BadRequest(f"{param} must be -1 (the prompt's last position) or a position >= 0, got {given}",
                             param=param)
        if given >= len(prompt):
            raise BadRequest(f"{param} ({given}) must be below the number of prompt tokens ({len(prompt)})",
                             param=param)
        starts.append(len(prompt) - 1 if given == -1 else given)
    return starts


def decode_body(body: bytes, kind: type[Any]) -> Any:
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as exc:
        message = str(exc)
        # "... - at `$.a.b`", or for a bad mapping key "... - at `key` in `$.a.b`"
        param = message.rsplit("`$.", 1)[1].rstrip("`").removesuffix("[...]") if "`$." in message else None
        if message.startswith("Object missing required field `"):  # (the field, not the object it is missing from)
            field = message.split("`", 2)[1]
            param = f"{param}.{field}" if param else field
        raise BadRequest(f"invalid request: {message}", param=param) from None
    except msgspec.DecodeError as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}") from None
    except UnicodeDecodeError as exc:  # msgspec checks UTF-8 inside strings lazily
        raise BadRequest(f"request body is not valid UTF-8: {exc.reason} at byte {exc.start}") from None
    except RecursionError:
        raise BadRequest("request body is nested too deeply") from None


def _reads_calls(tools: ToolPlan | None, params: SamplingParams) -> bool:
    """Whether the answer may hold tool calls to read: not under ``tool_choice: none``, nor under ``auto`` with
    a format of the request's own (its grammar constrains the answer: it is the format, content, never a call,
    and a stream of it is not held back as one that might be)."""
    if tools is None or tools.mode == "none":
        return False
    return not (tools.mode == "auto" and params.grammar is not None)


class ModelNotFound(NotFound):
    """OpenAI's answer to an unknown model: 404, invalid_request_error, code model_not_found."""

    type = "invalid_request_error"


class Frontend:
    def __init__(self, dispatcher: ChoiceDispatcher, tokenizer: Tokenizer, model_name: str, max_context: int,
                 default_max_tokens: int = 256, *, any_model: bool = False) -> None:
        self.dispatcher = dispatcher
        self.tokenizer = tokenizer
        self.model_name = model_name
        # Serve whatever ``model`` a request names (a worker's SGLang API, as SGLang's server: SGLang's router
        # sends "unknown" for a request without one); else only ``model_name`` or "default" (404 otherwise).
        self.any_model = any_model
        self.max_context = max_context
        self.default_max_tokens = default_max_tokens

    # -- validation --------------------------------------------------------------------------
    def _check_model(self, model: str | None) -> None:
        if model is not None and model not in (self.model_name, "default") and not self.any_model:
            raise ModelNotFound(f"The model {model!r} does not exist here; use {self.model_name!r}",
                                param="model", code="model_not_found")

    def _decode_capacity(self) -> int | None:
        capacity = getattr(self.dispatcher, "decode_capacity", None)
        return capacity() if capacity is not None else None

    def usable_context(self) -> int:
        """The most tokens (prompt + output) one request may have: the context, or less where the largest decode's
        KV pool holds less, or the largest prefill's holds a shorter prompt (``/v1/models``' ``max_model_len``:
        clients size their requests by it)."""
        pool = self._decode_capacity()
        usable = min(self.max_context, pool) if pool else self.max_context
        capacity = getattr(self.dispatcher, "prompt_capacity", None)
        prompt = capacity() if capacity is not None else None
        return min(usable, prompt + 1) if prompt else usable  # (its longest prompt, and one token to generate)

    def _default_budget(self, input_ids: list[int], room: int, min_tokens: int, default_max: int | None) -> int:
        """A request's budget when it sets none (``_params``): ``default_max`` (else ``--default-max-tokens``), at
        least ``min_tokens``, cut to the ``room`` the context leaves."""
        budget_room = room
        context = getattr(self.dispatcher, "prefill_context", None)
        for pool in (self._decode_capacity(), context(len(input_ids)) if context is not None else None):
            if pool is not None and pool - len(input_ids) >= max(min_tokens, 1):
                # (also what the largest decode's KV pool holds, as SGLang's scheduler cuts it, and the longest
                # context of a prefill that takes the prompt: a budget the client did not set is no reason for
                # a 400 or a 503; a prompt no pool holds is the dispatcher's 400)
                budget_room = min(budget_room, pool - len(input_ids))
        return min(max(default_max or self.default_max_tokens, min_tokens), budget_room)

    def _params(self, req: Any, input_ids: list[int], max_tokens: int | None, logprobs: bool,
                top_logprobs: int, prefix: str = "", *, prompt: str = "prompt",
                max_tokens_name: str = "max_tokens", default_max: int | None = None,
                ) -> tuple[SamplingParams, list[str]]:
        """``prompt``, ``max_tokens_name``: what the client called them (``param`` of a 400). ``max_tokens`` None:
        the route's default budget (``default_max``, else ``--default-max-tokens``), cut to what fits the context
        and the largest decode's KV pool."""
        if not input_ids:
            raise BadRequest("the prompt is empty", param=prompt)
        room = self.max_context - len(input_ids)
        if room <= 0:
            raise BadRequest(f"the prompt has {len(input_ids)} tokens; the context length is {self.max_context}",
                             param=prompt, code="context_length_exceeded")
        min_tokens = req.min_tokens or 0
        name = "min_new_tokens" if prefix else "min_tokens"
        if max_tokens is None:  # the default budget, raised to what the client asked at least
            if min_tokens > room:
                raise BadRequest(f"{name} ({min_tokens}) + prompt ({len(input_ids)} tokens) exceeds the context "
                                 f"length {self.max_context}", param=prefix + name, code="context_length_exceeded")
            max_tokens = self._default_budget(input_ids, room, min_tokens, default_max)
        if max_tokens > room:  # (ranges of single fields are checked by the decoder: gateway/api_models.py)
            raise BadRequest(f"{max_tokens_name} ({max_tokens}) + prompt ({len(input_ids)} tokens) exceeds the "
                             f"context length {self.max_context}", param=prefix + max_tokens_name,
                             code="context_length_exceeded")
        stream_options = getattr(req, "stream_options", None)
        if stream_options is not None:
            if not req.stream:  # (as OpenAI and vLLM answer)
                raise BadRequest("stream_options is only allowed with stream: true", param="stream_options")
            if stream_options.continuous_usage_stats:
                raise BadRequest("stream_options.continuous_usage_stats is not supported; include_usage gives the "
                                 "usage in the stream's last chunk", param="stream_options.continuous_usage_stats")
        temperature = 1.0 if req.temperature is None else req.temperature
        top_p = 1.0 if req.top_p is None else req.top_p
        top_k = -1 if not req.top_k else req.top_k  # (0 is off, as in vLLM)
        if top_p == 0.0:  # the nucleus of the most probable token alone (OpenAI accepts 0; vLLM with greedy)
            top_p, top_k = 1.0, 1
        min_p = 0.0 if req.min_p is None else req.min_p
        stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        if len(stops) > 8 and sum(len(s) for s in stops) > MAX_STOP_TOTAL_CHARS:  # (8 or fewer are within it)
            raise BadRequest(f"the stop strings have {sum(len(s) for s in stops)} characters in all; at most "
                             f"{MAX_STOP_TOTAL_CHARS} are allowed", param=prefix + "stop")
        if min_tokens > max_tokens:
            raise BadRequest(f"{name} ({min_tokens}) must not exceed max_tokens ({max_tokens})", param=prefix + name)
        params = SamplingParams(
            max_new_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
            seed=req.seed, stop_token_ids=list(req.stop_token_ids or []), stop=stops, ignore_eos=bool(req.ignore_eos),
            logprobs=logprobs, top_logprobs=top_logprobs,
            logit_bias={int(token): bias for token, bias in (req.logit_bias or {}).items()},
            presence_penalty=req.presence_penalty or 0.0, frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            min_new_tokens=min_tokens,
        )
        return params, stops

    def _plain_params(self, req: ChatCompletionRequest, input_ids: list[int], max_tokens: int | None,
                      logprobs: bool, max_tokens_name: str) -> SamplingParams:
        """``_params`` for a plain chat request (``prepare_chat``: none of ``_PLAIN_CHAT_UNSET`` set, so no
        ``min_tokens``, stop strings or tokens, logit bias, penalties, ``stream_options`` nor ``top_logprobs``): the
        same checks and ``SamplingParams``, those fields left at their defaults."""
        if not input_ids:
            raise BadRequest("the prompt is empty", param="messages")
        room = self.max_context - len(input_ids)
        if room <= 0:
            raise BadRequest(f"the prompt has {len(input_ids)} tokens; the context length is {self.max_context}",
                             param="messages", code="context_length_exceeded")
        if max_tokens is None:
            max_tokens = self._default_budget(input_ids, room, 0, None)
        elif max_tokens > room:  # (a default budget is cut to the room)
            raise BadRequest(f"{max_tokens_name} ({max_tokens}) + prompt ({len(input_ids)} tokens) exceeds the "
                             f"context length {self.max_context}", param=max_tokens_name,
                             code="context_length_exceeded")
        elif max_tokens < 0:  # (``_params``' check of min_tokens, 0 here; never a decoded body's: ``Count``)
            raise BadRequest(f"min_tokens (0) must not exceed max_tokens ({max_tokens})", param="min_tokens")
        top_p = 1.0 if req.top_p is None else req.top_p
        top_k = req.top_k or -1  # (0 is off, as in vLLM)
        if top_p == 0.0:  # the nucleus of the most probable token alone (OpenAI accepts 0; vLLM with greedy)
            top_p, top_k = 1.0, 1
        return SamplingParams(
            max_new_tokens=max_tokens, temperature=1.0 if req.temperature is None else req.temperature, top_p=top_p,
            top_k=top_k, min_p=0.0 if req.min_p is None else req.min_p, seed=req.seed, ignore_eos=bool(req.ignore_eos),
            logprobs=logprobs,
            # (given as ``_params`` gives them: omit_defaults leaves out only the default's own float object, and
            # the worker's message is then the same bytes)
            presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0)

    def prepare_chat(self, req: ChatCompletionRequest) -> Prepared:
        # A plain chat (the common request: none of the fields below set, each message a string of a role
        # without markup) passes every check but the model's, the context's and the template's: it is prepared
        # without them; any other takes the whole way (``_prepare_chat``), which answers as it always has.
        if _PLAIN_CHAT_FIELDS(req) == _PLAIN_CHAT_UNSET and req.messages:
            model = req.model
            if model is not None and model != self.model_name and model != "default" and not self.any_model:
                self._check_model(model)  # (its 404)
            messages = []
            for message in req.messages:
                role, content = message.role, message.content
                if role not in _PLAIN_ROLES or type(content) is not str or _MESSAGE_EXTRAS(message) != _NO_EXTRAS:
                    return self._prepare_chat(req)
                messages.append({"role": role, "content": content})
            try:
                input_ids = self.tokenizer.apply_chat_template(messages)
            except (ValueError, TypeError, TemplateError) as exc:  # (as ``_prepare_chat``)
                raise BadRequest(f"cannot apply the chat template: {exc}", param="messages") from None
            max_tokens = req.max_completion_tokens
            if max_tokens is None:
                named, max_tokens = "max_tokens", req.max_tokens
            else:
                named = "max_completion_tokens"
            logprobs = bool(req.logprobs)
            params = self._plain_params(req, input_ids, max_tokens, logprobs, named)
            return Prepared.plain(input_ids, params, req.n or 1, bool(req.stream), logprobs,
                                  bool(req.include_stop_str_in_output), named)
        return self._prepare_chat(req)

    def _prepare_chat(self, req: ChatCompletionRequest) -> Prepared:
        self._check_model(req.model)
        reject_unsupported(req, CHAT_RULES)
        if req.top_logprobs and not req.logprobs:  # (OpenAI's and vLLM's rule; silently none otherwise)
            raise BadRequest("top_logprobs requires logprobs: true", param="top_logprobs")
        if not req.messages:
            raise BadRequest("messages must be a non-empty list", param="messages")
        reject_non_text_content(req.messages)
        for i, message in enumerate(req.messages):
            if message.role not in CHAT_ROLES:
                hint = " (the legacy 'function' role: use 'tool')" if message.role == "function" else ""
                raise BadRequest(f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}, got "
                                 f"{message.role!r}{hint}", param=f"messages[{i}].role")
        template = getattr(self.tokenizer, "chat_template", None)
        tools = plan_tools(req, template)
        try:
            messages = [msgspec.structs.asdict(m) for m in req.messages]
            if not (isinstance(template, str) and "developer" in template):
                for entry in messages:  # OpenAI's newer name for system, which most templates know only as that
                    if entry["role"] == "developer":
                        entry["role"] = "system"
            options = None if (req.chat_template_kwargs is None and req.add_generation_prompt is None
                                and req.continue_final_message is None) else template_options(req)
            input_ids = render_prompt(self.tokenizer, messages, tools, options)
        except (ValueError, TypeError, TemplateError) as exc:  # (TemplateError: the template's raise_exception)
            raise BadRequest(f"cannot apply the chat template: {exc}", param="messages") from None
        named = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        logprobs = bool(req.logprobs)
        params, stops = self._params(req, input_ids, max_tokens, logprobs, req.top_logprobs or 0,
                                     prompt="messages", max_tokens_name=named)
        params.grammar = grammar_for(req)
        skip_special = req.skip_special_tokens
        if tools is not None and skip_special is None and tools.mode == "auto" and tools.hermes \
                and skips_call_tags(self.tokenizer):
            skip_special = False  # (the calls' tags are special tokens here: written out, or the calls are lost)
        _literal_stops(params, skip_special)
        if tools is not None and tools.grammar is not None:  # (a forced call: its arguments' grammar)
            # response_format shapes a message's content, which a forced call has none of: it waits for the turn
            # that answers in words (OpenAI's and vLLM's reading; the Agents SDK sends both, its output_type with
            # tool_choice required). A regex or a grammar constrains the whole output: it cannot give way.
            if params.grammar is not None and not params.grammar.param.startswith("response_format"):
                raise BadRequest(f"tool_choice {tools.mode} cannot be combined with {params.grammar.param}",
                                 param="tool_choice")
            params.grammar = tools.grammar
            # (a stop string or token may cut the call short, and a cut call is text: streamed, it is held to its end)
            tools.hold = bool(stops or params.stop_token_ids)

        return Prepared(input_ids, params, req.n or 1, stops, bool(req.stream),
                        bool(req.stream_options and req.stream_options.include_usage), logprobs,
                        bootstrap=ClientBootstrap.of(req), tools=tools if _reads_calls(tools, params) else None,
                        keep_stop=bool(req.include_stop_str_in_output),
                        skip_special=skip_special is not False, max_tokens_param=named, prompt_param="messages")

    def prepare_completion(self, req: CompletionRequest) -> Prepared:
        self._check_model(req.model)
        reject_unsupported(req, COMPLETION_RULES)
        prompt: Any = req.prompt
        n = req.n or 1
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (list, str)):  # a batch
            check_batch_choices(len(prompt), n, "prompt")
            prompts = [self._prompt_ids(item, f"prompt[{i}]") for i, item in enumerate(prompt)]
            texts = [item if isinstance(item, str) else None for item in prompt]
        else:
            prompts = [self._prompt_ids(prompt, "prompt")]
            texts = [prompt if isinstance(prompt, str) else None]
        input_ids = prompts[0]
        logprobs, echo = req.logprobs is not None, bool(req.echo)
        # (a batch shares its sampling parameters: its longest prompt decides what fits the context)
        params, stops = self._params(req, max(prompts, key=len), req.max_tokens, logprobs, req.logprobs or 0)
        params.prompt_logprobs = logprobs and echo
        params.grammar = grammar_for(req)
        _literal_stops(params, req.skip_special_tokens)
        return Prepared(input_ids, params, n * len(prompts), stops, bool(req.stream),
                        bool(req.stream_options and req.stream_options.include_usage), logprobs, echo,
                        ClientBootstrap.of(req), batch=prompts if len(prompts) > 1 else None,
                        prompt_texts=texts if echo else None, keep_stop=bool(req.include_stop_str_in_output),
                        skip_special=req.skip_special_tokens is not False)

    def _prompt_ids(self, prompt: Any, param: str) -> list[int]:
        """One completions prompt as token ids: text, or ids checked for range (400 naming ``param``)."""
        if isinstance(prompt, str):
            input_ids = self.tokenizer.encode(prompt)
        elif is_token_ids(prompt):
            input_ids = list(prompt)
        elif prompt is None:
            raise BadRequest("prompt is required", param="prompt")
        else:
            raise BadRequest(f"{param} must be a string or a list of token ids (in [0, {MAX_TOKEN_ID}])",
                             param=param)
        if not input_ids:
            raise BadRequest(f"{param} is empty", param=param)
        return input_ids

    def prepare_generate(self, req: GenerateRequest) -> tuple[Prepared, GenerateSampling]:
        sp = req.sampling_params if req.sampling_params is not None else GenerateSampling()
        reject_unsupported(req, GENERATE_RULES)
        reject_unsupported(sp, GENERATE_SAMPLING_RULES, prefix="sampling_params.")
        if req.text is not None and req.input_ids is not None:  # (SGLang's 400 too: which one is the prompt?)
            raise BadRequest("give one of text or input_ids, not both", param="input_ids")
        batched = isinstance(req.text, list) if req.input_ids is None else isinstance(req.input_ids[0], list)
        if req.input_ids is not None:
            name = "input_ids"
            items = req.input_ids if batched else [req.input_ids]
            prompts = [_token_ids(item, f"input_ids[{i}]" if batched else "input_ids") for i, item in enumerate(items)]
        elif req.text is not None:
            name = "text"
            texts = req.text if isinstance(req.text, list) else [req.text]
            prompts = [self.tokenizer.encode(text) for text in texts]
        else:
            raise BadRequest("one of text or input_ids is required", param="text")
        if len(prompts) > MAX_BATCH_CHOICES:
            raise BadRequest(f"a batch of {len(prompts)} prompts is more than {MAX_BATCH_CHOICES}; split it",
                             param=name)
        n = sp.n or 1
        if n > 1:  # (SGLang's parallel sampling: even one prompt is then a batch, answered as a list)
            check_batch_choices(len(prompts), n, "sampling_params.n")
            batched = True
        shim = _GenerateShim(sp)
        logprobs = bool(req.return_logprob)
        no_output = sp.max_new_tokens == 0
        if no_output and sp.min_new_tokens:
            raise BadRequest(f"sampling_params.min_new_tokens ({sp.min_new_tokens}) must not exceed max_new_tokens (0)",
                             param="sampling_params.min_new_tokens")
        # (a batch shares its sampling parameters: its longest prompt decides what fits the context; without
        # max_new_tokens, SGLang's default budget, cut to what fits, as SGLang's scheduler does)
        params, stops = self._params(shim, max(prompts, key=len), 1 if no_output else sp.max_new_tokens, logprobs, 0,
                                     "sampling_params.",
                                     prompt=name, max_tokens_name="max_new_tokens",
                                     default_max=GENERATE_MAX_NEW_TOKENS)
        if not all(prompts):
            raise BadRequest(f"{name}: a prompt of the batch is empty", param=name)
        params.prompt_logprobs = logprobs
        starts = _logprob_starts(req.logprob_start_len, prompts, batched) if logprobs else None
        if starts is not None:
            params.prompt_logprobs_start = starts[0]  # (a batch's others: per choice, ``run_choices``)
        params.grammar = grammar_for(sp, prefix="sampling_params.")
        _literal_stops(params, sp.skip_special_tokens)
        # A batch (even of one item) is answered as a list, item i by choice i (its own bootstrap fields): prompt
        # i's n samples are items i * n .. i * n + n - 1, as SGLang orders them.
        return Prepared(prompts[0], params, len(prompts) * n, stops, bool(req.stream), False, logprobs,
                        bootstrap=ClientBootstrap.of(req), param_prefix="sampling_params.",
                        batch=prompts if batched else None, keep_stop=bool(sp.no_stop_trim),
                        skip_special=sp.skip_special_tokens is not False,
                        logprob_text=bool(req.return_text_in_logprobs), logprob_starts=starts,
                        no_output=no_output, prompt_param="input_ids"), sp

    # -- running choices ---------------------------------------------------------------------
    def _choice(self, prep: Prepared, index: int = 0) -> ChoiceState:
        params, tokenizer = prep.params, self.tokenizer
        stop_tokens = (params.stop_token_ids,) if params.ignore_eos else (params.stop_token_ids,
                                                                          tokenizer.eos_token_ids)
        # (one prompt: ``decode_context`` without its calls)
        context = prep.decode_context(index) if prep.batch else prep.input_ids[-DECODE_CONTEXT_TOKENS:]
        return ChoiceState(index, tokenizer, prep.stops, prep.want_logprobs, context,
                           params.min_new_tokens, prep.keep_stop, stop_tokens, prep.skip_special)

    async def complete_one(self, prep: Prepared) -> ChoiceState:
        """The one choice of a whole response (``prep.n == 1``), run to its end. With the gateway's
        ``Dispatcher`` (``complete``): no generator layers, and without stop strings the non-final
        outputs are taken in the worker connection's callback (the task wakes once, for the last; with
        them, the decode that stops at them itself gathers its outputs: a few wake-ups).
        Another dispatcher: through ``run_choices``."""
        complete = getattr(self.dispatcher, "complete", None)
        if complete is None:
            last: ChoiceState | None = None
            async for state, _, _ in self.run_choices(prep):
                last = state
            assert last is not None  # (a choice ends with its final output or an error)
            return last
        state = self._choice(prep)
        try:
            # (stop strings the decode is not given, ``_literal_stops``: it must not gather past them)
            await complete(prep.input_ids, prep.params, state, in_callback=not prep.stops,
                           counts_output=not prep.no_output, gather=not prep.stops or bool(prep.params.stop))
        except BadRequest as exc:
            prep.name_for_client(exc)
            raise
        return state

    async def run_choices(self, prep: Prepared, emitter: TextEmitter | None = None,
                          ) -> AsyncIterator[tuple[ChoiceState, str, list[dict[str, Any]]]]:
        """Yield (choice, new text, new logprob entries) as tokens arrive, across all n choices.

        One choice (the common case) reads the dispatcher's generator in place; several run as one
        task each, merged through a queue. Either way, a choice whose stop string matched is closed
        at once, which aborts it on its workers. ``emitter`` (a stream of one choice without stop
        strings or logprobs): non-final outputs may go to it from the worker connection's callback,
        detokenized here, instead of being yielded.
        """
        if prep.n == 1:
            state = self._choice(prep)
            direct = emitter.direct(state) if emitter is not None and not prep.stops and \
                not prep.want_logprobs else None
            events = self.dispatcher.generate(prep.input_ids, prep.params, bootstrap=prep.bootstrap, direct=direct,
                                              counts_output=not prep.no_output)
            try:
                async for event in events:
                    text, entries = state.accept(event)
                    yield state, text, entries
                    if state.finish_reason is not None and event.finish_reason is None:
                        return  # a stop string: the generator is closed below (its request aborted)
            except BadRequest as exc:
                prep.name_for_client(exc)
                raise
            finally:
                await events.aclose()
            return
        states = [self._choice(prep, i) for i in range(prep.n)]
        queue: asyncio.Queue[tuple[int, StepOutput | BaseException | None]] = asyncio.Queue()
        # A choice's next output is taken from its generator only once the consumer has had the one before:
        # what a slow client leaves unread waits in the choice's own queue (``EventSink``), where
        # ``max_unread_events`` stops its generation, not in this one, which nothing bounds.
        taken = [asyncio.Event() for _ in range(prep.n)]

        async def pump(index: int) -> None:
            params = prep.params
            if params.seed is not None and index % prep.per_prompt:  # (each prompt's choices: seed, seed + 1...)
                params = msgspec.structs.replace(params, seed=params.seed + index % prep.per_prompt)
            start = prep.logprob_start_of(index)
            if params.prompt_logprobs and start != params.prompt_logprobs_start:
                params = msgspec.structs.replace(params, prompt_logprobs_start=start)
            events = self.dispatcher.generate(prep.prompt_of(index), params, choice=index, bootstrap=prep.bootstrap,
                                              counts_prompt=index % prep.per_prompt == 0,
                                              served=lambda: not failed, counts_output=not prep.no_output)
            try:
                async with contextlib.aclosing(events):  # (cancelled while waiting below: its requests end now)
                    async for event in events:
                        taken[index].clear()
                        queue.put_nowait((index, event))
                        await taken[index].wait()
            except Exception as exc:
                queue.put_nowait((index, exc))
            finally:
                queue.put_nowait((index, None))

        failed = False  # a choice failed: the request did, and the choices stopped for it were not served
        tasks = [asyncio.create_task(pump(i), name=f"choice-{i}") for i in range(prep.n)]
        remaining = prep.n
        try:
            while remaining:
                index, item = await queue.get()
                state = states[index]
                if item is None:
                    remaining -= 1
                    continue
                if isinstance(item, BaseException):
                    failed = True
                    prep.name_for_client(item)
                    raise item
                if state.finish_reason is not None:
                    taken[index].set()
                    continue
                text, entries = state.accept(item)
                if state.finish_reason is not None and item.finish_reason is None:
                    tasks[index].cancel()  # stop string matched: abort this choice's generation
                yield state, text, entries
                taken[index].set()
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


# A chat request's fields that only a request beyond a plain chat sets (``Frontend.prepare_chat``): the unsupported
# ones (``CHAT_RULES``), the structured output (``grammar_for``'s), tools, template options, SGLang's PD fields, and
# the sampling options ``_plain_params`` leaves at their defaults. Read in one C call, and compared to None each
# (``==`` of tuples: None equals only None).
_PLAIN_CHAT_NAMES = (*(name for name, _, _ in CHAT_RULES.rules),
                     "regex", "ebnf", "json_schema", "guided_json", "guided_regex", "guided_grammar", "guided_choice",
                     "structured_outputs", "response_format",
                     "tools", "tool_choice", "chat_template_kwargs", "add_generation_prompt", "continue_final_message",
                     "bootstrap_host", "bootstrap_port", "bootstrap_room", "skip_special_tokens",
                     "top_logprobs", "stream_options", "stop", "stop_token_ids", "logit_bias", "min_tokens",
                     "presence_penalty", "frequency_penalty", "repetition_penalty")
_PLAIN_CHAT_FIELDS = operator.attrgetter(*_PLAIN_CHAT_NAMES)
_PLAIN_CHAT_UNSET = (None,) * len(_PLAIN_CHAT_NAMES)
# A plain chat's messages: roles that need no conversion (``developer``) nor check (``tool``), string content,
# and no name or calls
_PLAIN_ROLES = frozenset(("system", "user", "assistant"))
_MESSAGE_EXTRAS = operator.attrgetter("name", "tool_calls", "tool_call_id")
_NO_EXTRAS = (None, None, None)


def _literal_stops(params: SamplingParams, skip_special_tokens: bool | None) -> None:
    """With ``skip_special_tokens: false`` the gateway alone watches the stop strings: a worker watches text
    without special tokens, where one could match across a marker that the answer's text holds."""
    if skip_special_tokens is False:
        params.stop = []


TEMPLATE_OWN_NAMES = ("messages", "tools", "add_generation_prompt", "continue_final_message")


def template_options(req: ChatCompletionRequest) -> TemplateOptions | None:
    """How the request wants its template rendered (None: as usual), as vLLM reads these fields."""
    variables, add, cont = req.chat_template_kwargs, req.add_generation_prompt, req.continue_final_message
    if not variables and add is None and not cont:
        return None
    if cont and add is not False:  # (vLLM's rule: the prompt cannot both continue a message and start a new one)
        raise BadRequest("continue_final_message: true needs add_generation_prompt: false",
                         param="continue_final_message")
    for name in TEMPLATE_OWN_NAMES:
        if variables and name in variables:
            hint = " (a field of the request)" if name not in ("messages", "tools") else ""
            raise BadRequest(f"chat_template_kwargs must not set {name!r}{hint}", param="chat_template_kwargs")
    return TemplateOptions(add is not False, bool(cont), variables or None)


def _token_ids(value: Any, param: str) -> list[int]:
    """One prompt given as token ids (a 400 naming ``param`` otherwise)."""
    if not (value and is_token_ids(value)):
        raise BadRequest(f"{param} must be a non-empty list of token ids (in [0, {MAX_TOKEN_ID}])", param=param)
    return list(value)


class _GenerateShim:
    """Adapts SGLang sampling_params to the attributes ``Frontend._params`` reads."""

    def __init__(self, sp: GenerateSampling) -> None:
        self.temperature, self.top_p, self.top_k, self.min_p = sp.temperature, sp.top_p, sp.top_k, sp.min_p
        self.seed, self.stop, self.stop_token_ids, self.ignore_eos = sp.seed, sp.stop, sp.stop_token_ids, sp.ignore_eos
        self.logit_bias, self.presence_penalty, self.frequency_penalty = sp.logit_bias, sp.presence_penalty, \
            sp.frequency_penalty
        self.repetition_penalty, self.min_tokens = sp.repetition_penalty, sp.min_new_tokens
        self.n = 1


def new_id(prefix: str) -> str:
    return f"{prefix}-{random_hex()}"


def now_s() -> int:
    return int(time.time())


def sse(payload: Any) -> bytes:
    return b"data: " + _json.encode(payload) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


def error_event(error: APIError) -> bytes:
    return sse(error.body())
