"""Structured-output request fields -> the ``Grammar`` the workers constrain decoding with.

Accepted (at most one per request; each a 400 naming the field when malformed or rejected):
- OpenAI ``response_format``: ``{"type": "text"}`` (none), ``{"type": "json_object"}``,
  ``{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}``.
- SGLang's extensions on the OpenAI routes and in ``/generate``'s ``sampling_params``: ``regex``,
  ``ebnf`` (GBNF) and ``json_schema`` (a JSON Schema, as a JSON string or an object).

When the grammar library (llguidance) is importable here, ``grammar_for`` also checks the grammar
compiles, so a bad one is refused before any worker sees the request; the workers check again.
"""

from __future__ import annotations

import functools
import json
from typing import Any

from gateway.errors import BadRequest
from workers import grammar as grammars
from workers.protocol import Grammar


def _schema_text(value: Any, param: str) -> str:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise BadRequest(f"{param} is not valid JSON: {exc}", param=param) from None
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
        return Grammar("json_schema", _schema_text(spec["schema"], param), strict=bool(strict), param=param)
    raise BadRequest(f"response_format.type must be text, json_object or json_schema, got {kind!r}",
                     param="response_format.type")


def _sglang_fields(obj: Any, prefix: str) -> list[Grammar]:
    found = []
    for name in ("regex", "ebnf"):
        value = getattr(obj, name, None)
        if value is None:
            continue
        if not isinstance(value, str) or not value:
            raise BadRequest(f"{prefix}{name} must be a non-empty string", param=prefix + name)
        found.append(Grammar(name, value, param=prefix + name))
    value = getattr(obj, "json_schema", None)
    if value is not None:
        param = prefix + "json_schema"
        found.append(Grammar("json_schema", _schema_text(value, param), strict=False, param=param))
    return found


def grammar_for(obj: Any, prefix: str = "") -> Grammar | None:
    """The constraint ``obj`` (a request body, or /generate's sampling_params with its prefix) asks for."""
    found = _sglang_fields(obj, prefix)
    if hasattr(obj, "response_format"):
        fmt = _response_format(obj.response_format)
        if fmt is not None:
            found.insert(0, fmt)
    if not found:
        return None
    if len(found) > 1:
        names = ", ".join(g.param for g in found)
        raise BadRequest(f"only one of response_format, regex, ebnf and json_schema may be set (got {names})",
                         param=found[1].param)
    return checked(found[0])


def checked(grammar: Grammar) -> Grammar:
    """``grammar``, after the library (when importable here) accepted it; else a 400 naming its field."""
    problem = _library_says(grammar)
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
