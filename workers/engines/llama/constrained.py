"""Constrained decoding in the torch engine: compiled grammars, per-sequence matchers, batch masks.

Lifecycle (one ``Constraints`` per ``TorchEngine``):
1. ``prepare(grammar)`` from the scheduler thread at admission: a future, done at once when the
   grammar is cached; otherwise the compile (and, the first time, the llguidance tokenizer, ~1 s)
   runs on one of this object's ``COMPILE_THREADS`` threads (queued when all are busy); the scheduler
   holds the request until it is done or its ``--grammar-timeout-s`` passes (``workers/grammar.py``).
   A rejected grammar fails the future with ``GrammarError`` and stays cached; any other failure (the
   worker's: a missing tokenizer.json, no memory) is not cached: the next request compiles it again.
   A compile cannot be stopped (the library has no cancel, a thread cannot be killed): one that a timed-out
   request leaves behind runs on to its end, holding its thread, so at most ``COMPILE_THREADS`` slow ones
   run at once and the others' distinct grammars still compile beside fewer of them. A queued compile whose
   every request has gone (timed out, aborted) is dropped unstarted: a pile of abandoned compiles does not
   delay the fresh ones behind it.
2. ``mask(seqs, scores)`` in ``TorchEngine._sample``, once per step, over the sampled rows: each
   constrained sequence gets its matcher (a copy of the cached compiled one) and is brought up to
   date with the outputs it has not seen: on a decode worker the first token came from the prefill
   (the last of the step's ``token_ids``); for a migrated stream the ``output_offset`` outputs ending
   the prompt (``all_token_ids``). Then one bitmask row per constrained sequence is filled and all
   are applied to ``scores`` at once (banned tokens -> -inf). Returns the masked copy.
3. ``accept(seqs, tokens)`` after sampling advances each matcher by its sequence's new token.
4. ``forget(seq_id)`` when the scheduler releases the sequence.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import threading
import time
import weakref
from collections import OrderedDict, deque
from typing import Any

import torch

from workers.engines.base import SeqInput
from workers.grammar import MAX_CACHED_SOURCE, GrammarError, to_llguidance
from workers.protocol import Grammar

log = logging.getLogger(__name__)
# What a matcher call may raise that fails only its sequence: any exception, and a panic of llguidance's Rust
# code (pyo3's ``PanicException`` derives from ``BaseException``); an interrupt or exit is re-raised.
_MATCHER_FAILURES = BaseException
MAX_CACHED_GRAMMARS = 256
# Compiles that run at once (each on its own thread; the library drops the GIL while it builds a grammar):
# also the most threads that compiles abandoned by their timed-out requests can hold.
COMPILE_THREADS = 4
_SHIFTS = torch.arange(32, dtype=torch.int32)


class _Matcher:
    __slots__ = ("matcher", "num_outputs")

    def __init__(self, matcher: Any) -> None:
        self.matcher = matcher
        self.num_outputs = 0  # outputs consumed (output_offset included)


class Constraints:
    def __init__(self, tokenizer_dir: str, vocab_size: int, eos_token_ids: tuple[int, ...]) -> None:
        self.vocab_size = vocab_size
        self._tokenizer_dir = tokenizer_dir
        self._eos = list(eos_token_ids)
        self._tokenizer: Any = None
        self._tokenizer_lock = threading.Lock()  # (built once, by the first compile that needs it)
        self._lock = threading.Lock()  # the cache and the queue, shared by the scheduler and the compile threads
        self._jobs_ready = threading.Condition(self._lock)
        # Compiles to run: the future only weakly (dropped by every request: not started)
        self._jobs: deque[tuple[Grammar, weakref.ref[concurrent.futures.Future[Any]]]] = deque()
        self._threads: list[threading.Thread] = []
        self._num_idle = 0  # compile threads waiting for a job
        self._closed = False
        # Compiled grammars, and grammars the library refused (``GrammarError``): finished futures only.
        self._cache: OrderedDict[Grammar, concurrent.futures.Future[Any]] = OrderedDict()
        # Every compile someone still holds (the scheduler keeps a request's until it ends; a compile thread
        # the one it runs), cached or not: more distinct grammars queued than the cache keeps are not
        # compiled twice, a request's first step never waits on a recompile of its own (evicted) grammar,
        # and a request for a grammar still compiling (a client's retry after a timeout) joins that compile.
        self._held: weakref.WeakValueDictionary[Grammar, concurrent.futures.Future[Any]] = \
            weakref.WeakValueDictionary()
        self._seqs: dict[int, _Matcher] = {}

    # -- compiling ----------------------------------------------------------------------------
    def prepare(self, grammar: Grammar) -> concurrent.futures.Future[None]:
        """The compile of ``grammar`` (done at once when cached); the caller holds the future for as long as
        it wants the compile: one queued that nobody holds any more is dropped unstarted."""
        return self._compiled(grammar)  # its value (a matcher) is ours, not the caller's

    def _compiled(self, grammar: Grammar) -> concurrent.futures.Future[Any]:
        with self._lock:
            future = self._cache.get(grammar)
            if future is not None:
                self._cache.move_to_end(grammar)
                return future
            future = self._held.get(grammar)
            if future is None or (future.done() and not _is_cacheable(future)):  # (a worker's fault: again)
                future = concurrent.futures.Future()
                if self._closed:
                    future.set_exception(RuntimeError("the engine is closed"))
                    return future
                self._held[grammar] = future
                self._jobs.append((grammar, weakref.ref(future)))
                if self._num_idle > len(self._jobs) - 1:
                    self._jobs_ready.notify()
                elif len(self._threads) < COMPILE_THREADS:
                    thread = threading.Thread(target=self._run_compiles, name=f"grammar-compile-{len(self._threads)}",
                                              daemon=True)  # (a compile still running does not hold up the exit)
                    self._threads.append(thread)
                    thread.start()
            return future

    def compile_load(self) -> tuple[int, int]:
        """(compile threads busy, compiles queued for a free one that someone still waits for): read at scrape
        time (``/metrics``), nothing counted per request."""
        with self._lock:
            queued = sum(1 for _, ref in self._jobs if ref() is not None)
            return len(self._threads) - self._num_idle, queued

    def _run_compiles(self) -> None:
        """A compile thread: runs queued compiles that someone still waits for, until ``close``."""
        while True:
            with self._lock:
                while not self._jobs and not self._closed:
                    self._num_idle += 1
                    self._jobs_ready.wait()
                    self._num_idle -= 1
                if self._closed:
                    return
                grammar, ref = self._jobs.popleft()
            future = ref()
            if future is not None and future.set_running_or_notify_cancel():  # (else every request for it has gone)
                self._run_one(grammar, future)
            del future

    def _run_one(self, grammar: Grammar, future: concurrent.futures.Future[Any]) -> None:
        try:
            self._load_tokenizer()  # (the first compiles wait for it: the worker's time, not the grammar's)
            future.started_at = time.monotonic()  # type: ignore[attr-defined]  # (``GrammarWait.advance``)
            matcher = self._compile(grammar)
        except BaseException as exc:  # (a panic of the library's Rust code included: its requests fail)
            self._finish(grammar, future, cacheable=isinstance(exc, GrammarError))
            future.set_exception(exc)
            return
        self._finish(grammar, future, cacheable=True)
        future.set_result(matcher)

    def _finish(self, grammar: Grammar, future: concurrent.futures.Future[Any], cacheable: bool) -> None:
        """Cache what holds for good (before the future's waiters hear of it); a worker's fault is not kept."""
        if cacheable and len(grammar.source) <= MAX_CACHED_SOURCE:
            with self._lock:
                self._cache[grammar] = future
                while len(self._cache) > MAX_CACHED_GRAMMARS:
                    self._cache.popitem(last=False)

    def _load_tokenizer(self) -> None:
        """The llguidance tokenizer, built once (~1 s), by the first compile that needs it."""
        import llguidance

        with self._tokenizer_lock:
            if self._tokenizer is None:
                path = os.path.join(self._tokenizer_dir, "tokenizer.json")
                if not os.path.isfile(path):
                    # (the deployment's fault, not the request's: the worker's ``internal``)
                    raise RuntimeError(f"constrained decoding needs the model's tokenizer.json ({path} is missing)")
                with open(path, encoding="utf-8") as f:
                    self._tokenizer = llguidance.LLTokenizer(f.read(), n_vocab=self.vocab_size, eos_token=self._eos)

    def _compile(self, grammar: Grammar) -> Any:
        """A matcher in its start state (copied per sequence); runs on a compile thread."""
        import llguidance

        self._load_tokenizer()
        matcher = llguidance.LLMatcher(self._tokenizer, to_llguidance(grammar), log_level=0)
        if matcher.is_error():
            raise GrammarError(f"invalid {grammar.kind}: {_first_line(matcher.get_error())}", grammar.param)
        # Its first mask, here rather than at the request's first step: a grammar that accepts nothing (a rule
        # that only recurses, a ``$ref`` cycle) compiles without error and fails only there, after its prompt
        # was computed. One past the lexer's limits (``a{1000000000}``) spends ~1 s of that step (every sequence
        # of the batch waits) building the lexer state its copies share, then every copy's first mask fails: a
        # second copy, computed after the first built that state, tells (and costs next to nothing otherwise).
        words = (self.vocab_size + 31) // 32
        scratch = torch.empty(words, dtype=torch.int32)  # (held: the library writes into it)
        for _ in range(2):
            probe = matcher.deep_copy()
            probe.unsafe_compute_mask_ptr(scratch.data_ptr(), words * 4)
            if probe.is_error():
                raise GrammarError(f"invalid {grammar.kind}: the grammar could not be followed: "
                                   f"{_first_line(probe.get_error())}", grammar.param)
        return matcher

    # -- per step ------------------------------------------------------------------------------
    def mask(self, seqs: list[SeqInput], scores: torch.Tensor, raw: torch.Tensor | None = None,
             ) -> tuple[torch.Tensor, dict[int, str]]:
        """``scores`` ``[len(seqs), vocab]`` with every constrained row's banned tokens at -inf (a copy), and
        the rows whose grammar failed (index in ``seqs`` -> why): their requests fail, nothing is sampled.

        A row the grammar leaves nothing in (``min_new_tokens`` banning the EOS of a grammar that has
        ended) is masked from ``raw`` (the logits before ``scores``' adjustments) instead: the grammar
        wins, and the row stays one that can be sampled."""
        failures: dict[int, str] = {}
        rows = [i for i, seq in enumerate(seqs) if seq.params.grammar is not None]
        if not rows:
            return scores, failures
        words = (scores.shape[1] + 31) // 32
        bitmask = torch.empty((len(rows), words), dtype=torch.int32)
        for j, i in enumerate(rows):
            row = bitmask[j]
            try:
                state = self._catch_up(seqs[i])
                if state.matcher.is_error():  # (it gave up on an earlier token: a stopped matcher, but no end)
                    raise RuntimeError(_first_line(state.matcher.get_error()))
                if state.matcher.is_stopped():  # the grammar ended (EOS taken) and the request goes on
                    self._only_eos(row)         # (ignore_eos): EOS again, as after the grammar's end
                    continue
                state.matcher.unsafe_compute_mask_ptr(row.data_ptr(), words * 4)
                if state.matcher.is_error():
                    raise RuntimeError(_first_line(state.matcher.get_error()))
            except _MATCHER_FAILURES as exc:  # (the matcher's error: a grammar past its limits, a failed recompile,
                if isinstance(exc, (KeyboardInterrupt, SystemExit)):  # a panic of the library's Rust code...)
                    raise
                # this sequence fails (``failures``: the engine samples nothing for it); the batch goes on
                log.warning("rid %s: the grammar matcher failed: %s", seqs[i].rid, exc)
                grammar = seqs[i].params.grammar
                param = grammar.param if grammar is not None else "grammar"
                failures[i] = f"{param}: the grammar could not be followed: {exc}"
                self._only_eos(row)  # (a row that can still be sampled, not used)
        allowed = ((bitmask.unsqueeze(-1) >> _SHIFTS) & 1).view(len(rows), words * 32)[:, : scores.shape[1]]
        index = torch.tensor(rows, device=scores.device)
        out = scores.clone()
        banned = allowed.to(scores.device) == 0
        picked = out.index_select(0, index).masked_fill_(banned, float("-inf"))
        dead = (picked == float("-inf")).all(dim=1)
        if raw is not None and bool(dead.any()):
            fallback = raw.index_select(0, index).to(picked.dtype).masked_fill_(banned, float("-inf"))
            picked = torch.where(dead.unsqueeze(1), fallback, picked)
        out.index_copy_(0, index, picked)
        return out, failures

    def _only_eos(self, row: torch.Tensor) -> None:
        row.zero_()
        for eos in self._eos:
            word = int(row[eos // 32]) & 0xFFFFFFFF | (1 << (eos % 32))
            row[eos // 32] = word - (1 << 32) if word >= 1 << 31 else word

    def accept(self, seqs: list[SeqInput], tokens: list[int | None]) -> dict[int, str]:
        """Advance each constrained sequence's matcher by its sampled token; the rows whose matcher failed
        (index -> why): those sequences fail, the batch goes on."""
        failures: dict[int, str] = {}
        for j, (seq, token) in enumerate(zip(seqs, tokens, strict=True)):
            state = self._seqs.get(seq.rid) if seq.params.grammar is not None else None
            if state is not None and token is not None:
                try:
                    if not state.matcher.is_stopped():
                        state.matcher.consume_token(token)
                except _MATCHER_FAILURES as exc:
                    if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                        raise
                    log.warning("rid %s: the grammar matcher failed on its token: %s", seq.rid, exc)
                    self._seqs.pop(seq.rid, None)
                    failures[j] = f"the grammar matcher failed: {type(exc).__name__}: {exc}"
                    continue
                state.num_outputs += 1
        return failures

    def forget(self, seq_id: int) -> None:
        self._seqs.pop(seq_id, None)

    def close(self) -> None:
        """Queued compiles are cancelled; running ones end on their own (not waited for)."""
        with self._lock:
            self._closed = True
            jobs = list(self._jobs)
            self._jobs.clear()
            self._jobs_ready.notify_all()
        for _, ref in jobs:
            future = ref()
            if future is not None:
                future.cancel()
        self._seqs.clear()

    def _catch_up(self, seq: SeqInput) -> _Matcher:
        """The sequence's matcher, advanced by every output before the one this step samples."""
        grammar = seq.params.grammar
        assert grammar is not None
        state = self._seqs.get(seq.rid)
        if state is None:
            # Normally compiled already (the scheduler waited); else this step waits for it.
            state = self._seqs[seq.rid] = _Matcher(self._compiled(grammar).result().deep_copy())
        target = seq.num_generated + seq.params.output_offset
        missing = target - state.num_outputs
        if missing <= 0:
            return state
        if seq.all_token_ids is not None and len(seq.all_token_ids) >= missing:
            known = seq.all_token_ids[len(seq.all_token_ids) - missing :]
        elif missing == 1:
            known = seq.token_ids[-1:]  # a decode's first step: the prefill's sampled token
        else:
            raise RuntimeError(f"rid {seq.rid}: {missing} earlier outputs are unknown to its grammar matcher")
        if not state.matcher.consume_tokens(known):
            raise RuntimeError(f"rid {seq.rid}: earlier outputs do not match its grammar: "
                               f"{_first_line(state.matcher.get_error())}")
        state.num_outputs = target
        return state


def _is_cacheable(future: concurrent.futures.Future[Any]) -> bool:
    """A finished compile that holds for good: compiled, or refused by the library (the client's grammar)."""
    return not future.cancelled() and isinstance(future.exception(), (type(None), GrammarError))


def _first_line(error: str) -> str:
    """The library's error without the state and grammar dump it appends (a client sees the message)."""
    return error.strip().split("\n", 1)[0][:300]
