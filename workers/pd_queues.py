"""The scheduler's disaggregation queues (mixed into ``Scheduler``; runs on its thread).

Prefill role: PrefillBootstrapQueue (``_bootstrap``: the decode's page list arrives) and the
inflight queue (``_inflight``: KV written, waiting for the transfer to complete before the pages
are released). Decode role: DecodePreallocQueue (``_prealloc``: connect to the prefill, reserve
``prompt + max_new_tokens`` pages and an aux slot, send their ids) and DecodeTransferQueue
(``_transfer``: poll until the KV and the first token arrived, then "prebuilt extend").
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from transfer.types import KVPoll
from workers.aux import decode_aux
from workers.engines.base import SeqOutput
from workers.request import Req

if TYPE_CHECKING:
    from workers.engines.base import Engine, KVChecker
    from workers.kv_pool import KVPool
    from workers.page_cache import PageCache


class PDQueues:
    """Mixin: the scheduler provides the state and helpers declared here."""

    if TYPE_CHECKING:
        engine: Engine
        kv_checker: KVChecker | None
        pool: KVPool
        cache: PageCache
        _bootstrap: list[Req]
        _prealloc: list[Req]
        _transfer: list[Req]
        _waiting: list[Req]
        _inflight: list[Req]
        _running: list[Req]

        def _fail(self, req: Req, code: str, message: str) -> None: ...
        def _enter(self, req: Req, stage: str, queue_: list[Req]) -> None: ...
        def _emit(self, req: Req, tokens: list[int], finish: str | None, out: SeqOutput | None = None) -> None: ...
        def _release(self, req: Req, abort_reason: str | None = None) -> None: ...
        def _record_room(self, req: Req) -> None: ...
        def _accept_token(self, req: Req, out: SeqOutput) -> None: ...

    def _advance_bootstrap(self) -> None:
        keep = []
        for req in self._bootstrap:
            if req.done:
                continue
            state = req.kv_sender.poll()
            if state == KVPoll.Failed:
                self._fail(req, "transfer_failed", _reason(req.kv_sender, "bootstrap failed"))
            elif state >= KVPoll.WaitingForInput:
                reserved = req.kv_sender.num_dst_pages
                needed = self.pool.pages_for(len(req.input_ids))
                if reserved is not None and reserved < needed:
                    self._fail(req, "transfer_failed", f"decode reserved {reserved} pages, prompt needs {needed}")
                else:
                    self._enter(req, "waiting", self._waiting)
            else:
                keep.append(req)
        self._bootstrap = keep

    def _advance_inflight(self) -> None:
        keep = []
        for req in self._inflight:
            if req.done:
                continue
            state = req.kv_sender.poll()
            if state == KVPoll.Failed:
                self._fail(req, "transfer_failed", _reason(req.kv_sender, "KV transfer failed"))
            elif state == KVPoll.Success:
                self._record_room(req)
                self._emit(req, [], "transferred")
                self._release(req)
            else:
                keep.append(req)
        self._inflight = keep

    def _advance_prealloc(self) -> None:
        keep = []
        blocked = False
        for req in self._prealloc:
            if req.done:
                continue
            rx = req.kv_receiver
            state = rx.poll()
            if state == KVPoll.Failed:
                self._fail(req, "transfer_failed", _reason(rx, "bootstrap failed"))
                continue
            if state < KVPoll.WaitingForInput or blocked:
                keep.append(req)
                continue
            pages = self.cache.alloc(self.pool.pages_for(len(req.input_ids) + req.params.max_new_tokens))
            slot = self.pool.alloc_aux() if pages is not None else None
            if pages is None or slot is None:
                if pages is not None:
                    self.cache.release(pages)
                blocked = True  # FCFS: later requests wait behind this one
                keep.append(req)
                continue
            req.pages, req.aux_slot = pages, slot
            self.pool.aux[slot, :8] = 0  # a stale record must not pass for this room's
            rx.send_metadata(pages, slot)
            self._enter(req, "transfer", self._transfer)
        self._prealloc = keep

    def _advance_transfer(self) -> None:
        keep = []
        for req in self._transfer:
            if req.done:
                continue
            state = req.kv_receiver.poll()
            if state == KVPoll.Failed:
                self._fail(req, "transfer_failed", _reason(req.kv_receiver, "KV transfer failed"))
            elif state == KVPoll.Success:
                self._import(req)
            else:
                keep.append(req)
        self._transfer = keep

    def _import(self, req: Req) -> None:
        """Prebuilt extend: the prompt's KV and first token arrived; join the decode batch."""
        assert req.aux_slot is not None
        try:
            record = decode_aux(self.pool.aux[req.aux_slot].data)
        except ValueError as exc:
            self._fail(req, "transfer_failed", f"room {req.room}: {exc}")
            return
        req.num_computed = len(req.input_ids)
        req.cached_tokens = record.cached_tokens
        if self.kv_checker is not None:
            req.kv_verified = self.kv_checker.verify(req.pages, req.input_ids)
        self._accept_token(req, SeqOutput(record.first_token, record.logprob, record.top_logprobs))
        self._record_room(req)
        if not req.done:
            self._enter(req, "running", self._running)


def _reason(handle: Any, default: str) -> str:
    exc = handle.failure()
    return str(exc) if exc is not None else default
