"""Grammars for constrained decoding: a ``Grammar`` request field -> llguidance, checks, the compile wait.

The library is llguidance (chosen by ``loadtests/bench_grammar.py``: no dependencies, ~3 ms to compile
a realistic JSON Schema, ~14 us per token mask on SmolLM2's 49,152-token vocabulary on this CPU).
It is imported lazily: the gateway and the sim engine work without it.

Lifecycle of a constrained request in a worker:
1. The gateway checks the grammar (``check``, no tokenizer needed) and answers 400 naming the
   client's field when the library rejects it; nothing reaches a worker.
2. ``Scheduler._admit``: an engine without ``GrammarCompiling`` refuses the request (bad_request);
   otherwise ``GrammarWait.hold`` asks the engine to ``prepare`` the grammar (a compile on the engine's
   own threads, cached by the ``Grammar``) and the request waits in stage "grammar", out of every
   batch, while the loop runs others; the future's completion wakes the loop.
3. ``GrammarWait.advance`` (each step) moves compiled requests on to their first PD stage (prefill:
   bootstrap; decode: prealloc; both: waiting) and fails those whose grammar the library rejected
   with bad_request: no page was reserved and no KV moved. A request still waiting
   ``timeout_s`` (``--grammar-timeout-s``) after its admission fails: with bad_request when its compile ran for
   at least half of that (its grammar is slow), else with overloaded (it waited for a busy compile thread, or
   the tokenizer's first load: another worker may serve it); either way it lets go of the compile: one still
   queued is not started when no other request waits for it; one running goes on (it cannot be stopped) and
   its result is kept as any other.
4. The engine masks every sampled row (``workers/engines/llama/constrained.py``).
"""

from __future__ import annotations

import concurrent.futures
import json
import re
import time
from collections.abc import Callable, Iterator
from typing import Any, Protocol, runtime_checkable

from workers.protocol import Grammar

KINDS = ("json_object", "json_schema", "regex", "ebnf")
# Caches keyed by a grammar keep its whole text: only grammars up to this size are kept once no request
# holds them (so a cache of 256 holds at most 16 MiB of keys, whatever the request body limit).
MAX_CACHED_SOURCE = 64 * 1024
# How long a request may wait for its grammar's compile (queue included) before it fails (``--grammar-timeout-s``):
# a realistic JSON Schema compiles in milliseconds, a big legal one in seconds (12,000 required properties: ~2 s).
GRAMMAR_TIMEOUT_S = 5.0
# Compact-but-readable JSON: ", " and ": " between items, no other whitespace. Flexible whitespace
# lets a small model emit newlines until max_tokens; fixed separators keep its answers short.
_JSON_OPTIONS: Any = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(ValueError):
    """The library rejected a grammar; ``param`` names the client's field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def is_available() -> bool:
    try:
        import llguidance  # noqa: F401
    except ImportError:
        return False
    return True


def to_llguidance(grammar: Grammar) -> str:
    """The llguidance grammar for ``grammar`` (not yet validated); GrammarError for unparsable input."""
    import llguidance

    matcher = llguidance.LLMatcher
    try:
        if grammar.kind == "json_object":
            return matcher.grammar_from_json_schema({"type": "object"}, defaults=_JSON_OPTIONS)
        if grammar.kind == "json_schema":
            schema = json.loads(grammar.source)
            if not isinstance(schema, dict):
                raise GrammarError("a JSON Schema must be a JSON object", grammar.param)
            options: Any = {**_JSON_OPTIONS, "lenient": not grammar.strict}
            return matcher.grammar_from_json_schema(schema, defaults=options)
        if grammar.kind == "regex":
            return matcher.grammar_from_regex(grammar.source)
        if grammar.kind == "ebnf":
            from llguidance.gbnf_to_lark import gbnf_to_lark

            return matcher.grammar_from_lark(gbnf_to_lark(_plain_unicode_escapes(grammar.source)))
    except GrammarError:
        raise
    except Exception as exc:  # the library's parse errors come as ValueError, AssertionError, ...
        raise GrammarError(f"invalid {grammar.kind}: {exc}", grammar.param) from None
    raise GrammarError(f"unknown grammar kind {grammar.kind!r}; one of {', '.join(KINDS)}", grammar.param)


# A GBNF escape: an escaped backslash (kept as it is), or a \\u / \\U code point
_GBNF_ESCAPE = re.compile(r"\\(?:\\|u([0-9a-fA-F]{4})|U([0-9a-fA-F]{8}))")


def _plain_unicode_escapes(source: str) -> str:
    """GBNF's ``\\uXXXX`` and ``\\UXXXXXXXX`` escapes, which llama.cpp's grammars use (``"caf\\u00e9"``,
    ``[\\u00e0-\\u00ff]``), in a spelling llguidance's converter carries over: it drops their leading zeros
    (``\\ue9``), which its lexer and regexes then refuse. A code point up to 0xFF becomes ``\\xNN``; one above
    is not special in GBNF and goes in as the character itself."""
    def plain(match: re.Match[str]) -> str:
        digits = match.group(1) or match.group(2)
        if digits is None:
            return match.group(0)  # (an escaped backslash: the next character is not an escape's)
        code = int(digits, 16)
        if code <= 0xFF:
            return f"\\x{code:02x}"
        if code > 0x10FFFF or 0xD800 <= code <= 0xDFFF:
            return match.group(0)  # (no character: the library's own error names it)
        return chr(code)

    return _GBNF_ESCAPE.sub(plain, source) if "\\" in source else source


def check(grammar: Grammar) -> None:
    """Raise GrammarError when the library rejects ``grammar`` (no tokenizer: cheap, for the gateway)."""
    import llguidance

    error = llguidance.LLMatcher.validate_grammar(to_llguidance(grammar))
    if error:
        raise GrammarError(f"invalid {grammar.kind}: {error}", grammar.param)


@runtime_checkable
class GrammarCompiling(Protocol):
    """Optional engine ability: constrained decoding. The scheduler checks for it once (``isinstance``)."""

    def prepare(self, grammar: Grammar) -> concurrent.futures.Future[None]:
        """Compile ``grammar`` off the calling thread (cached); the future fails with GrammarError. The caller
        keeps the future while it still wants the compile: an engine may drop one nobody holds unstarted."""
        ...


class GrammarWait:
    """Requests whose grammar is compiling; owned by the scheduler, used from its thread only."""

    def __init__(self, engine: GrammarCompiling, wake: Callable[[], None],
                 timeout_s: float = GRAMMAR_TIMEOUT_S) -> None:
        self._engine = engine
        self._wake = wake
        self.timeout_s = timeout_s
        # requests failed for a compile past ``timeout_s``, by the code they failed with (``/metrics``):
        # bad_request (a slow grammar), overloaded (queued)
        self.timed_out = {"bad_request": 0, "overloaded": 0}
        # (request, its compile, when it stops waiting: monotonic s), in admission order
        self._held: list[tuple[Any, concurrent.futures.Future[None], float]] = []

    def hold(self, req: Any) -> bool:
        """Start compiling ``req``'s grammar; True when the request must wait (``advance`` frees it)."""
        assert req.params.grammar is not None
        future = self._engine.prepare(req.params.grammar)
        req.grammar_compile = future
        if future.done() and not future.cancelled() and future.exception() is None:
            return False
        req.move("grammar")
        self._held.append((req, future, time.monotonic() + self.timeout_s))
        future.add_done_callback(lambda _f: self._wake())
        return True

    def advance(self, now: float | None = None) -> tuple[list[Any], list[tuple[Any, str, str]]]:
        """(requests ready to enter their first stage, (request, error, code) triples); ended ones dropped.
        ``bad_request`` (the client's) for a ``GrammarError`` (the library refused the grammar) or a compile that
        ran at least half of ``timeout_s`` without ending; ``overloaded`` (retryable elsewhere) for one that
        spent most of ``timeout_s`` queued behind other compiles (the engine sets ``started_at`` on the future
        when its compile starts); ``internal`` for anything else the compile raised (a crash, no memory, a
        tokenizer file missing: the worker's)."""
        if not self._held:
            return [], []
        now = time.monotonic() if now is None else now
        ready: list[Any] = []
        failed: list[tuple[Any, str, str]] = []
        keep = []
        for req, future, deadline in self._held:
            if req.done:
                req.grammar_compile = None
                continue
            if not future.done():
                if now < deadline:
                    keep.append((req, future, deadline))
                    continue
                grammar = req.params.grammar
                req.grammar_compile = None  # (its compile: dropped unstarted when queued and no one else waits)
                started = getattr(future, "started_at", None)
                if started is None or now - started < self.timeout_s / 2:
                    # mostly queued behind other compiles: the worker's capacity, not the grammar (retryable)
                    code, why = "overloaded", ("waited for a free compile thread past this worker's limit of "
                                               f"{self.timeout_s:g} s (--grammar-timeout-s): its compile threads "
                                               "are busy")
                else:
                    code, why = "bad_request", (f"took too long to compile: it was not ready within this worker's "
                                                f"limit of {self.timeout_s:g} s (--grammar-timeout-s); simplify it "
                                                "(e.g. fewer properties or alternatives)")
                self.timed_out[code] += 1
                failed.append((req, f"{grammar.param}: the {grammar.kind} {why}", code))
                continue
            exc = future.exception() if not future.cancelled() else RuntimeError("the compile was cancelled")
            if exc is None:
                ready.append(req)
            elif isinstance(exc, GrammarError):
                failed.append((req, f"{exc.param or req.params.grammar.param}: {exc}", "bad_request"))
            else:
                req.grammar_compile = None
                failed.append((req, f"compiling the {req.params.grammar.kind} failed: {type(exc).__name__}: {exc}",
                               "internal"))
        self._held = keep
        return ready, failed

    @property
    def num_timed_out(self) -> int:
        """Requests failed for a compile past ``timeout_s``."""
        return sum(self.timed_out.values())

    def next_deadline(self) -> float | None:
        """When the first request held gives up waiting (monotonic s); None when none is held."""
        if not self._held:
            return None
        return min((deadline for req, _, deadline in self._held if not req.done), default=None)

    def __len__(self) -> int:
        return sum(1 for req, _, _ in self._held if not req.done)

    def __iter__(self) -> Iterator[Any]:
        """The requests held (ended ones included until ``advance``), for load reports and metrics."""
        return iter([req for req, _, _ in list(self._held)])
