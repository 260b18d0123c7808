"""Function tools on ``/v1/responses`` (``gateway/responses.py``), through chat's (``gateway/tool_calls.py``).

In: ``tools`` (flat function definitions: ``{"type": "function", "name", "description", "parameters", "strict"}``)
and ``tool_choice`` (``"auto" | "none" | "required" | {"type": "function", "name"}``) become chat's; input items
``function_call`` (``call_id``, ``name``, ``arguments``) become an assistant message's ``tool_calls`` (consecutive
ones, and the assistant text right before them, one message) and ``function_call_output`` (``call_id``,
``output``) a ``tool`` message. Out: a message item for the answer's text (if any), then one ``function_call`` item
per call (``id`` ``fc_...``, ``call_id``, ``name``, ``arguments``); streamed, each call is its
``response.output_item.added``, ``response.function_call_arguments.delta`` events as the arguments come (a forced
call's), ``...arguments.done`` and ``response.output_item.done``.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from gateway.api_models import MAX_TOOLS, ChatMessage
from gateway.context import random_hex
from gateway.errors import BadRequest
from gateway.tool_calls import ToolPlan, shape_choices

TOOL_ITEMS = ("function_call", "function_call_output")


def chat_tools(tools: list[Any] | None, choice: Any) -> tuple[list[dict[str, Any]] | None, Any]:
    """(chat's ``tools``, chat's ``tool_choice``) for this route's."""
    if not tools:
        return None, choice
    if len(tools) > MAX_TOOLS:
        raise BadRequest(f"at most {MAX_TOOLS} tools", param="tools")
    converted = []
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise BadRequest(f"tools of type {kind!r} are not supported; only function tools", param=f"tools[{i}].type")
        converted.append({"type": "function", "function": {
            key: tool[key] for key in ("name", "description", "parameters", "strict") if key in tool}})
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise BadRequest('tool_choice must be "none", "auto", "required" or {"type": "function", "name": ...}',
                             param="tool_choice")
        choice = {"type": "function", "function": {"name": choice["name"]}}
    return converted, choice


def call_messages(messages: list[ChatMessage], item: dict[str, Any], at: str) -> None:
    """A ``function_call`` or ``function_call_output`` input item onto the chat messages (``at``: the item's name in a
    refusal, ``input[i]``)."""
    if item["type"] == "function_call_output":
        call_id, output = item.get("call_id"), item.get("output")
        if not isinstance(call_id, str) or not call_id:
            raise BadRequest("a function_call_output needs its call_id", param=f"{at}.call_id")
        if not any(call.get("id") == call_id for m in messages if m.role == "assistant" for call in m.tool_calls or ()):
            raise BadRequest(f"the function_call_output for {call_id!r} answers no function_call before it",
                             param=f"{at}.call_id")
        turn = messages[-1]  # (chat's rule, in this route's words: the outputs of a turn follow its calls)
        if turn.role != "tool" and not (turn.role == "assistant" and turn.tool_calls):
            raise BadRequest(f"the function_call_output for {call_id!r} must follow the function_call items of its "
                             "turn (or another function_call_output)", param=f"{at}.call_id")
        if isinstance(output, list):  # (text parts)
            if not all(isinstance(p, dict) and p.get("type") in ("input_text", "output_text")
                       and isinstance(p.get("text"), str) for p in output):
                raise BadRequest("a function_call_output's output must be a string or text parts",
                                 param=f"{at}.output")
            output = "".join(p["text"] for p in output)
        if not isinstance(output, str):
            raise BadRequest("a function_call_output's output must be a string", param=f"{at}.output")
        messages.append(ChatMessage(role="tool", content=output, tool_call_id=call_id))
        return
    call_id, name, arguments = item.get("call_id"), item.get("name"), item.get("arguments")
    for field, value in (("call_id", call_id), ("name", name), ("arguments", arguments)):
        if not isinstance(value, str) or (field != "arguments" and not value):
            raise BadRequest(f"a function_call needs its {field} (a string)", param=f"{at}.{field}")
    call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
    last = messages[-1] if messages else None
    if last is not None and last.role == "assistant" and any(c.get("id") == call_id for c in last.tool_calls or ()):
        raise BadRequest(f"two function_call items of one turn have the call_id {call_id!r}: an output could not "
                         "tell which it answers", param=f"{at}.call_id")
    if last is not None and last.role == "assistant":  # the calls of one turn: one assistant message
        last.tool_calls = [*(last.tool_calls or []), call]
    else:
        messages.append(ChatMessage(role="assistant", content=None, tool_calls=[call]))


# chat's ``tools[i].function.X`` and ``tool_choice.function.X`` -> this route's flat ``tools[i].X``, ``tool_choice.X``
_CHAT_TOOL_FIELD = re.compile(r"(tools\[\d+\]|tool_choice)\.function\.")


def chat_param(param: str) -> str:
    """Chat's name for a tool field -> this route's (``tools[i].function.parameters`` -> ``tools[i].parameters``)."""
    return _CHAT_TOOL_FIELD.sub(r"\1.", param, count=1)


def chat_message(message: str) -> str:
    """Chat's names for tool fields in a refusal's message -> this route's (as ``chat_param``)."""
    message = _CHAT_TOOL_FIELD.sub(r"\1.", message)
    return message.replace('{"type": "function", "function": {"name": ...}}', '{"type": "function", "name": ...}')


def function_item(call: dict[str, Any], status: str = "completed") -> dict[str, Any]:
    fn = call["function"]
    return {"id": "fc_" + random_hex(), "type": "function_call", "status": status, "call_id": call["id"],
            "name": fn["name"], "arguments": fn.get("arguments", "")}


def split_answer(plan: ToolPlan, text: str, finish_reason: str | None) -> tuple[str | None, list[dict[str, Any]],
                                                                                str | None]:
    """A whole answer -> (its content, its calls as chat's ``tool_calls``, the finish reason)."""
    message: dict[str, Any] = {"role": "assistant", "content": text}
    choice: dict[str, Any] = {"message": message, "finish_reason": finish_reason}
    shape_choices(plan, {"choices": [choice]})
    return message["content"], message.get("tool_calls") or [], choice["finish_reason"]


class ToolStream:
    """One streamed answer's chat deltas (``tool_calls.ChoiceStream``) -> this route's output items and events.

    ``event(kind, fields)`` builds one event (numbered by the caller); ``message(text, status)`` a message item."""

    def __init__(self, event: Callable[[str, dict[str, Any]], bytes],
                 message: Callable[[str, str], dict[str, Any]], message_id: str) -> None:
        self.event, self.message, self.message_id = event, message, message_id
        self.items: list[dict[str, Any]] = []  # the output so far, in order (finished or not)
        self.text: str | None = None  # the open message item's text (None: no message item open)
        self.text_index = -1
        self.calls: dict[int, int] = {}  # chat's call index -> its output index
        self.open_call: int | None = None  # the output index of the call whose arguments are coming

    def feed(self, deltas: list[dict[str, Any]]) -> list[bytes]:
        out: list[bytes] = []
        for delta in deltas:
            text = delta.get("content")
            if text:
                if self.text is None:
                    self._close_call(out)
                    self.text, self.text_index = "", len(self.items)
                    self.items.append(self.message("", "in_progress"))
                    out.append(self.event("response.output_item.added", {"output_index": self.text_index,
                                                                         "item": self.items[-1]}))
                    out.append(self.event("response.content_part.added", {
                        **self._text_fields(), "part": {"type": "output_text", "text": "", "annotations": []}}))
                self.text += text
                out.append(self.event("response.output_text.delta", {**self._text_fields(), "delta": text,
                                                                     "logprobs": []}))
            for call in delta.get("tool_calls") or ():
                index = self.calls.get(call["index"])
                fn = call.get("function") or {}
                if index is None:
                    self._close_text(out)
                    self._close_call(out)
                    index = self.calls[call["index"]] = self.open_call = len(self.items)
                    self.items.append(function_item({"id": call.get("id") or f"call_{random_hex()[:24]}",
                                                     "function": {"name": fn.get("name", ""), "arguments": ""}},
                                                    "in_progress"))
                    out.append(self.event("response.output_item.added", {"output_index": index,
                                                                         "item": dict(self.items[index])}))
                piece = fn.get("arguments") or ""
                if piece:
                    item = self.items[index]
                    item["arguments"] += piece
                    out.append(self.event("response.function_call_arguments.delta", {
                        "item_id": item["id"], "output_index": index, "delta": piece}))
        return out

    def so_far(self) -> list[dict[str, Any]]:
        """The output items as far as they went, the open ones ``incomplete`` (a stream that broke)."""
        items = [dict(item) for item in self.items]
        if self.text is not None:
            items[self.text_index] = self.message(self.text, "incomplete")
        if self.open_call is not None:
            items[self.open_call]["status"] = "incomplete"
        return items

    def finish(self, status: str = "completed") -> list[bytes]:
        """The open items' closing events; ``status``: theirs (``incomplete``: the budget cut the answer)."""
        out: list[bytes] = []
        self._close_text(out, status)
        self._close_call(out, status)
        return out

    def _text_fields(self) -> dict[str, Any]:
        return {"item_id": self.message_id, "output_index": self.text_index, "content_index": 0}

    def _close_text(self, out: list[bytes], status: str = "completed") -> None:
        if self.text is None:
            return
        text, self.text = self.text, None
        item = self.items[self.text_index] = self.message(text, status)
        fields = {"item_id": self.message_id, "output_index": self.text_index, "content_index": 0}
        out.append(self.event("response.output_text.done", {**fields, "text": text, "logprobs": []}))
        out.append(self.event("response.content_part.done", {**fields, "part": item["content"][0]}))
        out.append(self.event("response.output_item.done", {"output_index": self.text_index, "item": item}))

    def _close_call(self, out: list[bytes], status: str = "completed") -> None:
        index, self.open_call = self.open_call, None
        if index is None:
            return
        item = self.items[index]
        item["status"] = status
        out.append(self.event("response.function_call_arguments.done", {
            "item_id": item["id"], "output_index": index, "name": item["name"], "arguments": item["arguments"]}))
        out.append(self.event("response.output_item.done", {"output_index": index, "item": item}))
