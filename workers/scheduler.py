"""The worker's scheduler: admission, the PD queues, batching and the engine loop.

Lifecycle (one ``Scheduler`` per worker, its loop on a dedicated thread):
1. The network side calls ``connect`` / ``submit`` / ``abort`` / ``drop_connection`` from the event
   loop; they only enqueue (thread-safe, never block). A new connection gets a snapshot of the
   prefix cache (``KVEvents(reset=True)``) and a ``LoadReport``.
2. Each step the thread drains the inbox, expires requests past their deadline, advances the PD
   queues, runs one engine batch (decode tokens first, then prefill chunks up to ``chunk_size``
   tokens), and hands the step's outputs to ``sink`` in one call.
   - prefill role: PrefillBootstrapQueue (the decode's page list arrives) -> waiting (pages for the
     prompt) -> chunked prefill, each chunk's full pages sent as soon as computed -> the last chunk
     with the first sampled token as aux -> inflight (poll; free pages only when the transfer is done).
   - decode role: DecodePreallocQueue (connected to the prefill; reserve pages for the prompt +
     max_new_tokens - 1 positions it writes, and an aux slot; send their ids) -> DecodeTransferQueue (poll until KV and
     the first token arrived) -> prebuilt extend (no forward pass) -> running decode batch.
   - both: waiting -> chunked prefill -> running decode batch (no transfer).
   At the end of a step: the prefix cache's net changes as one broadcast ``KVEvents``, and a ``LoadReport`` per
   connection carrying the newest rid admitted from it: within ``REPORT_MIN_INTERVAL_S`` of a request ending or
   pages freed; within ``MOVED_REPORT_S`` of an admission or a stage move (the submitting gateway counts its own
   request until a report covers it: such a change rides on the next report rather than waking the loop for one of
   its own); at least every ``BUSY_REPORT_S`` while requests are live, ``IDLE_REPORT_S`` otherwise.
   A step that ran no batch is followed by a sleep on the inbox until a message arrives (from the
   network side, or a wake-up the KV manager's listener queues when a room changed state) or the
   next load report or request deadline is due; ``IDLE_WAIT_S`` at most. Nothing is polled.
3. Every exit (finish, error, abort, timeout, dropped connection) goes through ``_release``, which
   returns pages and aux slots to the pool and releases the KV sender/receiver.
4. ``drain()`` (optional, before ``stop``: the worker's ``--drain-timeout-s``) refuses every request admitted from
   then on with ``shutting_down`` (its room ended on the peer's side as turned away, ``OVERLOAD_MARK``) while the
   requests already held run on; ``num_held`` says how many are left.
5. ``stop()`` ends the loop; live requests fail with ``shutting_down``.
"""

from __future__ import annotations

import concurrent.futures
import logging
import math
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec

from transfer.types import KVPoll

if TYPE_CHECKING:
    from gateway.tokenizer import Tokenizer
    from transfer import KVManager
from gateway.api_models import (
    MAX_LOGIT_BIAS,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    MAX_STOP_TOTAL_CHARS,
    MAX_TOP_LOGPROBS,
)
from gateway.tokenizer import DECODE_CONTEXT_TOKENS
from workers.aux import AuxRecord, decode_aux, encode_aux, prompt_digest
from workers.engines.base import (
    OPTIONAL_SAMPLING,
    Engine,
    KVChecker,
    SeqInput,
    SeqOutput,
    SequenceState,
    check_sampling,
    needs_history,
)
from workers.grammar import GRAMMAR_TIMEOUT_S, GrammarCompiling, GrammarWait
from workers.kv_pool import KVPool
from workers.metrics import SchedulerMetrics
from workers.page_cache import PageCache, page_hashes
from workers.pd_queues import (
    DecodePreallocQueue,
    DecodeQuarantine,
    DecodeTransferQueue,
    PrefillBootstrapQueue,
    PrefillInflightQueue,
    StageQueue,
    decode_tokens,
    failure_fault,
    failure_reason,
    is_quiesced,
)
from workers.protocol import (
    Error,
    Fault,
    KVEvents,
    LoadReport,
    Outputs,
    SamplingParams,
    StepOutput,
    Submit,
    joined,
)
from workers.request import Req, live
from workers.stop_strings import StopWatch, history_tokens

log = logging.getLogger(__name__)

QUEUED_PAGES_INDEXED = 256  # leading pages per queued request in ``Scheduler._queued_pages`` (system prompts)

BROADCAST = -1  # connection id meaning "every connection" in the sink
# Put before the reason a worker gives its KV peer for a room whose request it refused (``bad_request``): the peer
# fails its side as the same refusal, not as a transfer failure. Over SGLang's HTTP protocol that side's 502 was
# retried by the router and held against the healthy worker's circuit breaker (the client's bad request took it out).
REFUSAL_MARK = "refused the request: "
# The same for a request it turned away as overloaded: the peer answers ``overloaded`` too (a 429 to retry later, held
# against neither worker), not a transfer failure.
OVERLOAD_MARK = "turned the request away: "
# A decode sends the first tokens of requests it imported before its step's forward (not with that step's tokens
# after it) when its last forward took this long: a waking of the event loop more per step, worth it against a
# model's decode step (ms), not against a zero-cost engine's (µs), where it only added a thread hand-off.
EARLY_FLUSH_MIN_S = 0.001
IDLE_WAIT_S = 0.05  # the longest idle sleep; a message, a KV room's change or a due time ends it sooner
REPORT_MIN_INTERVAL_S = 0.002  # a request ended or pages freed: reported at most this often...
# ...an admission or a stage move within this (its gateway counts the request itself until a report covers its rid;
# other gateways learn of it this much later at most). At one request at a time a report of its own at admission
# cost each worker two thread wake-ups and a write per request, and held the end's report back by the minimum
# interval (two more); now the end's report carries both, in the same write as the request's last output.
MOVED_REPORT_S = 0.01
BUSY_REPORT_S = 0.1  # ...and at least this often while requests are live
IDLE_REPORT_S = 0.5
# A step longer than this (a big prefill chunk, a slow forward) would leave every gateway without a report for its
# whole length; a gateway takes a report older than its ``--load-stale-s`` (1 s) as gone, and then sees only its own
# requests on the worker: another gateway's load vanished from its view, it piled onto the busiest worker. So the
# native server's event loop re-sends the newest reports (``reports_to_repeat``) while the scheduler is in a step.
REPEAT_REPORT_AFTER_S = 0.3
THROUGHPUT_EWMA = 0.2  # weight of the newest batch in the prefill tokens/s estimate
BUSY_WINDOW_S = 1.0  # time constant of the busy-fraction average
Message = Outputs | Error | LoadReport | KVEvents
Sink = Callable[[list[tuple[int, Message]]], None]


@dataclass(frozen=True)
class SchedulerConfig:
    role: str  # "prefill" | "decode" | "both"
    chunk_size: int = 512
    max_running: int = 64
    max_requests: int = 4096  # held at once, in any stage: more are refused overloaded
    prefix_cache: bool = True
    # a request whose next prompt page another request here is computing waits for it (``_awaits_prefix``)
    wait_for_prefix: bool = True
    # a request whose grammar has not compiled this long after its admission fails (bad_request; workers/grammar.py)
    grammar_timeout_s: float = GRAMMAR_TIMEOUT_S


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        engine: Engine,
        pool: KVPool,
        sink: Sink,
        kv: KVManager | None = None,
        stop_tokenizer: Tokenizer | None = None,
    ) -> None:
        if config.role not in ("prefill", "decode", "both"):
            raise ValueError(f"unknown role {config.role!r}")
        if config.role != "both" and kv is None:
            raise ValueError(f"role {config.role} needs a KV transfer manager")
        self.config = config
        self.role = config.role
        self.engine = engine
        self.kv_checker = engine if isinstance(engine, KVChecker) else None  # optional ability, checked once
        self.seq_state = engine if isinstance(engine, SequenceState) else None  # told of every release
        # Constrained decoding (optional ability): requests wait here while their grammar compiles.
        self.grammar_wait = GrammarWait(engine, self._on_kv_change, config.grammar_timeout_s) \
            if isinstance(engine, GrammarCompiling) else None
        self.pool = pool
        self.kv = kv
        # Stop strings are checked here (``workers.stop_strings``) when the worker decodes and has its
        # tokenizer; ``HelloAck.stop_strings`` tells the gateway.
        self.stop_tokenizer = stop_tokenizer if config.role != "prefill" else None
        # Decode workers receive whole prompts from prefill workers: nothing to share there.
        self.cache = PageCache(pool, enabled=config.prefix_cache and config.role != "decode")
        self.num_preemptions = 0
        self.num_prefix_waits = 0  # requests that waited for a prefix another one was computing
        # page hash -> admitted requests that will compute that page (their first ``QUEUED_PAGES_INDEXED``
        # pages, until their prefill ends): a prefix a queued request computes first is not counted
        # again in the load report (``_expected_cached``), as ``_awaits_prefix`` does not compute it again
        self._queued_pages: dict[bytes, int] = {}
        self.num_prompt_tokens = 0  # prompts prefilled here (prefill / both roles)
        self.num_cached_prompt_tokens = 0  # of which served from the prefix cache
        self._sink = sink
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        # Prefill: submits whose room's page list has not come yet (``submit``), taken in at the loop's next wake-up
        # (the page list's arrival is one) before anything of the inbox
        self._parked: deque[tuple[int, Submit]] = deque()
        self.reqs: dict[tuple[int, int], Req] = {}
        # PD stages (see workers/pd_queues.py); each role uses its own two.
        self.bootstrap_queue = PrefillBootstrapQueue(pool)  # prefill: waiting for the decode's page list
        self.inflight_queue = PrefillInflightQueue()  # prefill: KV sent, waiting for completion
        self.prealloc_queue = DecodePreallocQueue(pool, self.cache)  # decode: waiting to connect / for pages
        self.transfer_queue = DecodeTransferQueue()  # decode: waiting for KV
        self.quarantine = DecodeQuarantine()  # decode: ended, pages held until no late KV write can land
        self._waiting: list[Req] = []  # waiting for pages to start prefill
        self._prefilling: list[Req] = []
        self._running: list[Req] = []  # decoding
        # decode: imported (KV and first token here) while the batch was at ``max_running``: they join it
        # first come first served as sequences end (their pages stay held meanwhile)
        self._imported: list[Req] = []
        self._out: list[tuple[int, Message]] = []
        self.rooms: deque[dict[str, Any]] = deque(maxlen=512)  # recent rooms, for /debug/rooms
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._conns: dict[int, int] = {}  # connection -> newest rid admitted from it
        self._last_load = 0.0
        # the newest reports sent, one per connection (replaced whole, never mutated: read by the event loop)
        self._last_reports: list[tuple[int, Message]] = []
        self._last_progress = time.monotonic()  # end of the newest step (read by health probes)
        self._load_dirty = True  # a change to report within REPORT_MIN_INTERVAL_S (a request ended, pages freed)
        self._load_moved = False  # one to report within MOVED_REPORT_S (an admission, a stage move)
        self.prefill_tokens_per_s = 0.0
        self.busy_fraction = 0.0
        self._busy_s = 0.0  # engine time since the last load report
        # The newest engine step's time (``EARLY_FLUSH_MIN_S``); none timed yet: taken as slow (a model's first
        # forward is its slowest, and a fresh decode's first imported request must not wait it out for its token)
        self._last_forward_s = math.inf
        self.num_steps = 0
        self.metrics = SchedulerMetrics()  # histograms and outcome counters for /metrics
        self.error: BaseException | None = None
        self._wake_pending = False
        # The loop has ended: a submit queued from now on is answered by ``_answer_leftovers`` (never left unread)
        self._ended = False
        self._leftovers_lock = threading.Lock()
        self._draining = False  # (``drain``) new requests are refused ``shutting_down``; held ones run on
        if kv is not None:
            kv.set_listener(self._on_kv_change)

    # -- thread-safe API ---------------------------------------------------------------------
    def connect(self, conn_id: int) -> None:
        """A gateway finished its handshake: send it the cache snapshot and the current load."""
        self._inbox.put(("connect", conn_id))

    def submit(self, conn_id: int, msg: Submit) -> None:
        if self.role == "prefill" and msg.bootstrap is not None and self.kv is not None:
            # A PD request reaches its prefill before the decode's page list does (the decode sends that once it
            # admitted its side), and the list's arrival wakes the loop (``set_listener``): the submit waits for it
            # here instead of waking the loop now for nothing to run (one thread wake-up less per PD request). The
            # loop takes it in at its next wake-up whatever that is (an idle one is at most ``IDLE_WAIT_S`` away).
            self._parked.append((conn_id, msg))
            if self.kv.room_requested(msg.bootstrap.room):  # (after the append: a list that comes later wakes)
                self._inbox.put(("wake", None))
        else:
            self._inbox.put(("submit", (conn_id, msg)))
        if self._ended:  # (the loop's last look at its inbox may have come before this one)
            self._answer_leftovers()

    def abort(self, conn_id: int, rid: int, reason: str) -> None:
        self._inbox.put(("abort", (conn_id, rid, reason)))

    def drop_connection(self, conn_id: int) -> None:
        self._inbox.put(("drop", conn_id))

    def flush_cache(self) -> concurrent.futures.Future[int]:
        """Forget every cached prefix page no request holds; the future gets how many were freed."""
        future: concurrent.futures.Future[int] = concurrent.futures.Future()
        self._inbox.put(("flush", future))
        if self._ended:  # (as ``submit``: the loop will not read it)
            self._answer_leftovers()
        return future

    def _on_kv_change(self) -> None:
        """A transfer thread changed a room's state (its lock held): wake the loop, one wake-up queued at most."""
        if not self._wake_pending:
            self._wake_pending = True
            self._inbox.put(("wake", None))

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=f"scheduler-{self.role}", daemon=True)
        self._thread.start()

    def drain(self) -> None:
        """From the next step on, every request admitted is refused ``shutting_down`` (a gateway retries it on
        another worker; its room is ended on the peer's side, which answers ``overloaded``, held against neither),
        while the requests held already run to their end. Thread-safe; ``stop`` still ends whatever is left."""
        self._draining = True
        self._inbox.put(("wake", None))

    @property
    def num_held(self) -> int:
        """Requests held now, in any stage (what a drain waits for); thread-safe."""
        return len(self.reqs)

    def stop(self, timeout_s: float = 60.0) -> bool:
        """Stop the loop after its current step; returns whether the thread ended within the timeout."""
        self._stop.set()
        self._inbox.put(("wake", None))
        if self._thread is not None:
            self._thread.join(timeout_s)
            return not self._thread.is_alive()
        return True

    @property
    def stalled_s(self) -> float:
        """Seconds since the loop last finished a step while requests wait (0 when idle; inf if dead)."""
        if not self.is_alive:
            return float("inf")
        return time.monotonic() - self._last_progress if self.reqs else 0.0

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None

    # -- loop ------------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                did_work = self.step()
                self._last_progress = now = time.monotonic()
                if not did_work:
                    # Nothing to compute: requests (if any) wait on KV transfers, whose changes wake us
                    # through the inbox (``_on_kv_change``), or on pages that only a step frees.
                    self._wait_for_inbox(self._idle_wait_s(now))
        except BaseException as exc:  # the worker's health turns red; requests must not hang
            log.exception("scheduler loop crashed")
            self.error = exc
        finally:
            try:
                for req in list(self.reqs.values()):
                    try:
                        self._fail(req, *self._stop_reason())
                    except Exception:  # (its message is queued first: the others must be told too)
                        log.exception("request %s: failing it at the loop's end failed", req.key)
            finally:
                self._flush()
                self._ended = True
                self._answer_leftovers()

    def stopped(self, rid: int) -> Error:
        """What a submit gets once the loop has ended (``is_alive`` false), from here or the native server."""
        return Error(rid, *self._stop_reason())

    def _stop_reason(self) -> tuple[str, str]:
        """Stopped on purpose: ``shutting_down`` (the gateway retries elsewhere, holding nothing against this
        worker); the loop crashed: ``internal``."""
        if self.error is not None:
            return "internal", "the worker's scheduler stopped"
        return "shutting_down", "the worker is shutting down"

    def _answer_leftovers(self) -> None:
        """The loop has ended: every submit still in the inbox is answered (``shutting_down``, or ``internal``
        after a crash) instead of being left there unanswered, and a cache flush fails; thread-safe."""
        with self._leftovers_lock:
            answers: list[tuple[int, Message]] = []
            while self._parked:  # (the loop has ended: only this, under the lock, takes from it now)
                conn_id, msg = self._parked.popleft()
                answers.append((conn_id, self.stopped(msg.rid)))
            while True:
                try:
                    kind, payload = self._inbox.get_nowait()
                except queue.Empty:
                    break
                if kind == "submit":
                    conn_id, msg = payload
                    answers.append((conn_id, self.stopped(msg.rid)))  # (its gateway aborts the peer)
                elif kind == "flush" and payload.set_running_or_notify_cancel():  # (else: given up, cancelled)
                    payload.set_exception(RuntimeError("the worker's scheduler stopped"))
            if answers:
                self._sink(answers)

    def _idle_wait_s(self, now: float) -> float:
        """How long the loop may sleep: until the next load report or request deadline is due."""
        wait_s = IDLE_WAIT_S
        if self._conns:
            wait_s = min(wait_s, self._report_every() - (now - self._last_load))
        if self.reqs:
            wait_s = min(wait_s, min(r.deadline for r in self.reqs.values()) - now)
            if self.grammar_wait is not None and (compile_deadline := self.grammar_wait.next_deadline()) is not None:
                wait_s = min(wait_s, compile_deadline - now)
        return max(wait_s, 0.0)

    def _wait_for_inbox(self, timeout_s: float) -> None:
        try:
            item = self._inbox.get(timeout=timeout_s)
        except queue.Empty:
            return
        if self._parked:  # (a request's abort or its connection's end comes after its submit)
            self._take_parked()
        self._handle(item)

    def _take_parked(self) -> None:
        parked = self._parked
        while parked:
            self._handle(("submit", parked.popleft()))

    def step(self) -> bool:
        """One scheduler iteration; returns whether a batch ran."""
        inbox = self._inbox
        while True:  # parked submits before each inbox item, and after the last (it may be their wake-up)
            if self._parked:
                self._take_parked()
            if inbox.empty():  # (only this thread takes from it while the loop runs: no race with ``get``)
                break
            self._handle(inbox.get_nowait())
        now = time.monotonic()
        for req in [r for r in self.reqs.values() if now > r.deadline]:
            self._fail(req, "timeout", f"request timed out in stage {req.stage}")
        # Stages that free pages go before the ones that take them: a step that frees pages (a transfer
        # done, a request ended at its import) also admits what waited for them, rather than the loop
        # sleeping first with nothing to run.
        if self.role == "prefill":
            self._advance(self.inflight_queue, self._transferred)
            self._advance(self.bootstrap_queue, self._to_waiting)
        elif self.role == "decode":
            if self.quarantine:
                for req in self.quarantine.take_quiesced():
                    self._free(req)
                    self._load_dirty = True  # (its pages are free now: told at once, not at the idle heartbeat)
            self._advance(self.transfer_queue, self._import)
            self._advance(self.prealloc_queue, self._to_transfer)
        if self.grammar_wait is not None:
            ready, failed = self.grammar_wait.advance(now)
            for req, problem, code in failed:
                if code == "bad_request":
                    self._fail(req, code, problem, param=req.params.grammar.param)
                else:  # (``overloaded``: busy compile threads, not this worker's failure: another may take it)
                    self._fail(req, code, problem, Fault.NONE if code == "overloaded" else Fault.OWN)
            for req in ready:
                self._first_stage(req)
        if self._imported:
            self._prune_batch()
            self._admit_imported()
        if self.role == "prefill":
            # Requests being prefilled whose decode ended the room: failed now (each of them every step, not only
            # those this step's chunk budget reaches), before admission, so that the pages they held go to the
            # requests waiting for them in this step (found in the batch, the step could end with nothing to run
            # and the loop sleep with pages free and requests waiting)
            self._prune_batch()
            for req in list(self._prefilling):
                self._decode_ended(req)
        if self._waiting:  # (a decode's never holds any; ``_run_batch`` prunes the batch lists itself)
            self._admit_waiting()
        if self.role == "decode" and self._out and self._last_forward_s >= EARLY_FLUSH_MIN_S:
            # First tokens of requests imported this step (the prefill sampled them): out now, not after
            # the batch's forward, which would add a whole decode step to each stream's time to first token.
            self._flush()
        ran = self._run_batch()
        if self.role == "prefill":  # (again: what finished during the batch is told now, not a step later)
            self._advance(self.inflight_queue, self._transferred)
        self._publish_cache_events()
        self._maybe_report_load(now)
        self._flush()
        return ran

    def _handle(self, item: tuple[str, Any]) -> None:
        try:
            self._handle_one(item)
        except Exception:  # one bad message must not stop the loop
            log.exception("failed to handle %s", item[0])
            if item[0] == "submit":
                conn_id, msg = item[1]
                req = self.reqs.get((conn_id, msg.rid))
                if req is not None:
                    self._fail(req, "internal", "worker failed to admit the request")
                else:
                    self._out.append((conn_id, Error(msg.rid, "internal", "worker failed to admit the request")))

    def _handle_one(self, item: tuple[str, Any]) -> None:
        kind, payload = item
        if kind == "wake":
            self._wake_pending = False  # the step that follows sees every change made before this
        elif kind == "submit":
            self._admit(*payload)
        elif kind == "abort":
            conn_id, rid, reason = payload
            req = self.reqs.get((conn_id, rid))
            if req is not None:
                self._fail(req, "aborted", reason)
        elif kind == "drop":
            self._conns.pop(payload, None)
            for req in [r for r in self.reqs.values() if r.key[0] == payload]:
                self._release(req, f"connection {payload} closed")
        elif kind == "flush":
            freed = self.cache.clear()
            self._load_dirty = True
            if payload.set_running_or_notify_cancel():  # (False: its caller gave up waiting and cancelled it)
                payload.set_result(freed)
        elif kind == "connect":
            self._conns.setdefault(payload, 0)  # (a parked submit of it may have been taken in first)
            if self.cache.enabled:
                self._out.append((payload, KVEvents(stored=self.cache.cached_hashes(), reset=True)))
            self._out.append((payload, self.load_report()))

    # -- admission ---------------------------------------------------------------------------
    def _admit(self, conn_id: int, msg: Submit) -> None:
        key = (conn_id, msg.rid)
        self._load_moved = True
        if msg.rid > self._conns.get(conn_id, 0):
            self._conns[conn_id] = msg.rid
        if self._draining:
            why = f"the {self.role} worker is shutting down (draining: it takes no new requests)"
            self._out.append((conn_id, Error(msg.rid, "shutting_down", why)))
            self._end_room(msg, OVERLOAD_MARK + why)
            return
        problem = self._validate(msg)
        if key in self.reqs:
            problem = f"request id {msg.rid} is already in use on this connection"
        grammar = msg.params.grammar
        if problem is None and grammar is not None and self.grammar_wait is None:
            problem = f"{grammar.param} is not supported by the {self.engine.name} engine (no constrained decoding)"
        if problem is not None:
            param = grammar.param if grammar is not None and problem.startswith(grammar.param) else next(
                (name for name in (*OPTIONAL_SAMPLING, *_BOUNDED, "input_ids") if problem.startswith(name)), None)
            self._out.append((conn_id, Error(msg.rid, "bad_request", problem, param=param)))
            self._end_room(msg, REFUSAL_MARK + problem)
            return
        if len(self.reqs) >= self.config.max_requests:
            problem = f"the {self.role} worker holds {self.config.max_requests} requests (its --max-requests)"
            self._out.append((conn_id, Error(msg.rid, "overloaded", problem)))
            self._end_room(msg, OVERLOAD_MARK + problem)
            return
        req = Req(key, list(msg.input_ids), msg.params, time.monotonic() + msg.timeout_s, msg.bootstrap,
                  msg.request_id, gather_s=msg.gather_s if self.role != "prefill" else 0.0)
        b = req.bootstrap
        try:
            if self.role == "prefill":
                assert b is not None and self.kv is not None
                req.kv_sender = self.kv.create_sender(b.room)
            elif self.role == "decode":
                assert b is not None and self.kv is not None
                req.kv_receiver = self.kv.create_receiver(b.room, b.host, b.port, b.instance_id)
        except ValueError as exc:  # e.g. a room already in use here
            self._out.append((conn_id, Error(msg.rid, "bad_request", str(exc))))
            return
        except RuntimeError as exc:  # the KV manager is closing
            self._out.append((conn_id, Error(msg.rid, "shutting_down", str(exc))))
            return
        self.reqs[key] = req
        if self.role != "decode":
            req.num_cached_estimate = self._expected_cached(req)
        if req.params.grammar is not None and self.grammar_wait is not None and self.grammar_wait.hold(req):
            return  # compiling its grammar: ``_first_stage`` once done (workers/grammar.py)
        self._first_stage(req)

    def _end_room(self, msg: Submit, reason: str) -> None:
        """A worker refusing a request ends its room on the other side too, so that neither waits out its
        bootstrap timeout for it: a prefill fails the decode's page list at once, a decode tells the
        prefill (a gateway aborts the other side itself; an SGLang router, or a gateway that lost only
        the refusing worker, does not)."""
        b = msg.bootstrap
        if b is None or self.kv is None:
            return
        if self.role == "prefill":
            self.kv.end_room(b.room, reason)
        elif self.role == "decode":  # the prefill, told, fails its request at once (it would wait for pages)
            self.kv.decline_room(b.room, b.host, b.port, b.instance_id, reason)

    def _first_stage(self, req: Req) -> None:
        if self.role == "prefill":
            self._enter(req, "bootstrap", self.bootstrap_queue)
        elif self.role == "decode":
            self._enter(req, "prealloc", self.prealloc_queue)
        else:
            self._enter(req, "waiting", self._waiting)

    def _validate(self, msg: Submit) -> str | None:
        info = self.engine.info
        p = msg.params
        if not msg.input_ids:
            return "the prompt is empty"
        if p.max_new_tokens < 1:
            return "max_new_tokens must be at least 1"
        total = len(msg.input_ids) + p.max_new_tokens
        if total > info.max_context:
            return (
                f"prompt ({len(msg.input_ids)} tokens) + max_new_tokens ({p.max_new_tokens}) exceeds "
                f"the context length {info.max_context}"
            )
        # (a prefill keeps the prompt's KV only; a decoding request never writes its last output's)
        held = len(msg.input_ids) if self.role == "prefill" else decode_tokens(len(msg.input_ids), p.max_new_tokens)
        if self.pool.pages_for(held) > self.pool.num_pages:
            return f"request needs {self.pool.pages_for(held)} KV pages; the pool has {self.pool.num_pages}"
        if min(msg.input_ids) < 0 or max(msg.input_ids) >= info.vocab_size:  # (one C pass each, not a genexpr)
            bad = next(t for t in msg.input_ids if not 0 <= t < info.vocab_size)
            return f"input_ids: token ids must be in [0, {info.vocab_size}), got {bad}"
        if self.role != "both" and msg.bootstrap is None:
            return f"a {self.role} worker needs bootstrap_host/bootstrap_room"
        if not math.isfinite(msg.timeout_s) or msg.timeout_s <= 0:
            return "timeout_s must be a positive number"
        if not 0 <= p.output_offset <= len(msg.input_ids):  # (the penalties count from it: one outside fails the batch)
            return f"output_offset must be in [0, {len(msg.input_ids)}] (the prompt's length), got {p.output_offset}"
        if not (math.isfinite(msg.gather_s) and msg.gather_s >= 0):  # (NaN, below 0: read as 0; inf: held to the end)
            return f"gather_s must be a number of seconds >= 0, got {msg.gather_s}"
        return _oversized(p) or check_sampling(p, self.engine)

    def _enter(self, req: Req, stage: str, queue_: list[Req] | StageQueue) -> None:
        req.move(stage)
        queue_.append(req)
        self._load_moved = True

    # -- PD stages -----------------------------------------------------------------------------
    def _advance(self, queue_: StageQueue, on_ready: Callable[[Req], None]) -> None:
        if not queue_:  # (most steps of a decode: every request is past its PD stages)
            return
        moved = queue_.advance()
        for req, reason in moved.failed:
            if REFUSAL_MARK in reason:  # the peer refused the request: its 400 is this side's answer too
                self._fail(req, "bad_request", reason, Fault.NONE)
            elif OVERLOAD_MARK in reason:  # the peer turned it away, full: so is its answer here
                self._fail(req, "overloaded", reason, Fault.NONE)
            else:
                self._fail(req, "transfer_failed", reason, failure_fault(req.kv_receiver or req.kv_sender))
        for req, reason in moved.broken:
            self._fail(req, "internal", reason)
        for req in moved.ready:
            try:
                on_ready(req)
            except Exception as exc:  # one request's failure must not stop the loop
                log.exception("request %s failed entering its next stage", req.key)
                self._fail(req, "internal", f"{type(exc).__name__}: {exc}")

    def _to_waiting(self, req: Req) -> None:
        self._enter(req, "waiting", self._waiting)

    def _to_transfer(self, req: Req) -> None:
        self._enter(req, "transfer", self.transfer_queue)

    def _transferred(self, req: Req) -> None:
        """Prefill: the decode holds the whole KV; this side is done."""
        self._record_room(req)
        self._emit(req, [], "transferred")
        self._release(req)

    def _import(self, req: Req) -> None:
        """Decode, prebuilt extend: the prompt's KV and first token arrived; join the decode batch."""
        assert req.aux_slot is not None
        # Its KV landed (the room completed): counted now, whatever becomes of the request (one that ends waiting
        # for a batch slot, or whose aux record is refused, moved its bytes all the same; the prefill counted them)
        self.metrics.on_room(req, self.pool)
        try:
            record = decode_aux(self.pool.aux[req.aux_slot].data)
        except ValueError as exc:
            self._fail(req, "transfer_failed", f"room {req.room}: {exc}")
            return
        # Read: the slot goes back now (after Success nothing more lands in it); held to the request's end,
        # the pool's slots capped how many requests decode at once, whatever its free pages.
        self.pool.free_aux(req.aux_slot)
        req.aux_slot = None
        if record.prompt is not None and record.prompt != prompt_digest(req.input_ids):
            self._fail(req, "transfer_failed", f"room {req.room} brought the KV of another prompt than this request's "
                       "(one room given to two requests)", Fault.NONE)
            return
        vocab = self.engine.info.vocab_size
        if not 0 <= record.first_token < vocab:  # (a prefill serving another model: this request only)
            self._fail(req, "transfer_failed", f"room {req.room}: the prefill's first token {record.first_token} "
                       f"is outside this decode's vocabulary [0, {vocab})", Fault.PEER)
            return
        req.num_computed = len(req.input_ids)
        req.cached_tokens = record.cached_tokens
        if self.kv_checker is not None:
            req.kv_verified = self.kv_checker.verify(req.pages, req.input_ids)
            if req.kv_verified is False:
                log.warning("room %s (request %s): the imported KV is not its prompt's (pages %s)", req.room,
                            req.request_id or req.rid, req.pages)
        first = SeqOutput(record.first_token, record.logprob, record.top_logprobs)
        full = self._imported or len(live(self._running, "running")) >= self.config.max_running
        if full and not self._ends_at_first(req, record.first_token):
            # Behind those already waiting (FCFS). Its first token goes out when it joins the batch: sent
            # now, its stream would then wait for a slot in silence (a gateway's idle timeout between tokens
            # takes that for a frozen decode); the wait for a first token is the one a client expects.
            req.first_output = first
            self._enter(req, "imported", self._imported)
            return
        self._start_decoding(req, first)

    def _ends_at_first(self, req: Req, token: int) -> bool:
        """Whether ``token``, the first, ends the request (it then needs no batch slot: answered at once).
        (A stop string the first token alone completes is not looked for here: such a request waits.)"""
        p = req.params
        return (p.max_new_tokens <= 1 or token in p.stop_token_ids
                or (not p.ignore_eos and token in self.engine.info.eos_token_ids))

    def _start_decoding(self, req: Req, first: SeqOutput) -> None:
        """An imported request's first token goes out; it joins the batch unless that token ended it."""
        self._record_room(req, first.token_id)  # first: the token may finish the request (pages freed)
        self._accept_token(req, first)
        if not req.done:
            self._enter(req, "running", self._running)

    def _admit_imported(self) -> None:
        """Decode: imported requests join the batch as far as ``max_running`` allows, oldest first."""
        waiting = live(self._imported)
        room = self.config.max_running - len(self._running)
        while waiting and room > 0:
            req = waiting.pop(0)
            first, req.first_output = req.first_output, None
            assert first is not None
            try:
                self._start_decoding(req, first)
            except Exception as exc:  # one request's failure must not stop the loop (as in ``_advance``)
                log.exception("request %s failed joining the batch", req.key)
                self._fail(req, "internal", f"{type(exc).__name__}: {exc}")
            if not req.done:
                room -= 1
        self._imported = waiting

    def _prune_batch(self) -> None:
        """Drop from the batch lists what ended or moved on since the last step (finished, failed,
        aborted; a prefill's request now in flight; a combined worker's prefilled request, now decoding):
        they must not take batch room from waiting requests."""
        self._running = live(self._running, "running")
        self._prefilling = live(self._prefilling, "prefill")

    def num_in_batch(self) -> int:
        """Live requests in the batch (decoding + prefilling), for load reports and metrics (any thread)."""
        return len(live(self._running, "running")) + len(live(self._prefilling, "prefill"))

    def _admit_waiting(self) -> None:
        self._prune_batch()
        keep = []
        blocked = len(self._running) + len(self._prefilling) >= self.config.max_running
        for req in self._waiting:
            if req.done or self._decode_ended(req):  # (not at the head of the line: it ends now, not there)
                continue
            if not blocked and self._prefilling and self._awaits_prefix(req):
                keep.append(req)  # (not FCFS-blocking: the requests behind it may go first)
                continue
            if blocked or not self._take_pages(req):
                blocked = True  # FCFS: later requests wait behind this one
                keep.append(req)
                continue
            self._enter(req, "prefill", self._prefilling)
            blocked = len(self._running) + len(self._prefilling) >= self.config.max_running
        self._waiting = keep

    def _decode_ended(self, req: Req) -> bool:
        """A prefill's request whose KV transfer failed (its decode ended the room: aborted, timed out,
        gone): failed here now, and True."""
        if self.role != "prefill":
            return False
        try:
            failed = req.kv_sender.poll() == KVPoll.Failed
        except Exception as exc:  # (a transfer backend's bug: this request fails, not the loop)
            log.exception("request %s: polling its KV sender failed", req.key)
            self._fail(req, "internal", f"KV sender poll failed: {type(exc).__name__}: {exc}")
            return True
        if not failed:
            return False
        self._fail(req, "transfer_failed", failure_reason(req.kv_sender, "KV transfer failed"),
                   failure_fault(req.kv_sender))
        return True

    def _shareable(self, req: Req) -> int:
        """How many leading prompt tokens ``req`` may take from cached pages (at most all but its last): only
        positions it computes itself have prompt logprobs, so one that wants them shares no page past
        ``prompt_logprobs_start`` (the first wanted position may be cached: the engine re-runs the one before
        it). A preempted request's recompute has its logprobs already."""
        if not self.cache.enabled:
            return 0
        params = req.params
        if params.prompt_logprobs and not req.is_recompute:
            return min(req.prefill_len - 1, params.prompt_logprobs_start)
        return req.prefill_len - 1

    def _hashes(self, req: Req) -> list[bytes]:
        """``req``'s page hashes (computed once per prefill: a preemption resets them)."""
        hashes = req.page_hashes
        if hashes is None:
            hashes = req.page_hashes = page_hashes(req.all_ids[: req.prefill_len], self.pool.page_size)
        return hashes

    def _awaits_prefix(self, req: Req) -> bool:
        """In-flight prefix sharing: whether the first page ``req`` would compute (past what the cache
        holds) is one that a request being prefilled here will compute and publish. Then ``req``
        waits for it instead of computing the same KV alongside (a burst of one system prompt, which a
        prefix-aware router sends to one worker); it goes once the page is cached or that request is
        gone, and then computes only what it does not share."""
        limit = self._shareable(req) // self.pool.page_size  # (``match`` leaves at least one token to compute)
        if not (self.config.wait_for_prefix and limit):
            return False
        page_size = self.pool.page_size
        hashes = self._hashes(req)
        first = self.cache.num_cached_pages(hashes, limit)
        if first >= limit:
            return False
        wanted = hashes[first]
        for other in self._prefilling:
            theirs = other.page_hashes
            if (theirs is not None and len(theirs) > first and theirs[first] == wanted and not other.done
                    and other.num_computed < (first + 1) * page_size):
                if not req.awaited_prefix:
                    req.awaited_prefix = True
                    self.num_prefix_waits += 1
                return True
        return False

    def _expected_cached(self, req: Req) -> int:
        """At admission: the prompt tokens ``req`` is not expected to compute (for load reports), its
        leading pages cached now or to be computed by a request admitted before it; then indexes its
        own leading pages for the requests after it."""
        cache = self.cache
        if not cache.enabled:
            return 0
        page_size = self.pool.page_size
        hashes = self._hashes(req)[:QUEUED_PAGES_INDEXED]
        queued = self._queued_pages
        n = 0
        for h in hashes[: self._shareable(req) // page_size]:
            if h not in queued and not cache.holds(h):
                break
            n += 1
        for h in hashes:
            queued[h] = queued.get(h, 0) + 1
        req.num_indexed_pages = len(hashes)
        return n * page_size

    def _unqueue_pages(self, req: Req) -> None:
        """``req``'s prefill ended (or it did): its pages are cached or will not be."""
        n, req.num_indexed_pages = req.num_indexed_pages, 0
        if n and req.page_hashes is not None:
            queued = self._queued_pages
            for h in req.page_hashes[:n]:
                left = queued[h] - 1
                if left:
                    queued[h] = left
                else:
                    del queued[h]

    def _take_pages(self, req: Req) -> bool:
        """Pages for the positions to prefill: cached prefix pages first, fresh pages for the rest."""
        shareable = self._shareable(req)
        shared = self.cache.match(req.all_ids[: shareable + 1], self._hashes(req)) if shareable else []
        fresh = self.cache.alloc(self.pool.pages_for(req.prefill_len) - len(shared))
        if fresh is None:
            self.cache.release(shared)
            return False
        self.cache.count_hit(shared)
        req.pages = shared + fresh
        req.num_computed = len(shared) * self.pool.page_size
        if not (req.is_recompute or req.requeued):  # (counted, and its cache hits told, at its first admission)
            req.cached_tokens = req.num_computed
            self.num_prompt_tokens += len(req.input_ids)
            self.num_cached_prompt_tokens += req.cached_tokens
        return True

    def _grow_for_decode(self) -> None:
        """Combined role: every running sequence needs a page for the position it writes next.

        When the pool is out of pages, the youngest request holding pages gives them back, whether it
        is decoding or still being prefilled, and is re-queued first in line: a decoding one recomputes
        prompt + outputs, a prefilling one starts its prefill again (either may find its KV in the
        prefix cache). The oldest request therefore always progresses; a victim chosen among decoding
        sequences only used to let a sequence next to a long prefill preempt itself, take its pages
        back at the next admission, and the two swap places for ever.
        """
        page_size = self.pool.page_size
        for req in list(self._running):
            while (not req.done and req.stage == "running"
                   and len(req.pages) * page_size < len(req.input_ids) + len(req.output_ids)):
                page = self.cache.alloc(1)
                if page is not None:
                    req.pages += page
                    continue
                victim = max((r for r in (*self._running, *self._prefilling)
                              if not r.done and r.stage in ("running", "prefill")), key=lambda r: r.seq_id)
                self._give_way(victim)

    def _give_way(self, req: Req) -> None:
        """``req`` gives its pages back (what it computed stays cached) and waits first in line: to
        recompute prompt + outputs when it was decoding, to prefill again when it was mid-prefill."""
        self.num_preemptions += 1
        # A decoding request holds the KV of every position but its newest token's (``num_computed`` stops at
        # the end of its prefill): its output pages are cached too, so that its recompute shares them
        computed = len(req.all_ids) - 1 if req.stage == "running" else req.num_computed
        self.cache.insert(req.all_ids, req.pages, computed, req.page_hashes)  # (hashes None once decoding)
        self.cache.release(req.pages)
        self._unqueue_pages(req)
        if req.stage == "running":
            req.is_recompute, req.prefill_len, req.page_hashes = True, len(req.all_ids) - 1, None
        else:
            req.requeued = True
            if not req.is_recompute:  # (computed again, as it shares no pages; a recompute's came with its first)
                req.prompt_logprobs, req.prompt_top_logprobs = [], []
        req.pages, req.num_computed = [], 0
        req.move("waiting")
        self._waiting.insert(0, req)

    # -- batches -----------------------------------------------------------------------------
    def _run_batch(self) -> bool:
        if self.role == "both":
            self._grow_for_decode()
        self._prune_batch()
        reqs: list[Req] = []
        batch: list[SeqInput] = []
        for req in self._running:
            n = len(req.input_ids) + len(req.output_ids)
            batch.append(SeqInput(req.seq_id, req.pages, n - 1, [req.output_ids[-1]], True, req.params,
                                  len(req.output_ids),
                                  req.all_ids if needs_history(req.params) or self._grammar_catch_up(req) else None))
            reqs.append(req)
        budget = self.config.chunk_size
        for req in self._prefilling:
            if budget <= 0:
                break
            if req.done:
                continue
            start = req.num_computed
            take = min(budget, req.prefill_len - start)
            budget -= take
            last = start + take == req.prefill_len
            all_ids = req.all_ids
            batch.append(SeqInput(req.seq_id, req.pages, start, all_ids[start : start + take],
                                  last and not req.is_recompute, req.params, len(req.output_ids), all_ids))
            reqs.append(req)
        if not batch:
            return False
        num_prefill_tokens = sum(len(seq.token_ids) for seq, req in zip(batch, reqs, strict=True)
                                 if req.stage != "running")
        started = time.perf_counter()
        try:
            outputs = self.engine.forward(batch)
        except Exception as exc:  # a bad batch fails its requests, not the worker
            log.exception("engine step failed")
            for req in reqs:
                self._fail(req, "internal", f"engine step failed: {type(exc).__name__}: {exc}")
            return True
        if len(outputs) != len(batch):  # (an engine plugin's bug: which output is whose cannot be told)
            log.error("engine step returned %d outputs for %d sequences", len(outputs), len(batch))
            for req in reqs:
                self._fail(req, "internal", f"engine step returned {len(outputs)} outputs for {len(batch)} sequences")
            return True
        self.num_steps += 1
        self._last_forward_s = elapsed_s = time.perf_counter() - started
        self.metrics.on_step(len(batch), elapsed_s)
        self._busy_s += elapsed_s
        if num_prefill_tokens:
            self._measure_prefill(num_prefill_tokens, elapsed_s)
        for req, seq, out in zip(reqs, batch, outputs, strict=True):
            if req.done:
                continue
            if seq.sample and out.token_id is None:  # (the engine could not sample this one row)
                if out.error is not None:  # the request's own doing (its grammar)
                    grammar = req.params.grammar
                    self._fail(req, "bad_request", out.error, param=grammar.param if grammar is not None else None)
                else:
                    self._fail(req, "internal", "the engine could not sample a token (its scores are not finite)")
                continue
            try:
                if req.stage == "running":
                    self._accept_token(req, out)
                else:
                    self._after_chunk(req, seq, out)
            except Exception as exc:  # one request's failure must not stop the loop
                log.exception("request %s failed after a forward step", req.key)
                self._fail(req, "internal", f"{type(exc).__name__}: {exc}")
        return True

    @staticmethod
    def _grammar_catch_up(req: Req) -> bool:
        """A migrated constrained stream's first decode step: its matcher needs the outputs ending its prompt."""
        return req.params.grammar is not None and req.params.output_offset > 0 and len(req.output_ids) == 1

    def _after_chunk(self, req: Req, seq: SeqInput, out: SeqOutput) -> None:
        if out.prompt_logprobs:  # (from the first wanted position on: an engine's chunk covers all of its own)
            skip = max(0, req.params.prompt_logprobs_start - req.num_computed)
            req.prompt_logprobs.extend(out.prompt_logprobs[skip:])
            if out.prompt_top_logprobs is not None:
                req.prompt_top_logprobs.extend(out.prompt_top_logprobs[skip:])
        req.num_computed += len(seq.token_ids)
        self.cache.insert(req.all_ids, req.pages, req.num_computed, req.page_hashes)
        finished_prompt = req.num_computed == req.prefill_len
        if finished_prompt:
            self._unqueue_pages(req)
            req.page_hashes = None  # (not needed past the prefill; a preemption computes its own)
        if self.role == "prefill":
            self._send_chunk(req, out, finished_prompt)
        elif finished_prompt:
            if not req.is_recompute:
                self._accept_token(req, out)
            if not req.done:
                req.move("running")
                self._running.append(req)

    def _send_chunk(self, req: Req, out: SeqOutput, finished_prompt: bool) -> None:
        """Hand the pages this chunk completed to the KV sender; the last chunk carries the aux record."""
        full_pages = len(req.pages) if finished_prompt else req.num_computed // self.pool.page_size
        chunk = req.pages[req.num_sent_pages : full_pages]
        aux = None
        if finished_prompt:
            assert out.token_id is not None
            req.output_ids.append(out.token_id)
            record = AuxRecord(out.token_id, out.logprob, out.top_logprobs, req.cached_tokens,
                               prompt_digest(req.input_ids))
            aux = encode_aux(record, self.pool.aux_slot_bytes)
        if chunk or finished_prompt:
            try:
                req.kv_sender.send(chunk, last=finished_prompt, aux=aux)
            except (ValueError, RuntimeError) as exc:
                self._fail(req, "transfer_failed", str(exc))
                return
            req.num_sent_pages += len(chunk)
        if finished_prompt:
            self._enter(req, "inflight", self.inflight_queue)

    def _accept_token(self, req: Req, out: SeqOutput) -> None:
        assert out.token_id is not None
        token = out.token_id
        req.output_ids.append(token)
        p = req.params
        finish = None
        if ((p.stop and self._stop_string(req, token)) or token in p.stop_token_ids
                or (not p.ignore_eos and token in self.engine.info.eos_token_ids)):
            finish = "stop"
        elif len(req.output_ids) >= p.max_new_tokens:
            finish = "length"
        self._emit(req, [token], finish, out)
        if finish is not None:
            if self.role == "both":  # its answer's KV stays cached too: a chat's next turn resends it
                self.cache.insert(req.all_ids, req.pages, len(req.all_ids) - 1)  # (the newest token's is unwritten)
            self._release(req)

    def _stop_string(self, req: Req, token: int) -> bool:
        """Whether ``token`` completes one of the request's stop strings (False without a tokenizer)."""
        watch = req.stop_watch
        if watch is None:
            if self.stop_tokenizer is None:
                return False
            p = req.params
            stops, before = p.stop, min(p.output_offset, len(req.input_ids))
            start = len(req.input_ids) - (min(before, history_tokens(stops)) if before else 0)
            # (the history's first token is output number output_offset - len(history); min_new_tokens counts all)
            exempt = p.min_new_tokens - (p.output_offset - (len(req.input_ids) - start))
            watch = req.stop_watch = StopWatch(self.stop_tokenizer, stops, req.input_ids[start:],
                                               req.input_ids[max(0, start - DECODE_CONTEXT_TOKENS):start], exempt)
        return watch.push(token)

    # -- outputs and release -----------------------------------------------------------------
    def _emit(self, req: Req, tokens: list[int], finish: str | None, out: SeqOutput | None = None) -> None:
        item = StepOutput(req.rid, tokens, finish, prompt_tokens=len(req.input_ids), cached_tokens=req.cached_tokens)
        if out is not None and req.params.logprobs and out.logprob is not None:
            item.logprobs = [out.logprob]
            if req.params.top_logprobs and out.top_logprobs is not None:
                item.top_logprobs = [out.top_logprobs]
        if req.params.prompt_logprobs and req.prompt_logprobs and not req.prompt_logprobs_sent:
            # With the first output (a stream's first chunk shows the echoed prompt's logprobs; a
            # prefill's only output is its hand-over)
            req.prompt_logprobs_sent = True
            item.prompt_logprobs = req.prompt_logprobs
            if req.params.top_logprobs and len(req.prompt_top_logprobs) == len(req.prompt_logprobs):
                item.prompt_top_logprobs = req.prompt_top_logprobs
        if finish is not None:
            self.metrics.on_finish(finish)
            item.kv_verified = req.kv_verified
            if self.role == "prefill" and req.output_ids:
                item.token_ids = [req.output_ids[0]]
        if req.gather_s:
            due = self._gathered(req, item)
            if due is None:
                return
            item = due
        self._out.append((req.key[0], Outputs([item])))

    @staticmethod
    def _gathered(req: Req, item: StepOutput) -> StepOutput | None:
        """A whole response's output (``Submit.gather_s``): held (None) unless it is the first, the
        last, or ``gather_s`` has passed since the first one held; what was held goes out in front
        of it, as one output."""
        held = req.held
        if held is not None:
            item = joined(held, item)
            req.held = None
        if item.finish_reason is None and len(req.output_ids) > 1:
            now = time.monotonic()
            if held is None:
                req.held_since = now
            if now - req.held_since < req.gather_s:
                req.held = item
                return None
        return item

    def _fail(self, req: Req, code: str, message: str, fault: Fault = Fault.OWN, param: str | None = None) -> None:
        if req.done:
            return
        log.log(logging.INFO if code == "aborted" else logging.WARNING, "request %s (room %s, %s) failed: %s: %s",
                req.request_id or req.rid, req.room, req.stage, code, message)
        self._out.append((req.key[0], Error(req.rid, code, message, fault, param)))
        self._release(req, REFUSAL_MARK + message if code == "bad_request" else message)

    def _release(self, req: Req, abort_reason: str | None = None) -> None:
        if req.done:
            return
        req.done = True
        self._load_dirty = True
        self.reqs.pop(req.key, None)
        # (sim engine: an imported room's prompt KV still its own, not overwritten by a late write of another room?)
        if (req.kv_verified and req.pages and self.kv_checker is not None
                and not self.kv_checker.verify(req.pages, req.input_ids)):
            log.warning("room %s (request %s): its prompt's KV changed while it decoded (pages %s)", req.room,
                        req.request_id or req.rid, req.pages)
        # Each clean-up call on its own: one that raises (an engine's or a transfer backend's bug) must
        # neither keep the request's pages for good nor take the scheduler's loop down.
        _cleanly(req, "unqueuing its pages", self._unqueue_pages, req)
        if self.seq_state is not None:
            _cleanly(req, "forgetting its engine state", self.seq_state.forget, req.seq_id)
        for handle in (req.kv_sender, req.kv_receiver):
            if handle is not None and abort_reason is not None:
                _cleanly(req, "aborting its KV transfer", _abort_unsettled, handle, abort_reason)
        if req.kv_sender is not None:
            _cleanly(req, "releasing its KV sender", req.kv_sender.release)
        rx = req.kv_receiver
        if rx is not None and not is_quiesced(rx):
            # A write the prefill already posted may still land in these pages: hold them (and keep
            # the receiver, which learns when none is left) until then.
            self.quarantine.append(req)
            return
        self._free(req)

    def _free(self, req: Req) -> None:
        if req.kv_receiver is not None:
            _cleanly(req, "releasing its KV receiver", req.kv_receiver.release)
        if req.pages:
            self.cache.release(req.pages)
            req.pages = []
        if req.aux_slot is not None:
            self.pool.free_aux(req.aux_slot)
            req.aux_slot = None

    def _record_room(self, req: Req, first_token: int | None = None) -> None:
        if self.role == "prefill":  # (a decode's room is counted as it lands: ``_import``)
            self.metrics.on_room(req, self.pool)
        checker = self.kv_checker
        self.rooms.append({
            "room": req.room,
            "role": self.role,
            "prompt_tokens": len(req.input_ids),
            "kv_digest": checker.digest(req.pages, len(req.input_ids)) if checker is not None else None,
            "kv_verified": req.kv_verified,
            "first_token": first_token if first_token is not None else req.output_ids[0] if req.output_ids else None,
        })

    def _flush(self) -> None:
        """Hand the step's messages to the sink: one ``Outputs`` per connection, then the rest in order."""
        if not self._out:
            return
        out, self._out = self._out, []
        merged: dict[int, Outputs] = {}
        batch: list[tuple[int, Message]] = []
        for conn_id, msg in out:
            if isinstance(msg, Error):
                self.metrics.on_error(msg.code)
            if isinstance(msg, Outputs):
                if conn_id in merged:
                    merged[conn_id].items.extend(msg.items)
                    continue
                merged[conn_id] = msg
            batch.append((conn_id, msg))
        self._sink(batch)

    # -- load reports and cache events ---------------------------------------------------------
    def _measure_prefill(self, num_tokens: int, elapsed_s: float) -> None:
        if elapsed_s <= 0:
            return
        rate = num_tokens / elapsed_s
        old = self.prefill_tokens_per_s
        self.prefill_tokens_per_s = rate if old == 0 else old + THROUGHPUT_EWMA * (rate - old)

    def _publish_cache_events(self) -> None:
        if not self.cache.enabled:
            return
        stored, removed = self.cache.take_events()
        if stored or removed:
            self._out.append((BROADCAST, KVEvents(stored=stored, removed=removed)))

    def _report_every(self) -> float:
        """How long after the last load report the next is due: the shortest interval that applies (a request
        ended or pages freed, an admission or a stage move, the heartbeat: in that order, each at most the next)."""
        if self._load_dirty:
            return REPORT_MIN_INTERVAL_S
        if self._load_moved:
            return MOVED_REPORT_S
        return BUSY_REPORT_S if self.reqs else IDLE_REPORT_S

    def _maybe_report_load(self, now: float) -> None:
        since = now - self._last_load
        if since < self._report_every():
            return
        self._last_load, self._load_dirty, self._load_moved = now, False, False
        weight = min(1.0, since / BUSY_WINDOW_S)
        self.busy_fraction += weight * (min(1.0, self._busy_s / since) - self.busy_fraction) if since > 0 else 0.0
        self._busy_s = 0.0
        if not self._conns:  # (the busy fraction goes on averaging: /metrics and /load read it with no gateway)
            return
        report = self.load_report()
        reports: list[tuple[int, Message]] = [(conn_id, msgspec.structs.replace(report, last_rid=last_rid))
                                              for conn_id, last_rid in self._conns.items()]
        self._last_reports = reports
        self._out += reports

    def reports_to_repeat(self, now: float) -> list[tuple[int, Message]]:
        """Called from another thread (the native server's event loop): while the scheduler holds requests and its
        newest reports are older than ``REPEAT_REPORT_AFTER_S`` (it is in a long step), those same reports, to send
        again (the figures as they were, each with the ``last_rid`` it covered: exact for the gateway, only
        fresh); else none. The next report the loop makes replaces them."""
        if not self.reqs or now - self._last_load < REPEAT_REPORT_AFTER_S or not self.is_alive:
            return []
        return list(self._last_reports)

    def _compiling(self) -> list[Req]:
        """Admitted requests whose grammar is still compiling (``last_rid`` covers them: reports count them)."""
        return live(self.grammar_wait) if self.grammar_wait is not None else []

    def _num_prefill_tokens(self) -> int:
        queued = self.bootstrap_queue.num_prompt_tokens()
        queued += sum(len(r.input_ids) - r.num_cached_estimate for r in (*self._waiting, *self._compiling())
                      if not r.done)
        running = sum(r.prefill_len - r.num_computed for r in self._prefilling if not r.done)
        return queued + running

    def stats(self) -> dict[str, Any]:
        """Counters since start (read from another thread: plain ints, no consistency promised)."""
        return {
            "num_prompt_tokens": self.num_prompt_tokens,
            "num_cached_prompt_tokens": self.num_cached_prompt_tokens,
            "num_cached_pages": self.cache.num_cached,
            "num_evictions": self.cache.num_evictions,
            "num_preemptions": self.num_preemptions,
            "num_prefix_waits": self.num_prefix_waits,
            "num_steps": self.num_steps,
            "prefill_tokens_per_s": self.prefill_tokens_per_s,
            "busy_fraction": self.busy_fraction,
        }

    def load_report(self) -> LoadReport:
        compiling = self._compiling()
        queued_pages = self.prealloc_queue.num_queued_pages()
        if self.role == "decode":  # (a decode's compiling requests preallocate next)
            queued_pages += sum(self.pool.pages_for(decode_tokens(len(r.input_ids), r.params.max_new_tokens))
                                for r in compiling)
        return LoadReport(
            num_running=self.num_in_batch(),
            num_waiting=(len(live(self._waiting)) + self.bootstrap_queue.num_live + self.prealloc_queue.num_live
                         + len(compiling) + len(live(self._imported))),
            num_free_pages=self.cache.num_available,
            num_total_pages=self.pool.num_pages,
            num_inflight_transfers=(self.inflight_queue.num_live + self.transfer_queue.num_live
                                    + len(self.quarantine)),
            num_prefill_tokens=self._num_prefill_tokens() if self.role != "decode" else 0,
            prefill_tokens_per_s=round(self.prefill_tokens_per_s, 1),
            busy_fraction=round(self.busy_fraction, 4),
            max_running=self.config.max_running,
            num_transfer_seqs=self.transfer_queue.num_live,
            num_queued_pages=queued_pages,
        )


# The fields ``_oversized`` bounds (before ``check_sampling`` reads them), named in the refusal's ``Error.param``
# ("stop_token_ids" before "stop": the first whose name starts the message)
_BOUNDED = ("stop_token_ids", "stop", "logit_bias", "top_logprobs")


def _oversized(p: SamplingParams) -> str | None:
    """Why ``p`` asks more than the gateway lets a client ask (``gateway.api_models``), or None. A worker
    bounds them too: a peer that did not (a buggy or hostile gateway, any native client) made one
    request's every token scan megabytes of ``stop_token_ids`` or stop strings inside the step, and every
    other sequence of the batch wait for it; ``top_logprobs`` asked for the whole vocabulary per token."""
    if len(p.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        return f"stop_token_ids: at most {MAX_STOP_TOKEN_IDS} token ids are allowed, got {len(p.stop_token_ids)}"
    if len(p.stop) > MAX_STOP_STRINGS:
        return f"stop: at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(p.stop)}"
    longest = max(map(len, p.stop), default=0)
    if longest > MAX_STOP_CHARS:
        return f"stop: a stop string has {longest} characters; at most {MAX_STOP_CHARS} are allowed"
    total = sum(map(len, p.stop))
    if total > MAX_STOP_TOTAL_CHARS:
        return f"stop: the stop strings have {total} characters in all; at most {MAX_STOP_TOTAL_CHARS} are allowed"
    if len(p.logit_bias) > MAX_LOGIT_BIAS:
        return f"logit_bias: at most {MAX_LOGIT_BIAS} entries are allowed, got {len(p.logit_bias)}"
    if not 0 <= p.top_logprobs <= MAX_TOP_LOGPROBS:
        return f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {p.top_logprobs}"
    return None


def _cleanly(req: Req, what: str, fn: Callable[..., object], *args: Any) -> None:
    """``fn(*args)``, part of ending ``req``: an exception is logged, not raised (the rest of the clean-up goes on)."""
    try:
        fn(*args)
    except Exception:
        log.exception("request %s: %s failed", req.key, what)


def _abort_unsettled(handle: Any, reason: str) -> None:
    if handle.poll() not in (KVPoll.Success, KVPoll.Failed):
        handle.abort(reason)
