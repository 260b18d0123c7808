"""Structured-output request fields -> the ``Grammar`` the workers constrain decoding with.

Accepted (at most one per request; each a 400 naming the field when malformed or rejected):
- OpenAI ``response_format``: ``{"type": "text"}`` (none), ``{"type": "json_object"}``,
  ``{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}``.
- SGLang's extensions on the OpenAI routes and in ``/generate``'s ``sampling_params``: ``regex``,
  ``ebnf`` (GBNF) and ``json_schema`` (a JSON Schema, as a JSON string or an object).
- vLLM's on the OpenAI routes: ``guided_json``, ``guided_regex``, ``guided_grammar`` (GBNF, as its
  xgrammar backend takes it), ``guided_choice`` (one of a list of strings, as a regex of their
  alternation), and the newer ``structured_outputs`` object with the same as ``json``, ``regex``,
  ``grammar``, ``choice`` or ``json_object: true``.

When the grammar library (llguidance) is importable here, ``grammar_for`` also checks the grammar
compiles, so a bad one is refused before any worker sees the request; the workers check again.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import json
from collections.abc import Callable
from typing import Any

from gateway.errors import BadRequest
from gateway.request_checks import field_values
from workers import grammar as grammars
from workers.protocol import Grammar


def _schema_text(value: Any, param: str) -> str:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise BadRequest(f"{param} is not valid JSON: {exc}", param=param) from None
        except RecursionError:
            raise BadRequest(f"{param} is nested too deeply", param=param) from None
    if not isinstance(value, dict):
        raise BadRequest(f"{param} must be a JSON Schema object", param=param)
    return json.dumps(value)


def _response_format(value: Any) -> Grammar | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise BadRequest("response_format must be an object with a type", param="response_format")
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return Grammar("json_object", param="response_format")
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise BadRequest("response_format.json_schema needs a schema", param="response_format.json_schema")
        param = "response_format.json_schema.schema"
        strict = spec.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise BadRequest(f"response_format.json_schema.strict must be a boolean, got {strict!r}",
                             param="response_format.json_schema.strict")
        return Grammar("json_schema", _schema_text(spec["schema"], param), strict=bool(strict), param=param)
    raise BadRequest(f"response_format.type must be text, json_object or json_schema, got {kind!r}",
                     param="response_format.type")


def _sglang_fields(obj: Any, prefix: str) -> list[Grammar]:
    found = []
    for name in ("regex", "ebnf"):
        value = getattr(obj, name, None)
        if value is not None:
            found.append(_text(value, name, prefix + name))
    value = getattr(obj, "json_schema", None)
    if value is not None:
        param = prefix + "json_schema"
        found.append(Grammar("json_schema", _schema_text(value, param), strict=False, param=param))
    return found


_REGEX_META = frozenset("\\.+*?()|[]{}^$#&-~")  # (the grammar library's regex syntax: Rust's)
# vLLM's ``structured_outputs`` keys that change nothing here (the library and its defaults are ours)
_NEUTRAL_OUTPUT_KEYS = frozenset(("disable_fallback", "disable_any_whitespace", "disable_additional_properties",
                                  "_backend", "_backend_was_auto"))


def _choice(value: Any, param: str) -> Grammar:
    if not isinstance(value, list) or not value or not all(isinstance(item, str) for item in value):
        raise BadRequest(f"{param} must be a non-empty list of strings", param=param)
    literal = ("".join("\\" + c if c in _REGEX_META else c for c in item) for item in value)
    return Grammar("regex", "(" + "|".join(literal) + ")", param=param)


def _text(value: Any, kind: str, param: str) -> Grammar:
    if not isinstance(value, str) or not value:
        raise BadRequest(f"{param} must be a non-empty string", param=param)
    return Grammar(kind, value, param=param)


def _vllm_fields(obj: Any) -> list[Grammar]:
    found = []
    value = getattr(obj, "guided_json", None)
    if value is not None:
        found.append(Grammar("json_schema", _schema_text(value, "guided_json"), strict=False, param="guided_json"))
    for name, kind in (("guided_regex", "regex"), ("guided_grammar", "ebnf")):
        value = getattr(obj, name, None)
        if value is not None:
            found.append(_text(value, kind, name))
    value = getattr(obj, "guided_choice", None)
    if value is not None:
        found.append(_choice(value, "guided_choice"))
    outputs = getattr(obj, "structured_outputs", None)
    if outputs is None:
        return found
    if not isinstance(outputs, dict):
        raise BadRequest("structured_outputs must be an object", param="structured_outputs")
    for key, value in outputs.items():
        param = f"structured_outputs.{key}"
        if value is None or key in _NEUTRAL_OUTPUT_KEYS:
            continue
        if key == "json":
            found.append(Grammar("json_schema", _schema_text(value, param), strict=False, param=param))
        elif key in ("regex", "grammar"):
            found.append(_text(value, "regex" if key == "regex" else "ebnf", param))
        elif key == "choice":
            found.append(_choice(value, param))
        elif key == "json_object":
            if value is not True:
                raise BadRequest(f"{param} must be true when set", param=param)
            found.append(Grammar("json_object", param=param))
        else:  # structural_tag, whitespace_pattern...: would change the output, and are not implemented
            raise BadRequest(f"{param} is not supported", param=param)
    return found


# Every field ``grammar_for`` reads; most requests set none of them.
_FIELDS = ("regex", "ebnf", "json_schema", "guided_json", "guided_regex", "guided_grammar", "guided_choice",
           "structured_outputs", "response_format")
_unset_getters: dict[type, Callable[[Any], tuple[Any, ...]] | None] = {}


def _none_set(obj: Any) -> bool:
    """True when ``obj`` (a msgspec struct) has none of ``_FIELDS`` set: one C call per request (the
    full look-up runs some 130 bytecodes on the hot path); False when it has one, or cannot tell."""
    kind = type(obj)
    try:
        getter = _unset_getters[kind]
    except KeyError:
        names = [name for name in _FIELDS if name in getattr(kind, "__struct_fields__", ())]
        getter = _unset_getters[kind] = field_values(names) if names else None
    if getter is None:
        return False
    values = getter(obj)
    return values.count(None) == len(values)


def grammar_for(obj: Any, prefix: str = "") -> Grammar | None:
    """The constraint ``obj`` (a request body, or /generate's sampling_params with its prefix) asks for."""
    if _none_set(obj):
        return None
    found = _sglang_fields(obj, prefix) + _vllm_fields(obj)
    if hasattr(obj, "response_format"):
        fmt = _response_format(obj.response_format)
        if fmt is not None:
            found.insert(0, fmt)
    if not found:
        return None
    if len(found) > 1:
        names = ", ".join(g.param for g in found)
        raise BadRequest(f"only one structured output may be set (got {names})", param=found[1].param)
    return checked(found[0])


# A grammar's text (a schema, a regex...): each of a request's n choices carries it to both of its workers
MAX_GRAMMAR_CHARS = 1 << 18
# GBNF rules in one ``ebnf``: its conversion (llguidance's ``gbnf_to_lark``, pure Python) is quadratic in them
# (0.6 s for 1,000 rules on the development machine, 11 s for 3,000), on the gateway's prepare thread and
# again on each worker that compiles it.
MAX_EBNF_RULES = 1024


class CheckOffLoop(Exception):
    """A GBNF grammar met on an event loop: its check is dear (``MAX_EBNF_RULES``); prepare the request again
    on a thread (``gateway.responder``), where ``checked`` runs it."""


# Set where a request is prepared on an event loop that must check its GBNF grammars there all the same
# (``--prepare-thread-bytes 0``: no threads).
CHECK_ON_LOOP: contextvars.ContextVar[bool] = contextvars.ContextVar("check_grammars_on_loop", default=False)


def _on_event_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return not CHECK_ON_LOOP.get()


def checked(grammar: Grammar) -> Grammar:
    """``grammar``, after the library (when importable here) accepted it; else a 400 naming its field. A GBNF
    grammar met on an event loop: ``CheckOffLoop``."""
    if len(grammar.source) > MAX_GRAMMAR_CHARS:  # (unbounded: n=64 copies of a 3 MB schema broke worker connections)
        raise BadRequest(f"{grammar.param} is too large: {len(grammar.source)} characters as a grammar, at most "
                         f"{MAX_GRAMMAR_CHARS}", param=grammar.param)
    if grammar.kind == "ebnf" and grammar.source.count("::=") > MAX_EBNF_RULES:
        raise BadRequest(f"{grammar.param} has {grammar.source.count('::=')} rules; at most {MAX_EBNF_RULES} are "
                         "allowed", param=grammar.param)
    # (a grammar's text is kept as its cache key: only small ones are, so 256 keys hold at most 16 MiB)
    small = len(grammar.source) <= grammars.MAX_CACHED_SOURCE
    if grammar.kind == "ebnf" and grammars.is_available() and _on_event_loop():
        raise CheckOffLoop
    problem = _library_says(grammar) if small else _library_says.__wrapped__(grammar)
    if problem is not None:
        raise BadRequest(problem[0], param=problem[1])
    return grammar


@functools.lru_cache(maxsize=256)  # clients repeat their schemas; a check costs ~1-3 ms of the event loop
def _library_says(grammar: Grammar) -> tuple[str, str] | None:
    if not grammars.is_available():
        return None
    try:
        grammars.check(grammar)
    except grammars.GrammarError as exc:
        return str(exc), exc.param
    return None
