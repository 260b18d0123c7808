"""Tool calls on ``/v1/chat/completions``: ``tools`` + ``tool_choice`` in, OpenAI ``tool_calls`` out.

Lifecycle of a request with tools (hooks in ``gateway.api.Frontend.prepare_chat`` and
``gateway.shapes.ChatShape``):
1. ``plan_tools(req)`` checks ``tools`` and ``tool_choice`` (400 naming the field) and picks the mode:
   - ``none``: plain chat; a template that uses ``tools`` still gets them (as vLLM and OpenAI show them: the
     conversation may refer to them), no tool note otherwise, and the answer is never read as a call.
     No tools at all: plain chat.
   - a named function: the output is constrained (``Grammar``) to the function's ``parameters`` schema,
     so it is exactly the call's ``arguments`` JSON.
   - ``required``: constrained to ``{"name": <one of the tools>, "arguments": <its parameters>}``.
   - ``auto``: unconstrained; the answer is a call when it is in the model's own format: Hermes/Qwen
     ``<tool_call>{"name", "arguments"}</tool_call>`` blocks where the chat template defines them,
     else the JSON object the tool note asks for (below); anything else is plain content.
2. ``render_prompt`` builds the prompt: a template that uses ``tools`` gets them; otherwise (e.g.
   SmolLM2's) a system note lists them and the answer format. Assistant ``tool_calls`` and ``tool``
   messages of the conversation are accepted (``check_messages``: a ``tool`` message must answer a call made
   before it, each call has an id, unique in its message, and a named function).
3. ``shape_choices`` rewrites a whole response's choices: ``message.tool_calls`` (ids ``call_...``),
   ``content`` null (in Hermes format: the text before the first ``<tool_call>``, if any),
   ``finish_reason: "tool_calls"``. ``tool_events`` streams: forced calls stream their ``arguments``
   text as it arrives (the first delta carries index, id, type and name), but for a request with stop strings
   or stop tokens (``ToolPlan.hold``): a call one cuts is its text as content (whole answers alike), so it is
   held to the end; ``auto`` holds back an
   answer that starts like a call, and in Hermes format everything from a ``<tool_call>`` on, until
   it is complete; a stream and a whole answer of the same text say the same.
"""

from __future__ import annotations

import functools
import json
import re
import urllib.parse
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from typing import Any

import msgspec

from gateway.context import random_hex
from gateway.errors import BadRequest
from gateway.structured_output import checked
from gateway.tokenizer import TemplateOptions, content_text
from workers.protocol import Grammar

# A block's JSON; the last one may lack its closing tag (the model ended there, or a stop string took it),
# as vLLM's Hermes parser reads it: a call that parses is kept, one that does not makes it all content.
_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)
_HERMES_OPEN = "<tool_call>"
_CALL_START = (_HERMES_OPEN, "{")
_call_decoder = msgspec.json.Decoder(dict[str, msgspec.Raw])  # a call's fields, each as its JSON text
_REQUIRED_START = re.compile(r'\{"name": "((?:[^"\\]|\\.)*)", "arguments": ')  # a forced call's text, to its arguments


@dataclass
class ToolPlan:
    mode: str  # "auto" | "required" | "named" | "none"
    tools: list[dict[str, Any]]  # the functions: {"name", "description"?, "parameters"}
    name: str | None = None  # the named function
    grammar: Grammar | None = None
    hermes: bool = False  # the chat template defines <tool_call> blocks
    parallel: bool = True  # several calls in one answer (``parallel_tool_calls: false``: only its first)
    # (auto) strict tools' argument checks, by name: an answer whose call to one does not pass is content
    validators: dict[str, Callable[[Any], bool]] | None = None
    # (forced) the request has stop strings or stop tokens, which may cut the call short: streamed, its text is held
    # to the end, when it is told a call or (cut by one) content
    hold: bool = False

    @property
    def names(self) -> list[str]:
        return [t["name"] for t in self.tools]


_FUNCTION_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")  # (``fullmatch``: ``$`` would let a final newline through)


def _shown(value: Any) -> str:
    """A client's value in a refusal's message, cut short (a name may be megabytes)."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _functions(tools: Any) -> list[dict[str, Any]]:
    functions = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise BadRequest(f'{where}.type must be "function"', param=f"{where}.type")
        fn = tool.get("function")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise BadRequest(f"{where}.function.name must be a non-empty string", param=f"{where}.function.name")
        if not _FUNCTION_NAME.fullmatch(fn["name"]):  # (OpenAI's rule: a model writes the name back in its call)
            raise BadRequest(f"{where}.function.name must be 1 to 64 of a-z, A-Z, 0-9, underscores and dashes, got "
                             f"{_shown(fn['name'])}", param=f"{where}.function.name")
        description, strict = fn.get("description"), fn.get("strict")
        if description is not None and not isinstance(description, str):
            raise BadRequest(f"{where}.function.description must be a string, got {_shown(description)}",
                             param=f"{where}.function.description")
        if strict is not None and not isinstance(strict, bool):  # (as response_format.json_schema.strict)
            raise BadRequest(f"{where}.function.strict must be a boolean, got {_shown(strict)}",
                             param=f"{where}.function.strict")
        params = fn.get("parameters")
        if params is None:  # (absent or null: a function without parameters, as vLLM reads it; clients send both)
            params = {"type": "object", "properties": {}}
        if not isinstance(params, dict):
            raise BadRequest(f"{where}.function.parameters must be a JSON Schema object",
                             param=f"{where}.function.parameters")
        kind = params.get("type", "object")
        if kind != "object" and isinstance(kind, list) and "object" in kind:
            kind = "object"  # (e.g. ["object", "null"], as some schema generators write an optional model)
        if "type" not in params or kind != params["type"]:  # (e.g. {}: a call's arguments are an object all the same)
            params = {**params, "type": "object"}
        if kind != "object":
            raise BadRequest(f'{where}.function.parameters must describe an object ("type": "object")',
                             param=f"{where}.function.parameters")
        functions.append({"name": fn["name"], "description": description or "", "parameters": params,
                          "strict": bool(strict)})
    names = [f["name"] for f in functions]
    if len(set(names)) != len(names):
        raise BadRequest("function names in tools must be unique", param="tools")
    return functions


def skips_call_tags(tokenizer: Any) -> bool:
    """Whether a decode that skips special tokens leaves out the ``<tool_call>`` tag: in some models' vocabularies
    (Hermes 2 Pro's) it is a special token, and an ``auto`` answer's calls would lose their markers and come back as
    plain text. Such a request's text is decoded with its special tokens written out (as vLLM's Hermes parser asks)."""
    skipped = getattr(tokenizer, "skipped_ids", None)
    token_to_id = getattr(tokenizer, "token_to_id", None)
    if not skipped or token_to_id is None:
        return False
    return token_to_id(_HERMES_OPEN) in skipped


def plan_tools(req: Any, chat_template: str | None) -> ToolPlan | None:
    """What ``tools`` / ``tool_choice`` ask for; None for a plain chat."""
    choice = req.tool_choice
    if not req.tools:
        if choice not in (None, "none", "auto"):
            raise BadRequest(f"tool_choice {choice!r} is not supported without tools", param="tool_choice")
        return None
    tools = _functions(req.tools)
    hermes = chat_template is not None and _HERMES_OPEN in chat_template
    if choice is None or choice == "auto":  # (required and named modes make one call by their grammar)
        return ToolPlan("auto", tools, hermes=hermes, parallel=getattr(req, "parallel_tool_calls", None) is not False,
                        validators=_strict_validators(tools))
    if choice == "none":
        return ToolPlan("none", tools, hermes=hermes)
    if choice == "required":
        _check_shared_ids(tools)  # (one document now: two different resources with one $id would share references)
        # each tool's parameters move under its option's "arguments": their local references move along
        options = [{"type": "object", "properties": {"name": {"const": t["name"]}, "arguments": _rebased(
                        t["parameters"], "#/properties/arguments" if len(tools) == 1
                        else f"#/anyOf/{i}/properties/arguments")},
                    "required": ["name", "arguments"], "additionalProperties": False} for i, t in enumerate(tools)]
        schema = options[0] if len(options) == 1 else {"anyOf": options}
        strict = all(t["strict"] for t in tools)
        return ToolPlan("required", tools, grammar=checked(Grammar("json_schema", json.dumps(schema), strict,
                                                                   param="tools")), hermes=hermes)
    fn = choice.get("function") if isinstance(choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(name, str):
        raise BadRequest('tool_choice must be "none", "auto", "required" or {"type": "function", "function": '
                         '{"name": ...}}', param="tool_choice")
    tool = next((t for t in tools if t["name"] == name), None)
    if tool is None:
        raise BadRequest(f"tool_choice names {name!r}, which is not in tools", param="tool_choice.function.name")
    grammar = Grammar("json_schema", json.dumps(tool["parameters"]), tool["strict"],
                      param=f"tools[{tools.index(tool)}].function.parameters")
    return ToolPlan("named", tools, name=name, grammar=checked(grammar), hermes=hermes)


def _strict_validators(tools: list[dict[str, Any]]) -> dict[str, Callable[[Any], bool]] | None:
    """Under ``auto`` nothing constrains the answer, so ``strict: true`` (arguments valid against the schema, which
    OpenAI's SDKs rely on: ``parse`` validates them) is kept by checking: each strict tool's schema as the grammar
    library takes it (a 400 when it cannot enforce it, as under ``required``), then a call's arguments against it
    (``jsonschema_rs``, when installed; a call that fails is not reported as one: the answer is content)."""
    strict = [(i, t) for i, t in enumerate(tools) if t["strict"]]
    if not strict:
        return None
    validators: dict[str, Callable[[Any], bool]] = {}
    library: Any
    try:
        import jsonschema_rs as library
    except ImportError:  # (the gateway without its optional libraries: the schema check alone, where it can)
        library = None
    for i, tool in strict:
        param = f"tools[{i}].function.parameters"
        source = json.dumps(tool["parameters"])
        checked(Grammar("json_schema", source, True, param=param))
        if library is not None:
            try:  # (a schema's validator is ~20x its text: cached only when small, at most ~20 MiB in all)
                make = _validator if len(source) <= MAX_CACHED_SCHEMA_CHARS else _validator.__wrapped__
                validators[tool["name"]] = make(source)
            except Exception as exc:  # (its ValidationError for a schema it cannot read)
                raise BadRequest(f"{param} is not a valid JSON Schema: {exc}", param=param) from None
    return validators


MAX_CACHED_SCHEMA_CHARS = 4096  # a strict tool's schema whose validator is kept (256 of them: ~20 MiB at most)


@functools.lru_cache(maxsize=256)  # (clients send the same tools every turn: ~80 µs each to build)
def _validator(source: str) -> Callable[[Any], bool]:
    import jsonschema_rs

    # (a remote "$ref" is refused by the grammar check before this; no retriever is given all the same)
    validator: Callable[[Any], bool] = jsonschema_rs.validator_for(json.loads(source)).is_valid
    return validator


# Keywords whose values are data, not schemas (a "$ref" key inside them is a value like any other), and
# those whose values map names to schemas (their keys are names, whatever they are called)
_DATA_KEYWORDS = frozenset(("const", "default", "enum", "examples"))
_SCHEMA_MAPS = frozenset(("properties", "patternProperties", "$defs", "definitions", "dependentSchemas",
                          "dependencies"))  # (a dependencies entry may be a list of names: left as it is)


def _rebased(schema: Any, root: str) -> Any:
    """``schema`` with its local references (``#``, ``#/$defs/X``, ``#/definitions/X``...: JSON pointer
    fragments; a plain-name anchor such as ``#node`` finds its target wherever it is) pointing under
    ``root``, a JSON pointer fragment to where it is placed in a larger schema."""
    if isinstance(schema, list):
        return [_rebased(item, root) for item in schema]
    if not isinstance(schema, dict):
        return schema
    base = schema.get("$id")
    if _is_resource(base):  # a resource of its own ("#name": an anchor, draft 7; "": none):
        return schema  # its "#..." references resolve against it, wherever it is placed
    out = {}
    for key, value in schema.items():
        if key in _DATA_KEYWORDS:
            out[key] = value
        elif key == "$ref" and isinstance(value, str) and (value == "#" or value.startswith("#/")):
            out[key] = root + value[1:]
        elif key == "$id" and value == "":
            continue  # (names nothing; embedded, the library would take it as a base of its own)
        elif key in _SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: _rebased(sub, root) for name, sub in value.items()}
        else:
            out[key] = _rebased(value, root)
    return out


def _is_resource(schema_id: Any) -> bool:
    """A ``$id`` that makes its schema a resource of its own (its ``#/...`` references resolve against it)."""
    return isinstance(schema_id, str) and bool(schema_id) and not schema_id.startswith("#")


def _resource_ids(schema: Any, base: str, found: dict[str, str]) -> None:
    """The schema resources in ``schema`` (a ``$id`` other than a fragment: ``_rebased``), by their URI (resolved
    against ``base``), each as its canonical JSON text."""
    if isinstance(schema, list):
        for item in schema:
            _resource_ids(item, base, found)
        return
    if not isinstance(schema, dict):
        return
    own = schema.get("$id")
    if _is_resource(own):
        try:
            base = urllib.parse.urljoin(base, own).split("#", 1)[0]
        except ValueError as exc:  # (a URI Python cannot read, e.g. "http://[::1": a client's mistake, not a 500)
            where = f" against {base!r}" if base else ""
            raise BadRequest(f"the $id {own!r} cannot be resolved{where}: {exc}") from None
        found.setdefault(base, json.dumps(schema, sort_keys=True))
    for key, value in schema.items():
        if key in _DATA_KEYWORDS:
            continue
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            for sub in value.values():
                _resource_ids(sub, base, found)
        else:
            _resource_ids(value, base, found)


def _check_shared_ids(tools: list[dict[str, Any]]) -> None:
    """Under ``required`` every tool's parameters are one document: a ``$id`` that two tools give to different
    schemas would have both tools' references resolve against one of them (one tool held to the other's
    definitions): a 400. The same schema under one ``$id`` twice resolves alike: accepted."""
    seen: dict[str, tuple[int, str]] = {}
    for i, tool in enumerate(tools):
        found: dict[str, str] = {}
        try:
            _resource_ids(tool["parameters"], "", found)
        except BadRequest as exc:
            raise BadRequest(f"tools[{i}].function.parameters: {exc.message}",
                             param=f"tools[{i}].function.parameters") from None
        for uri, text in found.items():
            first = seen.setdefault(uri, (i, text))
            if first[1] != text:
                raise BadRequest(f"tools[{i}].function.parameters and tools[{first[0]}].function.parameters give "
                                 f"the $id {uri!r} to different schemas; under tool_choice \"required\" every "
                                 "tool's schema is part of one", param=f"tools[{i}].function.parameters")


# -- the prompt ----------------------------------------------------------------------------------
def check_messages(messages: list[dict[str, Any]]) -> None:
    """A ``tool`` message must follow an assistant message with ``tool_calls`` (or another tool message) and answer
    one of the calls made before it (``tool_call_id``, as ``/v1/responses`` asks of a ``function_call_output``); an
    assistant's ``tool_calls`` must each be a call (an ``id``, unique in the message, and a named ``function``).
    A conversation without calls costs what it did: the calls are looked at only where there are some."""
    answering = False
    made: set[str] | None = None  # the ids of the calls made so far (None: none, nothing allocated)
    for i, message in enumerate(messages):
        role = message["role"]
        if role == "tool":
            if not answering:
                raise BadRequest("a message with role 'tool' must answer a preceding assistant message's "
                                 "tool_calls", param=f"messages[{i}].role")
            call_id = message.get("tool_call_id")
            if not isinstance(call_id, str):
                raise BadRequest("a tool message needs its tool_call_id", param=f"messages[{i}].tool_call_id")
            if made is None or call_id not in made:
                raise BadRequest(f"the tool message's tool_call_id {_shown(call_id)} matches no tool call of an "
                                 "assistant message before it", param=f"messages[{i}].tool_call_id")
            continue
        if role == "assistant" and message.get("tool_calls"):
            answering = True
            made = _check_calls(message["tool_calls"], i, made)
        else:
            answering = False


def _check_calls(calls: list[Any], i: int, made: set[str] | None) -> set[str]:
    """An assistant message's ``tool_calls`` (``messages[i]``): each an object with an ``id`` (unique in the
    message) and a ``function`` with a name and ``arguments`` (a JSON string, or an object); ``made`` with their
    ids added."""
    ids: set[str] = set()
    for j, call in enumerate(calls):
        where = f"messages[{i}].tool_calls[{j}]"
        if not isinstance(call, dict):
            raise BadRequest(f"{where} must be an object", param=where)
        call_id, fn = call.get("id"), call.get("function")
        if not isinstance(call_id, str) or not call_id:
            raise BadRequest(f"{where}.id must be a non-empty string (the id a tool message answers)",
                             param=f"{where}.id")
        if call_id in ids:
            raise BadRequest(f"{where}.id {_shown(call_id)} is the id of another call of the same message",
                             param=f"{where}.id")
        ids.add(call_id)
        if call.get("type", "function") != "function":
            raise BadRequest(f'{where}.type must be "function"', param=f"{where}.type")
        if not isinstance(fn, dict):
            raise BadRequest(f"{where}.function must be an object with the call's name and arguments",
                             param=f"{where}.function")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise BadRequest(f"{where}.function.name must be a non-empty string", param=f"{where}.function.name")
        if not isinstance(fn.get("arguments", "{}"), str | dict):
            raise BadRequest(f"{where}.function.arguments must be a JSON string", param=f"{where}.function.arguments")
    return ids if made is None else made | ids


def _call_json(call: dict[str, Any]) -> dict[str, Any]:
    fn = call.get("function")
    fn = fn if isinstance(fn, dict) else {}
    arguments = fn.get("arguments", "{}")
    try:
        arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
    except ValueError:
        pass
    return {"name": fn.get("name", ""), "arguments": arguments}


def render_prompt(tokenizer: Any, messages: list[dict[str, Any]], plan: ToolPlan | None,
                  options: TemplateOptions | None = None) -> list[int]:
    """The prompt ids: the template gets ``tools`` when it uses them, else a system note describes them;
    ``options`` (None: the defaults) as the tokenizer's keywords."""
    check_messages(messages)
    template = getattr(tokenizer, "chat_template", None) or ""
    native = "tools" in template
    converted = []
    for message in messages:
        message = {k: v for k, v in message.items() if v is not None}
        calls = message.get("tool_calls")
        if calls and native:
            message["tool_calls"] = [{**c, "function": _call_json(c)} for c in calls]
        elif calls:  # shown as the model was asked to answer
            shown = [json.dumps(_call_json(c)) for c in calls]
            message["content"] = "\n".join([content_text(message.get("content")), *shown]).strip()
        converted.append(message)
    keywords = options.keywords() if options is not None else {}
    if plan is not None and native:
        tools = [{"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters")}}
                 for t in plan.tools]
        return tokenizer.apply_chat_template(converted, tools=tools, **keywords)
    if plan is not None and plan.mode != "none":
        note = _tool_note(plan)
        if converted and converted[0]["role"] == "system":
            converted[0] = {**converted[0], "content": f"{content_text(converted[0].get('content'))}\n\n{note}".strip()}
        else:
            converted.insert(0, {"role": "system", "content": note})
    return tokenizer.apply_chat_template(converted, **keywords)


def _tool_note(plan: ToolPlan) -> str:
    listed = json.dumps([{k: t[k] for k in ("name", "description", "parameters")} for t in plan.tools])
    if plan.mode == "named":
        return f"Call the function {plan.name}. Answer with its arguments as one JSON object.\nFunctions: {listed}"
    return ("You can call these functions. To call one, answer with only a JSON object "
            '{"name": <function name>, "arguments": <arguments object>}.\n' + f"Functions: {listed}")


# -- the answer ----------------------------------------------------------------------------------
def _new_call(name: str, arguments: str) -> dict[str, Any]:
    return {"id": f"call_{random_hex()[:24]}", "type": "function", "function": {"name": name, "arguments": arguments}}


def parse_calls(plan: ToolPlan, text: str) -> list[dict[str, Any]] | None:
    """The tool calls in a complete answer, or None when it is plain content."""
    if plan.mode == "named":
        assert plan.name is not None
        return [_new_call(plan.name, text)]
    # (Hermes blocks are the model's own format, read under auto alone: a forced call's text is its grammar's JSON
    # object, whose strings may hold a literal "<tool_call>")
    bodies = _HERMES.findall(text) if plan.mode == "auto" and plan.hermes and _HERMES_OPEN in text else [text]
    calls = []
    for body in bodies:
        # The arguments as the model wrote them (as a stream sends them), not re-serialized: the same text
        # whole and streamed, its characters and numbers as they were.
        try:
            obj = _call_decoder.decode(body)
            name = msgspec.json.decode(obj["name"]) if "name" in obj else None
        except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
            return None
        arguments = bytes(obj.get("arguments") or b"").decode()
        if not isinstance(name, str) or name not in plan.names or not arguments.startswith("{"):
            return None
        check = plan.validators.get(name) if plan.validators else None
        if check is not None and not _passes(check, arguments):
            return None  # (a strict tool's call whose arguments break its schema: the answer is text)
        calls.append(_new_call(name, arguments))
    return (calls if plan.parallel else calls[:1]) or None


def _passes(check: Callable[[Any], bool], arguments: str) -> bool:
    try:  # (NaN and Infinity are not JSON: a strict client's parser refuses them)
        return check(json.loads(arguments, parse_constant=_not_json))
    except (ValueError, RecursionError):  # (not JSON after all, or nested past what Python can hold)
        return False


def _not_json(constant: str) -> Any:
    raise ValueError(f"{constant} is not JSON")


def split_calls(plan: ToolPlan, text: str) -> tuple[str | None, list[dict[str, Any]] | None]:
    """A complete answer as (content, tool calls): in Hermes format, text before the first ``<tool_call>``
    is content (None when only whitespace); calls None: it is all content."""
    start = text.find(_HERMES_OPEN) if plan.mode == "auto" and plan.hermes else -1
    if start <= 0:
        return None, parse_calls(plan, text)
    before = text[:start]
    return (before if before.strip() else None), parse_calls(plan, text[start:])


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def _required_start(text: str) -> tuple[str, int] | None:
    """A forced call's (required mode) name and where its arguments start, once its text has come that far."""
    match = _REQUIRED_START.match(text)
    return None if match is None else (json.loads(f'"{match.group(1)}"'), match.end())


def _cut_call(plan: ToolPlan, text: str) -> list[dict[str, Any]] | None:
    """A forced call (required mode) cut before its end: its name and the arguments as far as they go."""
    start = _required_start(text)
    if start is None or start[0] not in plan.names:
        return None
    return [_new_call(start[0], text[start[1]:])]


def _forced_complete(plan: ToolPlan, text: str) -> bool:
    """Whether a forced call's text (named or required mode) is the whole call (its arguments parse)."""
    return _is_json(text) if plan.mode == "named" else parse_calls(plan, text) is not None


def shape_choices(plan: ToolPlan, result: dict[str, Any]) -> None:
    """Rewrite a whole chat response's choices whose text is a call into OpenAI's ``tool_calls`` shape.
    ``finish_reason`` turns to ``tool_calls`` only for a complete call: a forced one cut by ``max_tokens`` keeps
    ``length``, its arguments as far as they went (as when streamed); one cut by a stop string (or a stop token) is
    no call at all: its text is the content, ``finish_reason`` ``stop`` (a call whose arguments do not parse, with
    nothing saying it was cut, would be run)."""
    for choice in result["choices"]:
        message = choice["message"]
        if plan.mode == "auto" and choice["finish_reason"] != "stop":
            continue  # a cut-off answer is content (as when streamed)
        text = message["content"] or ""
        content, calls = split_calls(plan, text)
        complete = calls is not None and (plan.mode != "named" or _is_json(text))
        if not complete and plan.mode != "auto" and choice["finish_reason"] == "stop":
            continue  # a forced call a stop string cut: its text as content (as when streamed)
        if calls is None and plan.mode == "required":
            calls = _cut_call(plan, text)
        if calls is None:
            continue
        message["content"] = content
        message["tool_calls"] = calls
        if choice["finish_reason"] == "stop" and complete:
            choice["finish_reason"] = "tool_calls"


class ChoiceStream:
    """One streamed choice's text -> deltas: a forced call's arguments as they come, else held back."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.text = ""
        self.sent = 0  # characters of ``text`` already sent (as content or as arguments)
        self.call_id: str | None = None
        self.args_start: int | None = None  # where the arguments begin in ``text`` (required mode)
        self.held_from = 0  # auto: where the held-back text (a call) begins
        self.name = plan.name or ""
        self.hold = plan.hold  # (a forced call a stop string may cut: all of it held to the end)

    def feed(self, new: str) -> list[dict[str, Any]]:
        self.text += new
        return [] if self.hold else self._deltas()

    def _deltas(self) -> list[dict[str, Any]]:
        """The deltas of the text come since the last call (``feed``)."""
        plan = self.plan
        if plan.mode == "named":
            return self._arguments(0, len(self.text), self.name)
        if plan.mode == "required":
            if self.args_start is None:
                call_start = _required_start(self.text)
                if call_start is None:
                    return []
                self.name, self.args_start = call_start
                self.sent = self.args_start
            # (the last character, but for white space after it, may be the object's closing "}"; found
            # without copying the text: this runs per token)
            end = len(self.text)
            while end > self.args_start and self.text[end - 1].isspace():
                end -= 1
            return self._arguments(self.args_start, end - 1, self.name)
        if self.sent < 0:
            return []  # auto, an answer that started like a call: held until the end
        if self.sent == 0:
            stripped = self.text.lstrip()
            if any(stripped.startswith(p) for p in _CALL_START):
                self.sent = -1
                return []
            if any(p.startswith(stripped) for p in _CALL_START):
                return []  # nothing yet, or a prefix of "<tool_call>": wait for more
        end = len(self.text)
        if plan.hermes:  # content, then a call: the content goes, the call is held from its "<tool_call>"
            start = self.text.find(_HERMES_OPEN, self.sent)
            if start >= 0:
                end, self.held_from = start, start
            else:  # hold a tail that may become "<tool_call>"
                end = next((i for i in range(max(self.sent, end - len(_HERMES_OPEN) + 1), end)
                            if _HERMES_OPEN.startswith(self.text[i:])), end)
        delta = [{"content": self.text[self.sent : end]}] if end > self.sent else []
        self.sent = -1 if self.held_from else end
        return delta

    def _arguments(self, start: int, end: int, name: str) -> list[dict[str, Any]]:
        piece = self.text[max(self.sent, start) : end]
        self.sent = max(self.sent, end)
        call: dict[str, Any] = {"index": 0, "function": {"arguments": piece}}
        if self.call_id is None:
            self.call_id = f"call_{random_hex()[:24]}"
            call.update(id=self.call_id, type="function", function={"name": name, "arguments": piece})
        elif not piece:
            return []
        return [{"tool_calls": [call]}]

    def finish(self, reason: str | None) -> tuple[list[dict[str, Any]], str | None]:
        if self.hold:  # (a forced call, held: a stop string cut it, and it is content, or it goes out as it would have)
            self.hold = False
            if reason == "stop" and not _forced_complete(self.plan, self.text):
                return ([{"content": self.text}] if self.text else []), reason
            deltas = self._deltas()
            more, reason = self._finish(reason)
            return deltas + more, reason
        return self._finish(reason)

    def _finish(self, reason: str | None) -> tuple[list[dict[str, Any]], str | None]:
        plan = self.plan
        if plan.mode == "required" and self.args_start is not None:
            whole = parse_calls(plan, self.text) is not None  # a complete call, even if cut right after it
            done = reason == "stop" and whole  # (not cut by a stop string)
            end = self.text.rfind("}") if whole else len(self.text)
            deltas = self._arguments(self.args_start, max(end, self.sent), self.name)
            return deltas, "tool_calls" if done else reason
        if plan.mode == "named":
            return [], "tool_calls" if reason == "stop" and self.call_id and _is_json(self.text) else reason
        if plan.mode == "auto" and self.sent >= 0:  # plain content: the rest held (a call's start, e.g. "<to")
            rest = self.text[self.sent :]
            return ([{"content": rest}] if rest else []), reason
        # Held to the end (auto: it started like a call, or its call did; required: its arguments never
        # began): as a whole answer (``split_calls``: in Hermes format, text before the first block is content)
        held = self.text[self.held_from :]
        content, calls = split_calls(plan, held) if reason == "stop" else (None, None)
        if calls is None:
            return ([{"content": held}] if held else []), reason
        before: list[dict[str, Any]] = [{"content": content}] if content is not None else []
        return before + [{"tool_calls": [{"index": i, **c}]} for i, c in enumerate(calls)], "tool_calls"


async def tool_events(run: Any, chunk: Callable[..., bytes], usage: Callable[..., dict[str, Any]],
                      ) -> AsyncGenerator[bytes, None]:
    """A streamed chat completion with tools (``ChatShape.events`` for ``prep.tools``)."""
    prep = run.prep
    plan: ToolPlan = prep.tools
    streams: dict[int, ChoiceStream] = {}
    states: dict[int, Any] = {}
    held: dict[int, list[dict[str, Any]]] = {}  # logprob entries of text not sent yet: they go with the next chunk
    async for state, text, entries in run.frontend.run_choices(prep, None):
        first = state.index not in streams
        stream = streams.setdefault(state.index, ChoiceStream(plan))
        states[state.index] = state
        deltas = stream.feed(text)
        if first:
            deltas = [{"role": "assistant", "content": None}, *deltas]
        finish = None
        if state.finish_reason is not None:
            more, finish = stream.finish(state.finish_reason)
            deltas += more
        pending = held.get(state.index)  # (entries of outputs whose text was held back, extended in place)
        if pending is not None:
            pending.extend(entries)
            entries = pending
        if not deltas and finish is None:
            if entries and pending is None:
                held[state.index] = list(entries)
            continue
        if pending is not None:
            del held[state.index]
        logprobs = {"content": entries} if prep.want_logprobs else None
        for k, delta in enumerate(deltas):
            last = k == len(deltas) - 1
            yield chunk(run, [{"index": state.index, "delta": delta, "logprobs": logprobs if last else None,
                               "finish_reason": finish if last else None}])
        if not deltas and finish is not None:
            yield chunk(run, [{"index": state.index, "delta": {}, "logprobs": logprobs, "finish_reason": finish}])
    if prep.include_usage:
        yield chunk(run, [], usage(prep, list(states.values())))
