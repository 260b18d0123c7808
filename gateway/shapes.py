"""What differs between the generation routes (chat, completions, SGLang ``/generate``): a ``Shape``.

A shape has the route's request struct, turns the decoded body into a ``Prepared`` (validation), and
builds the JSON of the whole response and of each stream chunk; ``Run`` is one request being answered
(what the shapes need: ids, times, the per-request chunk templates). The responder
(``gateway/responder.py``) drives them: ``prepare`` -> ``whole`` or ``events`` (every chunk, through the
request's task) and ``middle`` (a middle chunk, also from the worker connection's callback).
Chunks are built from per-request byte templates: per token only the new text is JSON-encoded.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable
from time import monotonic as _monotonic
from time import time as _time
from typing import Any

import msgspec

from gateway.api import SSE_DONE, Frontend, Prepared, TextEmitter, error_event, new_id, sse
from gateway.api_models import ChatCompletionRequest, CompletionRequest, GenerateRequest
from gateway.context import REQUEST_T0
from gateway.errors import APIError, BadRequest
from gateway.text import ChoiceState
from gateway.tokenizer import literal_text, token_text_of
from gateway.tool_calls import shape_choices, tool_events

_json = msgspec.json.Encoder()
_NULL_FINISH = b'"finish_reason":null'  # (a chat chunk template's, ``ChatShape.events``)
WEIGHT_VERSION = "default"  # ``/generate``'s ``meta_info.weight_version`` (SGLang's, with no weight updates)


class Run:
    """One request being answered: what the shapes need to build its JSON."""

    __slots__ = ("created", "cumulative", "emitter", "frontend", "opened", "partial", "prep", "rid", "sequence",
                 "started", "t0", "templates")
    # (``partial``, set by a shape that wants it, unset otherwise: what a stream's answer is so far, for its
    # failure event; read with ``getattr``)
    partial: Callable[[], Any]

    def __init__(self, frontend: Frontend, prep: Prepared, rid: str) -> None:
        self.frontend = frontend
        self.prep = prep
        self.rid = rid
        self.created = int(_time())  # (``now_s``)
        self.t0 = REQUEST_T0.get() or _monotonic()  # (its arrival: ``/generate``'s ``e2e_latency``)
        self.templates: dict[int, tuple[bytes, bytes]] = {}  # choice index -> (before text, after text)
        self.started = False  # the response has started (streaming): errors are events from here on
        self.opened: set[int] = set()  # choices whose first output has been shaped (streaming)
        self.emitter: TextEmitter | None = None  # a stream's chunks, written from outside its task
        self.cumulative: dict[int, _Cumulative] | None = None  # (a ``/generate`` stream's lists, per choice)
        self.sequence = 0  # (a ``/v1/responses`` stream's next event number)


class Shape:
    """What differs between the generation routes (see the module doc)."""

    route = ""
    body_type: type[Any] = object
    id_prefix = ""
    end = SSE_DONE  # what ends a stream, after its last chunk

    def prepare(self, frontend: Frontend, req: Any) -> tuple[Prepared, str | None]:
        """Validate the decoded body; returns the prepared request and the client's id, if any."""
        raise NotImplementedError

    def whole(self, run: Run, choices: list[ChoiceState]) -> Any:
        raise NotImplementedError

    def events(self, run: Run) -> AsyncGenerator[bytes, None]:
        raise NotImplementedError

    def failure(self, run: Run, error: APIError) -> bytes:
        """The event that ends a started stream on ``error`` (``end`` follows it)."""
        return error_event(error)

    def first(self, run: Run, state: ChoiceState, text: str) -> bytes | None:
        """The chunk for a choice's first output, ``text``, not its last, no logprobs (what ``events``
        yields for it); the caller adds the choice to ``run.opened``."""
        return self.middle(run, state, text)

    def middle(self, run: Run, state: ChoiceState, text: str) -> bytes | None:
        """The chunk for ``text`` new in ``state``, not its first output nor its last, no logprobs:
        the choice's template (``_text_chunk`` split around its text, made once per request) around
        the JSON of ``text``."""
        if not text:
            return None
        before, after = run.templates.get(state.index) or self._template(run, state.index)
        return before + _json.encode(text) + after

    def middle_template(self, run: Run, index: int) -> tuple[bytes, bytes] | None:
        """``middle``'s chunk for choice ``index`` split around the JSON of its text (made once per
        request), or None when ``middle`` is not such a template."""
        return run.templates.get(index) or self._template(run, index)

    def _template(self, run: Run, index: int) -> tuple[bytes, bytes]:
        marker = "\x00text\x00"
        before, _, after = self._text_chunk(run, index, marker).partition(_json.encode(marker))
        run.templates[index] = (before, after)
        return before, after

    def _text_chunk(self, run: Run, index: int, text: str) -> bytes:
        """The stream chunk of ``text`` in choice ``index``: no finish reason, no logprobs."""
        raise NotImplementedError


class ChatShape(Shape):
    route = "chat"
    body_type = ChatCompletionRequest
    id_prefix = "chatcmpl"

    def prepare(self, frontend: Frontend, req: Any) -> tuple[Prepared, str | None]:
        return frontend.prepare_chat(req), None

    def whole(self, run: Run, choices: list[ChoiceState]) -> dict[str, Any]:
        prep = run.prep
        result = {
            "id": run.rid, "object": "chat.completion", "created": run.created, "model": run.frontend.model_name,
            "choices": [{
                "index": c.index, "message": {"role": "assistant", "content": c.text},
                "logprobs": {"content": c.logprobs} if prep.want_logprobs else None,
                "finish_reason": c.finish_reason,
            } for c in choices],
            "usage": usage(prep, choices),
        }
        if prep.tools is not None:
            shape_choices(prep.tools, result)  # calls -> message.tool_calls (gateway/tool_calls.py)
        return result

    def _chunk(self, run: Run, choices: list[dict[str, Any]], usage_: dict[str, Any] | None = None) -> bytes:
        payload: dict[str, Any] = {"id": run.rid, "object": "chat.completion.chunk", "created": run.created,
                                   "model": run.frontend.model_name, "choices": choices}
        if run.prep.include_usage:
            payload["usage"] = usage_
        return sse(payload)

    async def events(self, run: Run) -> AsyncGenerator[bytes, None]:
        prep = run.prep
        if prep.tools is not None:  # tool_calls deltas (gateway/tool_calls.py)
            async for event in tool_events(run, self._chunk, usage):
                yield event
            return
        states: dict[int, ChoiceState] = {}
        opened = run.opened
        async for state, text, entries in run.frontend.run_choices(prep, run.emitter):
            first = state.index not in opened
            opened.add(state.index)
            states[state.index] = state
            if not first and not prep.want_logprobs:
                if state.finish_reason is None:
                    chunk = self.middle(run, state, text)  # the common case: a few more tokens of text
                    if chunk:
                        yield chunk
                    continue
                # The last chunk: the choice's template (what ``_chunk`` makes of the same dict, ``middle``'s)
                # with its finish reason in place of the null one (the template's tail holds no text of the
                # client's: that null is its first "finish_reason")
                before, after = run.templates.get(state.index) or self._template(run, state.index)
                yield before + _json.encode(text) + after.replace(
                    _NULL_FINISH, b'"finish_reason":' + _json.encode(state.finish_reason), 1)
                continue
            delta: dict[str, Any] = {"content": text}
            if first:
                delta["role"] = "assistant"
            yield self._chunk(run, [{
                "index": state.index, "delta": delta,
                "logprobs": {"content": entries} if prep.want_logprobs else None,
                "finish_reason": state.finish_reason,
            }])
        if prep.include_usage:
            yield self._chunk(run, [], usage(prep, list(states.values())))

    def first(self, run: Run, state: ChoiceState, text: str) -> bytes | None:
        # (the chunk of {"content": text, "role": "assistant"} as ``_chunk`` encodes it: the choice's template,
        # which the stream's next chunks use, with the role after the text)
        before, after = run.templates.get(state.index) or self._template(run, state.index)
        return before + _json.encode(text) + b',"role":"assistant"' + after

    def _text_chunk(self, run: Run, index: int, text: str) -> bytes:
        return self._chunk(run, [{"index": index, "delta": {"content": text}, "logprobs": None,
                                  "finish_reason": None}])

    def _template(self, run: Run, index: int) -> tuple[bytes, bytes]:
        # A request's template differs from another's of the same model, usage option and choice only in its id
        # and time: ``Shape._template`` made once for those (``_forms``), then per request one formatting step.
        key = (run.frontend.model_name, run.prep.include_usage, index)
        form = _CHAT_FORMS.get(key)
        if form is None:
            form = _chat_form(self, run, index)
            if form is None:  # (a template the markers cannot be found in once each: made as it is)
                return Shape._template(self, run, index)
            if len(_CHAT_FORMS) >= 64:  # (a handful in practice: one model, n choices)
                _CHAT_FORMS.clear()
            _CHAT_FORMS[key] = form
        template = run.templates[index] = (form[0] % (_json.encode(run.rid), run.created), form[1])
        return template


# ``ChatShape._template``'s forms: (model name, include_usage, choice) -> (the text's "before" as a format of the
# request's JSON id and its ``created``, its "after")
_CHAT_FORMS: dict[tuple[str, bool, int], tuple[bytes, bytes]] = {}
_ID_MARK = "\x00id\x00"
_CREATED_MARK = 987_654_321_987_654_321
# (as they are in the JSON: a raw ``"`` is only ever a string's edge, so ``"id":`` and ``"created":`` are the keys)
_ID_FIELD = b'"id":' + _json.encode(_ID_MARK)
_CREATED_FIELD = b'"created":%d' % _CREATED_MARK


def _chat_form(shape: ChatShape, run: Run, index: int) -> tuple[bytes, bytes] | None:
    """``ChatShape._template``'s form for ``run``'s model, usage option and choice ``index`` (None when its markers
    are not each found once)."""
    probe = Run.__new__(Run)
    probe.frontend, probe.prep, probe.rid, probe.created, probe.templates = run.frontend, run.prep, _ID_MARK, \
        _CREATED_MARK, {}
    before, after = Shape._template(shape, probe, index)
    before = before.replace(b"%", b"%%")
    if before.count(_ID_FIELD) != 1 or before.count(_CREATED_FIELD) != 1:
        return None
    return before.replace(_ID_FIELD, b'"id":%b').replace(_CREATED_FIELD, b'"created":%d'), after


class CompletionShape(Shape):
    route = "completions"
    body_type = CompletionRequest
    id_prefix = "cmpl"

    def prepare(self, frontend: Frontend, req: Any) -> tuple[Prepared, str | None]:
        return frontend.prepare_completion(req), None

    def whole(self, run: Run, choices: list[ChoiceState]) -> dict[str, Any]:
        prep, frontend = run.prep, run.frontend
        return {
            "id": run.rid, "object": "text_completion", "created": run.created, "model": frontend.model_name,
            "choices": [{
                "index": c.index, "text": self._prompt_text(run, c.index) + c.text, "finish_reason": c.finish_reason,
                "logprobs": legacy_logprobs(echo_entries(frontend, prep, c) + c.logprobs, 0)
                if prep.want_logprobs else None,
            } for c in choices],
            "usage": usage(prep, choices),
        }

    def _chunk(self, run: Run, index: int, text: str, finish: str | None, logprobs: Any) -> bytes:
        return sse({"id": run.rid, "object": "text_completion", "created": run.created,
                    "model": run.frontend.model_name,
                    "choices": [{"index": index, "text": text, "finish_reason": finish, "logprobs": logprobs}]})

    async def events(self, run: Run) -> AsyncGenerator[bytes, None]:
        prep, frontend = run.prep, run.frontend
        states: dict[int, ChoiceState] = {}
        offsets: dict[int, int] = {}  # choice -> its next token's ``text_offset``
        opened = run.opened
        async for state, text, entries in frontend.run_choices(prep, run.emitter):
            if state.index not in opened:
                opened.add(state.index)
                text = self._prompt_text(run, state.index) + text
                if prep.echo and prep.want_logprobs:  # the prompt's logprobs came with the first output
                    entries = echo_entries(frontend, prep, state) + entries
            states[state.index] = state
            if not text and not entries and state.finish_reason is None:  # (entries: tokens held back as text)
                continue
            if state.finish_reason is None and not prep.want_logprobs:
                chunk = self.middle(run, state, text)  # (text is not empty here)
                if chunk:
                    yield chunk
                continue
            logprobs = None
            if prep.want_logprobs:
                offset = offsets.get(state.index, 0)
                logprobs = legacy_logprobs(entries, offset)
                offsets[state.index] = offset + sum(len(e["token"]) for e in entries)
            yield self._chunk(run, state.index, text, state.finish_reason, logprobs)
        if prep.include_usage:
            yield sse({"id": run.rid, "object": "text_completion", "created": run.created,
                       "model": frontend.model_name, "choices": [],
                       "usage": usage(prep, list(states.values()))})

    def first(self, run: Run, state: ChoiceState, text: str) -> bytes | None:
        return self.middle(run, state, self._prompt_text(run, state.index) + text)

    @staticmethod
    def _prompt_text(run: Run, index: int) -> str:
        """What choice ``index``'s text starts with: with ``echo`` its prompt as sent (ids: as text, special
        tokens written out, as vLLM echoes them), else nothing."""
        prep = run.prep
        if not prep.echo:
            return ""
        text = prep.prompt_text_of(index)
        return text if text is not None else literal_text(run.frontend.tokenizer, prep.prompt_of(index))

    def _text_chunk(self, run: Run, index: int, text: str) -> bytes:
        return self._chunk(run, index, text, None, None)


class GenerateShape(Shape):
    """SGLang's ``/generate``: ``text``, ``output_ids`` and ``meta_info`` (cumulative per chunk)."""

    route = "generate"
    body_type = GenerateRequest
    id_prefix = "gen"

    def prepare(self, frontend: Frontend, req: Any) -> tuple[Prepared, str | None]:
        prep, _ = frontend.prepare_generate(req)
        rid = req.rid
        if prep.batch is not None and rid is None:  # each item its own id, as SGLang gives them
            prep.item_ids = [new_id(self.id_prefix) for _ in range(prep.n)]
            return prep, None
        if not isinstance(rid, list):
            if prep.batch is not None:  # one id for several items: item i's is "<rid>_<i>", as SGLang names them
                prep.item_ids = [f"{rid}_{i}" for i in range(prep.n)]
                return prep, None
            return prep, rid
        if prep.batch is None or len(rid) != len(prep.batch):
            raise BadRequest("rid: a list of ids needs a batch of as many prompts (text or input_ids as a list)",
                             param="rid")
        per = prep.per_prompt  # (with n > 1, prompt i's samples are "<rid[i]>_<j>")
        prep.item_ids = rid if per == 1 else [f"{rid[i // per]}_{i % per}" for i in range(prep.n)]
        return prep, None

    def whole(self, run: Run, choices: list[ChoiceState]) -> Any:
        if run.prep.batch is not None:  # a batch: a list, item i's answer at i
            return [self._payload(run, c) for c in choices]
        return self._payload(run, choices[0])

    async def events(self, run: Run) -> AsyncGenerator[bytes, None]:
        async for state, _, _ in run.frontend.run_choices(run.prep, run.emitter):
            yield sse(self._payload(run, state, streamed=True))

    def middle(self, run: Run, state: ChoiceState, text: str) -> bytes | None:
        return sse(self._payload(run, state, streamed=True))

    def middle_template(self, run: Run, index: int) -> tuple[bytes, bytes] | None:
        return None  # every chunk carries the cumulative text and ids

    @staticmethod
    def _payload(run: Run, state: ChoiceState, streamed: bool = False) -> dict[str, Any]:
        """``streamed``: a chunk of a stream (each repeats the lists so far: their entries encoded once each,
        ``_Cumulative``)."""
        prep = run.prep
        if prep.no_output:  # (``max_new_tokens: 0``: the one token it ran for is not the answer's)
            state = state.prompt_only()
            streamed = False
        prompt = prep.prompt_of(state.index)
        meta: dict[str, Any] = {
            "id": run.rid if prep.item_ids is None else prep.item_ids[state.index],
            "prompt_tokens": len(prompt), "completion_tokens": len(state.token_ids),
            "cached_tokens": state.cached_tokens, "finish_reason": None, "weight_version": WEIGHT_VERSION,
        }
        if state.finish_reason is not None:
            meta["e2e_latency"] = _monotonic() - run.t0  # (as SGLang's: once the item has finished)
            if state.stop.matched is not None:
                meta["finish_reason"] = {"type": "stop", "matched": state.stop.matched}
            elif state.finish_reason == "stop":
                meta["finish_reason"] = {"type": "stop", "matched": state.token_ids[-1]}
            else:
                meta["finish_reason"] = {"type": "length", "length": len(state.token_ids)}
        output_ids: Any
        if streamed:
            cumulative = run.cumulative
            if cumulative is None:
                cumulative = run.cumulative = {}
            lists = cumulative.get(state.index)
            if lists is None:
                lists = cumulative[state.index] = _Cumulative()
            output_ids = lists.output_ids(state)
            if prep.want_logprobs:
                meta["output_token_logprobs"], meta["input_token_logprobs"] = lists.logprobs(run, state)
        else:
            output_ids = list(state.token_ids)
            if prep.want_logprobs:
                meta["output_token_logprobs"] = _output_logprobs(prep, state, 0)
                meta["input_token_logprobs"] = _input_logprobs(run, state)
        payload: dict[str, Any] = {"text": state.text, "output_ids": output_ids, "meta_info": meta}
        if prep.batch is not None:  # (a batch's events interleave: each names its item, as SGLang's)
            payload["index"] = state.index
        return payload


def _output_logprobs(prep: Prepared, state: ChoiceState, start: int) -> list[list[Any]]:
    """``output_token_logprobs`` from output position ``start`` on: [logprob, token id, its text with
    ``return_text_in_logprobs``, else null] each, as SGLang's."""
    text = prep.logprob_text
    return [[e["logprob"], t, e["token"] if text else None] for e, t in
            zip(state.logprobs[start:], state.token_ids[start:], strict=False)]


def _input_logprobs(run: Run, state: ChoiceState) -> list[list[Any]]:
    """``input_token_logprobs``: always a list (an SGLang router in front of a decode worker puts the prefill's
    in front of it: the prompt's logprobs come from the prefill, the decode's own part is empty); positions from
    ``logprob_start_len`` on (-1, the default: the last alone), as SGLang's."""
    prep = run.prep
    prompt = prep.prompt_of(state.index)
    name = token_text_of(run.frontend.tokenizer) if prep.logprob_text else None
    start = prep.logprob_start_of(state.index)
    return [
        [None if i == 0 or lp != lp else lp, t, name(t) if name is not None else None]  # (lp != lp: NaN)
        for i, lp, t in zip(range(start, len(prompt)), state.prompt_logprobs or [], prompt[start:], strict=False)
    ]


class _Cumulative:
    """One choice's ``/generate`` stream: SGLang's chunks each carry the whole output so far (``text``,
    ``output_ids``, ``output_token_logprobs``) and the prompt's logprobs. Each output entry is encoded once, as it
    comes, into a growing JSON list that every later chunk repeats as it is (``msgspec.Raw``), and the prompt's
    entries are made once; a chunk then costs copying bytes, not building and encoding every entry again."""

    __slots__ = ("encoded_logprobs", "ids", "input", "num_ids", "num_logprobs", "prompt_logprobs")

    def __init__(self) -> None:
        self.ids = bytearray()
        self.num_ids = 0
        self.encoded_logprobs = bytearray()
        self.num_logprobs = 0
        self.prompt_logprobs: list[float] | None = None  # what ``input`` was made from
        self.input: msgspec.Raw | None = None

    def output_ids(self, state: ChoiceState) -> msgspec.Raw:
        token_ids = state.token_ids
        if len(token_ids) < self.num_ids:  # (never seen: the lists only grow; start again rather than lie)
            self.ids, self.num_ids = bytearray(), 0
        if len(token_ids) > self.num_ids:
            self.num_ids = _append(self.ids, token_ids[self.num_ids:], len(token_ids))
        return msgspec.Raw(b"[" + self.ids + b"]")

    def logprobs(self, run: Run, state: ChoiceState) -> tuple[msgspec.Raw, msgspec.Raw]:
        """(``output_token_logprobs``, ``input_token_logprobs``)."""
        if len(state.logprobs) < self.num_logprobs:
            self.encoded_logprobs, self.num_logprobs = bytearray(), 0
        if len(state.logprobs) > self.num_logprobs:
            new = _output_logprobs(run.prep, state, self.num_logprobs)
            self.num_logprobs = _append(self.encoded_logprobs, new, self.num_logprobs + len(new))
        if self.input is None or self.prompt_logprobs is not state.prompt_logprobs:
            self.prompt_logprobs = state.prompt_logprobs
            self.input = msgspec.Raw(_json.encode(_input_logprobs(run, state)))
        return msgspec.Raw(b"[" + self.encoded_logprobs + b"]"), self.input


def _append(encoded: bytearray, items: list[Any], count: int) -> int:
    """``items`` encoded onto the JSON list ``encoded`` holds (without its brackets); returns ``count``."""
    if items:
        if encoded:
            encoded += b","
        encoded += _json.encode(items)[1:-1]
    return count


def usage(prep: Prepared, choices: list[ChoiceState]) -> dict[str, Any]:
    """The response's ``usage``: each prompt (of a batch) counted once, its cached part as the most any of
    its choices found cached."""
    if prep.batch is None and len(choices) == 1:  # (the common answer: one prompt, one choice)
        choice = choices[0]
        prompt_tokens, completion, cached = len(prep.input_ids), len(choice.token_ids), choice.cached_tokens
    elif prep.batch is None:  # one prompt
        prompt_tokens, completion = prep.prompt_tokens, sum(len(c.token_ids) for c in choices)
        cached = max((c.cached_tokens for c in choices), default=0)
    else:
        prompt_tokens, completion = prep.prompt_tokens, sum(len(c.token_ids) for c in choices)
        by_prompt: dict[int, int] = {}
        for c in choices:
            item = c.index // prep.per_prompt
            by_prompt[item] = max(by_prompt.get(item, 0), c.cached_tokens)
        cached = sum(by_prompt.values())
    return {
        "prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def legacy_logprobs(entries: list[dict[str, Any]], offset: int) -> dict[str, Any]:
    """The legacy completions' logprobs of ``entries``; ``offset``: where the first entry's text starts
    in the choice's text (``text_offset``: each token's, from the tokens' texts as vLLM counts them)."""
    offsets = []
    for e in entries:
        offsets.append(offset)
        offset += len(e["token"])
    return {
        "tokens": [e["token"] for e in entries],
        "text_offset": offsets,
        "token_logprobs": [e["logprob"] for e in entries],
        "top_logprobs": [_top_dict(e) if e["top_logprobs"] is not None else None for e in entries],
    }


def _top_dict(entry: dict[str, Any]) -> dict[str, float]:
    """A token's legacy ``top_logprobs``: its most likely tokens and always the token itself (OpenAI's
    "up to logprobs + 1"; ``logprobs: 0`` gives the token alone), as vLLM answers."""
    top = {t["token"]: t["logprob"] for t in entry["top_logprobs"]}
    top.setdefault(entry["token"], entry["logprob"])
    return top


def echo_entries(frontend: Frontend, prep: Prepared, choice: ChoiceState) -> list[dict[str, Any]]:
    """Prompt-token entries for ``echo`` + ``logprobs`` (the first token has no logprob). With
    ``logprobs`` > 0 each position after the first also has its most likely tokens, the prompt's own
    among them, as vLLM answers (lm-evaluation-harness reads them to tell a greedy continuation)."""
    if not prep.echo:
        return []
    name = token_text_of(frontend.tokenizer)
    values = choice.prompt_logprobs or []
    tops = choice.prompt_top_logprobs if prep.params.top_logprobs > 0 else None
    entries = []
    for i, token_id in enumerate(prep.prompt_of(choice.index)):
        lp = values[i] if i < len(values) else None
        known = not (i == 0 or lp is None or lp != lp)
        token = name(token_id)
        top: list[dict[str, Any]] | None = [] if known else None  # ([]: the token alone, with ``logprobs: 0``)
        if known and tops is not None and i < len(tops) and tops[i]:
            top = [{"token": name(t.token_id), "logprob": t.logprob} for t in tops[i]]
            if all(t.token_id != token_id for t in tops[i]):
                top.append({"token": token, "logprob": lp})
        entries.append({"token": token, "logprob": lp if known else None, "top_logprobs": top})
    return entries
