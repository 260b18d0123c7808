"""The scheduler's disaggregation queues: each owns its list of requests and an ``advance()``.

Lifecycle (all on the scheduler thread, once per step):
1. The scheduler ``append``s a request when it enters the stage (``Scheduler._enter``).
2. ``advance()`` polls each request's KV handle and returns a ``Moved``: the requests ready for the
   next stage and the ones that failed, each with a reason. Requests that ended elsewhere
   (``req.done``) are dropped; the rest stay, in order. A queue never calls back into the scheduler:
   the scheduler acts on what moved (fail it, enter the next stage).
3. Readers on other threads (``/metrics``, load reports) use ``num_live`` and iterate a snapshot.

Prefill role: ``PrefillBootstrapQueue`` (the decode's page list arrives) -> waiting -> chunked
prefill -> ``PrefillInflightQueue`` (KV written; pages freed only when the transfer completed).
Decode role: ``DecodePreallocQueue`` (connected to the prefill; reserve pages for the
``prompt + max_new_tokens - 1`` positions it writes (``decode_tokens``), page-aligned, and an aux slot; send
their ids) -> ``DecodeTransferQueue`` (until the KV and the first token arrived) -> prebuilt extend -> running.
A decode request that ended while a write could still land waits in ``DecodeQuarantine`` until its receiver is quiesced.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from transfer.errors import PeerReport, TransferErrorKind
from transfer.types import KVPoll
from workers.protocol import Fault
from workers.request import Req

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from workers.kv_pool import KVPool
    from workers.page_cache import PageCache


@dataclass
class Moved:
    """What one ``advance()`` moved on: ``ready`` for the next stage, ``failed`` (its transfer) with a reason
    each, ``broken``: a call on its KV handle raised (a transfer backend's bug: that request fails, not the
    scheduler's loop)."""

    ready: list[Req] = field(default_factory=list)
    failed: list[tuple[Req, str]] = field(default_factory=list)
    broken: list[tuple[Req, str]] = field(default_factory=list)


def decode_tokens(num_prompt: int, max_new_tokens: int) -> int:
    """The positions whose KV a decoding request writes, at most: its prompt's and every output's but the last
    (the last sampled token ends the request: it is never fed back, its KV never written)."""
    return num_prompt + max_new_tokens - 1


class StageQueue:
    """The requests in one PD stage, in arrival order."""

    stage = ""

    def __init__(self) -> None:
        self._reqs: list[Req] = []

    def append(self, req: Req) -> None:
        self._reqs.append(req)

    def __iter__(self) -> Iterator[Req]:
        return iter(list(self._reqs))  # a snapshot: safe while the scheduler thread replaces the list

    def __len__(self) -> int:
        return len(self._reqs)

    @property
    def num_live(self) -> int:
        """Requests not yet ended (ended ones leave at the next ``advance``)."""
        return sum(1 for r in list(self._reqs) if not r.done)

    def advance(self) -> Moved:
        """Poll every live request once; see the module docstring."""
        moved = Moved()
        keep = []
        for req in self._reqs:
            if req.done:
                continue
            try:
                handle = self._handle(req)
                state = handle.poll()
                if state == KVPoll.Failed:
                    moved.failed.append((req, failure_reason(handle, self._failure_default)))
                elif self._is_ready(req, state, moved):
                    moved.ready.append(req)
                else:
                    keep.append(req)
            except Exception as exc:
                log.exception("request %s: its KV handle failed in stage %s", req.key, self.stage)
                moved.broken.append((req, f"KV transfer ({self.stage}): {type(exc).__name__}: {exc}"))
        self._reqs = keep
        return moved

    _failure_default = "KV transfer failed"
    _side = "kv_sender"  # the request's KV handle this stage polls

    def _handle(self, req: Req) -> Any:
        return getattr(req, self._side)

    def _is_ready(self, req: Req, state: KVPoll, moved: Moved) -> bool:
        """Whether ``req`` (not failed) moves on; may instead append it to ``moved.failed``. Here: its
        transfer succeeded."""
        return state == KVPoll.Success


class PrefillBootstrapQueue(StageQueue):
    """Prefill: waits until the decode sent its page list (the sender is WaitingForInput)."""

    stage = "bootstrap"
    _failure_default = "bootstrap failed"

    def __init__(self, pool: KVPool) -> None:
        super().__init__()
        self._pool = pool

    def _is_ready(self, req: Req, state: KVPoll, moved: Moved) -> bool:
        if state < KVPoll.WaitingForInput:
            return False
        reserved = req.kv_sender.num_dst_pages
        needed = self._pool.pages_for(len(req.input_ids))
        if reserved is not None and reserved < needed:
            moved.failed.append((req, f"decode reserved {reserved} pages, prompt needs {needed}"))
            return False
        return True

    def num_prompt_tokens(self) -> int:
        """Uncached prompt tokens waiting here (load reports)."""
        return sum(len(r.input_ids) - r.num_cached_estimate for r in self if not r.done)


class PrefillInflightQueue(StageQueue):
    """Prefill: the whole prompt's KV is posted; ready once the transfer succeeded."""

    stage = "inflight"


class DecodePreallocQueue(StageQueue):
    """Decode: once connected to the prefill, reserve pages and an aux slot and send their ids.

    First come, first served: when the pool cannot hold a request, later ones wait behind it.
    """

    stage = "prealloc"
    _failure_default = "bootstrap failed"
    _side = "kv_receiver"

    def __init__(self, pool: KVPool, cache: PageCache) -> None:
        super().__init__()
        self._pool = pool
        self._cache = cache
        self._blocked = False

    def advance(self) -> Moved:
        self._blocked = False
        return super().advance()

    def _is_ready(self, req: Req, state: KVPoll, moved: Moved) -> bool:
        if state < KVPoll.WaitingForInput or self._blocked:
            return False
        pool = self._pool
        pages = self._cache.alloc(pool.pages_for(decode_tokens(len(req.input_ids), req.params.max_new_tokens)))
        slot = pool.alloc_aux() if pages is not None else None
        if pages is None or slot is None:
            if pages is not None:
                self._cache.release(pages)
            self._blocked = True
            return False
        req.pages, req.aux_slot = pages, slot
        pool.aux[slot, :8] = 0  # a stale record must not pass for this room's
        req.kv_receiver.send_metadata(pages, slot)
        return True

    def num_queued_pages(self) -> int:
        """Pages the live requests here will reserve (load reports)."""
        pool = self._pool
        return sum(pool.pages_for(decode_tokens(len(r.input_ids), r.params.max_new_tokens)) for r in self if not r.done)


class DecodeTransferQueue(StageQueue):
    """Decode: page ids sent; ready once the KV and the first token arrived."""

    stage = "transfer"
    _side = "kv_receiver"


class DecodeQuarantine:
    """Decode: ended requests whose pages a late KV write could still reach; freed once quiesced."""

    def __init__(self) -> None:
        self._reqs: list[Req] = []

    def append(self, req: Req) -> None:
        self._reqs.append(req)

    def __len__(self) -> int:
        return len(self._reqs)

    def take_quiesced(self) -> list[Req]:
        """Remove and return the requests no write can reach any more."""
        ready: list[Req] = []
        keep: list[Req] = []
        for req in self._reqs:
            (ready if is_quiesced(req.kv_receiver) else keep).append(req)
        self._reqs = keep
        return ready


_UNTELLING: dict[int, None] = {}  # (``is_quiesced``) ids of receivers whose failure was logged, the newest kept


def is_quiesced(receiver: Any) -> bool:
    """``receiver.quiesced``; a receiver that cannot tell is taken as not (its pages wait: never reused under a
    write that could still land), said once per receiver (the quarantine asks every scheduler pass)."""
    try:
        return bool(receiver.quiesced)
    except Exception:
        if id(receiver) not in _UNTELLING:
            log.exception("a KV receiver could not tell whether it is quiesced; its pages stay in quarantine")
            _UNTELLING[id(receiver)] = None
            if len(_UNTELLING) > 1024:
                del _UNTELLING[next(iter(_UNTELLING))]
        return False


def failure_reason(handle: Any, default: str) -> str:
    try:
        exc = handle.failure()
    except Exception as err:
        return f"{default} (and its handle failed to say why: {type(err).__name__}: {err})"
    return str(exc) if exc is not None else default


_PEER_KINDS = frozenset({TransferErrorKind.PEER_UNREACHABLE, TransferErrorKind.PEER_GONE, TransferErrorKind.TIMEOUT})
_NOBODYS_KINDS = frozenset({TransferErrorKind.BOOTSTRAP, TransferErrorKind.ABORTED})


def failure_fault(handle: Any) -> Fault:
    """Whose failure a failed KV handle's is: a peer that went away, fell silent or could not be reached
    (a timeout waits on the peer), neither worker's (the registry, the peer's abort), else our own.

    A failure the peer reported (``PeerReport``) is judged as the peer judged it, from our side: its
    "the peer went away" means us. Both workers then name the same culprit, whichever of their two
    reports reaches the gateway first."""
    try:
        exc = handle.failure() if handle is not None else None
    except Exception:  # (a backend's bug: its own failure, as a handle that cannot say)
        exc = None
    kind = getattr(exc, "kind", None)
    if kind in _NOBODYS_KINDS:
        return Fault.NONE
    theirs = isinstance(exc, PeerReport)
    if kind in _PEER_KINDS:
        return Fault.OWN if theirs else Fault.PEER
    return Fault.PEER if theirs else Fault.OWN
