"""PD dispatch: pick a pair, give it a fresh bootstrap room, drive both sides, stream decode tokens.

Two ways in, one lifecycle: ``Dispatcher.generate`` (an async generator of the decode's outputs: streams,
several choices) and ``Dispatcher.complete`` (a coroutine that hands every output to a collector and
returns at the end: a whole response of one choice, without the generator layers). Both run their
attempts as ``_Attempt``s and keep the choice's state across attempts in a ``_Choice``.
Lifecycle of one request:
1. Select a (prefill, decode) pair among healthy workers with the router's policies (sync, no
   I/O; they read each worker's ``WorkerState`` and the prefix index through ``RequestInfo``).
2. Draw a fresh ``bootstrap_room`` (random 63-bit) and submit to the decode and the prefill at
   once: awaiting one before the other would deadlock the KV handshake.
3. Relay the decode's ``StepOutput`` events. The prefill's only event is "transferred" (or an
   error). Failure coupling: a prefill error aborts the decode, a decode error aborts the prefill.
4. Before an attempt's first token (a new request's, or a migrated stream's new pair), a retryable
   failure (worker gone or unhealthy, transfer failed, overloaded) retries with a new pair and a new
   room, at most ``max_retries`` times per request, after a jittered exponential backoff, avoiding
   the worker the failure is held against (``_culprit``); any 4xx is final. After the first
   token a decode failure (gone, transfer/engine/timeout error, silent past the idle deadline)
   migrates the stream, at most ``max_migrations`` times: prompt + every token yielded so far are
   the new prompt of a new pair (the failed decode avoided) with the remaining budget and
   ``output_offset`` for seeded draws; the consumer sees one uninterrupted stream. Otherwise the
   error is final. Each side's outcome feeds a circuit breaker: success when its part completes;
   a failure counts against the worker it concerns (``Error.fault``): the reporter's own error, or
   its KV peer's when the peer went away, fell silent or could not be reached, or nobody's (the
   registry failed, an abort; never a client abort, a bad request or overload).
5. Deadlines: ``first_token_timeout_s`` until the first token, then ``stream_idle_timeout_s``
   between events: one timer per attempt (``EventSink``), moved forward per event, not a
   ``wait_for`` per event. Decode outputs that are already queued when the consumer gets to them
   are merged into one ``StepOutput`` (several tokens, one SSE chunk). A consumer that passes
   ``direct`` gets an attempt's non-final decode outputs (the first token's included, none queued
   before them) from the worker connection's callback (``EventSink.tap``), with the same bookkeeping
   (deadline, latency figures, tokens kept for migration), without waking this generator; when
   ``direct`` is not ready (the client's socket is full) they queue as usual. ``complete`` does the
   same with its collector when it may (no stop strings), so a whole response's task wakes once, for
   the final output. The prefill's hand-over is recorded in that callback too (the generator is not
   woken for it). A request for prompt logprobs gets them from the hand-over with its first output:
   decode outputs that come before it wait for it (at most ``HANDOVER_WAIT_S``, or the idle timeout
   if shorter, and the unread limit; then they go without). Whatever ends the request (finish, error,
   timeout, client gone, the consumer done early), open requests are aborted on both workers, and
   the policies hear how the attempt ended (``on_finish``). The prefill's load (its prompt tokens) is
   released when its part ends, i.e. when its KV is handed over, not when the decode's stream ends.
6. Backpressure: a consumer (an SSE client) that falls behind leaves events queued in the attempt's
   ``EventSink``; past ``max_unread_events`` the attempt is aborted on both workers at once and the
   stream ends with a clear error when the consumer gets back (``SlowClient``), so a client that
   stops reading costs neither worker time nor gateway memory.
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
import logging
import operator
import random
import sys
import time
from collections import deque
from collections.abc import AsyncGenerator, Callable, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import msgspec

from gateway.context import REQUEST_ID, REQUEST_T0, random_room
from gateway.errors import APIError, BadGateway, BadRequest, NoWorkers, UpstreamTimeout, from_worker_error
from gateway.event_sink import DirectPathFailed, EventSink, SinkOverflow
from gateway.health import Selectability
from gateway.metrics import GatewayMetrics
from gateway.policies import Pair, RequestInfo
from gateway.router import Router
from gateway.worker_client import Event, WorkerClient, WorkerGone
from gateway.worker_state import WorkerState
from workers.protocol import BootstrapTarget, Error, Fault, SamplingParams, StepOutput, Submit, TokenLogprob

if TYPE_CHECKING:
    from gateway.api import ClientBootstrap

RETRYABLE_CODES = frozenset({"transfer_failed", "overloaded", "shutting_down"})
# A decode failing this way after the first token: the stream can continue elsewhere (migration).
MIGRATABLE_CODES = frozenset({"worker_gone", "transfer_failed", "internal", "timeout", "shutting_down"})
log = logging.getLogger(__name__)
# Count against the worker (its breaker). Not ``shutting_down``: a worker stopped on purpose ends every open
# request with it, which would open its breaker and keep it out for the cooldown once restarted.
BLAMED_CODES = frozenset({"transfer_failed", "internal", "timeout"})
# (an ``open_rids`` entry for a side no longer open: its rid, -1, is no breaker's trial)
_NOT_OPEN = (None, -1)
MAX_BACKOFF_S = 2.0
# Outputs of a decode that wait for the prefill's hand-over (its prompt logprobs go out with the first):
# the hand-over is due as the decode starts; past this (or --stream-idle-timeout-s if shorter) they go
# without them.
HANDOVER_WAIT_S = 5.0
# A side that relays its peer's refusal (``bad_request`` with ``Fault.NONE``) before that peer's own 400 came: how
# long to wait for the peer's own answer (it names the client's field; the relay names none).
PEER_REFUSAL_WAIT_S = 1.0
_monotonic = time.monotonic
_encode_ids, _encoded = msgspec.msgpack.Encoder().encode, msgspec.Raw  # (``_Attempt.submit``: a prompt's ids, once)
_bisect_left = bisect.bisect_left
_compress = itertools.compress
_state_of, _is_healthy = operator.attrgetter("state"), operator.attrgetter("healthy")


@dataclass(frozen=True)
class DispatchConfig:
    first_token_timeout_s: float = 300.0
    stream_idle_timeout_s: float = 120.0
    request_timeout_s: float = 1800.0
    max_retries: int = 2
    retry_backoff_s: float = 0.05  # first retry's mean delay; doubles per retry, +-50% jitter
    max_migrations: int = 2  # a stream whose decode failed continues on a new pair this often (0: off)
    max_unread_events: int = 4096  # worker events a slow consumer may leave unread before its stream ends
    # ``complete`` (a whole response): the decode sends the tokens after the first gathered, one output
    # per this long (``Submit.gather_s``); 0: one per step. With stop strings only to a decode that stops
    # at them itself (``HelloAck.stop_strings``): the gateway would find one late, the decode running on.
    gather_s: float = 0.05


class DirectConsumer(Protocol):
    """Takes a stream's non-final outputs from the worker connection's callback (``Dispatcher.generate``).

    ``ready()``: can it take one now (e.g. the client's socket has room)? ``take(output)``: handle it
    completely (it is not yielded); must not raise and must not end the stream (no stop strings).
    ``offer(output)``: ``take`` it if ``ready()`` and say so, in one call (the steady path, per token; the
    attribute is read once, after the first ``take`` of a token: a consumer may set a faster one by then).
    """

    def ready(self) -> bool: ...

    def take(self, output: StepOutput) -> None: ...

    def offer(self, output: StepOutput) -> bool: ...


class SlowClient(APIError):
    """The client read its stream too slowly: the gateway stopped generating for it."""

    status = 503
    type = "client_too_slow"


class Dispatcher:
    def __init__(self, prefills: list[WorkerClient], decodes: list[WorkerClient], router: Router,
                 config: DispatchConfig | None = None, metrics: GatewayMetrics | None = None,
                 combined: bool | None = None) -> None:
        # The owner's lists, not copies: workers added or removed there (admin API) count here at once.
        self.prefills = prefills
        self.decodes = decodes
        self.router = router
        self.config = config or DispatchConfig()
        self.metrics = metrics or GatewayMetrics()
        # Disaggregated unless the gateway was started with combined workers (``--worker``).
        self.combined = (not self.prefills) if combined is None else combined
        self.num_retries = 0
        # ``gateway.tokenizer.tokenizer_digest`` of the text the gateway makes of outputs (set with the
        # frontend): a decode watching stop strings with another tokenizer is not sent them (``submit``).
        self.tokenizer_digest = ""
        # The smallest pool among the decodes (tokens of KV: prompt + max_new_tokens) and the prefills (the
        # prompt) that have connected, as of ``WorkerState.shape_epoch``: a request within both fits any
        # worker, and only one past them has the workers that cannot hold it left out (``_fitting``).
        self._floors_epoch = -1
        self._total_floor = self._prefill_floor = 0
        # The selectable workers' views (prefills, decodes) as of ``Selectability.epoch`` (``_fresh_views``)
        self._views: tuple[tuple[WorkerState, ...], tuple[WorkerState, ...]] = ((), ())
        self._views_epoch = -1

    def decode_capacity(self) -> int | None:
        """The most tokens (prompt + max_new_tokens) one decode (or combined) worker's KV pool holds; None before
        any has connected. A default budget is cut to it (``Frontend._params``), as SGLang's scheduler cuts one.
        (Called on a prepare thread too, for a long body: looked at here, not through the event loop's cached
        floors, which a thread's refresh racing the loop's could leave stale under the newer epoch.) Only the decodes
        that can take requests count (a larger pool of one draining, disconnected or failing its probes raised the
        budget past every decode left: a 503 for as long as it stayed away, or its breaker stayed open); none can: all
        of them, as before. (``_able`` reads no breaker's ``state``: that moves it on.)"""
        return max((c.state.total_tokens for c in _able(self.decodes)), default=0) or None

    def prefill_context(self, prompt: int) -> int | None:
        """The most tokens (prompt + max_new_tokens) one prefill worker that holds a prompt of ``prompt`` tokens takes:
        its context (of those that can take requests, as ``decode_capacity``); None when combined or before any
        prefill has connected. A default budget is cut to it too: a fleet of mixed contexts serves the longest, which
        a long prefill that is away still counts in (``Gateway._max_context``), and ``_fitting`` gives a request only
        to prefills whose context holds prompt + max_new_tokens."""
        return max((c.state.total_tokens for c in _able(self.prefills) if c.state.capacity_tokens >= prompt),
                   default=0) or None

    def prompt_capacity(self) -> int | None:
        """The longest prompt one prefill worker takes: what its KV pool holds, with room in its context for a
        token to generate (the largest of those that can take requests, as ``decode_capacity``); None when
        combined or before any prefill has connected."""
        return max((min(c.state.capacity_tokens, c.state.max_context - 1) if c.state.max_context
                    else c.state.capacity_tokens for c in _able(self.prefills)), default=0) or None

    @property
    def is_disaggregated(self) -> bool:
        return not self.combined

    def is_ready(self) -> bool:
        """At least one selectable decode (or combined) worker, and a prefill when disaggregated."""
        decodes = any(w.available for w in self.decodes)  # (a half-open breaker's trials do not flap it)
        return decodes and (not self.is_disaggregated or any(w.available for w in self.prefills))

    def _select(self, request: RequestInfo, avoid: AbstractSet[WorkerClient]) -> tuple[Pair, WorkerClient | None,
                                                                                WorkerClient]:
        """The policies' pair, and its prefill's (None when combined) and decode's connections; a pair
        that is not one of the workers the policies were given is the policy's bug: a 500 naming it."""
        prefills: Sequence[Any]
        decodes: Sequence[Any]
        if avoid:
            prefills, decodes = _selectable(self.prefills, avoid), _selectable(self.decodes, avoid)
            reused = False
        elif self._views_epoch == Selectability.epoch:  # (every request's first attempt, nothing changed since)
            prefills, decodes = self._views
            reused = True
        else:
            prefills, decodes = self._fresh_views()
            reused = False
        combined = self.combined
        if not decodes or not (prefills or combined):
            missing = "combined" if combined else "decode" if not decodes else "prefill"
            raise NoWorkers(f"no healthy {missing} worker", retry_after_s=1.0)
        if self._floors_epoch != WorkerState.shape_epoch:
            self._set_floors()
        prompt = len(request.input_ids)
        if prompt + request.max_new_tokens > self._total_floor or prompt > self._prefill_floor:
            prefills, decodes = self._fitting(request, avoid)
        router = self.router
        pair = router.pick(prefills, decodes, request)
        # (``router.client_of``'s check, inline; only a pick it refuses goes to it, for its 500)
        view = pair.prefill
        if view is None:
            if not combined:
                raise APIError(f"routing policy {router.name} chose no prefill worker for a disaggregated fleet")
            prefill = None
        else:
            prefill = getattr(view, "client", None)
            if not isinstance(prefill, WorkerClient) or view not in prefills:
                prefill = router.client_of(view, prefills, WorkerClient)
        view = pair.decode
        decode = getattr(view, "client", None)
        if not isinstance(decode, WorkerClient) or view not in decodes:
            decode = router.client_of(view, decodes, WorkerClient)
        if reused and not (decode.healthy and (prefill is None or prefill.healthy)):
            # A change no event told of (a transport the peer's end began closing, whose loss is announced at the
            # loop's next turn): the views again, as they are now, and the policies' choice among them.
            self._views_epoch = -1
            return self._select(request, avoid)
        return pair, prefill, decode

    def _fresh_views(self) -> tuple[tuple[WorkerState, ...], tuple[WorkerState, ...]]:
        """The views of the healthy workers of each pool (``_selectable``'s without ``avoid``, in C but for
        ``healthy``), kept for the next requests (``_views``) while ``Selectability.epoch`` stays the same and every
        breaker is closed: a half-open one's trials come and go per request, an open one turns half-open by time."""
        epoch = Selectability.epoch
        pools = self.prefills, self.decodes
        prefills, decodes = (tuple(_compress(map(_state_of, pool), map(_is_healthy, pool))) for pool in pools)
        if all(c.health.breaker.closed for pool in pools for c in pool):
            self._views, self._views_epoch = (prefills, decodes), epoch
        return prefills, decodes

    def _set_floors(self) -> None:
        self._floors_epoch = WorkerState.shape_epoch
        connected = [c.state for c in (*self.decodes, *self.prefills) if c.state.page_size]
        self._total_floor = min((state.total_tokens for state in connected), default=0)
        self._prefill_floor = min((c.state.capacity_tokens for c in self.prefills if c.state.page_size),
                                  default=0 if self.prefills else sys.maxsize)

    def _fitting(self, request: RequestInfo, avoid: AbstractSet[WorkerClient]) -> tuple[list[Any], list[Any]]:
        """``_selectable``'s views, of the workers that can take ``request``: its prompt + max_new_tokens within
        their context, and within a decode's KV pool (a prefill's pool holds the prompt); the avoided ones too when
        only they can. When one side has none: a 503 if a worker that is unavailable now could, else a 400, sent
        to no worker."""
        prompt = len(request.input_ids)
        total = prompt + request.max_new_tokens

        def takes(state: WorkerState) -> bool:
            return state.total_tokens >= total and (state.role != "prefill" or state.capacity_tokens >= prompt)

        decodes = _selectable([w for w in self.decodes if takes(w.state)], avoid)
        prefills = _selectable([w for w in self.prefills if takes(w.state)], avoid)
        if decodes and (prefills or self.combined):
            return prefills, decodes
        side, pool = ("combined" if self.combined else "decode", self.decodes) if not decodes \
            else ("prefill", self.prefills)
        if any(takes(c.state) for c in pool):
            raise NoWorkers(f"no healthy {side} worker has a KV pool and context that hold this request (a prompt "
                            f"of {prompt} tokens, {total} with the most tokens to generate); the one that does is "
                            "unavailable", retry_after_s=1.0)
        if side == "prefill" and any(c.state.capacity_tokens >= prompt for c in pool):
            longest = max(c.state.max_context for c in pool)
            raise BadRequest(f"the prompt ({prompt} tokens) + max_new_tokens ({request.max_new_tokens}) exceeds the "
                             f"context length of every prefill worker (the longest: {longest})",
                             param="max_new_tokens", code="context_length_exceeded")
        largest = max((c.state.total_tokens if side != "prefill" else c.state.capacity_tokens for c in pool),
                      default=0)
        prompt_alone = side == "prefill" or prompt > largest  # (no budget would make it fit)
        what = "the prompt" if prompt_alone else "the prompt and the most tokens to generate"
        raise BadRequest(f"the request needs {prompt if prompt_alone else total} tokens of KV cache ({what}); the "
                         f"largest {side} worker's pool holds {largest}",
                         param=None if prompt_alone else "max_new_tokens", code="context_length_exceeded")

    async def generate(self, input_ids: list[int], params: SamplingParams, *, choice: int = 0,
                       bootstrap: ClientBootstrap | None = None, direct: DirectConsumer | None = None,
                       counts_prompt: bool = True, served: Callable[[], bool] | None = None,
                       counts_output: bool = True) -> AsyncGenerator[StepOutput, None]:
        """Run one completion choice; yields the decode's ``StepOutput`` events (see the module doc).

        ``choice`` and the client's ``bootstrap`` fields do not matter here: every attempt gets a
        pair and a fresh room of the gateway's own choosing. ``direct``: non-final decode outputs that
        arrive while none is queued go to ``direct.take`` from the worker connection's callback (when
        ``direct.ready()``) instead of through this generator. ``served``: asked when the consumer stops
        early (closes or cancels this), whether the choice counts as served in the request figures (it did
        if it had tokens, unless this says no: a choice of a request another choice of which failed).
        """
        run = _Choice(self, input_ids, params)
        run.counts_prompt, run.counts_output = counts_prompt, counts_output
        try:
            while True:
                num_before = len(run.generated)
                # A stream: its first token should not wait for this loop pass to end.
                attempt = _Attempt(self, run, direct, urgent=direct is not None)
                try:
                    try:
                        attempt.submit()
                        while True:
                            item = await attempt.next()
                            run.record(item)
                            yield item
                            if attempt.finished:
                                return
                    except (GeneratorExit, asyncio.CancelledError):  # a stop string, or the client left
                        attempt.outcome = "cancelled"
                        raise
                    finally:
                        attempt.close()  # (before a retry's backoff: the failed pair is freed at once)
                except _Retryable as exc:
                    delay = run.recover(exc, num_before)
                    if delay is not None:
                        await asyncio.sleep(delay)
        except (GeneratorExit, asyncio.CancelledError):
            run.completed = bool(run.generated) and (served is None or served())
            raise
        finally:
            run.close()

    async def complete(self, input_ids: list[int], params: SamplingParams, collector: Collector, *,
                       in_callback: bool = False, counts_output: bool = True, gather: bool = True) -> None:
        """Run one choice to its end for a whole (non-streamed) response: ``generate``'s lifecycle
        (retries, migration, deadlines, bookkeeping) in one coroutine, without the generator layers.

        Every output goes to ``collector.accept`` in order; it ends when the final one has, or when the
        collector sets its ``finish_reason`` first (its own stop string: the rest is aborted).
        ``in_callback``: non-final outputs that arrive while none is queued are accepted in the worker
        connection's callback (the request's task is woken only for the last); the collector must then
        not finish on a non-final output (no stop strings). The decode gathers its outputs after the
        first (``DispatchConfig.gather_s``); with stop strings only one that ends requests at them.
        ``gather``: False when the collector watches stop strings that ``params`` does not carry to the decode
        (``gateway.api._literal_stops``): a gathering decode would run on past them for its whole window.
        """
        run = _Choice(self, input_ids, params)
        if not counts_output:
            run.counts_output = False
        direct = _Collect(collector) if in_callback else None
        # (with stop strings, only a decode that stops at them: ``submit``)
        gather_s = self.config.gather_s if gather else 0.0
        try:
            while True:
                num_before = len(run.generated)
                attempt = _Attempt(self, run, direct, urgent=False, gather_s=gather_s)
                try:
                    try:
                        attempt.submit()
                        while True:
                            item = await attempt.next()
                            run.record(item)
                            collector.accept(item)
                            if attempt.finished:
                                return
                            if collector.finish_reason is not None:  # a stop string: the rest is not needed
                                attempt.outcome = "cancelled"
                                run.completed = True
                                return
                    except asyncio.CancelledError:
                        attempt.outcome = "cancelled"
                        raise
                    finally:
                        attempt.close()  # (before a retry's backoff: the failed pair is freed at once)
                except _Retryable as exc:
                    delay = run.recover(exc, num_before)
                    if delay is not None:
                        await asyncio.sleep(delay)
        except asyncio.CancelledError:  # the client left
            run.completed = bool(run.generated)
            raise
        finally:
            run.close()

    def _blame(self, reporter: WorkerClient, culprit: WorkerClient | None, event: Error | WorkerGone) -> None:
        if isinstance(event, WorkerGone):
            if event.counted:  # (one lost connection is one failure, not one per request it had open)
                return
            event.counted = True
        code = event.code if isinstance(event, Error) else "worker_gone"
        if code == "transfer_failed":
            self.metrics.transfer_failures.labels(reporter.role).inc()
        if culprit is not None and (code == "worker_gone" or code in BLAMED_CODES):
            breaker = culprit.health.breaker
            opened = breaker.num_opened
            breaker.record_failure()
            self.metrics.worker_failures.labels(culprit.url, culprit.role, code).inc()
            if breaker.num_opened != opened:
                log.warning("%s worker %s: breaker opened (%s); the last failure, reported by its %s: %s: %s",
                            culprit.role, culprit.url, breaker.opened_because, reporter.role, code, event.message)


class Collector(Protocol):
    """Where ``Dispatcher.complete`` hands a whole response's outputs (``gateway.text.ChoiceState``):
    ``accept`` takes one; ``finish_reason`` set means it needs no more (or the final one came)."""

    finish_reason: str | None

    def accept(self, output: StepOutput) -> object: ...


class _Collect:
    """``complete``'s direct consumer: always ready; it hands each output to the collector."""

    __slots__ = ("collector",)

    def __init__(self, collector: Collector) -> None:
        self.collector = collector

    def ready(self) -> bool:
        return True

    def take(self, output: StepOutput) -> None:
        self.collector.accept(output)

    def offer(self, output: StepOutput) -> bool:
        self.collector.accept(output)
        return True


class _Choice:
    """One choice across its attempts (``generate``, ``complete``): what the next attempt sends, the
    tokens so far, the latency figures, and the request's figures once it has been served."""

    # (no ``__slots__``: the fields that start the same for every choice are these class defaults, not
    # stores made per request; each is set on the instance when it changes)
    retries = 0
    migrations = 0
    last_t = 0.0
    cached_tokens = 0
    cause: APIError | None = None  # the failure the stream last migrated off (its answer if it cannot go on)
    completed = False  # finished, or the consumer stopped early (a stop string): counts as served
    counts_prompt = True  # the first choice of its prompt: its prompt's tokens are counted (once)
    counts_output = True  # its tokens are the answer's (not: /generate's max_new_tokens 0, run for one)
    # Workers a failure is held against: the next attempt avoids them (a new set each time one is added: this empty
    # one is every choice's until then).
    avoid: AbstractSet[WorkerClient] = frozenset()

    def __init__(self, dispatcher: Dispatcher, input_ids: list[int], params: SamplingParams) -> None:
        self.dispatcher = dispatcher
        self.input_ids = input_ids
        self.params = params
        self.t0 = t0 = REQUEST_T0.get() or time.monotonic()
        # ``request_timeout_s`` bounds the request, not each attempt: an attempt gets what is left of it.
        self.deadline = t0 + dispatcher.config.request_timeout_s
        self.request = dispatcher.router.request(input_ids, params.max_new_tokens)
        self.itl = dispatcher.metrics.itl  # (observed per output with tokens)
        self.generated: list[int] = []  # every token delivered so far (a migration's new prompt is input_ids + these)
        self.prompt = input_ids  # what the next attempt sends
        self.attempt_params = params

    def record(self, item: StepOutput) -> None:
        """An output on its way to the consumer: latency figures, tokens so far, cache hits."""
        token_ids = item.token_ids
        if token_ids:
            now = _monotonic()
            n = len(token_ids)
            if self.generated:  # one gap per token: an output of several (merged, or gathered) counts each
                self.itl.observe((now - self.last_t) / n, n)
            else:
                self.dispatcher.metrics.ttft.observe(now - self.t0)
                if n > 1:  # the first output's other tokens came with the first: gaps of 0
                    self.itl.counts[0] += n - 1  # (``observe(0.0, n - 1)``: the lowest bucket, the sum as it was)
            self.last_t = now
            self.generated.extend(token_ids)
        if self.migrations:  # the new prompt's cache hits include our own output: not the client's
            item.cached_tokens = self.cached_tokens
        self.cached_tokens = item.cached_tokens
        self.completed = item.finish_reason is not None

    def recover(self, exc: _Retryable, num_before: int) -> float | None:
        """After an attempt failed with ``exc`` (``num_before``: tokens delivered before it), set up the
        next one and return how long to wait before it (None: a migration, at once); or raise the
        error the client gets."""
        dispatcher, generated = self.dispatcher, self.generated
        config, metrics = dispatcher.config, dispatcher.metrics
        if _monotonic() >= self.deadline:  # no time left for another attempt
            raise exc.error from None
        if len(generated) > num_before:  # this attempt had streamed: only a migration goes on
            left = self.params.max_new_tokens - len(generated)
            if not exc.migratable or self.migrations >= config.max_migrations or left <= 0:
                raise exc.error from None
            # Migration: the prompt and every token streamed so far are the new prompt of a new pair;
            # the client's stream goes on as if nothing happened.
            self.migrations += 1
            self.cause = exc.error
            metrics.migrations.inc()
            if exc.blamed is not None:
                self.avoid = {*self.avoid, exc.blamed}
            log.warning("stream migrated after %d tokens (%d of %d): %s", len(generated), self.migrations,
                        config.max_migrations, exc.error.message)
            self.prompt = self.input_ids + generated
            self.attempt_params = msgspec.structs.replace(  # (its prompt logprobs went out with the first output)
                self.params, max_new_tokens=left, output_offset=self.params.output_offset + len(generated),
                prompt_logprobs=False)
            self.request = dispatcher.router.request(self.prompt, left)
            return None
        # Before this attempt's first token (a new request's, or a migrated stream's new pair: the
        # client's stream waits): a new pair, the same prompt.
        if self.retries >= config.max_retries:
            raise exc.error from None
        delay = min(config.retry_backoff_s * 2 ** self.retries * random.uniform(0.5, 1.5), MAX_BACKOFF_S)
        if _monotonic() + delay >= self.deadline:  # the retry would start past the request's deadline
            raise exc.error from None
        self.retries += 1
        dispatcher.num_retries += 1
        metrics.retries.labels(exc.error.code or exc.error.type).inc()
        if exc.blamed is not None:
            self.avoid = {*self.avoid, exc.blamed}
        if exc.also is not None:
            self.avoid = {*self.avoid, exc.also}
        return delay

    def close(self) -> None:
        metrics = self.dispatcher.metrics
        if self.counts_output:
            metrics.generation_tokens.inc(len(self.generated))  # (generated and sent, also before a failure)
        if self.completed:
            metrics.e2e.observe(time.monotonic() - self.t0)
            if self.counts_prompt:  # (one choice per prompt: as the response's usage counts it)
                metrics.prompt_tokens.inc(len(self.input_ids))
                metrics.cached_tokens.inc(self.cached_tokens)


class _Attempt:
    """One pair, one room (see the module doc). Made with its pair selected (nothing open yet);
    ``submit`` sends to both workers; ``next`` is the next decode output for the consumer (the
    prefill's hand-over, merging and failures are handled in it); ``close`` aborts whatever is still
    open and tells the policies how the attempt ended (``outcome``, unless it finished)."""

    # (no ``__slots__``: the fields that start the same for every attempt are these class defaults, not
    # stores made per attempt; each is set on the instance when it changes)
    finished = False
    sent = False  # the policies heard ``dispatched``: they hear how it ended (``close``)
    outcome = "failed"
    got_token = False
    peer_refusal: tuple[str, Error] | None = None  # (side, relay) waiting for the refusing side's own 400
    # Prompt logprobs come from the prefill's hand-over and go out with the consumer's first output
    # (a stream's first chunk carries them); the hand-over may trail the decode's outputs, which
    # wait for it in ``held`` (until then, or until the wait for it times out; a deque from ``submit`` on
    # when they are wanted, none held until then).
    want_prompt = False
    prompt_logprobs: list[float] | None = None
    prompt_top: list[list[TokenLogprob]] | None = None
    held: deque[StepOutput] = ()  # type: ignore[assignment]

    def __init__(self, dispatcher: Dispatcher, run: _Choice, direct: DirectConsumer | None, *, urgent: bool,
                 gather_s: float = 0.0) -> None:
        self.dispatcher = dispatcher
        self.run = run
        self.request = run.request
        try:
            self.pair, self.prefill, self.decode = dispatcher._select(run.request, run.avoid)
        except (BadRequest, NoWorkers):
            if run.cause is None:
                raise
            # A migrated stream's new prompt (the client's and the tokens streamed so far) that no worker can
            # hold, or no worker left to take it: the stream ends with the failure it migrated off, not a 400
            # blaming the client's request or a 503 "no healthy worker" hiding why its decode stopped.
            raise run.cause from None
        self.open_rids: dict[str, tuple[WorkerClient, int]] = {}
        self.sink = EventSink(dispatcher.config.max_unread_events, self._overflow, self.decode.loop)
        self.direct = direct
        self.urgent = urgent  # the submits go out at once, not at the end of this loop pass (a stream)
        self.gather_s = gather_s  # (``Submit.gather_s``, to the decode)

    def submit(self) -> None:
        dispatcher, run, pair, prefill, decode = self.dispatcher, self.run, self.pair, self.prefill, self.decode
        input_ids, params, request = run.prompt, run.attempt_params, self.request
        target = None
        if prefill is not None:
            info = prefill.info
            assert info is not None
            if info.bootstrap_host is None:
                raise BadGateway(f"prefill worker {prefill.url} reported no bootstrap address")
            target = BootstrapTarget(info.bootstrap_host, info.bootstrap_port, random_room(), info.instance_id)
        prompt_tokens = len(input_ids)
        # (``request.num_pages_needed(pair.decode.page_size)``, inline: ``request`` is of ``input_ids``)
        page_size = pair.decode.page_size
        pages = -(-(prompt_tokens + request.max_new_tokens) // (page_size if page_size > 1 else 1))
        hashed = request.has_page_hashes  # (a property: read once)
        if hashed:  # the policy consulted the prefix index: count only the uncached part
            prompt_tokens -= request.num_cached_tokens(pair.prefill if pair.prefill is not None else pair.decode)
        self.request_id = request_id = REQUEST_ID.get()  # (also for log lines from the connections' callbacks)
        timeout_s = run.deadline - _monotonic()  # (the worker's deadline for this attempt: what is left)
        if timeout_s <= 0:
            raise _request_timed_out(dispatcher.config)
        open_rids, urgent = self.open_rids, self.urgent
        gather_s, decode_params = self.gather_s, params
        if params.stop and not decode.stops_at_strings_as(dispatcher.tokenizer_digest):
            gather_s = 0.0  # it would run on past a stop string until the gateway's abort: not held back
            if decode.stops_at_strings:  # but with other text than ours: it could stop where we see none
                decode_params = msgspec.structs.replace(params, stop=[])
        config = dispatcher.config
        idle_s = config.stream_idle_timeout_s  # (the idle deadline between events, from the first token on)
        if gather_s:  # a gathering decode is silent for up to gather_s between outputs: not a frozen one
            idle_s += gather_s
        self.idle_s = idle_s
        sink = self.sink
        # Both sides' ``Submit`` carry the prompt: its ids encoded once, for both (the same bytes on the wire as the
        # list's; a prompt of thousands of tokens is not encoded twice)
        ids: list[int] = _encoded(_encode_ids(input_ids)) if prefill is not None else input_ids  # type: ignore[assignment]
        try:
            rid = decode.submit(Submit(0, ids, decode_params, target, timeout_s, request_id, gather_s),
                                sink, "decode", prefill_tokens=0 if prefill is not None else prompt_tokens,
                                pages=pages, urgent=urgent)
            open_rids["decode"] = (decode, rid)
            if prefill is not None:
                rid = prefill.submit(Submit(0, ids, params, target, timeout_s, request_id), sink,
                                     "prefill", prefill_tokens=prompt_tokens, urgent=urgent)
                open_rids["prefill"] = (prefill, rid)
        except ConnectionError as exc:
            raise _Retryable(BadGateway(str(exc))) from None
        router = dispatcher.router
        if hashed or router.dispatch_hooks:  # (else ``dispatched`` has nothing to do)
            router.dispatched(pair, request)
        self.sent = True
        if params.prompt_logprobs and prefill is not None:
            self.want_prompt = True
            self.held = deque()
        # From now to the first token, whatever comes before it; none past the request's own deadline (a frozen
        # decode cannot enforce it; what was left of it as the submits went out): ``cap_in`` and ``set_deadline``.
        sink.start(config.first_token_timeout_s, timeout_s)
        sink.tap = self._tap

    def _overflow(self) -> None:
        """The consumer stopped reading: stop both workers now, not at its next read."""
        dispatcher = self.dispatcher
        dispatcher.metrics.slow_clients.inc()
        log.warning("request %s: its client left %d events unread; stopping its generation",
                    self.request_id or "-", dispatcher.config.max_unread_events)
        for worker, rid in self.open_rids.values():
            worker.abort(rid, "the client reads too slowly")
        self.open_rids.clear()

    def _tap(self, item: tuple[Any, Event]) -> bool:
        """Outputs handled in the worker connection's callback, not waking the consumer's task (``next``
        is waiting in ``sink.get`` with nothing queued, so the order holds): the prefill's hand-over
        (unless outputs wait for its prompt logprobs), and non-final decode outputs to ``direct`` when
        it is ready for them, recorded first (``record`` corrects a migrated stream's cache hits before
        the consumer counts them)."""
        side, event = item
        if type(event) is not StepOutput:
            return False
        if side == "prefill":
            if self.held:
                return False
            # (``_handed_over``, inline: every request's hand-over comes this way)
            entry = self.open_rids.pop("prefill", None)
            if entry is not None:  # (not after ``_overflow`` stopped both sides)
                entry[0].health.breaker.record_success(entry[1])
            if self.want_prompt:
                self.prompt_logprobs, self.prompt_top = event.prompt_logprobs, event.prompt_top_logprobs
        else:
            direct = self.direct
            if direct is None or event.finish_reason is not None or not direct.ready():
                return False
            if self.want_prompt:
                if "prefill" in self.open_rids:
                    return False  # (it waits for the prompt logprobs in ``next``)
                self._with_prompt(event)
            self.run.record(event)
            direct.take(event)
            if not self.got_token and event.token_ids:
                self.got_token = True
                if self.prefill is None:
                    self._prefilled()
                self.sink.slide(self.idle_s)  # the first-token deadline set at ``submit`` gives way
                entry = self.open_rids.get("decode")
                if entry is not None and not self.run.migrations:  # (a migrated stream's outputs all go through this
                    entry[0].set_lane(entry[1], self._lane())      # tap: ``_lane``)
                return True
        if self.got_token:
            sink = self.sink
            sink.active = sink.clock()  # progress: the idle deadline moves on
        return True

    def _lane(self) -> Callable[[StepOutput], bool]:
        """Once the direct path has passed on a token (``_tap`` sets it on the decode's connection,
        ``WorkerClient.set_lane``): the decode's non-final outputs straight to ``direct.offer`` from the frame's
        callback, without the sink in between, recorded as ``_Choice.record`` would, the latency histogram observed
        in place; only while the consumer waits with none queued (``EventSink.waiter``), as the tap. Anything
        else it refuses and the sink gets (its final output, one ``direct`` cannot take now; a migrated stream's
        attempt sets none: its outputs' cache hits are ``record``'s to correct). Run once per streamed token: what
        it reads is bound here, once per attempt."""
        run, sink, direct = self.run, self.sink, self.direct
        assert direct is not None  # (a token went to it)
        # (what it has chosen by now: a stream's emitter picks its own lane with the first token, which came)
        offer = direct.offer
        itl, generated, clock = run.itl, run.generated, sink.clock
        counts, bounds = itl.counts, itl.bounds

        def lane(event: StepOutput) -> bool:
            if event.finish_reason is not None or sink.waiter is None:
                return False
            try:
                if not offer(event):
                    return False
                token_ids = event.token_ids
                if token_ids:
                    now = _monotonic()
                    n = len(token_ids)
                    gap = (now - run.last_t) / n
                    counts[_bisect_left(bounds, gap)] += n  # (``PlainHistogram.observe``)
                    itl.sum += gap * n
                    run.last_t = now
                    generated.extend(token_ids)
                run.cached_tokens = event.cached_tokens
                sink.active = clock()  # progress: the idle deadline moves on
            except Exception:  # as the sink's tap: a bug in a consumer must not drop the worker connection
                sink.direct_failed()
            return True
        return lane

    def _handed_over(self, event: StepOutput) -> None:
        """The prefill's part is done (its KV is on the decode); the decode carries on."""
        entry = self.open_rids.pop("prefill", None)
        if entry is not None:  # (not after ``_overflow`` stopped both sides)
            entry[0].health.breaker.record_success(entry[1])
        if self.want_prompt:  # (read by ``_with_prompt`` only, which only a wanted prompt's outputs meet)
            self.prompt_logprobs, self.prompt_top = event.prompt_logprobs, event.prompt_top_logprobs

    def _prefilled(self) -> None:
        """A combined worker's first token: the prompt is computed, its tokens leave the worker's queued
        prefill in the gateway's counts (a prefill's leave with its hand-over)."""
        entry = self.open_rids.get("decode")
        if entry is not None:
            entry[0].state.prefill_done(entry[1])

    def _with_prompt(self, event: StepOutput) -> None:
        """The consumer's first output, with the prefill's prompt logprobs."""
        event.prompt_logprobs, event.prompt_top_logprobs = self.prompt_logprobs, self.prompt_top
        self.want_prompt = False

    def _stop_waiting_for_prompt(self) -> None:
        """The prefill's hand-over did not come in time (or outputs piled up waiting for it): abort its
        request and let the held outputs go without prompt logprobs."""
        prefill = self.open_rids.pop("prefill", None)
        if prefill is not None:
            prefill[0].abort(prefill[1])
        log.warning("request %s: no hand-over from the prefill after %d outputs of its decode; answering "
                    "without prompt logprobs", REQUEST_ID.get() or "-", len(self.held))
        self.want_prompt = False

    def _release(self) -> StepOutput:
        """The first of the outputs held for the prompt logprobs (the rest follow in the next calls)."""
        event = self.held.popleft()
        if event.finish_reason is not None:
            self.finished = True
        return event

    async def next(self) -> StepOutput:
        """The next decode output for the consumer (the final one sets ``finished``); raises the
        failure (``APIError``, or ``_Retryable`` for the dispatcher to retry or migrate)."""
        sink = self.sink
        if self.held and not self.want_prompt:
            return self._release()
        while True:
            # (before the first token, the first-token deadline set at ``submit`` stands; while outputs
            # wait for the prefill's hand-over, the deadline set when the first of them came)
            if self.got_token and not self.held:
                sink.slide(self.idle_s)
            try:
                side, event = await sink.get()
            except SinkOverflow:
                raise SlowClient(f"the client read its stream too slowly ({sink.limit} events unread); "
                                 "generation was stopped") from None
            except DirectPathFailed:
                raise APIError("internal error in the gateway while taking the workers' outputs; generation "
                               "was stopped (see the gateway's log)") from None
            except TimeoutError:
                if self.peer_refusal is not None:  # the refusing side's own answer did not come: the relay's
                    relay_side, relay = self.peer_refusal
                    raise _as_error(relay, relay_side, None) from None
                if sink.capped and not self.held:  # the request's own deadline: final, and no worker's fault
                    raise _request_timed_out(self.dispatcher.config) from None
                if self.held:  # the decode goes on; only the prefill's prompt logprobs never came
                    self._stop_waiting_for_prompt()
                    return self._release()
                wait_s = self.idle_s if self.got_token else self.dispatcher.config.first_token_timeout_s
                stage = "between tokens" if self.got_token else "before the first token"
                error = UpstreamTimeout(f"no progress from the workers for {wait_s:g}s {stage}")
                if self.got_token:  # a frozen decode: the stream may continue elsewhere
                    # Its failure, as a ``timeout`` it reported itself would be: its breaker hears of it.
                    self.dispatcher._blame(self.decode, self.decode, Error(0, "timeout", error.message))
                    raise _Retryable(error, self.decode, migratable=True) from None
                raise error from None
            if type(event) is StepOutput:
                if side == "prefill":
                    self._handed_over(event)
                    if self.held:
                        self._with_prompt(self.held[0])
                        return self._release()
                    continue
                if event.finish_reason is None:
                    event = sink.merge_ready(event)
                if not self.got_token and event.token_ids:
                    self.got_token = True
                    if self.prefill is None:
                        self._prefilled()
                if event.finish_reason is not None:
                    self.decode.health.breaker.record_success(self.open_rids.pop("decode", _NOT_OPEN)[1])
                if self.want_prompt:
                    if "prefill" in self.open_rids and len(self.held) < sink.limit:
                        if not self.held:  # the hand-over is due about now: outputs do not move this deadline
                            sink.set_deadline(min(self.idle_s, HANDOVER_WAIT_S))
                        self.held.append(event)
                        continue
                    if self.held:  # (as many as a slow reader may leave unread: go on without the logprobs)
                        self.held.append(event)
                        self._stop_waiting_for_prompt()
                        return self._release()
                    self._with_prompt(event)
                if event.finish_reason is not None:
                    self.finished = True
                return event
            worker = self.decode if side == "decode" else self.prefill
            assert worker is not None and not isinstance(event, StepOutput)
            self.open_rids.pop(side, None)
            if (type(event) is Error and event.code == "bad_request" and event.fault == Fault.NONE
                    and not self.got_token and self.peer_refusal is None
                    and ("prefill" if side == "decode" else "decode") in self.open_rids):
                # This side relays its peer's refusal; the peer's own 400 (naming the client's field) is on
                # its way over the peer's connection: that one is the client's answer.
                self.peer_refusal = (side, event)
                sink.set_deadline(PEER_REFUSAL_WAIT_S)
                continue
            if type(event) is Error and event.code == "timeout" and _monotonic() >= self.run.deadline:
                # The request's own deadline (``Submit.timeout_s``): final, and no worker's fault.
                raise _request_timed_out(self.dispatcher.config)
            culprit = _culprit(event, side, self.prefill, self.decode)
            self.dispatcher._blame(worker, culprit, event)
            if side == "prefill" and (self.got_token or self.held):
                # The decode already has its KV: a late prefill failure (e.g. restarting) does not
                # concern it; only its prompt logprobs are lost.
                self.want_prompt = False
                if self.held:
                    return self._release()
                continue
            # The next attempt avoids the culprit, or when nobody is (the registry failed the look-up: a
            # decode that has the prefill's address cached may not need it), the worker that reported it; a
            # full worker (``overloaded``, no failure of anyone's), the full one: the reporter, or its peer when
            # it relays the peer's refusal.
            # A failure of nobody's otherwise (a wait for the peer that ran out: a prefill's queue held the
            # request, a decode's pages were all in use; the peer's abort) avoids the peer too: it is the busy
            # one, or the one whose own failure is on its way (each pool falls back to all when none is left).
            avoid, also = culprit or worker, None
            if type(event) is Error and event.fault == Fault.NONE:
                peer = self.prefill if side == "decode" else self.decode
                if event.code == "overloaded":
                    avoid = peer or worker
                else:
                    also = peer
            failure = _as_error(event, side, avoid, after_first_token=self.got_token)
            if also is not None and isinstance(failure, _Retryable):
                failure.also = also
            raise failure

    def close(self) -> None:
        self.sink.close()
        # A decode that finished, or served tokens, did so on the prefill's KV: if the prefill's hand-over has
        # not come yet (each answers on its own connection), the prefill did its part all the same.
        if self.finished:
            prefill = self.open_rids.get("prefill")
            if prefill is not None:  # (its late hand-over ends its rid)
                prefill[0].health.breaker.record_success(prefill[1])
        else:  # error, timeout or the consumer went away: free both sides now
            for worker, rid in self.open_rids.values():
                worker.abort(rid)
            if self.outcome == "cancelled" and self.got_token:
                # The consumer stopped (a stop string the gateway found, the client left) after the decode
                # served tokens: a success of the decode's, as its final output would have been (a
                # half-open breaker closes on these too; not twice: a final output held for the prompt
                # logprobs was counted when it came), and of the prefill's when it had not said so yet.
                for worker, rid in self.open_rids.values():
                    worker.health.breaker.record_success(rid)
        if self.sent:
            router = self.dispatcher.router
            if router.finish_hooks:  # (without any, ``finished`` has nothing to do: not called)
                router.finished(self.pair, self.request, "finished" if self.finished else self.outcome)


def _request_timed_out(config: DispatchConfig) -> UpstreamTimeout:
    return UpstreamTimeout(f"the request ran past its timeout ({config.request_timeout_s:g}s)", code="request_timeout",
                           final=True)


def _able(pool: list[WorkerClient]) -> list[WorkerClient]:
    """The workers of ``pool`` that have connected and can take requests (not draining, disconnected or failing
    their probes, or with an open breaker: not selected either); all that have connected when none can. (A breaker's
    ``state`` is not read: reading it moves it on, which is the event loop's to do; these run on a prepare thread too.
    ``is_open`` does not move it.)"""
    connected = [c for c in list(pool) if c.state.page_size]
    return [c for c in connected if c.is_connected and not c.is_draining and not c.is_stopping
            and c.health.is_probe_healthy and not c.health.breaker.is_open] or connected


def _selectable(pool: list[WorkerClient], avoid: AbstractSet[WorkerClient]) -> list[Any]:
    """The views of the healthy workers of ``pool`` not in ``avoid``, or of all the healthy ones if
    that leaves none (a failed worker beats none at all)."""
    if not avoid:
        return [w.state for w in pool if w.healthy]
    healthy = [w for w in pool if w.healthy]
    return [w.state for w in healthy if w not in avoid] or [w.state for w in healthy]


class _Retryable(Exception):
    """Before the first token: try another pair. After it, if ``migratable``: continue the stream elsewhere."""

    def __init__(self, error: APIError, blamed: WorkerClient | None = None, *, migratable: bool = False) -> None:
        super().__init__(error.message)
        self.error = error
        self.blamed = blamed  # the worker to avoid on the next attempt
        self.also: WorkerClient | None = None  # (and its peer: a failure of nobody's, ``_Attempt.next``)
        self.migratable = migratable


def _culprit(event: Event, side: str, prefill: WorkerClient | None, decode: WorkerClient) -> WorkerClient | None:
    """The worker a failure is held against (its breaker; the retry avoids it): the one that reported it,
    its KV peer (``Fault.PEER``: the peer went away, fell silent or could not be reached), or neither
    (``Fault.NONE``: the registry failed, or the peer aborted and reports its own failure)."""
    fault = event.fault if isinstance(event, Error) else Fault.OWN
    if fault == Fault.PEER:
        return prefill if side == "decode" else decode
    if fault == Fault.NONE:
        return None
    return decode if side == "decode" else prefill


def _as_error(event: Event, side: str, blamed: WorkerClient | None, *, after_first_token: bool = False) -> Exception:
    decode_failed_mid_stream = after_first_token and side == "decode"
    if isinstance(event, WorkerGone):
        return _Retryable(BadGateway(event.message, code="worker_gone"), blamed, migratable=decode_failed_mid_stream)
    assert isinstance(event, Error)
    migratable = decode_failed_mid_stream and event.code in MIGRATABLE_CODES
    error = from_worker_error(event.code, event.message, side, event.param)
    if event.code in RETRYABLE_CODES or migratable:
        return _Retryable(error, blamed, migratable=migratable)
    return error
