"""Faults injected inside a worker's engine, scheduler and transfer calls: every request ends with an error,
every page and aux slot comes back, and the scheduler loop survives (or, when it cannot, dies loudly)."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from tests.workers.test_scheduler import (
    Collector,
    _pd_pair,
    _submit_pd,
    _until_pool_full,
    fail_on_call,
    make,
    run_until_idle,
    tokens_of,
)
from workers.protocol import SamplingParams, Submit


def _ended(sink: Collector, rid: int) -> bool:
    return bool(sink.errors(rid)) or any(o.finish_reason for o in sink.outputs(rid))


def test_decode_step_failure_with_a_batch_of_several() -> None:
    sched, sink, pool = make(chunk_size=64)
    real = sched.engine.forward
    n = {"decode": 0}

    def flaky(batch):  # type: ignore[no-untyped-def]
        if all(len(s.token_ids) == 1 and s.num_cached > 0 for s in batch) and len(batch) == 3:
            n["decode"] += 1
            if n["decode"] == 2:
                raise RuntimeError("CUDA out of memory (injected)")
        return real(batch)

    sched.engine.forward = flaky  # type: ignore[method-assign]
    for rid in (1, 2, 3):
        sched.submit(0, Submit(rid, [rid, 2, 3, 4, 5], SamplingParams(max_new_tokens=10)))
    run_until_idle(sched)
    codes = {rid: [e.code for e in sink.errors(rid)] for rid in (1, 2, 3)}
    assert all(c == ["internal"] for c in codes.values())
    assert sched.cache.num_available == pool.num_pages
    sched.submit(0, Submit(9, [1, 2, 3], SamplingParams(max_new_tokens=4)))
    run_until_idle(sched)
    assert len(tokens_of(sink, 9)) == 4


@pytest.mark.parametrize("where", ["prefill_chunk", "decode_step"])
def test_pd_forward_failure(where: str) -> None:
    (p, psink, pkv), (d, dsink, dkv) = _pd_pair(64, 64, prefill_chunk_size=4)
    fail_on_call((p if where == "prefill_chunk" else d).engine, 2, RuntimeError("injected"))
    try:
        _submit_pd(d, p, pkv, 1, SamplingParams(max_new_tokens=8))
        deadline = time.monotonic() + 20
        while not (_ended(dsink, 1) and _ended(psink, 1)):
            assert time.monotonic() < deadline, (psink.items, dsink.items)
            p.step()
            d.step()
            time.sleep(0.005)
        _until_pool_full(p)
        _until_pool_full(d)
        assert p.pool.num_free_aux_slots == p.pool.aux.shape[0] and d.pool.num_free_aux_slots == d.pool.aux.shape[0]
    finally:
        pkv.close()
        dkv.close()


def _drive(p: Any, d: Any, psink: Collector, dsink: Collector, rid: int, limit_s: float = 10.0) -> None:
    deadline = time.monotonic() + limit_s
    while not (_ended(dsink, rid) and _ended(psink, rid)):
        if time.monotonic() > deadline:
            return
        for s in (p, d):
            try:
                s.step()
            except Exception as exc:  # the threaded loop would die here (``Scheduler._run``)
                raise AssertionError(f"{s.role} scheduler step raised (its loop dies): {exc!r}") from exc
        time.sleep(0.005)


@pytest.mark.parametrize("call", ["send_metadata", "receiver_poll", "sender_poll", "sender_send_oserror",
                                  "abort"])
def test_a_transfer_call_raising_fails_its_request_not_the_loop(call: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from transfer.receiver import KVReceiver
    from transfer.room import RoomHandle
    from transfer.sender import KVSender

    (p, psink, pkv), (d, dsink, dkv) = _pd_pair(64, 64, prefill_chunk_size=4)
    armed = {"on": True}

    def boom(*_a: Any, **_k: Any) -> Any:
        raise RuntimeError(f"{call} (injected)") if call != "sender_send_oserror" else OSError("injected")

    if call == "send_metadata":
        monkeypatch.setattr(KVReceiver, "send_metadata", boom)
    elif call == "sender_send_oserror":
        monkeypatch.setattr(KVSender, "send", boom)
    elif call in ("receiver_poll", "sender_poll"):
        cls = KVReceiver if call == "receiver_poll" else KVSender
        real_poll = RoomHandle.poll
        n = {"k": 0}

        def poll(self: Any) -> Any:
            if isinstance(self, cls) and armed["on"] and threading.current_thread() is threading.main_thread():
                n["k"] += 1
                if n["k"] == 3:
                    armed["on"] = False
                    raise RuntimeError("poll (injected)")
            return real_poll(self)

        monkeypatch.setattr(RoomHandle, "poll", poll)
    elif call == "abort":
        monkeypatch.setattr(RoomHandle, "abort", boom)
        def flaky(batch):  # type: ignore[no-untyped-def]
            raise RuntimeError("engine (injected)")

        p.engine.forward = flaky  # type: ignore[method-assign]
    try:
        _submit_pd(d, p, pkv, 1, SamplingParams(max_new_tokens=4))
        _drive(p, d, psink, dsink, 1)
        assert _ended(psink, 1) and _ended(dsink, 1)
    finally:
        pkv.close()
        dkv.close()


def test_a_dying_loop_still_tells_every_request(monkeypatch: pytest.MonkeyPatch) -> None:
    """The last resort (``Scheduler._run``'s ``finally``) must end every request even when releasing one of
    them raises again: here a KV handle's ``abort`` raises, so the engine failure that fails the batch kills
    the loop, and the ``finally`` meets the same exception at its first request."""
    from transfer.room import RoomHandle

    (p, psink, pkv), (d, _dsink, dkv) = _pd_pair(64, 64, prefill_chunk_size=64)

    def boom(*_a: Any, **_k: Any) -> Any:
        raise RuntimeError("abort (injected)")

    def failing(batch):  # type: ignore[no-untyped-def]
        raise RuntimeError("engine (injected)")

    monkeypatch.setattr(RoomHandle, "abort", boom)
    p.engine.forward = failing  # type: ignore[method-assign]
    p.start()
    d.start()
    try:
        for rid in (1, 2, 3):
            _submit_pd(d, p, pkv, rid, SamplingParams(max_new_tokens=4))
        deadline = time.monotonic() + 5
        while p.is_alive and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)
        told = {rid: [e.code for e in psink.errors(rid)] for rid in (1, 2, 3)}
        assert all(told[rid] for rid in (1, 2, 3)), f"requests never told: {told}"
    finally:
        p.stop(5)
        d.stop(5)
        pkv.close()
        dkv.close()


def test_a_backend_write_raising_fails_its_request_and_withholds_its_staging_slot() -> None:
    """A backend's ``write`` that raises (against its contract, which is ``TransferError``: a plugin's bug) on the
    last chunk fails the request on both sides, and their pages come back; the aux staging slot taken for that
    chunk is not reused (the write may be under way, reading it), where a ``TransferError`` returns it."""
    from transfer.sender_rooms import NUM_STAGING_SLOTS

    (p, psink, pkv), (d, dsink, dkv) = _pd_pair(64, 64, prefill_chunk_size=64)
    rooms = pkv._prefill.rooms  # type: ignore[attr-defined]
    backend = pkv._ctx.backend  # type: ignore[attr-defined]
    real = backend.write

    def raising(*a: Any, **k: Any) -> Any:
        raise RuntimeError("plugin backend write (injected)")

    backend.write = raising
    try:
        _submit_pd(d, p, pkv, 1, SamplingParams(max_new_tokens=4))
        _drive(p, d, psink, dsink, 1)
        assert psink.errors(1) and dsink.errors(1)
        _until_pool_full(p)
        _until_pool_full(d)
        assert len(rooms._free_slots) == NUM_STAGING_SLOTS - 1
    finally:
        backend.write = real
        pkv.close()
        dkv.close()


def test_a_stop_string_decoder_raising_fails_that_request_only() -> None:
    from gateway.tokenizer import ByteTokenizer

    class Breaking(ByteTokenizer):
        def decoder(self, context: Any = (), *, skip_special_tokens: bool = True) -> Any:
            inner = super().decoder(context, skip_special_tokens=skip_special_tokens)

            class D:
                def __init__(self) -> None:
                    self.n = 0

                def push(self, ids: Any) -> str:
                    self.n += 1
                    if self.n == 3:
                        raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
                    return inner.push(ids)

                def flush(self) -> str:
                    return inner.flush()

            return D()

    sched, sink, pool = make(stop_tokenizer=Breaking())
    sched.submit(0, Submit(1, [5, 6, 7], SamplingParams(max_new_tokens=30, stop=["zzzz"])))
    sched.submit(0, Submit(2, [5, 6, 7], SamplingParams(max_new_tokens=30)))
    run_until_idle(sched)
    assert [e.code for e in sink.errors(1)] == ["internal"] and len(tokens_of(sink, 2)) == 30
    assert sched.cache.num_available == pool.num_pages


@pytest.mark.parametrize("method", ["alloc", "match", "insert"])
def test_a_page_cache_fault_inside_the_step(method: str) -> None:
    """``insert`` runs inside the per-request guard (that request fails, the loop goes on); ``alloc`` and
    ``match`` run in admission, outside any guard: the loop dies, failing every request as ``internal``."""
    sched, sink, pool = make(chunk_size=4)
    real = getattr(sched.cache, method)
    n = {"k": 0}

    def flaky(*a: Any, **k: Any) -> Any:
        n["k"] += 1
        if n["k"] == 3:
            raise KeyError("page cache (injected)")
        return real(*a, **k)

    setattr(sched.cache, method, flaky)
    sched.start()
    try:
        for rid in (1, 2, 3):
            sched.submit(0, Submit(rid, list(range(rid, rid + 9)), SamplingParams(max_new_tokens=20)))
        deadline = time.monotonic() + 5
        while not all(_ended(sink, r) for r in (1, 2, 3)) and time.monotonic() < deadline:
            time.sleep(0.01)
        # by design the loop dies loudly: every request told, every page back, health red (stalled_s inf)
        codes = sorted(e.code for r in (1, 2, 3) for e in sink.errors(r))
        assert codes == (["internal"] if method == "insert" else ["internal"] * 3)
        assert sched.cache.num_available == pool.num_pages
        assert sched.is_alive == (method == "insert") and (sched.is_alive or sched.stalled_s == float("inf"))
    finally:
        sched.stop(5)


def test_release_frees_pages_even_when_a_cleanup_call_raises() -> None:
    """``Scheduler._release`` marks the request done, then calls the engine's ``forget`` and the KV handles,
    and only then frees pages and the aux slot: any of those raising leaves the pages taken for good (the
    request is done, nothing releases it again)."""
    from workers.engines.sim import SimEngine

    class Forgetful(SimEngine):
        calls = 0

        def forget(self, seq_id: int) -> None:
            Forgetful.calls += 1
            if Forgetful.calls == 1:
                raise KeyError(f"seq {seq_id} (injected)")

    sched, sink, pool = make(chunk_size=64, engine=Forgetful())
    sched.submit(0, Submit(1, list(range(20)), SamplingParams(max_new_tokens=50)))
    sched.submit(0, Submit(2, list(range(30, 50)), SamplingParams(max_new_tokens=5)))
    for _ in range(3):
        sched.step()
    sched.abort(0, 1, "client went away")
    run_until_idle(sched)
    assert sink.errors(1) and len(tokens_of(sink, 2)) == 5
    assert sched.cache.num_available == pool.num_pages, "the aborted request's pages never came back"
