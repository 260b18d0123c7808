"""Stop strings on the worker: the request ends at the token whose text completes one of them.

The gateway remains what trims the text (``gateway.text.StopMatcher`` over its own detokenization);
the worker's part is to stop generating there, instead of one or more steps later when the gateway's
abort arrives, so that a whole response's decode can hold its outputs back (``Submit.gather_s``) even
when the request has stop strings. Both sides detokenize with the same tokenizer and the same
incremental decoder, so the worker stops at the token where the gateway finds the string. A decode
that continues a migrated stream (``SamplingParams.output_offset``: its prompt ends with the outputs
streamed before) first reads the last of those outputs (``history_tokens``), so a string that spans the
two attempts ends the request too.
"""

from __future__ import annotations

from collections.abc import Sequence

from gateway.text import StopMatcher
from gateway.tokenizer import Tokenizer


def history_tokens(stops: list[str]) -> int:
    """How many earlier output tokens hold the text a stop string could start in: every character but
    the string's last, at most 4 tokens each (one per UTF-8 byte), and a margin over which a decode
    started mid-text settles (e.g. a leading space it would drop)."""
    return 4 * max((len(s) for s in stops), default=0) + 8


class StopWatch:
    """One request's output text, watched for its stop strings token by token (scheduler thread)."""

    __slots__ = ("_decoder", "_exempt", "_matcher")

    def __init__(self, tokenizer: Tokenizer, stops: list[str], history: Sequence[int] = (),
                 context: Sequence[int] = (), exempt: int = 0) -> None:
        """``history``: the end of the outputs before this request (a migrated stream's), text that a
        string may start in; ``context``: the prompt's ids before it (or before the outputs), which the
        text follows, as in the gateway's decoder (``gateway.tokenizer``); ``exempt``: how many tokens,
        from the first of ``history``, are still within ``min_new_tokens``, whose text no string may end in
        (as the gateway's ``ChoiceState``)."""
        self._decoder = tokenizer.decoder(context)
        self._matcher = StopMatcher(stops)
        self._exempt = exempt
        if history:
            free = max(0, min(exempt, len(history)))
            if free:  # (a token at a time, as the gateway's ``ChoiceState`` decodes the first min_tokens)
                push = self._decoder.push
                self._matcher.push("".join([push([token]) for token in history[:free]]), exempt=True)
                self._exempt -= free
            if len(history) > free:
                self._matcher.push(self._decoder.push(history[free:]))
            if self._matcher.matched is not None:  # a string the gateway would have stopped at: this
                self._matcher = StopMatcher(stops)  # tail's text is not the gateway's; start afresh

    def push(self, token_id: int) -> bool:
        """Add one output token; True once the text so far (past ``min_new_tokens``) contains a stop string."""
        text = self._decoder.push([token_id])
        if self._exempt > 0:  # (a string may start in this text, not end in it)
            self._exempt -= 1
            self._matcher.push(text, exempt=True)
            return False
        self._matcher.push(text)
        return self._matcher.matched is not None
