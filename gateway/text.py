"""Per-choice output text: incremental detokenization, stop strings, logprob entries."""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

from gateway.tokenizer import Tokenizer, token_text_of
from workers.protocol import StepOutput, TokenLogprob


def _end_then_start(hit: tuple[int, str]) -> tuple[int, int]:
    return hit[0] + len(hit[1]), hit[0]


class StopMatcher:
    """Finds the first stop string in a growing text; holds back a tail that could start one.

    Text pushed as ``exempt`` (that of the first ``min_tokens`` tokens) is never where a string ends, but a
    string may start in it and end in later text, as vLLM matches (its search window reaches back into
    the text before a step's own); so its tail is held back like any other.
    """

    _pending = ""
    _exempt = 0  # how many characters at the start of ``_pending`` are exempt text
    matched: str | None = None
    # (the state's defaults above are the class's: a matcher is made per request choice, most never set them)

    def __init__(self, stops: list[str], keep: bool = False) -> None:
        """``keep``: the text returned at a match ends with the stop string (else just before it)."""
        self.stops = [s for s in stops if s]
        self.keep = keep
        self._hold = max(map(len, self.stops)) - 1 if self.stops else 0

    def push(self, text: str, *, final: bool = False, exempt: bool = False) -> str:
        """Returns the text safe to emit now; after a match, ``matched`` is set and nothing follows."""
        if self.matched is not None:
            return ""
        buf = self._pending + text
        if exempt:
            self._exempt = len(buf)
        elif self.stops:
            floor = self._exempt  # (a string must end past the exempt text)
            hits = [(buf.find(s, max(0, floor - len(s) + 1)), s) for s in self.stops]
            hits = [(i, s) for i, s in hits if i >= 0]
            if hits:  # the one that ends first (ties: the longer), as if the text had come a character at a time:
                index, stop = min(hits, key=_end_then_start)  # so the match is the same however it is split
                self.matched = stop
                self._pending = ""
                return buf[:index + len(stop)] if self.keep else buf[:index]
        if final or self._hold == 0:
            self._pending, self._exempt = "", 0
            return buf
        cut = max(0, len(buf) - self._hold)
        self._pending = buf[cut:]
        self._exempt = max(0, self._exempt - cut)
        return buf[:cut]


class _NoStops(StopMatcher):
    """The ``StopMatcher`` of a choice without stop strings (most are): nothing to find nor to hold back, its
    text passes as it comes (what ``StopMatcher.push`` returns without strings), and ``matched`` stays None."""

    _hold = 0

    def __init__(self, keep: bool = False) -> None:
        self.stops = []
        self.keep = keep

    def push(self, text: str, *, final: bool = False, exempt: bool = False) -> str:
        return text


class ChoiceState:
    """Accumulates one choice's tokens, text and logprobs from decode step outputs."""

    # (defaults of the state that outputs set, on the class: one is made per request choice)
    finish_reason: str | None = None
    cached_tokens = 0
    prompt_logprobs: list[float] | None = None
    prompt_top_logprobs: list[list[TokenLogprob]] | None = None

    def __init__(self, index: int, tokenizer: Tokenizer, stops: list[str], want_logprobs: bool,
                 context: Sequence[int] = (), min_tokens: int = 0, keep_stop: bool = False,
                 stop_tokens: tuple[Sequence[int], ...] = (), skip_special: bool = True) -> None:
        """``context``: the prompt's last ids (``gateway.tokenizer.DECODE_CONTEXT_TOKENS``), which the text
        follows. ``min_tokens``: the text of the first that many tokens is not searched for stop strings
        (as vLLM; the worker's ``workers.stop_strings.StopWatch`` counts alike). ``keep_stop``: the stop
        string that ends the text stays in it. ``stop_tokens``: collections of token ids (the request's
        ``stop_token_ids``, the EOS ids) whose text is left out when one ends the choice (vLLM and SGLang
        do; it stays in ``token_ids`` and the logprobs). Not with ``keep_stop``: it is kept then.
        ``skip_special``: special tokens have no text (False: written out, vLLM's ``skip_special_tokens``)."""
        self.index = index
        self.context = context
        self.skip_special = skip_special
        self.ends = stop_tokens  # (``stop_tokens`` even with ``keep_stop``: what a worker stops at besides strings)
        self.min_tokens = min_tokens
        self.tokenizer = tokenizer
        self.decoder = tokenizer.decoder(context) if skip_special else \
            tokenizer.decoder(context, skip_special_tokens=False)
        self.stop = StopMatcher(stops, keep_stop) if stops else _NoStops(keep_stop)
        self.want_logprobs = want_logprobs
        self.stop_tokens = () if keep_stop else stop_tokens
        self.token_ids: list[int] = []
        self.text_parts: list[str] = []
        self.logprobs: list[dict[str, Any]] = []

    @property
    def text(self) -> str:
        return "".join(self.text_parts)

    def prompt_only(self) -> ChoiceState:
        """This choice without its output (a budget of 0, run for one token): no tokens, text or logprobs, cut at
        its length once it has ended."""
        bare = copy.copy(self)
        bare.token_ids, bare.text_parts, bare.logprobs = [], [], []
        bare.stop = StopMatcher([], False)
        if self.finish_reason is not None:
            bare.finish_reason = "length"
        return bare

    def accept(self, event: StepOutput) -> tuple[str, list[dict[str, Any]]]:
        """Apply one step; returns (new text, new logprob entries). Sets ``finish_reason`` when done."""
        ids = event.token_ids
        exempt = self.min_tokens - len(self.token_ids)  # tokens still before min_tokens: no stop strings in them
        self.token_ids.extend(ids)
        if event.cached_tokens > self.cached_tokens:
            self.cached_tokens = event.cached_tokens
        if event.prompt_logprobs is not None:
            self.prompt_logprobs, self.prompt_top_logprobs = event.prompt_logprobs, event.prompt_top_logprobs
        final = event.finish_reason is not None
        if final and ids and event.finish_reason == "stop" and any(ids[-1] in ends for ends in self.stop_tokens):
            ids = ids[:-1]  # the stop token's text is not the answer's (``stop_tokens``)
        head = ""
        if exempt > 0:  # (the text of tokens within min_tokens: no stop string ends in it)
            # a token at a time, as the worker's ``StopWatch``: pushed together, ids that end inside a character
            # hold back the text before it too, which would then count as searchable text after them
            push = self.decoder.push
            head_text = "".join([push([token]) for token in ids[:exempt]])
            ids = ids[exempt:]
            if final and not ids:
                head_text += self.decoder.flush()
            head = self.stop.push(head_text, final=final and not ids, exempt=True)
        text = self.decoder.push(ids) if ids else ""
        if final:  # (also for a final output without tokens: what the decoder holds back is the text's end)
            text += self.decoder.flush()
        new_text = head + self.stop.push(text, final=final)
        cut = None
        if self.stop.matched is not None:
            self.finish_reason = "stop"
            if not self._stopped_by_worker(event):  # (else it ended at the string's token itself)
                cut = self._tokens_to(sum(map(len, self.text_parts)) + len(new_text)
                                      + (0 if self.stop.keep else len(self.stop.matched)))
        elif final:
            self.finish_reason = "stop" if event.finish_reason == "stop" else "length"
        self.text_parts.append(new_text)
        if self.want_logprobs:
            entries = self._logprob_entries(event)
            self.logprobs.extend(entries)
        else:
            entries = []
        if cut is not None and cut < len(self.token_ids):
            # The tokens after the one whose text completed the string (a decode that does not stop at the strings
            # ran on, its outputs merged or gathered into this one, or the text of the ones before held back with
            # them) are not the answer's: not counted, no logprobs.
            del entries[max(0, len(entries) - (len(self.token_ids) - cut)):]
            del self.token_ids[cut:]
            del self.logprobs[cut:]
        return new_text, entries

    def _stopped_by_worker(self, event: StepOutput) -> bool:
        """Whether the worker ended the request with ``event`` at a stop string (its last token completes it, as
        the worker watches the strings token by token): ended ``stop`` by a token that is no stop token."""
        ids = event.token_ids
        return event.finish_reason == "stop" and bool(ids) and not any(ids[-1] in ends for ends in self.ends)

    def _tokens_to(self, end: int) -> int | None:
        """How many of the output's tokens make the first ``end`` characters of its text, decoded again a token at
        a time after the same context; None if they never do (the text as decoded does not reach it)."""
        decoder = self.tokenizer.decoder(self.context) if self.skip_special else \
            self.tokenizer.decoder(self.context, skip_special_tokens=False)
        length = 0
        for i, token in enumerate(self.token_ids):
            length += len(decoder.push([token]))
            if length >= end:
                return i + 1
        return None

    def accept_middle(self, event: StepOutput) -> str:
        """``accept`` for a non-final output of a choice without stop strings or logprobs: its new text."""
        self.token_ids.extend(event.token_ids)
        if event.cached_tokens > self.cached_tokens:
            self.cached_tokens = event.cached_tokens
        if event.prompt_logprobs is not None:
            self.prompt_logprobs, self.prompt_top_logprobs = event.prompt_logprobs, event.prompt_top_logprobs
        text = self.decoder.push(event.token_ids)
        self.text_parts.append(text)
        return text

    def middle_accepter(self) -> Callable[[StepOutput], str]:
        """``accept_middle`` for a stream's direct path (``gateway.responder``), run once per streamed token:
        the same steps in a closure, with the two lists' and the decoder's methods it calls bound once, here
        (the lists are never replaced)."""
        extend, push, append = self.token_ids.extend, self.decoder.push, self.text_parts.append
        # (from here on an attribute of this state, not the class's default: read per token, and CPython 3.11
        # reads a class attribute through an instance the slow way)
        self.cached_tokens = self.cached_tokens

        def accept(event: StepOutput) -> str:
            token_ids = event.token_ids
            extend(token_ids)
            if event.cached_tokens > self.cached_tokens:
                self.cached_tokens = event.cached_tokens
            if event.prompt_logprobs is not None:
                self.prompt_logprobs, self.prompt_top_logprobs = event.prompt_logprobs, event.prompt_top_logprobs
            text = push(token_ids)
            append(text)
            return text
        return accept

    def _logprob_entries(self, event: StepOutput) -> list[dict[str, Any]]:
        if event.logprobs is None:
            return []
        entries = []
        tops = event.top_logprobs or [[] for _ in event.token_ids]
        name, as_bytes = token_text_of(self.tokenizer), getattr(self.tokenizer, "token_bytes", None)
        for token_id, logprob, top in zip(event.token_ids, event.logprobs, tops, strict=False):
            token = name(token_id)
            entries.append({
                "token": token,
                "logprob": logprob,
                "bytes": _bytes_of(token, token_id, as_bytes),
                "top_logprobs": [
                    {"token": (t := name(alt.token_id)), "logprob": alt.logprob,
                     "bytes": _bytes_of(t, alt.token_id, as_bytes)}
                    for alt in top
                ],
            })
        return entries


def _bytes_of(text: str, token_id: int, as_bytes: Callable[[int], bytes | None] | None) -> list[int]:
    """A logprob entry's ``bytes``: the token's own, where its text is only part of a character (a
    byte-level token, one byte of an emoji, decodes to U+FFFD) and the tokenizer can tell them; clients
    join them to rebuild such characters."""
    if "\ufffd" in text and as_bytes is not None:
        raw = as_bytes(token_id)
        if raw is not None:
            return list(raw)
    return list(text.encode("utf-8"))
