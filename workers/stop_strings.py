"""Stop strings on the worker: the request ends at the token whose text completes one of them.

The gateway remains what trims the text (``gateway.text.StopMatcher`` over its own detokenization);
the worker's part is to stop generating there, instead of one or more steps later when the gateway's
abort arrives, so that a whole response's decode can hold its outputs back (``Submit.gather_s``) even
when the request has stop strings. Both sides detokenize with the same tokenizer and the same
incremental decoder, so the worker stops at the token where the gateway finds the string (a decode
that starts after a migration starts its text fresh there: it may miss a string that spans the two
attempts, which the gateway then finds and aborts as before).
"""

from __future__ import annotations

from gateway.text import StopMatcher
from gateway.tokenizer import Tokenizer


class StopWatch:
    """One request's output text, watched for its stop strings token by token (scheduler thread)."""

    __slots__ = ("_decoder", "_matcher")

    def __init__(self, tokenizer: Tokenizer, stops: list[str]) -> None:
        self._decoder = tokenizer.decoder()
        self._matcher = StopMatcher(stops)

    def push(self, token_id: int) -> bool:
        """Add one output token; True once the text so far contains a stop string."""
        self._matcher.push(self._decoder.push([token_id]))
        return self._matcher.matched is not None
