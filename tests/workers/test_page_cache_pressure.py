"""The prefix cache under pressure (randomized, sim engine verifying KV), what other threads
read of it, and whether the sim engine's KV check sees a preempted request's recomputed KV."""

from __future__ import annotations

import random
import threading
from collections import Counter
from typing import Any

import numpy as np
import pytest

from tests.workers.test_scheduler import make, run_until_idle, tokens_of
from workers.page_cache import page_hashes
from workers.protocol import KVEvents, SamplingParams, Submit
from workers.scheduler import Scheduler

PS = 4  # (``make``'s page size)


def _check_cache(sched: Scheduler, chains: dict[bytes, list[int]], index: set[bytes], where: str) -> None:
    """Every invariant of the cache against the requests that hold its pages and the pool's bytes."""
    cache, pool, engine = sched.cache, sched.pool, sched.engine
    held: Counter[int] = Counter()
    for r in sched.reqs.values():
        held.update(r.pages)
    assert dict(held) == cache._refs, f"{where}: reference counts are not the pages requests hold"
    every = [*pool._free_pages, *cache._evictable, *cache._refs]
    assert len(every) == len(set(every)) == pool.num_pages, f"{where}: a page is lost or in two places"
    assert {p: h for h, p in cache._by_hash.items()} == cache._hash_of, where
    assert set(cache._evictable) <= set(cache._hash_of), where
    for h, page in cache._by_hash.items():  # a cached page holds exactly the KV of the prefix it is cached for
        tokens = chains[h]
        first = len(tokens) - PS
        for b, buf in enumerate(pool.kv_buffers()):
            rows = buf.view(np.uint64).reshape(pool.num_pages, PS, -1)[page]
            assert np.array_equal(rows, engine.expected_rows(b, first, tokens[first:])), f"{where}: page {page}"
    for r in sched.reqs.values():  # a live request's computed positions hold its own KV
        if r.pages:
            n = len(r.all_ids) - 1 if r.stage == "running" else r.num_computed
            assert engine.verify(r.pages, r.all_ids[:n]), f"{where}: request {r.key} ({r.stage})"
    assert index == set(cache._by_hash), f"{where}: the KV events do not say what the cache holds"


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_randomized_prefix_sharing_under_pressure_keeps_every_invariant(seed: int) -> None:
    """Shared prefixes, duplicates, prompts that are prefixes of others, partial last pages, aborts, flushes
    and preemptions on a 16-page pool: after every step the cache's pages hold the KV of their prefix, the
    reference counts are the requests' pages, the KV events rebuild the cache's content, outputs equal a
    solo run's, and the pool comes back whole."""
    rng = random.Random(seed)
    sched, sink, pool = make(num_pages=16, chunk_size=8, max_running=8)
    sched.engine.prefill_token_s = sched.engine.decode_step_s = sched.engine.decode_seq_s = 0.0
    sched.connect(1)
    bases = [[rng.randrange(256) for _ in range(40)] for _ in range(3)]
    prompts: list[list[int]] = []
    chains: dict[bytes, list[int]] = {}
    index: set[bytes] = set()
    seen = 0
    submitted: dict[int, tuple[list[int], int]] = {}

    def record(ids: list[int]) -> None:
        for i, h in enumerate(page_hashes(ids, PS)):
            chains.setdefault(h, ids[: (i + 1) * PS])

    def step(where: str) -> None:
        nonlocal seen
        for r in sched.reqs.values():
            record(r.all_ids)
        sched.step()
        for r in sched.reqs.values():
            record(r.all_ids)
        for _, m in sink.items[seen:]:
            if isinstance(m, KVEvents):
                if m.reset:
                    index.clear()
                index.difference_update(m.removed)
                index.update(m.stored)
        seen = len(sink.items)
        _check_cache(sched, chains, index, where)

    rid = 0
    for n in range(150):
        for _ in range(rng.choice([0, 1, 1, 2])):
            rid += 1
            k = rng.random()
            if prompts and k < 0.2:
                prompt = list(rng.choice(prompts))
            elif prompts and k < 0.35:
                other = rng.choice(prompts)
                prompt = other[: rng.randrange(1, len(other) + 1)]
            else:
                prompt = rng.choice(bases)[: rng.randrange(0, 30)] + [rng.randrange(256)
                                                                      for _ in range(rng.randrange(1, 10))]
            prompts.append(prompt)
            record(prompt)
            submitted[rid] = (prompt, rng.randrange(1, 12))
            sched.submit(1, Submit(rid, prompt, SamplingParams(max_new_tokens=submitted[rid][1], ignore_eos=True)))
        if rng.random() < 0.08 and sched.reqs:
            sched.abort(*rng.choice(list(sched.reqs)), "test abort")
        if rng.random() < 0.03:
            sched.flush_cache()
        step(f"step {n}")
    for n in range(3000):
        if not sched.reqs:
            break
        step(f"drain {n}")
    step("end")
    assert not sched.reqs and not sched._queued_pages
    assert sched.cache.num_available == pool.num_pages
    assert sched.num_preemptions and sched.cache.num_evictions and sched.cache.num_hit_tokens
    for r, (prompt, max_new) in submitted.items():
        if sink.errors(r):
            continue
        solo, solo_sink, _ = make(chunk_size=64)
        solo.submit(0, Submit(r, prompt, SamplingParams(max_new_tokens=max_new, ignore_eos=True)))
        run_until_idle(solo)
        assert tokens_of(sink, r) == tokens_of(solo_sink, r), r


@pytest.mark.parametrize("how", ["flush", "eviction"])
def test_free_pages_read_by_another_thread_never_dip_while_cached_pages_are_freed(how: str) -> None:
    """``/load``, ``/v1/loads`` and ``/metrics`` read ``load_report()`` / ``cache.num_available`` on the event
    loop while the scheduler thread mutates the cache. Every page is free or evictable here, so any read
    must say 16. ``PageCache.clear`` empties the evictable list first and frees the pages last (and
    ``alloc`` pops a victim before freeing it): a read in between sees the evicted pages in neither place.
    (Another thread reads from inside ``pool.free``, where the GIL can switch threads: given a moment to read
    there, it must not see the dip; with the cache's lock it waits for the move to end.)"""
    sched, _, pool = make(num_pages=16)
    sched.submit(0, Submit(1, list(range(100, 140)), SamplingParams(max_new_tokens=1)))  # 40 tokens: 10 pages
    run_until_idle(sched)
    assert sched.cache.num_available == 16 and sched.cache.num_cached == 10
    seen: list[int] = []
    readers: list[threading.Thread] = []
    real_free = pool.free

    def free(pages: Any) -> None:
        reader = threading.Thread(target=lambda: seen.append(sched.load_report().num_free_pages))
        reader.start()
        reader.join(0.2)  # (the moment it gets: with the lock it is still waiting when this goes on)
        readers.append(reader)
        real_free(pages)

    pool.free = free  # type: ignore[method-assign]
    if how == "flush":
        future = sched.flush_cache()
        sched.step()
        assert future.result() == 10
    else:
        pages = sched.cache.alloc(16)  # evicts all 10 cached pages
        assert pages is not None
    for reader in readers:
        reader.join(10)
    # (16 before the move; after an eviction the allocation itself may have taken all 16 by the time it reads)
    allowed = {16} if how == "flush" else {16, 0}
    assert seen and set(seen) <= allowed, f"another thread could read {sorted(set(seen))} free pages of 16"


def test_the_sim_engine_reads_a_preempted_requests_recomputed_kv() -> None:
    """The sim engine's tokens are a function of the KV the worker holds, which is what lets token
    comparisons (``test_preemption_by_recompute_when_pages_run_out``) catch wrong KV. But it keeps each
    sequence's running CRC across a preemption: after a recompute it folds in only rows past those it had
    already read, never the recomputed (or prefix-cache-shared) rows. Here a recompute's position 0 is
    overwritten with garbage, as a wrong shared page would be; the request's later tokens must change."""
    prompts = [list(range(i * 10, i * 10 + 8)) for i in range(3)]

    def run(corrupt: bool) -> tuple[dict[int, list[int]], int]:
        sched, sink, pool = make(num_pages=10, chunk_size=64)
        real = sched.engine.forward
        hit = {"n": 0}

        def forward(batch: list[Any]) -> list[Any]:
            outs = real(batch)
            for seq in batch:
                if corrupt and not seq.sample and seq.num_generated > 0:  # a recompute's last chunk
                    for buf in pool.kv_buffers():
                        buf[seq.page_ids[0], 0] = 12345.0  # position 0's KV row: not this token's
                    hit["n"] += 1
            return outs

        sched.engine.forward = forward  # type: ignore[method-assign]
        for rid, p in enumerate(prompts):
            sched.submit(0, Submit(rid, p, SamplingParams(max_new_tokens=20, ignore_eos=True)))
        run_until_idle(sched, 5000)
        assert sched.num_preemptions > 0
        return {rid: tokens_of(sink, rid) for rid in range(3)}, hit["n"]

    clean, _ = run(False)
    corrupted, n = run(True)
    assert n > 0, "a recompute ran"
    assert corrupted != clean, "the sim produced the same tokens from KV with a wrong row"
