"""OpenAI's Responses API, ``POST /v1/responses``: text and function tools in, a message and calls out; stored.

The request becomes a chat request and runs as one (the chat template, the default budget, the same
dispatch and checks): ``instructions`` is a system message in front of ``input`` (a string: one user
message; a list: message items whose content is text or text parts, and function calls and their outputs,
``gateway/responses_tools.py``), ``max_output_tokens`` the budget, ``text.format`` structured output
(``json_object`` or a flat ``json_schema``, as chat's ``response_format``), ``tools``/``tool_choice`` chat's.
The answer is a ``response`` object with an output message and a ``function_call`` item per call (``status:
incomplete`` with ``incomplete_details.reason: max_output_tokens`` when the budget ran out). A stream is the
API's typed events (``event:`` and ``data:`` lines, each with its ``sequence_number``): ``response.created``,
``response.in_progress``, ``response.output_item.added``, ``response.content_part.added``, one
``response.output_text.delta`` per piece of text, then the ``...done`` events and ``response.completed``
(or ``response.incomplete``) with the whole response and its usage; no ``[DONE]``. With tools under ``auto``,
an answer that starts like a call is held back until it ends (to tell a call from a message) and then comes out
as what it is, but ``response.created`` and ``response.in_progress`` still go out with the first output, as on
every stream. An error before that is an HTTP status; after it, ``response.failed`` (``failure``: the output as
far as it went, none of a held answer), an event the SDK's typed stream yields.

Stored responses (``gateway/response_store.py``, ``--responses-store-max``): unless ``store`` is false, the final
response object (completed or incomplete, stored as its generation ends, before it is sent; not a failed stream's,
whose ``response.failed`` says ``store: false``) is kept with its conversation (the items before its output, its
own input items with ids), for ``GET``/``DELETE /v1/responses/{id}``, ``GET .../input_items`` and for
``previous_response_id``, whose conversation and output go in front of the new ``input`` (its ``instructions`` do
not carry over: only the request's own are in front); an id not stored (or another key's) is a 404 naming
``previous_response_id``. With the store off (``--responses-store-max 0``) ``store`` is answered ``false`` and
``previous_response_id`` is a 400.
``conversation`` (OpenAI's conversation objects), hosted tools, reasoning options, ``background``, ``include``,
``top_logprobs`` and non-text input are a 400 naming the field rather than silently ignored.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import AsyncGenerator
from typing import Annotated, Any

import msgspec
from msgspec import Meta

from gateway.api import Frontend, Prepared, now_s
from gateway.api_models import ChatCompletionRequest, ChatMessage, Count, ModelName, Temperature, TopP
from gateway.errors import APIError, BadRequest
from gateway.responder import PREPARE_THREAD_BYTES, Exchange, Host, Responder
from gateway.response_store import PENDING, ResponseStore, held_bytes, not_found
from gateway.responses_tools import (
    TOOL_ITEMS,
    ToolStream,
    call_messages,
    chat_message,
    chat_param,
    chat_tools,
    function_item,
    split_answer,
)
from gateway.shapes import Run, Shape, usage
from gateway.structured_output import CheckOffLoop, _on_event_loop
from gateway.text import ChoiceState
from gateway.tool_calls import ChoiceStream

_json = msgspec.json.Encoder()
INPUT_ROLES = ("user", "system", "developer", "assistant")
# (an assistant turn's own text comes back as output_text, or a refusal's as refusal)
_TEXT_PARTS = {"input_text": "text", "output_text": "text", "refusal": "refusal"}
# ``response.failed``'s ``error.code`` (OpenAI's codes) by the failure's status; any other: ``server_error``
_FAILURE_CODES = {400: "invalid_prompt", 429: "rate_limit_exceeded"}
# OpenAI's rule for a json_schema ``text.format``'s name
_FORMAT_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
# OpenAI's limits on ``metadata``
MAX_METADATA = 16
Metadata = Annotated[dict[Annotated[str, Meta(max_length=64)], Annotated[str, Meta(max_length=512)]],
                     Meta(max_length=MAX_METADATA)]


class ResponsesRequest(msgspec.Struct):
    """``POST /v1/responses``. Unknown fields are ignored; ``null`` is the default, as on the other routes."""

    input: str | list[Any] | None = None
    model: ModelName | None = None
    instructions: str | None = None
    max_output_tokens: Count | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    stream: bool | None = False
    # {"format": {"type": "text" | "json_object" | "json_schema", ...}, "verbosity": ...}
    text: dict[str, Any] | None = None
    metadata: Metadata | None = None  # answered as sent
    store: bool | None = None  # absent: true (OpenAI's default); answered false when the gateway stores nothing
    previous_response_id: str | None = None  # a stored response this one continues
    user: str | None = None
    # function tools (gateway/responses_tools.py): {"type": "function", "name", "description", "parameters", "strict"}
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None  # "auto" | "none" | "required" | {"type": "function", "name"}
    parallel_tool_calls: bool | None = None
    truncation: str | None = None  # "disabled" only
    service_tier: str | None = None  # accepted, not used
    safety_identifier: str | None = None  # accepted, not used
    prompt_cache_key: str | None = None  # accepted, not used
    stream_options: dict[str, Any] | None = None  # accepted, not used
    # not implemented: a 400 unless absent or neutral
    conversation: Any = None
    reasoning: dict[str, Any] | None = None
    include: list[Any] | None = None
    background: bool | None = None
    prompt: Any = None
    top_logprobs: int | None = None
    max_tool_calls: int | None = None


def _refuse_unsupported(req: ResponsesRequest, stores: bool) -> None:
    """``stores``: this gateway keeps responses (``previous_response_id`` can be served)."""
    if req.previous_response_id is not None and not stores:
        raise BadRequest("previous_response_id is not supported: this gateway stores no responses "
                         "(--responses-store-max 0); send the whole conversation in input",
                         param="previous_response_id")
    if req.conversation is not None:
        raise BadRequest("conversation is not supported: send the whole conversation in input"
                         + (", or continue a stored response with previous_response_id" if stores else ""),
                         param="conversation")
    if req.max_tool_calls is not None:
        raise BadRequest("max_tool_calls is not supported (parallel_tool_calls: false allows one call)",
                         param="max_tool_calls")
    if req.reasoning and any(value is not None for value in req.reasoning.values()):
        raise BadRequest("reasoning options are not supported", param="reasoning")
    if req.include:
        raise BadRequest("include is not supported", param="include")
    if req.background:
        raise BadRequest("background responses are not supported", param="background")
    if req.prompt is not None:
        raise BadRequest("prompt templates are not supported; send the text in input", param="prompt")
    if req.top_logprobs:
        raise BadRequest("top_logprobs is not supported on /v1/responses; /v1/chat/completions has logprobs",
                         param="top_logprobs")
    if req.truncation not in (None, "disabled"):
        raise BadRequest("truncation must be 'disabled': a conversation longer than the context is a 400",
                         param="truncation")


def _format(text: dict[str, Any] | None) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """``text`` -> (its ``format`` as the response repeats it, chat's ``response_format`` or None)."""
    if text is None:
        return {"type": "text"}, None
    verbosity = text.get("verbosity")
    if verbosity not in (None, "medium"):
        raise BadRequest("text.verbosity other than 'medium' is not supported", param="text.verbosity")
    fmt = text.get("format")
    if fmt is None:
        return {"type": "text"}, None
    if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str):
        raise BadRequest("text.format must be an object with a type", param="text.format")
    kind = fmt["type"]
    if kind == "text":
        return fmt, None
    if kind == "json_object":
        return fmt, {"type": "json_object"}
    if kind == "json_schema":  # flat here; nested under "json_schema" in chat's response_format
        # (OpenAI's requirements, which chat's response_format does not have: the response repeats the format,
        # and the SDK's model of it needs both)
        name = fmt.get("name")
        if not isinstance(name, str) or not _FORMAT_NAME.fullmatch(name):
            raise BadRequest("text.format.name is required: a-z, A-Z, 0-9, underscores and dashes, at most 64",
                             param="text.format.name")
        if not isinstance(fmt.get("schema"), dict):
            raise BadRequest("text.format.schema is required: a JSON Schema object", param="text.format.schema")
        description = fmt.get("description")
        if description is not None and not isinstance(description, str):
            raise BadRequest(f"text.format.description must be a string, got {type(description).__name__}",
                             param="text.format.description")
        schema = {key: fmt[key] for key in ("name", "schema", "strict", "description") if key in fmt}
        return fmt, {"type": "json_schema", "json_schema": schema}
    raise BadRequest(f"text.format.type must be text, json_object or json_schema, got {kind!r}",
                     param="text.format.type")


def _messages(req: ResponsesRequest, prefix: list[Any]) -> tuple[list[ChatMessage], list[str]]:
    """The chat messages, and where each came from (``instructions``, ``previous_response_id``, ``input[i]``: a
    refusal's ``param``). ``prefix``: a stored conversation's items, in front of ``input`` (after instructions)."""
    messages = [ChatMessage(role="system", content=req.instructions)] if req.instructions else []
    origins = ["instructions"] if req.instructions else []
    items = req.input
    if isinstance(items, str):
        if not items:
            raise BadRequest("input must not be empty", param="input")
    elif not items:
        raise BadRequest("input is required: a string or a non-empty list of messages", param="input")
    for item in prefix:
        _add_item(messages, origins, item, "previous_response_id")
    if isinstance(items, str):
        messages.append(ChatMessage(role="user", content=items))
        return messages, [*origins, "input"]
    for i, item in enumerate(items):
        _add_item(messages, origins, item, f"input[{i}]")
    return messages, origins


def _add_item(messages: list[ChatMessage], origins: list[str], item: Any, at: str) -> None:
    """One input item (``at``: its name in a refusal) onto the chat messages, and its origin."""
    if not isinstance(item, dict):
        raise BadRequest("each input item must be an object (a message)", param=at)
    kind = item.get("type", "message")
    if kind in TOOL_ITEMS:
        call_messages(messages, item, at)
        origins += [at] * (len(messages) - len(origins))  # (a call may join the message before)
        return
    if kind != "message":
        raise BadRequest(f"input items of type {kind!r} are not supported; only messages, function_call and "
                         "function_call_output", param=f"{at}.type")
    role = item.get("role")
    if role not in INPUT_ROLES:
        raise BadRequest(f"{at}.role must be one of {', '.join(INPUT_ROLES)}, got {role!r}", param=f"{at}.role")
    content = item.get("content")
    origins.append(at)
    if isinstance(content, str):
        messages.append(ChatMessage(role=role, content=content))
        return
    if not isinstance(content, list):
        raise BadRequest("a message's content must be a string or a list of text parts", param=f"{at}.content")
    parts = []
    for j, part in enumerate(content):
        part_kind = part.get("type") if isinstance(part, dict) else None
        field = _TEXT_PARTS.get(part_kind) if isinstance(part_kind, str) else None
        if field is None:
            raise BadRequest(f"content parts of type {part_kind!r} are not supported; only input_text, "
                             "output_text and refusal", param=f"{at}.content[{j}].type")
        if not isinstance(part.get(field), str):
            raise BadRequest(f"a {part_kind} part needs a string {field}", param=f"{at}.content[{j}].{field}")
        parts.append({"type": "text", "text": part[field]})
    messages.append(ChatMessage(role=role, content=parts))


def _stored_items(given: str | list[Any]) -> list[dict[str, Any]]:
    """A request's ``input`` (checked by ``_messages``) as stored: the fields that make the prompt, nothing else (an
    unknown field is ignored, not kept)."""
    if isinstance(given, str):
        return [{"type": "message", "role": "user", "content": given}]
    items: list[dict[str, Any]] = []
    for item in given:
        kind = item.get("type", "message")
        if kind == "function_call":
            items.append({"type": kind, "call_id": item["call_id"], "name": item["name"],
                          "arguments": item["arguments"]})
        elif kind == "function_call_output":
            output = item["output"]
            items.append({"type": kind, "call_id": item["call_id"], "output": output if isinstance(output, str)
                          else [{"type": p["type"], "text": p["text"]} for p in output]})
        else:
            content = item["content"]
            if not isinstance(content, str):
                content = [{"type": p["type"], _TEXT_PARTS[p["type"]]: p[_TEXT_PARTS[p["type"]]]} for p in content]
            items.append({"type": "message", "role": item["role"], "content": content})
    return items


# an input item's id (``GET /v1/responses/{id}/input_items``) by its type: OpenAI's prefixes
_ITEM_ID_PREFIXES = {"message": "msg", "function_call": "fc", "function_call_output": "fco"}


def _with_ids(items: list[dict[str, Any]], response_id: str) -> list[dict[str, Any]]:
    """A response's own input items (``_stored_items``) with the ids ``input_items`` lists them by: the response's
    id, then the item's place in its input (unique in a store of unique response ids; an id the client gave an item
    is not kept, as no other of its fields the prompt does not need is)."""
    tail = response_id.removeprefix("resp_")
    return [{"id": f"{_ITEM_ID_PREFIXES[item['type']]}_{tail}_{i}", **item} for i, item in enumerate(items)]


# chat's names -> this route's (a prefix of a refusal's ``param``, a word of its message)
_NAMES = (("max_completion_tokens", "max_output_tokens"), ("response_format.json_schema", "text.format"),
          ("response_format", "text.format"), ("messages", "input"))


def _ours(param: str, origins: list[str]) -> str:
    """Chat's name for a field -> this route's; ``origins``: where each chat message came from (``_messages``)."""
    for chat, ours in _NAMES:
        if param.startswith(chat):
            rest = param[len(chat):]
            if chat == "messages" and rest.startswith("["):  # messages[k]... -> input[i]... (or instructions)
                index, _, tail = rest[1:].partition("]")
                origin = origins[int(index)] if index.isdigit() and int(index) < len(origins) else "input"
                return origin if origin in ("instructions", "previous_response_id") else origin + tail
            return ours + rest
    return chat_param(param)


def _renamed(exc: BadRequest, origins: list[str]) -> BadRequest:
    if exc.param is not None:
        exc.param = _ours(exc.param, origins)
    for chat, ours in _NAMES[:3]:
        exc.message = exc.message.replace(chat, ours)
    exc.message = chat_message(exc.message)
    return exc


class ResponsesShape(Shape):
    route = "responses"
    body_type = ResponsesRequest
    id_prefix = "resp"
    end = b""  # (no ``[DONE]``: the last event is ``response.completed``)

    def __init__(self, store: ResponseStore | None = None, prepare_thread_bytes: int = PREPARE_THREAD_BYTES) -> None:
        self.store = store  # None: nothing stored (``store`` answered false, ``previous_response_id`` a 400)
        # a stored conversation this long (JSON bytes) in front of the input is prepared (tokenized) on a thread, as a
        # body this long is (``Responder``; 0: never)
        self.prepare_thread_bytes = prepare_thread_bytes

    def prepare(self, frontend: Frontend, req: Any) -> tuple[Prepared, str | None]:
        pending = PENDING.get() if self.store is not None else None  # (set by ``ResponsesResponder``)
        _refuse_unsupported(req, pending is not None)
        prefix: list[Any] = []
        if req.previous_response_id is not None:
            assert pending is not None and self.store is not None
            previous = self.store.get(pending.owner, req.previous_response_id)
            if previous is None:
                raise not_found(req.previous_response_id, "previous_response_id")
            if previous.conversation_bytes >= self.prepare_thread_bytes > 0 and _on_event_loop():
                raise CheckOffLoop  # (a short body, a long prompt: tokenized on a thread, as a long body is)
            prefix = [*previous.conversation, *previous.output]  # (its instructions stay behind)
            pending.prefix_bytes = previous.conversation_bytes
        fmt, response_format = _format(req.text)
        messages, origins = _messages(req, prefix)
        tools, tool_choice = chat_tools(req.tools, req.tool_choice)
        chat = ChatCompletionRequest(model=req.model, messages=messages, max_completion_tokens=req.max_output_tokens,
                                     temperature=req.temperature, top_p=req.top_p, stream=req.stream,
                                     response_format=response_format, user=req.user, tools=tools,
                                     tool_choice=tool_choice, parallel_tool_calls=req.parallel_tool_calls)
        try:
            prep = frontend.prepare_chat(chat)
        except BadRequest as exc:
            raise _renamed(exc, origins) from None
        prep.max_tokens_param = "max_output_tokens"  # (a worker's refusal of the budget)
        prep.prompt_param = "input"
        grammar = prep.params.grammar
        if grammar is not None:  # (a worker's refusal of the format names it by its param)
            prep.params.grammar = msgspec.structs.replace(grammar, param=_ours(grammar.param, origins))
        prep.echo_fields = {
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "metadata": req.metadata or {}, "parallel_tool_calls": req.parallel_tool_calls is not False,
            "temperature": 1.0 if req.temperature is None else req.temperature,
            "text": {"format": fmt}, "tool_choice": req.tool_choice or "auto", "tools": req.tools or [],
            "top_p": 1.0 if req.top_p is None else req.top_p, "user": req.user,
            "safety_identifier": req.safety_identifier, "prompt_cache_key": req.prompt_cache_key,
            "previous_response_id": req.previous_response_id, "store": False,
        }
        if pending is not None and req.store is not False:  # (stored with its answer: ``_kept``)
            pending.conversation = (prefix, req.input)
            prep.echo_fields["store"] = True
        # (OpenAI's spelling of its ids: resp_..., msg_...) From the OS's generator, not ``random_hex``'s
        # ``random``: a stored response's id is all that guards it on a gateway without keys, and a Mersenne
        # Twister's next ids follow from 624 words of those it handed out (request ids, other responses' ids).
        return prep, f"resp_{secrets.token_hex(16)}"

    # -- the response object ----------------------------------------------------------------------------

    @staticmethod
    def _message_id(run: Run) -> str:
        return "msg_" + run.rid.removeprefix("resp_")

    def _message(self, run: Run, text: str, status: str) -> dict[str, Any]:
        content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] \
            if status != "in_progress" else []
        return {"id": self._message_id(run), "type": "message", "status": status, "role": "assistant",
                "content": content}

    @staticmethod
    def _response(run: Run, status: str, output: list[dict[str, Any]], state: ChoiceState | None) -> dict[str, Any]:
        echo = run.prep.echo_fields or {}
        body: dict[str, Any] = {
            "id": run.rid, "object": "response", "created_at": run.created, "status": status, "background": False,
            "error": None, "incomplete_details": None, "model": run.frontend.model_name, "output": output,
            "previous_response_id": None, "reasoning": {"effort": None, "summary": None}, "service_tier": "default",
            "store": False, "truncation": "disabled", "usage": None, **echo,
        }
        if state is not None:
            if state.finish_reason == "length":
                body["status"] = "incomplete"
                body["incomplete_details"] = {"reason": "max_output_tokens"}
            else:
                body["completed_at"] = now_s()
            chat = usage(run.prep, [state])
            body["usage"] = {
                # (``cache_write_tokens``: the SDK's models require it; nothing is billed for writing the cache)
                "input_tokens": chat["prompt_tokens"],
                "input_tokens_details": {**chat["prompt_tokens_details"], "cache_write_tokens": 0},
                "output_tokens": chat["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": chat["total_tokens"],
            }
        return body

    @staticmethod
    def _item_status(state: ChoiceState) -> str:
        """The output message's status: ``incomplete`` when the budget cut it, as the response's."""
        return "incomplete" if state.finish_reason == "length" else "completed"

    def _kept(self, body: dict[str, Any]) -> dict[str, Any]:
        """The final response object ``body``, stored first if its request is to be (once)."""
        if self.store is not None:
            pending = PENDING.get()
            if pending is not None and pending.conversation is not None:
                prefix, given = pending.conversation
                own = _with_ids(_stored_items(given), body["id"])
                # (``own_bytes``: what its items hold in memory, for the store's bound; ``conversation_bytes``: the
                # JSON a continuation carries in front of its input, for where it is prepared)
                json_bytes = len(_json.encode(own)) + len(_json.encode(body["output"]))
                self.store.put(pending.owner, body["id"], _json.encode(body), body["output"], [*prefix, *own],
                               own_bytes=held_bytes(own), conversation_bytes=pending.prefix_bytes + json_bytes)
                pending.conversation = None
        return body

    def whole(self, run: Run, choices: list[ChoiceState]) -> dict[str, Any]:
        state = choices[0]
        plan = run.prep.tools
        if plan is None:
            return self._kept(self._response(
                run, "completed", [self._message(run, state.text, self._item_status(state))], state))
        content, calls, _ = split_answer(plan, state.text, state.finish_reason)  # (gateway/responses_tools.py)
        status = self._item_status(state)  # (a forced call cut by the budget: its arguments as far as they went)
        output = [self._message(run, content, status)] if content else []
        return self._kept(self._response(run, "completed", output + [function_item(call, status) for call in calls],
                                         state))

    # -- the stream's events -----------------------------------------------------------------------------

    @staticmethod
    def _event(run: Run, kind: str, fields: dict[str, Any]) -> bytes:
        number = run.sequence
        run.sequence = number + 1
        return b"event: %s\ndata: %s\n\n" % (kind.encode(), _json.encode(
            {"type": kind, "sequence_number": number, **fields}))

    def _text_fields(self, run: Run) -> dict[str, Any]:
        return {"item_id": self._message_id(run), "output_index": 0, "content_index": 0}

    def _head(self, run: Run) -> list[bytes]:
        """A stream's first events: the response created, in progress (no output yet)."""
        opening = self._response(run, "in_progress", [], None)
        return [self._event(run, "response.created", {"response": opening}),
                self._event(run, "response.in_progress", {"response": opening})]

    def first(self, run: Run, state: ChoiceState, text: str) -> bytes | None:
        run.partial = lambda: [self._message(run, state.text, "incomplete")]
        chunks = [
            *self._head(run),
            self._event(run, "response.output_item.added",
                        {"output_index": 0, "item": self._message(run, "", "in_progress")}),
            self._event(run, "response.content_part.added", {
                **self._text_fields(run), "part": {"type": "output_text", "text": "", "annotations": []}}),
        ]
        delta = self.middle(run, state, text)
        if delta is not None:
            chunks.append(delta)
        return b"".join(chunks)

    def middle(self, run: Run, state: ChoiceState, text: str) -> bytes | None:
        if not text:
            return None
        return self._event(run, "response.output_text.delta", {**self._text_fields(run), "delta": text,
                                                                "logprobs": []})

    def middle_template(self, run: Run, index: int) -> tuple[bytes, bytes] | None:
        return None  # (every event has its own sequence number)

    def _closing(self, run: Run, state: ChoiceState) -> bytes:
        text = state.text
        item = self._message(run, text, self._item_status(state))
        part = item["content"][0]
        whole = self._kept(self._response(run, "completed", [item], state))
        return b"".join((
            self._event(run, "response.output_text.done", {**self._text_fields(run), "text": text, "logprobs": []}),
            self._event(run, "response.content_part.done", {**self._text_fields(run), "part": part}),
            self._event(run, "response.output_item.done", {"output_index": 0, "item": item}),
            self._event(run, f"response.{whole['status']}", {"response": whole}),
        ))

    def failure(self, run: Run, error: APIError) -> bytes:
        """``response.failed``, as OpenAI ends a stream that broke: the response ``failed``, its ``error``, and
        the output as far as it went (the open items ``incomplete``)."""
        partial = getattr(run, "partial", None)
        response = self._response(run, "failed", partial() if partial is not None else [], None)
        response["error"] = {"code": _FAILURE_CODES.get(error.status, "server_error"), "message": error.message,
                             "param": error.param, "type": error.type}
        if response["store"]:  # (what is true: a failed response is not stored; one the shutdown cut while its
            # completed answer went out was, before it went: ``_kept``)
            pending = PENDING.get()
            response["store"] = pending is not None and pending.conversation is None
        return self._event(run, "response.failed", {"response": response})

    async def events(self, run: Run) -> AsyncGenerator[bytes, None]:
        if run.prep.tools is not None:
            async for events in self._tool_events(run):
                yield events
            return
        last: ChoiceState | None = None
        opened = run.opened
        async for state, text, _ in run.frontend.run_choices(run.prep, run.emitter):
            last = state
            if state.index not in opened:
                opened.add(state.index)
                chunk = self.first(run, state, text)
            else:
                chunk = self.middle(run, state, text)
            if chunk:
                yield chunk
        if last is not None:
            yield self._closing(run, last)

    async def _tool_events(self, run: Run) -> AsyncGenerator[bytes, None]:
        """A stream with tools: chat's deltas (text, or a call's arguments as they come) as output items' events."""
        plan = run.prep.tools
        assert plan is not None
        chat = ChoiceStream(plan)
        items = ToolStream(lambda kind, fields: self._event(run, kind, fields),
                           lambda text, status: self._message(run, text, status), self._message_id(run))
        head = self._head(run)
        run.partial = items.so_far
        last: ChoiceState | None = None
        async for state, text, _ in run.frontend.run_choices(run.prep, None):  # (no direct path: deltas held back)
            last = state
            deltas = chat.feed(text)
            if state.finish_reason is not None:
                deltas += chat.finish(state.finish_reason)[0]
            events = items.feed(deltas)
            if head:  # (with the first output even when its text is held: the stream has started, and an error
                # from here on is ``response.failed``, not an HTTP status)
                events, head = head + events, []
            if events:
                yield b"".join(events)
        if last is None:
            return
        closing = items.finish(self._item_status(last))  # (cut by the budget: the items as far as they went)
        whole = self._kept(self._response(run, "completed", items.items, last))
        yield b"".join([*head, *closing, self._event(run, f"response.{whole['status']}", {"response": whole})])


class ResponsesResponder(Responder):
    """``POST /v1/responses``: the responder of ``ResponsesShape(store)``; with a store, each request is marked with
    its ``Pending`` (``gateway/response_store.py``: its key, what to store with its answer) while it is served."""

    def __init__(self, gw: Host, store: ResponseStore | None, prepare_thread_bytes: int) -> None:
        super().__init__(gw, ResponsesShape(store, prepare_thread_bytes), prepare_thread_bytes)
        self.store = store

    async def serve(self, exchange: Exchange) -> None:
        store = self.store
        if store is None:
            await super().serve(exchange)
            return
        token = PENDING.set(store.pending(exchange.headers))
        try:
            await super().serve(exchange)
        finally:
            PENDING.reset(token)
