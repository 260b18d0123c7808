"""Request fields the gateway refuses with a 400 naming them, instead of silently ignoring them.

A request that asks for a feature the gateway does not implement would otherwise get something else
than it asked for. ``reject_unsupported`` checks a decoded request against its route's rules;
``reject_non_text_content`` refuses chat content parts other than text.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any

from gateway.api_models import MAX_BATCH_CHOICES, ChatMessage
from gateway.errors import BadRequest


def check_batch_choices(items: int, n: int, param: str) -> None:
    """A batch of ``items`` prompts with ``n`` choices each: at most ``MAX_BATCH_CHOICES`` choices in all."""
    if items * n > MAX_BATCH_CHOICES:
        raise BadRequest(f"a batch of {items} prompts x n={n} is more than {MAX_BATCH_CHOICES} choices; split it",
                         param=param)

# -- features the gateway does not implement -----------------------------------------------------
# A request that asks for one of these would silently get something else, so it is a 400 naming the
# field. Each rule: (field, honoured(value, request): is this value one we honour?, what is accepted,
# for the message).
Rule = tuple[str, Callable[[Any, Any], bool], str]


def field_values(names: Sequence[str]) -> Callable[[Any], tuple[Any, ...]]:
    """One C call reading ``names`` off an object, as a tuple (``attrgetter`` gives one name's value bare)."""
    if len(names) == 1:
        name = names[0]
        return lambda obj: (getattr(obj, name),)
    return operator.attrgetter(*names)


class Rules:
    """A route's rules, with the one call that reads all their fields (made once, at import)."""

    __slots__ = ("rules", "values")

    def __init__(self, *rules: Rule) -> None:
        self.rules = rules
        self.values = field_values([name for name, _, _ in rules])


def _unset(value: Any, _req: Any) -> bool:
    return value is None or value is False or (isinstance(value, (str, list, dict)) and not value)


def _is(*neutral: Any) -> Callable[[Any, Any], bool]:
    return lambda value, _req: value is None or value in neutral


_SAMPLING_RULES: tuple[Rule, ...] = (  # (structured output: gateway/structured_output.py)
    ("guided_whitespace_pattern", _unset, ""),
    ("spaces_between_special_tokens", _is(True), "true"),
    ("allowed_token_ids", _is(None), ""),
    ("bad_words", _unset, ""),
    ("prompt_logprobs", _is(None), ""),
    ("truncate_prompt_tokens", _is(None), ""),
    ("use_beam_search", _is(False), "false"),
    ("length_penalty", _is(1, 1.0), "1.0"),
    ("return_tokens_as_token_ids", _is(False), "false"),
)
CHAT_RULES = Rules(
    *_SAMPLING_RULES,
    ("add_special_tokens", _is(False), "false"),  # (the template writes the special tokens)
    ("chat_template", _unset, ""),
    ("echo", _is(False), "false"),
    ("functions", _unset, ""),
    ("function_call", _is("none"), '"none"'),
    ("modalities", lambda value, _req: value is None or value == ["text"], '["text"]'),
    ("audio", _unset, ""),
    ("web_search_options", _is(None), ""),  # ({} asks for a search too)
)
COMPLETION_RULES = Rules(
    *_SAMPLING_RULES,
    ("add_special_tokens", _is(True), "true"),
    ("suffix", _unset, ""),
    ("best_of", lambda value, req: value is None or value in (1, req.n or 1), "1 or n"),
)
GENERATE_RULES = Rules(
    ("image_data", _unset, ""),
    ("audio_data", _unset, ""),
    ("video_data", _unset, ""),
    ("input_embeds", _unset, ""),
    ("lora_path", _unset, ""),
    ("custom_logit_processor", _unset, ""),
    ("return_hidden_states", _unset, ""),
    ("top_logprobs_num", _is(0), "0"),
    ("token_ids_logprob", lambda value, req: _unset(value, req) or not req.return_logprob, ""),
)
GENERATE_SAMPLING_RULES = Rules(
    ("structural_tag", _unset, ""),
    ("spaces_between_special_tokens", _is(True), "true"),
    ("stop_regex", _unset, ""),
)


def reject_unsupported(obj: Any, rules: Rules, prefix: str = "") -> None:
    """400 naming the first field of ``obj`` set to a value the gateway would not honour."""
    values = rules.values(obj)
    if values.count(None) == len(values):  # (every field unset, the common case: one C call, no rule run)
        return
    for (name, honoured, accepted), value in zip(rules.rules, values, strict=True):
        if not honoured(value, obj):
            only = f" (only {accepted} is accepted)" if accepted else ""
            raise BadRequest(f"{prefix}{name} is not supported{only}", param=prefix + name)


def reject_non_text_content(messages: list[ChatMessage]) -> None:
    """Message content may be a string or a list of text parts (concatenated); anything else is a 400."""
    for i, message in enumerate(messages):
        if not isinstance(message.content, list):
            continue
        for j, part in enumerate(message.content):
            kind = part.get("type")
            if kind != "text":
                what = f"{kind} content parts are" if isinstance(kind, str) else "content parts without a type are"
                raise BadRequest(f"{what} not supported; only text parts",
                                 param=f"messages[{i}].content[{j}].type")
            if not isinstance(part.get("text"), str):
                raise BadRequest("a text content part needs a string text", param=f"messages[{i}].content[{j}].text")
